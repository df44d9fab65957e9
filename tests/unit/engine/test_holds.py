"""Holds per thread (``engine/holds.py``): a hold belongs to the thread that acquired
it and to the process that did; a held lock object that is garbage-collected is
released with a warning.

Each test here reproduces a defect found by running peers' lock test suites and an
adversary against ``Redlock`` (issue 12, items 2, 3 and 5): it failed on the code
before the fix.
"""

from __future__ import annotations

import gc
import os
import threading
import warnings

import pytest

from celery_redlock import LockLost, LockNotOwned, Redlock
from tests.harness import collect_garbage, wait_for


def _token(client, key: str) -> str | None:
    return client.hget(key, "token")


# -- items 2 and 3: a hold belongs to its thread ---------------------------------------


def _in_thread(target, *args):
    result: dict = {}

    def run():
        try:
            result["value"] = target(*args)
        except BaseException as exc:
            result["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(20)
    assert not thread.is_alive()
    if "error" in result:
        raise result["error"]
    return result.get("value")


@pytest.mark.parametrize("how", ["expiry", "deleted with the watchdog on"])
def test_a_late_release_by_one_thread_leaves_another_threads_hold(redis_node, how):
    """A ends its hold late; B holds through the same handle; A's release/extend touch only A's."""
    client = redis_node.client(decode_responses=True)
    auto = how != "expiry"
    lock = Redlock("job", nodes=[redis_node.url], ttl=0.6 if not auto else 2, auto_renew=auto)
    a_holds, a_may_leave = threading.Event(), threading.Event()
    a_result: dict = {}

    def thread_a():
        lock.acquire()
        a_holds.set()
        a_may_leave.wait(20)
        try:
            lock.extend()
        except LockLost:
            a_result["extend"] = "lost"
        try:
            lock.release()
            a_result["release"] = "ok"
        except LockNotOwned as exc:
            a_result["release"] = exc

    a = threading.Thread(target=thread_a)
    a.start()
    assert a_holds.wait(10)
    if auto:
        client.delete(lock.key)
    else:
        wait_for(lambda: not client.exists(lock.key), timeout=5)

    b_token = _in_thread(lambda: (lock.acquire(blocking=False), lock.lease.token))
    assert b_token[0], "thread B could not take the free lock through the handle"
    a_may_leave.set()
    a.join(10)
    assert a_result["extend"] == "lost"
    assert _token(client, lock.key) == b_token[1], "A's release or extend touched B's lock"
    third = Redlock("job", nodes=[redis_node.url], ttl=5)
    assert not third.acquire(blocking=False)
    # B's own release works, from B's thread; the main thread holds nothing.
    with pytest.raises(LockNotOwned, match="another thread"):
        lock.release()


def test_each_thread_releases_only_its_own_hold(redis_node):
    """B cannot release A's hold through a shared handle, and B's acquire contends."""
    lock = Redlock("job", nodes=[redis_node.url], ttl=5)
    assert lock.acquire()
    assert _in_thread(lambda: lock.acquire(blocking=False)) is False
    with pytest.raises(LockNotOwned, match="another thread"):
        _in_thread(lock.release)
    with pytest.raises(LockNotOwned):
        _in_thread(lock.extend)
    assert lock.owned()
    lock.release()


@pytest.mark.parametrize("kind", [{"mode": "shared"}, {"limit": 2}])
def test_shared_handle_used_by_two_threads_leaves_no_share(redis_node, kind):
    """Two threads each take a share through one handle and release it: nothing is left."""
    client = redis_node.client(decode_responses=True)
    lock = Redlock("job", nodes=[redis_node.url], ttl=5, **kind)
    both, done = threading.Barrier(2), []

    def hold():
        assert lock.acquire(timeout=5)
        both.wait(10)
        lock.release()
        done.append(True)

    threads = [threading.Thread(target=hold) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    assert done == [True, True]
    assert client.zcard(lock.keys.shared) == 0, "a share was orphaned"
    writer = Redlock("job", nodes=[redis_node.url], ttl=5)
    assert writer.acquire(blocking=False), "writers are locked out"
    writer.release()


# -- forks -----------------------------------------------------------------------------


def test_a_forked_child_does_not_hold_or_release_its_parents_lock(redis_node):
    """The child's release is refused, its acquire contends, and the parent keeps the lock."""
    lock = Redlock("job", nodes=[redis_node.url], ttl=5)
    assert lock.acquire()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        code = 0
        try:
            try:
                lock.release()
                code |= 1
            except LockNotOwned:
                pass
            if lock.acquire(blocking=False):
                code |= 2
            if lock.remaining() != 0.0:
                code |= 4
        except BaseException:
            code |= 8
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert lock.owned()
    lock.release()


# -- item 5: a held handle that is garbage-collected --------------------------------


def test_a_collected_held_lock_is_released_with_a_warning(redis_node, caplog):
    """Dropping the last reference of a held, renewed lock releases it (not at TTL end)."""
    client = redis_node.client()
    lock = Redlock("job", nodes=[redis_node.url], ttl=30)
    assert lock.acquire()
    key = lock.key
    collect_garbage()  # what the harness left (unclosed sockets) must not warn inside the block
    with pytest.warns(ResourceWarning, match="garbage-collected while held"):
        del lock
        gc.collect()
    wait_for(lambda: not client.exists(key), timeout=5)
    # Logged too: production runs without development mode never show the warning.
    assert any("garbage-collected while held" in r.getMessage() for r in caplog.records)


def test_a_collected_lock_without_renewal_just_runs_out(redis_node):
    """With auto_renew=False nothing renews it: the lease ends by itself, silently."""
    client = redis_node.client()
    lock = Redlock("job", nodes=[redis_node.url], ttl=30, auto_renew=False)
    assert lock.acquire()
    key = lock.key
    collect_garbage()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        del lock
        gc.collect()
    assert client.pttl(key) > 20_000
