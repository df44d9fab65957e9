"""A real network partition: Redlock nodes in network namespaces whose links go down.

A minority cut off: the holder keeps its lock (a quorum still renews it) and nobody
else gets in. A majority cut off: the holder learns its lease is lost before the lease
can end on the nodes, and nobody can acquire (fail closed) until the link heals.
"""

from __future__ import annotations

import time

import pytest

from celery_redlock import NodeUnavailable, Redlock
from celery_redlock.engine.lease import clock
from tests.harness import wait_for
from tests.harness.netns import NetnsRedisServer, available

UNAVAILABLE = available()
pytestmark = pytest.mark.skipif(UNAVAILABLE is not None, reason=str(UNAVAILABLE))

TTL = 2.0


@pytest.fixture
def nodes():
    servers = [NetnsRedisServer().start() for _ in range(3)]
    yield servers
    for server in servers:
        server.close()


def lock_on(servers, **kwargs) -> Redlock:
    return Redlock("partitioned", nodes=[s.url for s in servers], ttl=TTL, **kwargs)


def test_a_minority_cut_off_changes_nothing(nodes):
    """One of three nodes unreachable for two leases: the lock stays held and exclusive."""
    holder = lock_on(nodes)
    assert holder.acquire(timeout=5)
    fence = holder.fence
    nodes[0].partition()
    try:
        other = lock_on(nodes)
        until = clock() + 2 * TTL
        while clock() < until:
            holder.check()  # renewed by the two reachable nodes
            assert not other.acquire(blocking=False)
            time.sleep(0.2)  # pacing the probes, not waiting for an event
    finally:
        nodes[0].heal()
    wait_for(nodes[0].ping, timeout=10, message="the link back")
    holder.check()
    holder.release()
    assert other.acquire(timeout=5) and other.fence > fence
    other.release()


def test_a_majority_cut_off_stops_the_holder_in_time_and_fails_closed(nodes):
    """Two of three unreachable: the loss is declared before the lease could end on them."""
    lost = []
    holder = lock_on(nodes, on_lost=lambda exc: lost.append(clock()))
    assert holder.acquire(timeout=5)
    fence, deadline = holder.fence, holder.lease.deadline
    nodes[0].partition()
    nodes[1].partition()
    try:
        wait_for(lambda: lost, timeout=3 * TTL, message="the holder's loss")
        # The nodes' keys could expire at the earliest at the deadline (send time of the
        # last confirmed renewal + TTL - drift): the holder knew before then.
        assert lost[0] < holder.lease.deadline
        assert holder.lease.deadline >= deadline
        other = lock_on(nodes)
        with pytest.raises(NodeUnavailable):
            other.acquire(timeout=1)
    finally:
        nodes[0].heal()
        nodes[1].heal()
    # A healed link may take a moment to carry traffic again (neighbour discovery).
    wait_for(lambda: all(node.ping() for node in nodes), timeout=10, message="the link back")
    successor = lock_on(nodes)
    assert successor.acquire(timeout=3 * TTL), "the lock is usable again once healed"
    assert successor.fence > fence
    successor.release()
