"""One attempt's vote (``engine/vote.py``) over several independent masters: quorum,
budgets, fences stored back, and the undo of what a failed attempt was granted."""

from __future__ import annotations

import time

import pytest

from celery_redlock import NodeUnavailable, Redlock
from tests.harness.fences import assert_counter_expires, server_clock_us
from tests.harness.servers import wait_for


def lock_on(servers, **kwargs):
    kwargs.setdefault("ttl", 5)
    return Redlock("job", nodes=[s.url for s in servers], **kwargs)


def holders(servers):
    return sum(s.client().exists("redlock:{job}") for s in servers if s.alive())


@pytest.mark.parametrize(("n", "down"), [(3, 1), (5, 2)])
def test_a_minority_down_still_acquires(redis_factory, n, down):
    """With a minority of nodes dead, acquire, renew and release still work."""
    servers = redis_factory(n)
    for server in servers[:down]:
        server.kill()
    lock = lock_on(servers, ttl=1.5)
    assert lock.acquire(blocking=False)
    assert holders(servers) == n - down
    assert lock.extend() > 1.0
    lock.check()
    lock.release()
    assert holders(servers) == 0


@pytest.mark.parametrize(("n", "down"), [(3, 2), (5, 3)])
def test_a_majority_down_fails_within_budget_and_leaves_nothing(redis_factory, n, down):
    """With a majority dead, acquisition fails fast and the live nodes keep no key."""
    servers = redis_factory(n)
    for server in servers[:down]:
        server.kill()
    lock = lock_on(servers, node_timeout=0.2)
    for blocking in (False, True):
        start = time.monotonic()
        with pytest.raises(NodeUnavailable) as info:
            lock.acquire(blocking=blocking)
        # Two fan-outs at most (acquire, then undo), each within the node budget;
        # the slack is for a loaded CI machine, not for retries.
        assert time.monotonic() - start < 2 * 0.2 + 1.0
        assert len(info.value.args[1]) == down
        assert holders(servers) == 0


def test_busy_on_a_majority_is_busy(redis_factory):
    """A lock held on a quorum is refused to a second owner, who leaves no key behind."""
    servers = redis_factory(5)
    a, b = lock_on(servers), lock_on(servers)
    assert a.acquire()
    assert not b.acquire(blocking=False)
    # b's attempt must not have left its token on any node
    for server in servers:
        assert server.client().hget("redlock:{job}", "token") == a.lease.token
    a.release()


def test_split_vote_is_undone_everywhere(redis_factory):
    """Granted on a minority only: the attempt releases the nodes that did grant."""
    servers = redis_factory(3)
    # Another owner holds the lock on two of three nodes (e.g. a split vote).
    for server in servers[:2]:
        server.client().hset("redlock:{job}", mapping={"token": "other", "task_id": "t"})
        server.client().pexpire("redlock:{job}", 5000)
    lock = lock_on(servers)
    assert not lock.acquire(blocking=False)
    assert not servers[2].client().exists("redlock:{job}")


def test_fences_keep_growing_when_nodes_disagree(redis_factory, fault_proxy):
    """Fence = max over the granting quorum, stored back, so it grows across quorums."""
    servers = redis_factory(3)
    # Node 0's counter is far ahead of the others' (which start from their clocks,
    # in µs): a fence from it must win and be stored back on the other granting node.
    ahead = server_clock_us(servers[0].client()) + 10**9
    servers[0].client().set("redlock:{job}:fence", ahead, px=60_000)
    # The first quorum must be nodes 0 and 1: with all three answering, a quorum of 1
    # and 2 may be decided before node 0's reply (its fence is then theirs, 1).
    third = fault_proxy(servers[2])
    third.blackhole()
    lock = Redlock("job", nodes=[servers[0].url, servers[1].url, third.url], ttl=5)
    with lock:
        first = lock.fence
    assert first == ahead + 1
    assert int(servers[1].client().get("redlock:{job}:fence")) == first, "stored back"
    third.restore()
    # The proxy dropped what it held back; a connection across a real partition would
    # have died with it (or delivered it late): abort the proxy's, as such.
    third.reset()
    # The node that had the high counter is now down; the other two were synced.
    servers[0].kill()
    with lock:
        assert lock.fence > first
    counters = [int(s.client().get("redlock:{job}:fence")) for s in servers[1:]]
    assert min(counters) > first
    for server in servers[1:]:
        assert_counter_expires(server.client(), "redlock:{job}:fence", 5_000)


def test_min_replicas_counts_only_replicated_votes(redis_factory):
    """WAIT decides: no replica means no vote; an attached replica makes it count."""
    (primary,) = redis_factory(1, "--repl-diskless-sync-delay", "0")
    # A generous budget: a replica that just synced may take a few hundred ms to ACK.
    lock = Redlock("job", nodes=[primary.url], ttl=10, node_timeout=1.0, min_replicas=1)
    with pytest.raises(NodeUnavailable, match="0 of 1 replicas acknowledged"):
        lock.acquire(blocking=False)
    assert not primary.client().exists("redlock:{job}")
    (replica,) = redis_factory(1, "--replicaof", "127.0.0.1", str(primary.port))
    wait_for(
        lambda: (
            primary.client().info("replication")["connected_slaves"] == 1
            and replica.client().info("replication")["master_link_status"] == "up"
        ),
        timeout=10,
    )
    assert lock.acquire(blocking=False)
    assert replica.client().exists("redlock:{job}")
    lock.release()


def test_a_release_a_quorum_does_not_confirm_waits_for_every_node(redis_factory, caplog):
    """Keys deleted behind the holder's back on three nodes: the release waits for all
    five and says the lock was no longer held there."""
    servers = redis_factory(5)
    lock = lock_on(servers, ttl=30)
    assert lock.acquire(blocking=False)
    for server in servers[:3]:
        server.client().delete("redlock:{job}")
    with caplog.at_level("WARNING", logger="celery_redlock.lock"):
        lock.release()
    messages = [r.getMessage() for r in caplog.records]
    assert any("gone on 3" in m for m in messages), messages
    assert holders(servers) == 0


def test_a_release_does_not_wait_for_a_node_that_lags(redis_factory, fault_proxy):
    """One node of three blackholed: the first release waits out its budget there and
    marks it lagging; from then on a release returns once the two others confirmed it,
    leaving that node's reply unread (None), and so does an acquisition's vote."""
    servers = redis_factory(3)
    silent = fault_proxy(servers[2])
    silent.blackhole()
    # A budget the two live nodes meet however loaded the machine (the first release
    # waits it out once for the silent node).
    nodes = [servers[0].url, servers[1].url, silent.url]
    lock = Redlock("job", nodes=nodes, ttl=10, node_timeout=1.0)
    assert lock.acquire(blocking=False)
    lock.release()  # waits out the budget for the silent node
    assert lock.nodeset.lagging() == frozenset({2})
    assert lock.acquire(blocking=False)
    replies = lock._unlock(lock.lease.token)  # the release, as release() sends it
    assert [r is not None and r.ok for r in replies[:2]] == [True, True]
    assert replies[2] is None, "the lagging node was not waited for"
    lock.release()  # ends the hold (its keys are gone already)
