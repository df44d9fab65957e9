"""The Lua scripts, called directly against a real redis-server."""

from __future__ import annotations

import pytest
import redis

from celery_redlock.keys import lock_keys
from celery_redlock.nodes import Call, Node, fan_out
from celery_redlock.scripts import (
    ACQUIRE,
    BEAT_CLAIM,
    FENCE_SYNC,
    INSPECT,
    RELEASE,
    RELEASE_IF,
    RENEW_MANY,
)

KEYS = lock_keys("job")


def acquire(client, token, ttl=10_000, task_id="t1", pid=100, keys=KEYS):
    return client.eval(ACQUIRE.source, 2, keys.lock, keys.fence, token, ttl, task_id, "h", pid, 0)


def test_scripts_load_from_the_installed_package():
    """Every script is package data with a header naming its KEYS and ARGV."""
    for script in (ACQUIRE, BEAT_CLAIM, FENCE_SYNC, INSPECT, RELEASE, RELEASE_IF, RENEW_MANY):
        assert script.source.startswith("-- ")
        assert "-- KEYS[" in script.source
        assert len(script.sha) == 40


def test_acquire_grants_a_growing_fence_and_names_the_holder(redis_node):
    """A free lock is granted with fence 1, 2...; a held one reports holder and TTL."""
    c = redis_node.client()
    assert acquire(c, "a") == [1, 1]
    assert acquire(c, "a") == [2, 1], "the same token refreshes, keeping its fence"
    code, pttl, holder = acquire(c, "b", task_id="t2")
    assert (code, holder) == (0, "t1")
    assert 0 < pttl <= 10_000
    c.delete(KEYS.lock)
    assert acquire(c, "b") == [1, 2]
    assert c.pttl(KEYS.fence) == -1, "the fence counter never expires"


def test_acquire_rejects_a_malformed_lease(redis_node):
    """A non-positive or fractional lease is an error reply, and nothing is written."""
    c = redis_node.client()
    for bad in (0, -5, "1.5", "soon"):
        with pytest.raises(redis.ResponseError, match="positive integer"):
            acquire(c, "a", ttl=bad)
    with pytest.raises(redis.ResponseError, match="empty owner token"):
        acquire(c, "")
    assert c.exists(KEYS.lock, KEYS.fence) == 0


def test_renew_many_reports_each_key(redis_node):
    """One call renews owned keys and reports gone (0) and taken (-1) ones."""
    c = redis_node.client()
    k1, k2, k3 = lock_keys("k1"), lock_keys("k2"), lock_keys("k3")
    acquire(c, "a", ttl=1000, keys=k1)
    acquire(c, "other", ttl=1000, keys=k2)
    codes = c.eval(
        RENEW_MANY.source, 3, k1.lock, k2.lock, k3.lock, "a", 60_000, "a", 60_000, "a", 60_000
    )
    assert codes == [1, -1, 0]
    assert c.pttl(k1.lock) > 1000
    assert c.pttl(k2.lock) <= 1000, "a lock held by another token is not extended"


def test_renew_many_validates_before_renewing_anything(redis_node):
    """A bad lease anywhere in the batch fails the call before any key is touched."""
    c = redis_node.client()
    k1, k2 = lock_keys("k1"), lock_keys("k2")
    acquire(c, "a", ttl=1000, keys=k1)
    with pytest.raises(redis.ResponseError, match="positive integer"):
        c.eval(RENEW_MANY.source, 2, k1.lock, k2.lock, "a", 60_000, "a", -1)
    assert c.pttl(k1.lock) <= 1000
    with pytest.raises(redis.ResponseError, match="one token and one lease per key"):
        c.eval(RENEW_MANY.source, 2, k1.lock, k2.lock, "a", 60_000)


def test_release_deletes_only_its_own_token_and_announces_it(redis_node):
    """Release by another token is refused; the owner's release publishes once."""
    c = redis_node.client()
    acquire(c, "a")
    pubsub = c.pubsub()
    pubsub.subscribe(KEYS.channel)
    assert pubsub.get_message(timeout=1)["type"] == "subscribe"
    assert c.eval(RELEASE.source, 1, KEYS.lock, "intruder") == -1
    assert c.exists(KEYS.lock)
    assert c.eval(RELEASE.source, 1, KEYS.lock, "a") == 1
    assert not c.exists(KEYS.lock)
    message = pubsub.get_message(timeout=1)
    assert (message["type"], message["channel"]) == ("message", KEYS.channel)
    assert c.eval(RELEASE.source, 1, KEYS.lock, "a") == 0
    assert pubsub.get_message(timeout=0.2) is None, "no announcement for a no-op release"
    pubsub.close()


