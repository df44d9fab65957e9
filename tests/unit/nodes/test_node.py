"""Node, one master's connection pool: stale pooled connections, one thread's requests in order."""

from __future__ import annotations

from celery_redlock import Redlock


def test_undo_cannot_overtake_a_slow_nodes_acquisition(redis_factory, fault_proxy):
    """A refusal decided before a slow node answered still leaves no key on that node."""
    servers = redis_factory(3)
    proxy = fault_proxy(servers[2])
    for server in servers[:2]:  # another owner holds the lock on a majority
        server.client().hset("redlock:{job}", mapping={"token": "other", "task_id": "t"})
        server.client().pexpire("redlock:{job}", 10_000)
    lock = Redlock(
        "job", nodes=[servers[0].url, servers[1].url, proxy.url], ttl=5, node_timeout=1.0
    )
    assert lock.acquire(blocking=False) is False  # warms the connections
    proxy.delay(0.2)
    for _ in range(3):
        assert lock.acquire(blocking=False) is False
        assert not servers[2].client().exists("redlock:{job}")


def test_the_first_acquire_after_a_server_restart_is_not_refused(redis_factory):
    """Pooled connections the restarted server closed are dropped, not used for a vote."""
    (server,) = redis_factory(1)
    lock = Redlock("job", nodes=[server.url], ttl=5, auto_renew=False)
    with lock:
        pass  # the pool now holds a connection to the old server process
    server.restart()
    assert lock.acquire(blocking=False), "a stale pooled connection cost the node's vote"
    lock.release()
