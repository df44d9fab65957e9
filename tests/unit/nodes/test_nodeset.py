"""NodeSet: the masters of a lock, and their nodes shared per process."""

from __future__ import annotations

from celery_redlock import Redlock


def test_locks_with_many_distinct_ttls_share_their_connections(redis_node):
    """300 locks with 300 short ttls (so 300 node timeouts) open a handful of connections."""
    client = redis_node.client()
    before = int(client.info("clients")["connected_clients"])
    for i in range(300):
        lock = Redlock(f"ttl:{i}", nodes=[redis_node.url], ttl=0.5 + i / 150, auto_renew=False)
        assert lock.acquire(blocking=False)
        lock.release()
    opened = int(client.info("clients")["connected_clients"]) - before
    assert opened <= 4, f"{opened} connections for 300 ttls"
