"""The Lua scripts, called directly against a real redis-server."""

from __future__ import annotations

import json

import pytest
import redis

from celery_redlock.engine import scripts
from celery_redlock.engine.keys import LockKeys, lock_keys, release_keys
from celery_redlock.engine.scripts import (
    ACQUIRE,
    ACQUIRE_FAIR,
    ACQUIRE_SHARED,
    BEAT_CLAIM,
    FAIR_LEAVE,
    FENCE_SYNC,
    FENCE_SYNC_SHARED,
    INSPECT,
    RELEASE,
    RELEASE_FAIR,
    RELEASE_IF,
    RELEASE_SHARED,
    RENEW_MANY,
)
from tests.harness import wait_for
from tests.harness.fences import assert_clock_fence, assert_counter_expires, horizon_ms
from tests.harness.lua import run

# Every script against every server binary of the compatibility matrix.
pytestmark = pytest.mark.smoke

KEYS = lock_keys("job")


def acquire(client, token, ttl=10_000, task_id="t1", pid=100, keys=KEYS, writer="", fair=""):
    resources = [keys] if isinstance(keys, LockKeys) else keys
    return run(
        client, ACQUIRE_FAIR if fair else ACQUIRE,
        resources=[key for resource in resources for key in resource.resource],
        record=resources[0].record if fair else (), abandoned=resources[0].abandoned,
        token=token, ttl_ms=ttl, task_id=task_id, host="h", pid=pid, acquired_at=0,
        task_name="task", blocking=writer, waiter_ms=fair, arrival="", channel="", attempt=1,
        grant_ms=1, handoff=(),
    )  # fmt: skip


def share(client, token, limit=0, ttl=10_000, task_id="", keys=KEYS):
    return run(
        client, ACQUIRE_SHARED, keys, token=token, ttl_ms=ttl, limit=limit, task_id=task_id,
        host="h", pid=7, acquired_at=0, task_name="task", attempt=1,
    )  # fmt: skip


def release(client, token, keys=(KEYS,), fair=False):
    return run(
        client, RELEASE_FAIR if fair else RELEASE, locks=release_keys(keys),
        record=keys[0].record if fair else (), fence=(keys[0].fence,) if fair else (), token=token,
        reserve_ms=0, channel="", attempt="",
    )  # fmt: skip


def release_share(client, token):
    return run(client, RELEASE_SHARED, KEYS, token=token, attempt="")


def renew(client, holds, leases):
    return run(client, RENEW_MANY, holds=holds, leases=leases)


def test_scripts_load_from_the_installed_package():
    """Every script is package data with a header naming its KEYS and ARGV."""
    for script in (s for s in vars(scripts).values() if isinstance(s, scripts.Script)):
        assert script.source.startswith("-- ")
        assert "-- KEYS[" in script.source
        assert len(script.sha) == 40


def test_scripts_build_no_key_names_and_share_the_writer_mark():
    """Every key a script touches comes in KEYS (keys.py builds them all): no script
    appends ':released' to a key; the writer and yield marks are keys.WRITER_MARK and
    keys.YIELD_MARK, not copies."""
    from importlib import resources

    from celery_redlock.engine.keys import WRITER_MARK, YIELD_MARK

    for path in resources.files(scripts).iterdir():
        if path.name.endswith(".lua"):
            text = path.read_text("utf-8")
            assert ".. ':" not in text and ":released'" not in text, path.name
            assert WRITER_MARK not in text and YIELD_MARK not in text, path.name
    for script in (s for s in vars(scripts).values() if isinstance(s, scripts.Script)):
        assert f"local WRITER_MARK = '{WRITER_MARK}'" in script.source
        assert f"local YIELD_MARK = '{YIELD_MARK}'" in script.source


def test_acquire_grants_a_growing_fence_and_names_the_holder(redis_node):
    """A free lock is granted a fence from the node's clock (in µs), then +1, +2...
    while its counter lives; a held one reports holder and TTL."""
    c = redis_node.client()
    code, first = acquire(c, "a")
    assert code == 1
    assert_clock_fence(first, c)
    assert c.get(KEYS.fence) == c.hget(KEYS.lock, "fence") == str(first), "every digit"
    assert acquire(c, "a") == [2, first], "the same token refreshes, keeping its fence"
    code, pttl, holder = acquire(c, "b", task_id="t2")
    assert (code, holder) == (0, "t1")
    assert 0 < pttl <= 10_000
    c.delete(KEYS.lock)
    assert acquire(c, "b") == [1, first + 1]
    assert c.get(KEYS.fence) == c.hget(KEYS.lock, "fence") == str(first + 1)
    counter_ttl = assert_counter_expires(c, KEYS.fence, 10_000)
    assert counter_ttl > c.pttl(KEYS.lock), "the fence counter outlives the lock"


