"""Reading shares: a node that cannot be read is an error, never "no shares"."""

from __future__ import annotations

from celery_redlock.nodes import NodeSet
from celery_redlock.ops.shares import read_shares


def test_read_shares_reports_a_node_it_could_not_read(redis_factory):
    """A node that fails the share read (after answering SCAN) is an error, not "none"."""
    (server,) = redis_factory(1)
    nodeset = NodeSet([server.url], timeout=0.2)
    server.kill()
    try:
        shares, errors = read_shares(nodeset, ["redlock:{r}:shared"], "redlock:", timeout=0.2)
    finally:
        nodeset.nodes[0].close()
    assert shares == []
    assert set(errors) == {server.url}
