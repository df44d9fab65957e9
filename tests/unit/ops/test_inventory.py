"""The read model: lock views across nodes, key resolution, and release by the token read."""

from __future__ import annotations

import pytest

from celery_redlock import Redlock
from celery_redlock.engine import keys as redis_keys
from celery_redlock.engine.keys import is_lock_key
from celery_redlock.nodes import NodeSet
from celery_redlock.ops.inventory import LockView, NodeView, read_locks, release_lock, resolve_key
from tests.harness import wait_for


def test_lock_view_picks_the_majority_token_and_its_quorum_ttl():
    """Across nodes the holder is the token on most nodes; TTL is how long it keeps a quorum."""
    views = [
        NodeView("a", pttl=10_000, fields={"token": "t1", "fence": "5"}),
        NodeView("b", pttl=20_000, fields={"token": "t1", "fence": "5"}),
        NodeView("c", pttl=30_000, fields={"token": "t2", "fence": "6"}),
        NodeView("d", pttl=-2),
        NodeView("e", error="ConnectionError: refused"),
    ]
    lock = LockView("redlock:{k}", "k", views, 3)
    assert (lock.token, lock.held_on, lock.other_tokens, lock.has_quorum) == ("t1", 2, 1, False)
    assert lock.ttl == 20.0, "not a quorum: until the last holding node expires"
    assert lock.unreachable() == ["e"]
    quorum = LockView("redlock:{k}", "k", views[:2] + views[3:4], 2)
    assert quorum.has_quorum and quorum.ttl == 10.0


def test_keys_and_names_resolve_to_the_lock_key():
    """KEY may be the key, a sibling key of the lock, or the lock's name."""
    assert resolve_key("redlock:{a:b}", "redlock:") == "redlock:{a:b}"
    assert resolve_key("redlock:{a:b}:fence", "redlock:") == "redlock:{a:b}"
    assert resolve_key("a:b", "redlock:") == "redlock:{a:b}"
    assert resolve_key("a:b", "app1:") == "app1:{a:b}"
    assert is_lock_key("redlock:{beat:x}", "redlock:")
    assert not is_lock_key("redlock:{beat:x}:state", "redlock:")
    assert not is_lock_key("redlock:{x}:fence", "redlock:")
    assert not is_lock_key("redlock:{}", "redlock:")


@pytest.mark.parametrize(
    "which", ["lock", "fence", "channel", "state", "shared", "holders", "queue", "waiting"]
)
def test_every_key_of_a_lock_resolves_to_its_lock_key(which):
    """resolve_key("redlock:{x}:shared") used to return "redlock:{redlock:{x}:shared}", a key
    that does not exist: every key of a lock (keys.SUFFIXES) names that lock."""
    for name in ("x", "a:b", "}odd", "x}:shared"):
        keys = redis_keys.lock_keys(name)
        assert resolve_key(getattr(keys, which), "redlock:") == keys.lock
        assert (
            resolve_key(getattr(redis_keys.lock_keys(name, "app1:"), which), "app1:")
            == redis_keys.lock_keys(name, "app1:").lock
        )


def test_release_lock_deletes_only_the_token_it_read(redis_factory):
    """release_lock on three nodes: released where the token is, left alone elsewhere."""
    servers = redis_factory(3)
    urls = [s.url for s in servers]
    nodeset = NodeSet(urls, timeout=1.0)
    lock = Redlock("r", nodes=urls, ttl=30, auto_renew=False)
    assert lock.acquire(blocking=False)
    # The vote returns once a quorum granted it: the third node's grant may be on its way.
    wait_for(lambda: read_locks(nodeset, ["redlock:{r}"], "redlock:")[0].held_on == 3, timeout=5)
    (view,) = read_locks(nodeset, ["redlock:{r}"], "redlock:")
    assert view.token == lock.lease.token and view.held_on == 3
    with servers[1].client() as conn:  # node 1 now holds someone else's token
        conn.hset("redlock:{r}", "token", "someone-else")
    with servers[2].client() as conn:  # node 2 lost it
        conn.delete("redlock:{r}")

    results = release_lock(nodeset, view)

    assert [r["result"] for r in results] == ["released", "taken", "gone"]
    with servers[1].client() as conn:
        assert conn.hget("redlock:{r}", "token") == "someone-else"