def test_acquire_rejects_a_malformed_lease(redis_node):
    """A non-positive or fractional lease is an error reply, and nothing is written."""
    c = redis_node.client()
    for bad in (0, -5, "1.5", "soon"):
        with pytest.raises(redis.ResponseError, match="positive integer"):
            acquire(c, "a", ttl=bad)
    with pytest.raises(redis.ResponseError, match="empty owner token"):
        acquire(c, "")
    assert c.exists(KEYS.lock, KEYS.fence) == 0


#: Leases hypothesis found (tests/reliability/test_bad_input.py: argv
#: ['0', '99999999999999992', '0', '', '', '', '', ''] for acquire_shared and
#: ['0', 'INFINITY', '', ...] for acquire). Lua holds them as doubles that pass the
#: "positive integer" check and hands them to PEXPIRE as '1e+17' or 'inf', which Redis
#: refuses after the HSET or ZADD before it was done: a key with no TTL is left.
TOO_LONG = "99999999999999992"


@pytest.mark.parametrize("lease", [TOO_LONG, "INFINITY"])
@pytest.mark.parametrize("kind", ["acquire", "fair waiter", "acquire_shared"])
def test_a_lease_pexpire_cannot_take_is_refused_before_anything_is_written(redis_node, kind, lease):
    """Settings cap leases at 30 days, so the library never sends one this long; the
    script must still refuse it cleanly rather than leave a key that never expires."""
    c = redis_node.client()
    if kind == "fair waiter":
        acquire(c, "holder")  # held with a lease: the fair waiter queues
    with pytest.raises(redis.ResponseError) as info:
        if kind == "acquire_shared":
            share(c, "a", ttl=lease)
        elif kind == "fair waiter":
            acquire(c, "a", fair=lease)
        else:
            acquire(c, "a", ttl=lease)
    assert "celery_redlock" in str(info.value), str(info.value)
    keys = [KEYS.lock, KEYS.shared, KEYS.holders, *KEYS.record]
    assert [k for k in keys if c.pttl(k) == -1] == [], "a key with no TTL was left"


def test_renew_many_reports_each_key(redis_node):
    """One call renews owned keys and reports gone (0) and taken (-1) ones."""
    c = redis_node.client()
    k1, k2, k3 = lock_keys("k1"), lock_keys("k2"), lock_keys("k3")
    acquire(c, "a", ttl=1000, keys=k1)
    acquire(c, "other", ttl=1000, keys=k2)
    codes = renew(c, [k1.lock, k2.lock, k3.lock], ["a", 60_000, "x"] * 3)
    assert codes == [1, -1, 0]
    assert c.pttl(k1.lock) > 1000
    assert c.pttl(k2.lock) <= 1000, "a lock held by another token is not extended"


def test_renew_many_validates_before_renewing_anything(redis_node):
    """A bad lease anywhere in the batch fails the call before any key is touched."""
    c = redis_node.client()
    k1, k2 = lock_keys("k1"), lock_keys("k2")
    acquire(c, "a", ttl=1000, keys=k1)
    with pytest.raises(redis.ResponseError, match="positive integer"):
        renew(c, [k1.lock, k2.lock], ["a", 60_000, "x", "a", -1, "x"])
    assert c.pttl(k1.lock) <= 1000
    with pytest.raises(redis.ResponseError, match="token, lease and kind per key"):
        renew(c, [k1.lock, k2.lock], ["a", 60_000, "x"])
    with pytest.raises(redis.ResponseError, match="kind must be"):
        renew(c, [k1.lock], ["a", 60_000, "q"])


def test_release_deletes_only_its_own_token_and_announces_it(redis_node):
    """Release by another token is refused; the owner's release publishes once."""
    c = redis_node.client()
    acquire(c, "a")
    pubsub = c.pubsub()
    pubsub.subscribe(KEYS.channel)
    assert pubsub.get_message(timeout=1)["type"] == "subscribe"
    assert release(c, "intruder") == -1
    assert c.exists(KEYS.lock)
    assert release(c, "a") == 1
    assert not c.exists(KEYS.lock)
    message = pubsub.get_message(timeout=1)
    assert (message["type"], message["channel"]) == ("message", KEYS.channel)
    assert release(c, "a") == 0
    assert pubsub.get_message(timeout=0.2) is None, "no announcement for a no-op release"
    pubsub.close()


