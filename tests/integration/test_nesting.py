"""Locked runs nested in one thread: eager ``apply()``, inline errbacks, eager results."""

from __future__ import annotations

import pytest
from celery import states

from celery_redlock import LockBusy
from tests.apps.locked import create_app
from tests.harness import close_app, lock_keys, wait_for
from tests.integration.test_task import get


@pytest.fixture
def app(celery_redis):
    app = create_app(celery_redis.url)
    yield app
    close_app(app)


def test_apply_inside_a_locked_body_releases_both_locks_in_a_worker(
    app, celery_redis, inprocess_worker_factory
):
    """outer(7) runs inner.apply(7) in its body: both locks are freed, outer(7) runs again."""
    inprocess_worker_factory(app, pool="solo")
    outer = app.tasks["tests.apps.locked.outer"]
    first = get(outer.delay(7))
    assert first["still"] == first["outer_key"], "self.lock is outer's again after inner"
    assert first["inner"]["key"] != first["outer_key"]
    wait_for(lambda: not lock_keys(celery_redis), timeout=10, message="both locks released")
    second = get(outer.delay(7))
    assert second["outer_key"] == first["outer_key"], "the same key is free to lock again"


@pytest.mark.parametrize("where", ["worker", "apply"])
def test_a_task_calling_itself_keeps_its_lock_until_its_own_body_returns(
    app, celery_redis, inprocess_worker_factory, where
):
    """recurse(7, 2) calls recurse(7, 1) and recurse(7, 0) directly, in its body: the
    lock is released as the outermost body returns, not as a nested call does (the
    lock is still owned, by the same fence, when each returns), and then it is free."""
    recurse = app.tasks["tests.apps.locked.recurse"]
    if where == "worker":
        inprocess_worker_factory(app, pool="solo")
        seen = get(recurse.delay(7, 2))
    else:
        result = recurse.apply(args=(7, 2))
        assert result.state == states.SUCCESS, result.traceback
        seen = result.result
    levels = [seen, seen["below"], seen["below"]["below"]]
    assert [level["owned"] for level in levels] == [True] * 3
    assert len({level["fence"] for level in levels}) == 1, "one acquisition, one fence"
    wait_for(lambda: not lock_keys(celery_redis), timeout=10, message="the lock released")


def test_eager_apply_nested_in_eager_apply_releases_both_locks(app, celery_redis):
    """No worker at all: outer.apply(7) nests inner.apply(7); nothing stays locked."""
    outer = app.tasks["tests.apps.locked.outer"]
    for _ in range(2):
        result = outer.apply(args=(7,))
        assert result.state == states.SUCCESS, result.traceback
        assert not lock_keys(celery_redis)


def test_inline_errback_of_an_eager_failure_releases_the_failed_tasks_lock(app, celery_redis):
    """fail.apply(link_error=on_error.s()) runs the locked errback inline; fail's lock is freed."""
    fail, on_error = app.tasks["tests.apps.locked.fail"], app.tasks["tests.apps.locked.on_error"]
    for _ in range(2):
        result = fail.apply(args=("boom",), link_error=on_error.s())
        assert result.state == states.FAILURE
        assert isinstance(result.result, ValueError), "not LockBusy: the lock was free"
        assert not lock_keys(celery_redis)


def test_a_skipped_eager_run_fails_with_lockbusy_as_a_worker_run_does(app, celery_redis):
    """apply() of a held key: FAILURE with LockBusy and get() raises it, as from a worker."""
    from celery_redlock import Redlock

    hold = app.tasks["tests.apps.locked.hold"]
    probe = hold.apply(args=("acct-eager",))  # to learn the key this call locks
    holder = Redlock(probe.result["key"].split("{", 1)[1][:-1], nodes=[app.conf.redlock_url])
    with holder:
        skipped = hold.apply(args=("acct-eager",))
        assert skipped.state == states.FAILURE
        with pytest.raises(LockBusy):
            skipped.get()
        assert isinstance(skipped.get(propagate=False), LockBusy)
        with pytest.raises(LockBusy):
            hold.apply(args=("acct-eager",), throw=True)
    assert not lock_keys(celery_redis)


def test_a_call_that_does_not_bind_fails_with_pythons_type_error(
    app, celery_redis, inprocess_worker_factory
):
    """A missing argument fails with the TypeError Python gives, not a LockKeyError."""
    inprocess_worker_factory(app, pool="solo")
    result = app.send_task("tests.apps.locked.hold", args=(), kwargs={"path": None})
    with pytest.raises(TypeError, match=r"missing 1 required positional argument: 'resource'"):
        get(result)
    eager = app.tasks["tests.apps.locked.hold"].apply(kwargs={"path": None})
    assert isinstance(eager.result, TypeError)
    assert "missing 1 required positional argument: 'resource'" in str(eager.result)
    assert not lock_keys(celery_redis)
