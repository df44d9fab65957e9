"""Configuration-only enablement on a project's own task base class (in-process workers)."""

from __future__ import annotations

import pytest

from celery_redlock import LockBusy, LockedTask
from celery_redlock.task import lock_options
from tests.apps import configonly_custom
from tests.harness import close_app, lock_keys, make_app, wait_for
from tests.harness.celery_workers import redis_url_with_db
from tests.integration.test_task import get


@pytest.fixture
def app(celery_redis):
    configonly_custom.EVENTS.clear()
    app = configonly_custom.create_app(celery_redis.url)
    yield app
    close_app(app)


def test_project_attributes_and_hooks_survive_configuration_only_locking(
    app, celery_redis, inprocess_worker_factory
):
    """self.lock(name), lock_key and the project's hooks (push_request too) stay the project's."""
    inprocess_worker_factory(app, pool="solo")
    result = app.tasks["custom.sync"].delay(7)
    value = get(result)
    assert value["lock"] == "project-lock:x", "the project's own lock() method"
    assert value["lock_key"] == "project-meaning", "the project's own lock_key attribute"
    assert value["held"].startswith("redlock:{custom.sync:"), "and the task ran locked"
    assert ("before_start", result.id) in configonly_custom.EVENTS
    assert ("__call__", result.id) in configonly_custom.EVENTS
    # Task.__call__ pushes the body's request through push_request: the project's
    # runs, and gets the execution's fields (LockedTask's merges them in first).
    assert ("push_request", result.id) in configonly_custom.EVENTS
    failed = app.tasks["custom.explode"].delay(3)
    with pytest.raises(ValueError):
        get(failed)
    assert ("on_failure", failed.id) in configonly_custom.EVENTS
    wait_for(lambda: not lock_keys(celery_redis), timeout=10, message="locks released")


def test_options_come_from_redlock_tasks_not_from_the_projects_attributes(
    app, inprocess_worker_factory
):
    """Keyed by account_id as redlock_tasks says, not by the project's lock_key attribute."""
    inprocess_worker_factory(app, pool="threads", concurrency=3)
    sync = app.tasks["custom.sync"]
    first = sync.delay(7, 1.5)
    wait_for(lambda: ("__call__", first.id) in configonly_custom.EVENTS, timeout=10)
    same, other = sync.delay(7), sync.delay(8)
    with pytest.raises(LockBusy):
        get(same)
    assert get(other)["held"] != get(first)["held"]


def test_nested_eager_runs_of_configuration_locked_tasks_release_both_locks(
    app, celery_redis, inprocess_worker_factory
):
    """custom.outer(7) applies custom.sync(7) in its body: nothing stays locked after it."""
    inprocess_worker_factory(app, pool="solo")
    outer = app.tasks["custom.outer"]
    for _ in range(2):
        assert get(outer.delay(7))["held"].startswith("redlock:{custom.sync:")
        wait_for(lambda: not lock_keys(celery_redis), timeout=10, message="both locks released")


def test_the_worker_says_which_code_options_a_config_entry_overrides(
    celery_redis, inprocess_worker_factory, caplog
):
    """lock_ttl=60 in code, {"ttl": 5} in redlock_tasks: the entry wins, said at INFO."""
    app = make_app(
        celery_redis.url,
        redlock_url=redis_url_with_db(celery_redis.url, 0),
        redlock_tasks={"prec.*": {"ttl": 5, "on_busy": "skip"}},
    )

    @app.task(name="prec.sync", base=LockedTask, shared=False, lock_ttl=60, lock_on_busy="skip")
    def sync(account_id):
        return account_id

    with caplog.at_level("INFO", logger="celery_redlock.worker"):
        inprocess_worker_factory(app, pool="solo")
    said = [r.getMessage() for r in caplog.records if "over the code's" in r.getMessage()]
    assert said == [
        "celery_redlock: task prec.sync: redlock_tasks['prec.*'] sets ttl=5 "
        "over the code's lock_ttl=60"
    ]
    assert lock_options(app.tasks["prec.sync"]).timing.ttl == 5
    close_app(app)