def test_release_if_matches_task_id_and_pid(redis_node):
    """The parent's cleanup frees a lock only for the dead child's task id and pid."""
    c = redis_node.client()
    acquire(c, "a", task_id="t1", pid=100)
    keys = (KEYS.lock, KEYS.channel)
    assert c.eval(RELEASE_IF.source, 2, *keys, "t1", 101) == -1, "a redelivery elsewhere"
    assert c.eval(RELEASE_IF.source, 2, KEYS.lock, KEYS.channel, "t2", 100) == -1
    assert c.eval(RELEASE_IF.source, 2, KEYS.lock, KEYS.channel, "t1", 100) == 1
    assert c.eval(RELEASE_IF.source, 2, KEYS.lock, KEYS.channel, "t1", 100) == 0
    with pytest.raises(redis.ResponseError, match="empty task id"):
        c.eval(RELEASE_IF.source, 2, KEYS.lock, KEYS.channel, "", 100)


def test_fence_sync_only_raises_the_counter(redis_node):
    """The counter moves up to the quorum's fence, never down, and keeps its expiry."""
    c = redis_node.client()
    _, fence = acquire(c, "a")

    def sync(token, granted):
        return run(c, FENCE_SYNC, KEYS, token=token, granted=granted)

    counter_ttl = assert_counter_expires(c, KEYS.fence, 10_000)
    quorum = fence + 7  # another node seeded its counter 7 µs later
    assert sync("a", quorum) == 1
    assert c.get(KEYS.fence) == str(quorum)
    assert c.hget(KEYS.lock, "fence") == str(quorum)
    assert 0 < c.pttl(KEYS.fence) <= counter_ttl, "the counter keeps its expiry"
    assert sync("b", 3) == 0
    assert sync("b", fence) == 0
    assert c.get(KEYS.fence) == str(quorum)
    assert 0 < c.pttl(KEYS.fence) <= counter_ttl


def test_a_counter_that_expired_starts_again_above_every_earlier_fence(redis_node):
    """Every script that writes a fence counter leaves it with a TTL within the
    horizon (a counter from before the horizon, with none, included); once it
    expired or was deleted, the next fence (from the node's clock) is still larger
    than every fence the lock was given."""
    c = redis_node.client()

    def sync(token, granted, script=FENCE_SYNC):
        return run(c, script, KEYS, token=token, granted=granted)

    fences = []

    def exclusive(token, ttl=1_000):
        code, fence = acquire(c, token, ttl=ttl)
        assert code == 1 and fence > max(fences, default=0), (fence, fences)
        assert c.get(KEYS.fence) == str(fence)
        assert_counter_expires(c, KEYS.fence, ttl)
        assert release(c, token) == 1
        fences.append(fence)
        return fence

    def shared(token, ttl=1_000):
        code, fence = share(c, token, ttl=ttl)
        assert code == 1 and fence > max(fences, default=0), (fence, fences)
        assert c.get(KEYS.fence) == str(fence)
        assert_counter_expires(c, KEYS.fence, ttl)
        assert release_share(c, token) == 1
        fences.append(fence)
        return fence

    def expire_counter():
        c.pexpire(KEYS.fence, 1)
        wait_for(lambda: not c.exists(KEYS.fence), timeout=5, message="the counter expired")

    first = exclusive("a")
    assert_clock_fence(first, c)
    assert exclusive("b") == first + 1
    assert shared("r1") == first + 2
    expire_counter()
    assert_clock_fence(exclusive("c", ttl=60_000), c)
    assert c.pttl(KEYS.fence) > horizon_ms(1_000), "a longer lease, a longer horizon"
    c.delete(KEYS.fence)
    assert_clock_fence(shared("r2"), c)
    expire_counter()
    assert_clock_fence(shared("r3"), c)
    c.delete(KEYS.fence)
    assert_clock_fence(exclusive("d"), c)

    # fence_sync: raising a live counter keeps its TTL; a counter that expired in
    # between, or one written before counters expired (no TTL), gets one.
    code, fence = acquire(c, "e")
    assert code == 1 and fence == fences[-1] + 1
    c.delete(KEYS.fence)
    assert sync("e", fence + 5) == 1
    assert c.get(KEYS.fence) == c.hget(KEYS.lock, "fence") == str(fence + 5)
    assert_counter_expires(c, KEYS.fence, 0)
    c.persist(KEYS.fence)
    assert sync("e", fence + 6) == 1
    assert c.get(KEYS.fence) == str(fence + 6)
    assert_counter_expires(c, KEYS.fence, 0)
    c.persist(KEYS.fence)
    assert sync("e", fence) == 1, "a lower fence: the counter stays"
    assert c.get(KEYS.fence) == str(fence + 6)
    assert_counter_expires(c, KEYS.fence, 0)
    assert release(c, "e") == 1
    fences += [fence, fence + 6]
    # A share's fence is synced into its details, with every digit.
    code, fence = share(c, "r4")
    assert code == 1 and fence == fences[-1] + 1
    c.delete(KEYS.fence)
    assert sync("r4", fence + 3, FENCE_SYNC_SHARED) == 1
    assert json.loads(c.hget(KEYS.holders, "r4"))["fence"] == str(fence + 3)
    assert c.get(KEYS.fence) == str(fence + 3)
    assert_counter_expires(c, KEYS.fence, 0)
    assert release_share(c, "r4") == 1
    fences += [fence, fence + 3]
    # A counter from before counters expired (no TTL): counted on, and given one.
    c.persist(KEYS.fence)
    assert exclusive("f") == fence + 4
    expire_counter()
    assert_clock_fence(exclusive("g"), c)
    assert fences == sorted(set(fences)), "fences went back or repeated"


