"""Send-time claims (``claim.lua``, ``unclaim.lua``, :mod:`celery_redlock.integration.claims`)
against real redis-servers: one node, and three with a split vote."""

from __future__ import annotations

import pytest
import redis

from celery_redlock import NodeUnavailable
from celery_redlock.engine.keys import claim_key, lock_keys
from celery_redlock.engine.scripts import CLAIM, CLAIM_START, THROTTLE, UNCLAIM, UnclaimStatus
from celery_redlock.integration import claims
from celery_redlock.integration.claims import admit, claim, start, unclaim
from celery_redlock.nodes import NodeSet
from tests.harness.servers import free_port, wait_for

KEYS = lock_keys("job:7")
#: The claim of the task these tests send ("proj.job") on KEYS.
CLAIM_KEY = claim_key(KEYS, "proj.job")


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


def run_claim(client, task_id, ttl=10_000, replace="", debounce="", args="", running=""):
    return client.eval(
        CLAIM.source,
        2,
        CLAIM_KEY,
        KEYS.lock,
        task_id,
        ttl,
        "proj.job",
        "0",
        replace,
        debounce,
        args,
        running,
    )


def test_claim_script_claims_refreshes_reports_and_replaces(redis_node):
    client = redis_node.client()
    assert run_claim(client, "a") == [1]
    assert client.hgetall(CLAIM_KEY) == {
        "task_id": "a",
        "task_name": "proj.job",
        "claimed_at": "0",
    }
    client.pexpire(CLAIM_KEY, 500)
    assert run_claim(client, "a", ttl=10_000) == [2], "the same task id (a retry) refreshes it"
    assert client.pttl(CLAIM_KEY) > 5_000
    status, holder, pttl = run_claim(client, "b")
    assert (status, holder) == (0, "a") and 0 < pttl <= 10_000
    assert run_claim(client, "b", replace="x")[0] == 0, "replace names another holder: refused"
    assert run_claim(client, "b", replace="a") == [1], "a holder known to have ended is replaced"
    assert client.hget(CLAIM_KEY, "task_id") == "b"


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (("", 1000, "n", "0", "", "", "", ""), "empty task id"),
        (("a", 0, "n", "0", "", "", "", ""), "TTL"),
        (("a", 1.5, "n", "0", "", "", "", ""), "TTL"),
        (("a", 2592000001, "n", "0", "", "", "", ""), "TTL"),
        (("a", 1000, "n", "0", "", "-1", "", ""), "debounce"),
        (("a", 1000, "n", "0", "", "x", "", ""), "debounce"),
        (("a", 1000, "n", "0"), "expected 8 arguments"),
    ],
)
def test_claim_script_refuses_bad_arguments_and_writes_nothing(redis_node, args, error):
    client = redis_node.client()
    with pytest.raises(redis.ResponseError, match=error):
        client.eval(CLAIM.source, 2, CLAIM_KEY, KEYS.lock, *args)
    assert not client.exists(CLAIM_KEY)


def test_unclaim_frees_only_the_holders_claim(redis_node):
    client = redis_node.client()
    run_claim(client, "a")
    assert client.eval(UNCLAIM.source, 1, CLAIM_KEY, "b") == -1
    assert client.exists(CLAIM_KEY)
    assert client.eval(UNCLAIM.source, 1, CLAIM_KEY, "a") == 1
    assert client.eval(UNCLAIM.source, 1, CLAIM_KEY, "a") == 0
    with pytest.raises(redis.ResponseError, match="empty task id"):
        client.eval(UNCLAIM.source, 1, CLAIM_KEY, "")


def test_claim_over_one_node(redis_node, nodeset_of):
    nodeset = nodeset_of([redis_node.url], 0.5)
    assert claim(nodeset, KEYS, "a", 10, task_name="proj.job").claimed
    found = claim(nodeset, KEYS, "b", 10, task_name="proj.job")
    assert (found.claimed, found.holder) == (False, "a") and 0 < found.ttl <= 10
    assert claim(nodeset, KEYS, "a", 10, task_name="proj.job").claimed, "its own claim again"
    assert unclaim(nodeset, KEYS, "b", "proj.job") == UnclaimStatus.TAKEN
    assert unclaim(nodeset, KEYS, "a", "proj.job") == UnclaimStatus.FREED
    assert unclaim(nodeset, KEYS, "a", "proj.job") == UnclaimStatus.GONE
    assert claim(nodeset, KEYS, "b", 10, task_name="proj.job").claimed


def test_a_split_vote_is_undone_and_retried_until_one_sender_wins(
    redis_factory, monkeypatch, nodeset_of
):
    """Three nodes, each claimed by another sender: no majority; the undo frees ours."""
    servers = redis_factory(3)
    nodeset = nodeset_of([s.url for s in servers], 0.5)
    # Node 1 already has "x", node 2 "y": "z" gets node 3 only.
    servers[0].client().eval(
        CLAIM.source, 2, CLAIM_KEY, KEYS.lock, "x", 10_000, "proj.job", "0", "", "", "", ""
    )
    servers[1].client().eval(
        CLAIM.source, 2, CLAIM_KEY, KEYS.lock, "y", 10_000, "proj.job", "0", "", "", "", ""
    )
    monkeypatch.setattr(claims, "SPLIT_ROUNDS", 3)
    with pytest.raises(NodeUnavailable, match="split votes"):
        claim(nodeset, KEYS, "z", 10, task_name="proj.job")
    assert not servers[2].client().exists(CLAIM_KEY), "the minority claim was undone"
    servers[1].client().delete(CLAIM_KEY)
    found = claim(nodeset, KEYS, "x", 10, task_name="proj.job")
    assert found.claimed, "x holds node 1 and now gets nodes 2 and 3"


