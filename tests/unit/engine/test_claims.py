"""Send-time claims (``claim.lua``, ``unclaim.lua``, :mod:`celery_redlock.engine.claims`)
against real redis-servers: one node, and three with a split vote."""

from __future__ import annotations

import pytest
import redis

from celery_redlock import NodeUnavailable
from celery_redlock.engine import claims
from celery_redlock.engine.claims import admit, claim, start, unclaim
from celery_redlock.engine.keys import lock_keys
from celery_redlock.engine.scripts import CLAIM, CLAIM_START, THROTTLE, UNCLAIM, UnclaimStatus
from celery_redlock.nodes import NodeSet
from tests.harness.servers import free_port, wait_for

KEYS = lock_keys("job:7")


@pytest.fixture
def nodeset_of():
    """``nodeset_of(urls, timeout)``: a NodeSet of this test's own, closed at its end."""
    made = []

    def make(urls, timeout=0.5):
        made.append(NodeSet(urls, timeout=timeout))
        return made[-1]

    yield make
    for nodeset in made:
        nodeset.close()


def run_claim(client, task_id, ttl=10_000, replace="", debounce="", args=""):
    return client.eval(
        CLAIM.source, 1, KEYS.claim, task_id, ttl, "proj.job", "0", replace, debounce, args
    )


def test_claim_script_claims_refreshes_reports_and_replaces(redis_node):
    client = redis_node.client()
    assert run_claim(client, "a") == [1]
    assert client.hgetall(KEYS.claim) == {
        "task_id": "a",
        "task_name": "proj.job",
        "claimed_at": "0",
    }
    client.pexpire(KEYS.claim, 500)
    assert run_claim(client, "a", ttl=10_000) == [2], "the same task id (a retry) refreshes it"
    assert client.pttl(KEYS.claim) > 5_000
    status, holder, pttl = run_claim(client, "b")
    assert (status, holder) == (0, "a") and 0 < pttl <= 10_000
    assert run_claim(client, "b", replace="x")[0] == 0, "replace names another holder: refused"
    assert run_claim(client, "b", replace="a") == [1], "a holder known to have ended is replaced"
    assert client.hget(KEYS.claim, "task_id") == "b"


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (("", 1000, "n", "0", "", "", ""), "empty task id"),
        (("a", 0, "n", "0", "", "", ""), "TTL"),
        (("a", 1.5, "n", "0", "", "", ""), "TTL"),
        (("a", 2592000001, "n", "0", "", "", ""), "TTL"),
        (("a", 1000, "n", "0", "", "-1", ""), "debounce"),
        (("a", 1000, "n", "0", "", "x", ""), "debounce"),
        (("a", 1000, "n", "0"), "expected 7 arguments"),
    ],
)
def test_claim_script_refuses_bad_arguments_and_writes_nothing(redis_node, args, error):
    client = redis_node.client()
    with pytest.raises(redis.ResponseError, match=error):
        client.eval(CLAIM.source, 1, KEYS.claim, *args)
    assert not client.exists(KEYS.claim)


def test_unclaim_frees_only_the_holders_claim(redis_node):
    client = redis_node.client()
    run_claim(client, "a")
    assert client.eval(UNCLAIM.source, 1, KEYS.claim, "b") == -1
    assert client.exists(KEYS.claim)
    assert client.eval(UNCLAIM.source, 1, KEYS.claim, "a") == 1
    assert client.eval(UNCLAIM.source, 1, KEYS.claim, "a") == 0
    with pytest.raises(redis.ResponseError, match="empty task id"):
        client.eval(UNCLAIM.source, 1, KEYS.claim, "")


def test_claim_over_one_node(redis_node, nodeset_of):
    nodeset = nodeset_of([redis_node.url], 0.5)
    assert claim(nodeset, KEYS, "a", 10).claimed
    found = claim(nodeset, KEYS, "b", 10)
    assert (found.claimed, found.holder) == (False, "a") and 0 < found.ttl <= 10
    assert claim(nodeset, KEYS, "a", 10).claimed, "its own claim again"
    assert unclaim(nodeset, KEYS, "b") == UnclaimStatus.TAKEN
    assert unclaim(nodeset, KEYS, "a") == UnclaimStatus.FREED
    assert unclaim(nodeset, KEYS, "a") == UnclaimStatus.GONE
    assert claim(nodeset, KEYS, "b", 10).claimed