def test_inspect_snapshot(redis_node):
    """Inspect returns PTTL, the fence counter and the holder's fields."""
    c = redis_node.client()
    assert run(c, INSPECT, KEYS) == [-2, 0]
    acquire(c, "a", task_id="t9", pid=42)
    pttl, counter, *flat = run(c, INSPECT, KEYS)
    fields = dict(zip(flat[::2], flat[1::2], strict=True))
    assert 0 < pttl <= 10_000 and counter == int(fields["fence"])
    assert_clock_fence(counter, c)
    assert fields["token"] == "a" and fields["task_id"] == "t9" and fields["pid"] == "42"


def test_beat_claim_checks_leadership_and_advances_once(redis_node):
    """Only the leader claims; each known run can be advanced past by one claim only."""
    c = redis_node.client()
    keys = lock_keys("beat:app")
    acquire(c, "leader", keys=keys)

    def claim(token, known, now):
        return run(
            c, BEAT_CLAIM, keys, token=token, entry="entry", known=known, run_at=now, keep_ms=""
        )

    assert claim("usurper", "", "10") == [-1]
    assert claim("leader", "", "10") == [1]
    assert claim("leader", "", "11") == [0, "10"], "someone already ran it"
    assert claim("leader", "10", "11") == [1]
    assert claim("leader", "10", "11.5") == [0, "11"], "a second leader based on 10 is refused"
    assert claim("leader", "11", "11") == [0, "11"], "a run time is claimed once"
    assert claim("leader", "11", "10.5") == [0, "11"], "and never an earlier one"
    assert c.hget(keys.state, "entry") == "11"


def test_acquire_takes_several_resources_all_or_none(redis_node):
    """A multi-resource acquisition writes nothing when one resource is held."""
    c = redis_node.client()
    a, b = lock_keys("acct:1"), lock_keys("acct:2")
    _, before = acquire(c, "other", keys=b, task_id="t9")
    code, _, holder = acquire(c, "mine", keys=[a, b])
    assert (code, holder) == (0, "t9")
    assert c.exists(a.lock, a.fence) == 0, "no partial hold, no fence taken"
    c.delete(b.lock)
    code, fence_a, fence_b = acquire(c, "mine", keys=[a, b])
    assert code == 1 and fence_b == before + 1, "b's counter lives on"
    assert_clock_fence(fence_a, c)
    assert acquire(c, "mine", keys=[a, b]) == [2, fence_a, fence_b], "the same token refreshes both"
    for keys in (a, b):
        assert_counter_expires(c, keys.fence, 10_000)
    assert release(c, "mine", keys=(a, b)) == 1
    assert c.exists(a.lock, b.lock) == 0


def test_shares_exclude_writers_and_respect_the_limit(redis_node):
    """Shares coexist up to the limit; an exclusive holder and shares never mix."""
    c = redis_node.client()
    code, fence = share(c, "r1", limit=2)
    assert code == 1
    assert_clock_fence(fence, c)
    assert share(c, "r1", limit=2) == [2, fence], "the same token refreshes its share"
    assert share(c, "r2", limit=2) == [1, fence + 1]
    assert json.loads(c.hget(KEYS.holders, "r2"))["fence"] == str(fence + 1), "every digit"
    assert_counter_expires(c, KEYS.fence, 10_000)
    code, wait, _ = share(c, "r3", limit=2)
    assert code == 0 and 0 < wait <= 10_000, "the limit is reached"
    code, wait, holder = acquire(c, "w")
    assert (code, holder) == (0, "") and wait > 0, "a writer waits for the shares"
    assert release_share(c, "r1") == 1
    assert release_share(c, "r1") == 0
    assert release_share(c, "r2") == 1
    assert acquire(c, "w")[0] == 1
    code, _, holder = share(c, "r4", task_id="t5")
    assert (code, holder) == (0, "t1"), "no share while a writer holds it"


