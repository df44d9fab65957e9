"""Redlock on one node: acquire, hold, release, bad input (waiting: test_waiting.py)."""

from __future__ import annotations

import pickle
import threading
import time

import pytest

from celery_redlock import (
    ConfigurationError,
    LockBusy,
    LockLost,
    LockNotOwned,
    NodeUnavailable,
    Redlock,
)
from tests.harness.servers import free_port, wait_for


@pytest.mark.smoke
def test_acquire_release_and_fences_grow(redis_node):
    """Each acquisition gets a larger fence; locked/owned follow the holder."""
    a = Redlock("job", nodes=[redis_node.url], ttl=5)
    b = Redlock("job", nodes=[redis_node.url], ttl=5)
    assert not a.locked()
    fences = []
    for _ in range(3):
        with a:
            fences.append(a.fence)
            assert a.locked() and a.owned()
            assert not b.owned()
            assert 4 < a.remaining() <= 5
        assert not a.locked()
    assert fences == sorted(fences) and len(set(fences)) == 3


@pytest.mark.smoke
def test_busy_lock_names_its_holder(redis_node):
    """A second owner is refused; LockBusy carries key, holder task id and TTL in args."""
    a = Redlock("job", nodes=[redis_node.url], ttl=5, task_id="task-1")
    b = Redlock("job", nodes=[redis_node.url], ttl=5)
    assert a.acquire(blocking=False)
    assert b.acquire(blocking=False) is False
    with pytest.raises(LockBusy) as info:
        b.try_acquire()
    assert info.value.key == "redlock:{job}" and info.value.holder == "task-1"
    assert 0 < info.value.ttl <= 5
    assert "task task-1" in str(info.value)
    rebuilt = pickle.loads(pickle.dumps(info.value))
    assert (rebuilt.key, rebuilt.holder, rebuilt.ttl) == (
        info.value.key,
        info.value.holder,
        info.value.ttl,
    )
    a.release()


def test_reentrant_for_the_same_object(redis_node):
    """Acquiring twice needs two releases; another object stays out until the last."""
    a = Redlock("job", nodes=[redis_node.url], ttl=5)
    other = Redlock("job", nodes=[redis_node.url], ttl=5)
    assert a.acquire() and a.acquire(blocking=False)
    fence = a.fence
    a.release()
    assert a.locked() and not other.acquire(blocking=False)
    a.release()
    assert other.acquire(blocking=False) and other.fence == fence + 1
    other.release()
    with pytest.raises(LockNotOwned):
        a.release()


def test_release_after_expiry_leaves_the_new_holders_lock_alone(redis_node):
    """An old owner's late release must not delete the lock someone else now holds."""
    old = Redlock("job", nodes=[redis_node.url], ttl=0.3, auto_renew=False)
    new = Redlock("job", nodes=[redis_node.url], ttl=5)
    assert old.acquire()
    client = redis_node.client()
    wait_for(lambda: not client.exists("redlock:{job}"), timeout=5)
    assert new.acquire(blocking=False)
    with pytest.raises(LockLost, match="renewal not confirmed"):
        old.check()
    old.release()
    assert new.owned()
    new.release()


def test_extend_and_check(redis_node):
    """extend() renews now; after the key is deleted, extend and check raise LockLost."""
    lock = Redlock("job", nodes=[redis_node.url], ttl=2, auto_renew=False)
    assert lock.acquire()
    assert 1.9 < lock.extend() <= 2
    lock.check()
    redis_node.client().delete("redlock:{job}")
    with pytest.raises(LockLost):
        lock.extend()
    with pytest.raises(LockLost):
        lock.check()


@pytest.mark.smoke
def test_key_deleted_behind_the_holders_back_is_a_loss_within_one_interval(redis_node):
    """The watchdog reports a stolen lock at its next tick, through on_lost."""
    lost = []
    lock = Redlock("job", nodes=[redis_node.url], ttl=1.5, on_lost=lost.append)
    assert lock.acquire()
    deleted_at = time.monotonic()
    redis_node.client().delete("redlock:{job}")
    wait_for(lambda: lost, timeout=5)
    assert time.monotonic() - deleted_at <= lock.timing.renew_interval + 0.5
    assert isinstance(lost[0], LockLost) and lost[0].key == "redlock:{job}"
    with pytest.raises(LockLost):
        lock.check()
    lock.release()  # releasing a lost lock is allowed and touches nothing