def test_a_split_vote_is_undone_and_retried_until_one_sender_wins(
    redis_factory, monkeypatch, nodeset_of
):
    """Three nodes, each claimed by another sender: no majority; the undo frees ours."""
    servers = redis_factory(3)
    nodeset = nodeset_of([s.url for s in servers], 0.5)
    # Node 1 already has "x", node 2 "y": "z" gets node 3 only.
    servers[0].client().eval(CLAIM.source, 1, KEYS.claim, "x", 10_000, "n", "0", "", "", "")
    servers[1].client().eval(CLAIM.source, 1, KEYS.claim, "y", 10_000, "n", "0", "", "", "")
    monkeypatch.setattr(claims, "SPLIT_ROUNDS", 3)
    with pytest.raises(NodeUnavailable, match="split votes"):
        claim(nodeset, KEYS, "z", 10)
    assert not servers[2].client().exists(KEYS.claim), "the minority claim was undone"
    servers[1].client().delete(KEYS.claim)
    found = claim(nodeset, KEYS, "x", 10)
    assert found.claimed, "x holds node 1 and now gets nodes 2 and 3"


def test_a_majority_holder_is_reported_even_with_a_node_down(redis_factory, nodeset_of):
    servers = redis_factory(3)
    nodeset = nodeset_of([s.url for s in servers[:2]] + [f"redis://127.0.0.1:{free_port()}"])
    assert claim(nodeset, KEYS, "a", 10).claimed
    found = claim(nodeset, KEYS, "b", 10)
    assert (found.claimed, found.holder) == (False, "a")
    assert not servers[2].client().exists(KEYS.claim)


def test_too_few_nodes_answer(redis_factory, nodeset_of):
    servers = redis_factory(1)
    dead = [f"redis://127.0.0.1:{free_port()}" for _ in range(2)]
    nodeset = nodeset_of([servers[0].url, *dead], 0.2)
    with pytest.raises(NodeUnavailable):
        claim(nodeset, KEYS, "a", 10)
    assert not servers[0].client().exists(KEYS.claim), "the one node's claim was undone"


def test_debounce_pushes_the_due_time_and_keeps_the_last_arguments(redis_node):
    """Each call moves 'due' to now + debounce and leaves its arguments; the copy may run
    only once due has passed and with those arguments (claim_start), freeing the claim."""
    client = redis_node.client()
    assert run_claim(client, "a", debounce=60_000, args="[1]") == [1]
    status, holder, _ = run_claim(client, "b", debounce=60_000, args="[2]")
    assert (status, holder) == (0, "a"), "the call lands in the queued copy"
    assert client.hget(KEYS.claim, "args") == "[2]"
    status, wait, args = client.eval(CLAIM_START.source, 1, KEYS.claim, "a", "[1]")
    assert status == 0 and 59_000 < wait <= 60_000 and args == "[2]", "not yet, and as [2]"
    client.hset(KEYS.claim, "due", 0)
    assert client.eval(CLAIM_START.source, 1, KEYS.claim, "a", "[1]") == [0, 0, "[2]"], (
        "due, but with other arguments: requeued as the last call at once"
    )
    assert client.eval(CLAIM_START.source, 1, KEYS.claim, "b", "[2]") == [-1], "not b's claim"
    assert client.eval(CLAIM_START.source, 1, KEYS.claim, "a", "[2]") == [1]
    assert not client.exists(KEYS.claim), "freed as the run starts"


def test_throttle_admits_one_task_id_per_window(redis_node, nodeset_of):
    client = redis_node.client()
    assert client.eval(THROTTLE.source, 1, KEYS.throttle, "a", 60_000) == [1]
    assert client.eval(THROTTLE.source, 1, KEYS.throttle, "a", 60_000) == [1], "a redelivery"
    status, wait = client.eval(THROTTLE.source, 1, KEYS.throttle, "b", 60_000)
    assert status == 0 and 59_000 < wait <= 60_000
    client.pexpire(KEYS.throttle, 1)
    wait_for(lambda: not client.exists(KEYS.throttle), timeout=5)
    assert client.eval(THROTTLE.source, 1, KEYS.throttle, "b", 60_000) == [1]
    with pytest.raises(redis.ResponseError, match="window"):
        client.eval(THROTTLE.source, 1, KEYS.throttle, "c", 0)
    nodeset = nodeset_of([redis_node.url], 0.5)
    assert 59 < admit(nodeset, KEYS, "c", 60) <= 60
    assert start(nodeset, KEYS, "c", "[]") is None, "no claim: it runs"