def test_a_waiting_writer_stops_new_shares(redis_node):
    """Writer preference: once a blocking writer waits, new readers are refused."""
    c = redis_node.client()
    assert share(c, "r1")[0] == 1
    assert acquire(c, "w", writer="")[0] == 0
    assert share(c, "r2")[0] == 1, "a writer that only tried does not block readers"
    assert acquire(c, "w", writer="1")[0] == 0
    assert share(c, "r3")[0] == 0, "the waiting writer is served first"
    release_share(c, "r1")
    release_share(c, "r2")
    assert acquire(c, "w", writer="1")[0] == 1
    assert c.zrange(KEYS.shared, 0, -1) == [], "the writer's mark is gone with it"


def test_expired_shares_are_dropped_and_not_renewed(redis_node):
    """A dead reader's share ends at its deadline; renewal reports it gone."""
    c = redis_node.client()
    code, fence = share(c, "r1", ttl=50, task_id="t1")
    assert code == 1
    assert_clock_fence(fence, c)
    holds, leases = [KEYS.shared, KEYS.holders], ["r1", 60_000, "s", "r1", 60_000, "d"]
    assert renew(c, holds, leases) == [1, 1]
    c.zadd(KEYS.shared, {"r1": 0})  # its deadline passes
    assert renew(c, holds, leases)[0] == 0
    assert acquire(c, "w")[0] == 1, "an expired share does not keep a writer out"
    assert c.hlen(KEYS.holders) == 0, "its details went with it"


def test_a_task_id_holds_one_share_only(redis_node):
    """A redelivered task (same id) cannot take a second share and overlap itself."""
    c = redis_node.client()
    assert share(c, "r1", task_id="t1", limit=3)[0] == 1
    assert share(c, "r2", task_id="t1", limit=3)[:3:2] == [0, "t1"]
    assert share(c, "r3", task_id="t2", limit=3)[0] == 1


def test_release_if_frees_a_dead_childs_share(redis_node):
    """The parent's cleanup finds a share by task id and pid too."""
    c = redis_node.client()
    share(c, "r1", task_id="t1")
    assert run(c, RELEASE_IF, KEYS, task_id="t1", pid=8, reserve_ms=0) == 0, "another pid"
    assert run(c, RELEASE_IF, KEYS, task_id="t1", pid=7, reserve_ms=0) == 1
    assert c.zcard(KEYS.shared) == 0


def test_fair_queue_serves_arrival_order(redis_node):
    """Only the head of the queue takes a free lock; a try never queues."""
    c = redis_node.client()
    assert acquire(c, "holder", fair="10000")[0] == 1
    assert acquire(c, "w1", fair="10000")[0] == 0
    assert acquire(c, "w2", fair="10000")[0] == 0
    assert acquire(c, "try", fair="0")[0] == 0
    assert c.zrange(KEYS.queue, 0, -1) == ["w1", "w2"]
    pubsub = c.pubsub()
    pubsub.subscribe(KEYS.channel)
    pubsub.get_message(timeout=1)
    assert release(c, "holder", fair=True) == 1
    assert pubsub.get_message(timeout=1)["data"] == "w1", "the release names the head"
    assert acquire(c, "w2", fair="10000")[0] == 0, "not w2's turn"
    assert acquire(c, "try", fair="0")[0] == 0
    assert acquire(c, "w1", fair="10000")[0] == 1
    assert c.zrange(KEYS.queue, 0, -1) == ["w2"]
    release(c, "w1", fair=True)
    assert pubsub.get_message(timeout=1)["data"] == "w2"
    assert run(c, FAIR_LEAVE, KEYS, token="w2", reserve_ms=0) == 1
    assert acquire(c, "try", fair="0")[0] == 1, "an empty queue lets a try in"
    pubsub.close()


def test_a_dead_fair_waiter_leaves_the_queue(redis_node):
    """A waiter that stops refreshing its place drops out at its deadline."""
    c = redis_node.client()
    acquire(c, "holder", fair="10000")
    acquire(c, "dead", fair="10000")
    c.zadd(KEYS.waiting, {"dead": 0})  # its deadline passes
    release(c, "holder", fair=True)
    assert acquire(c, "next", fair="10000")[0] == 1
    assert c.zcard(KEYS.queue) == 0