def test_a_majority_holder_is_reported_even_with_a_node_down(redis_factory, nodeset_of):
    servers = redis_factory(3)
    nodeset = nodeset_of([s.url for s in servers[:2]] + [f"redis://127.0.0.1:{free_port()}"])
    assert claim(nodeset, KEYS, "a", 10, task_name="proj.job").claimed
    found = claim(nodeset, KEYS, "b", 10, task_name="proj.job")
    assert (found.claimed, found.holder) == (False, "a")
    assert not servers[2].client().exists(CLAIM_KEY)


def test_too_few_nodes_answer(redis_factory, nodeset_of):
    servers = redis_factory(1)
    dead = [f"redis://127.0.0.1:{free_port()}" for _ in range(2)]
    nodeset = nodeset_of([servers[0].url, *dead], 0.2)
    with pytest.raises(NodeUnavailable):
        claim(nodeset, KEYS, "a", 10, task_name="proj.job")
    assert not servers[0].client().exists(CLAIM_KEY), "the one node's claim was undone"


def test_debounce_pushes_the_due_time_and_keeps_the_last_arguments(redis_node):
    """Each call moves 'due' to now + debounce and leaves its arguments; the copy may run
    only once due has passed and with those arguments (claim_start), freeing the claim."""
    client = redis_node.client()
    assert run_claim(client, "a", debounce=60_000, args="[1]") == [1]
    status, holder, _ = run_claim(client, "b", debounce=60_000, args="[2]")
    assert (status, holder) == (0, "a"), "the call lands in the queued copy"
    assert client.hget(CLAIM_KEY, "args") == "[2]"
    status, wait, args = client.eval(CLAIM_START.source, 1, CLAIM_KEY, "a", "[1]")
    assert status == 0 and 59_000 < wait <= 60_000 and args == "[2]", "not yet, and as [2]"
    client.hset(CLAIM_KEY, "due", 0)
    assert client.eval(CLAIM_START.source, 1, CLAIM_KEY, "a", "[1]") == [0, 0, "[2]"], (
        "due, but with other arguments: requeued as the last call at once"
    )
    assert client.eval(CLAIM_START.source, 1, CLAIM_KEY, "b", "[2]") == [-1], "not b's claim"
    assert client.eval(CLAIM_START.source, 1, CLAIM_KEY, "a", "[2]") == [1]
    assert not client.exists(CLAIM_KEY), "freed as the run starts"


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
    assert start(nodeset, KEYS, "c", "proj.job", "[]") is None, "no claim: it runs"


def test_until_finished_a_running_copy_holds_the_claim_for_as_long_as_its_lease(redis_node):
    """The claim of a copy that runs outlives its TTL: the execution lock held by a copy
    of this task (renewed while it runs) holds it; another task's hold does not."""
    client = redis_node.client()
    client.hset(KEYS.lock, mapping={"token": "t", "task_id": "running", "task_name": "proj.job"})
    client.pexpire(KEYS.lock, 30_000)
    status, holder, pttl = run_claim(client, "second", running="1")
    assert (status, holder) == (0, "running") and 29_000 < pttl <= 30_000
    assert not client.exists(CLAIM_KEY), "nothing claimed for the duplicate"
    assert run_claim(client, "second") == [1], "until_started: a running copy holds nothing"
    client.delete(CLAIM_KEY)
    assert run_claim(client, "running", running="1") == [1], "the copy itself (its retry)"
    client.delete(CLAIM_KEY)
    assert run_claim(client, "second", running="1", replace="running") == [1], "it ended"
    client.delete(CLAIM_KEY)
    client.hset(KEYS.lock, "task_name", "proj.other")
    assert run_claim(client, "second", running="1") == [1], "another task's hold is no copy"


def test_claims_are_per_task_on_one_name(redis_node, nodeset_of):
    """Two tasks naming one resource: neither is taken for a duplicate of the other."""
    nodeset = nodeset_of([redis_node.url], 0.5)
    assert claim(nodeset, KEYS, "sync-7", 10, task_name="proj.sync_account").claimed
    assert claim(nodeset, KEYS, "close-7", 10, task_name="proj.close_account").claimed
    found = claim(nodeset, KEYS, "sync-8", 10, task_name="proj.sync_account")
    assert (found.claimed, found.holder) == (False, "sync-7")
    assert claim_key(KEYS, "proj.sync_account") != claim_key(KEYS, "proj.close_account")
    assert claim_key(KEYS, "proj.sync_account").startswith(KEYS.claim + ":")


def test_a_second_claim_by_one_task_id_says_so(redis_node, nodeset_of):
    """A deterministic task id sent twice: the second claim is 'again', not new."""
    nodeset = nodeset_of([redis_node.url], 0.5)
    first = claim(nodeset, KEYS, "x", 10, task_name="proj.job")
    assert first.claimed and not first.again
    again = claim(nodeset, KEYS, "x", 10, task_name="proj.job")
    assert again.claimed and again.again