def test_release_if_matches_task_id_and_pid(redis_node):
    """The parent's cleanup frees a lock only for the dead child's task id and pid."""
    c = redis_node.client()
    acquire(c, "a", task_id="t1", pid=100)
    assert c.eval(RELEASE_IF.source, 1, KEYS.lock, "t1", 101) == -1, "a redelivery elsewhere"
    assert c.eval(RELEASE_IF.source, 1, KEYS.lock, "t2", 100) == -1
    assert c.eval(RELEASE_IF.source, 1, KEYS.lock, "t1", 100) == 1
    assert c.eval(RELEASE_IF.source, 1, KEYS.lock, "t1", 100) == 0
    with pytest.raises(redis.ResponseError, match="empty task id"):
        c.eval(RELEASE_IF.source, 1, KEYS.lock, "", 100)


def test_fence_sync_only_raises_the_counter(redis_node):
    """The counter moves up to the quorum's fence, never down."""
    c = redis_node.client()
    acquire(c, "a")
    assert c.eval(FENCE_SYNC.source, 2, KEYS.lock, KEYS.fence, "a", 7) == 1
    assert c.get(KEYS.fence) == "7"
    assert c.hget(KEYS.lock, "fence") == "7"
    assert c.eval(FENCE_SYNC.source, 2, KEYS.lock, KEYS.fence, "b", 3) == 0
    assert c.get(KEYS.fence) == "7"


def test_inspect_snapshot(redis_node):
    """Inspect returns PTTL, the fence counter and the holder's fields."""
    c = redis_node.client()
    assert c.eval(INSPECT.source, 2, KEYS.lock, KEYS.fence) == [-2, 0]
    acquire(c, "a", task_id="t9", pid=42)
    pttl, counter, *flat = c.eval(INSPECT.source, 2, KEYS.lock, KEYS.fence)
    fields = dict(zip(flat[::2], flat[1::2], strict=True))
    assert 0 < pttl <= 10_000 and counter == 1
    assert fields["token"] == "a" and fields["task_id"] == "t9" and fields["pid"] == "42"


def test_scripts_go_by_evalsha_and_reload_after_a_flush(redis_node):
    """Calls use EVALSHA; after SCRIPT FLUSH one SCRIPT LOAD restores it for good."""
    node = Node(redis_node.url, timeout=1.0)
    call = [Call(INSPECT, KEYS[:2])]
    redis_node.reset_stats()
    fan_out([node], [call], timeout=1.0)
    stats = redis_node.commandstats()
    assert stats.get("script|load", stats.get("script")) == 1, "a new connection loads first"
    assert stats.get("evalsha") == 1, "so the first call does not hit NOSCRIPT"
    redis_node.client().script_flush()
    redis_node.reset_stats()
    for _ in range(3):
        (reply,) = fan_out([node], [call], timeout=1.0)
        assert reply.ok and reply.values[0] == [-2, 0]
    stats = redis_node.commandstats()
    assert stats.get("script|load", stats.get("script")) == 1, stats
    assert "eval" not in stats
    assert stats.get("evalsha") == 4, "three calls plus the one that answered NOSCRIPT"


def test_beat_claim_checks_leadership_and_advances_once(redis_node):
    """Only the leader claims; each known run can be advanced past by one claim only."""
    c = redis_node.client()
    keys = lock_keys("beat:app")
    acquire(c, "leader", keys=keys)

    def claim(token, known, now):
        return c.eval(BEAT_CLAIM.source, 2, keys.lock, keys.state, token, "entry", known, now)

    assert claim("usurper", "", "10") == [-1]
    assert claim("leader", "", "10") == [1]
    assert claim("leader", "", "11") == [0, "10"], "someone already ran it"
    assert claim("leader", "10", "11") == [1]
    assert claim("leader", "10", "11.5") == [0, "11"], "a second leader based on 10 is refused"
    assert c.hget(keys.state, "entry") == "11"