# -- bad input -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"ttl": 0}, "ttl must be > 0"),
        ({"ttl": -1}, "ttl must be > 0"),
        ({"ttl": "30"}, "ttl must be a number"),
        ({"ttl": 10, "renew_interval": 10}, "renew_interval must be shorter than ttl"),
        ({"ttl": 10, "renew_interval": 3, "node_timeout": 5}, "node_timeout"),
        ({"drift_factor": 0.9}, "drift_factor must be >= 0.0 and <= 0.5"),
        ({"nodes": []}, "no Redis nodes given"),
        ({"nodes": ["redis://a", "redis://a"]}, "must be distinct"),
        ({"nodes": ["http://example"]}, "invalid Redis URL"),
    ],
)
def test_bad_options_raise_a_clear_error(kwargs, message):
    """Invalid options fail at construction with a message naming the problem."""
    with pytest.raises(ConfigurationError, match=message):
        Redlock("job", **kwargs)


def test_empty_name_is_refused():
    """A lock needs a name."""
    with pytest.raises(ConfigurationError, match="non-empty string"):
        Redlock("")


def test_unreachable_node_is_named():
    """Nothing listening: NodeUnavailable names the URL, blocking or not, promptly."""
    url = f"redis://127.0.0.1:{free_port()}/0"
    lock = Redlock("job", nodes=[url], ttl=5)
    for blocking in (False, True):
        with pytest.raises(NodeUnavailable, match=f"127.0.0.1:{url.rsplit(':', maxsplit=1)[-1]}"):
            lock.acquire(blocking=blocking)


@pytest.mark.smoke
def test_wrong_password_is_named(redis_factory):
    """A bad password is reported as an authentication failure, with the password hidden."""
    (server,) = redis_factory(1, "--requirepass", "right")
    url = f"redis://:wrong@127.0.0.1:{server.port}/0"
    with pytest.raises(NodeUnavailable) as info:
        Redlock("job", nodes=[url], ttl=5).acquire(blocking=False)
    text = str(info.value)
    assert "Authentication" in text or "WRONGPASS" in text or "invalid" in text.lower()
    assert "wrong" not in text
    good = Redlock("job", nodes=[f"redis://:right@127.0.0.1:{server.port}/0"], ttl=5)
    assert good.acquire(blocking=False)
    good.release()


def test_threads_sharing_one_object_still_exclude_each_other(redis_node):
    """Reentrancy is per holding thread: another thread with the same object must wait."""
    lock = Redlock("job", nodes=[redis_node.url], ttl=5)
    assert lock.acquire()
    result = {}
    thread = threading.Thread(target=lambda: result.update(got=lock.acquire(blocking=False)))
    thread.start()
    thread.join(10)
    assert result["got"] is False
    lock.release()


def test_release_warning_says_another_owner_holds_it(redis_node, caplog):
    """A release that finds another owner's lock says so; it does not promise an expiry."""
    lock = Redlock("job", nodes=[redis_node.url], ttl=30, auto_renew=False)
    assert lock.acquire()
    client = redis_node.client()
    client.delete(lock.key)  # an operator (or a bug elsewhere) deleted it...
    other = Redlock("job", nodes=[redis_node.url], ttl=30)
    assert other.acquire(blocking=False)  # ...and someone else holds it now
    with caplog.at_level("WARNING", logger="celery_redlock.lock"):
        lock.release()
    messages = [record.getMessage() for record in caplog.records]
    assert any("held by another owner on 1 of 1 nodes" in m for m in messages), messages
    assert not any("expire within 30.0s" in m for m in messages), messages
    assert other.owned()
    other.release()


def test_fence_is_an_int_while_held_and_raises_otherwise(redis_node):
    """A fence comes from an acquisition: before any there is no None to guard a write with."""
    lock = Redlock("job", nodes=[redis_node.url], ttl=5, auto_renew=False)
    with pytest.raises(LockNotOwned, match="no fence"):
        lock.fence  # noqa: B018
    with lock:
        assert isinstance(lock.fence, int) and lock.fence >= 1
        seen = []
        other = threading.Thread(target=lambda: seen.append(_fence_or_error(lock)))
        other.start()
        other.join(10)
        # A thread that never acquired (an on_lost callback, a helper) reads the only
        # hold's fence, as it reads its lease.
        assert seen == [lock.fence]
        fence = lock.fence
    assert lock.fence == fence, "after the release: the last acquisition's fence"


def _fence_or_error(lock: Redlock) -> object:
    try:
        return lock.fence
    except LockNotOwned as exc:
        return type(exc).__name__


def test_the_quick_starts_fence_use_type_checks(tmp_path):
    """``store(page, fence=self.lock.fence)`` with an ``int`` parameter passes mypy --strict."""
    api = pytest.importorskip("mypy.api", reason="mypy (the lint extra) is not installed")
    source = tmp_path / "quickstart.py"
    source.write_text(
        "from celery_redlock import Redlock\n"
        "def store(page: str, fence: int) -> None: ...\n"
        "def write(lock: Redlock) -> None:\n"
        "    store('page', fence=lock.fence)\n"
        "    store('page', fence=lock.fences['page'])\n"
    )
    out, err, status = api.run(["--strict", "--no-incremental", str(source)])
    assert status == 0, out + err
