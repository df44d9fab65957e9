"""Configuration-only enablement on a project's own task base class (in-process workers),
and in a process that only sends (a web process: a subprocess)."""

from __future__ import annotations

import json
import logging

import pytest

from celery_redlock import LockBusy, LockedTask, lock_configured_tasks
from celery_redlock.integration.task import lock_options
from tests.apps import configonly_custom
from tests.harness import close_app, lock_keys, make_app, wait_for
from tests.harness.celery_workers import BROKER_DB, redis_url_with_db, run_python
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
    # Celery stores the failure before it calls on_failure: the caller may hear first.
    wait_for(
        lambda: ("on_failure", failed.id) in configonly_custom.EVENTS,
        timeout=10,
        message="the project's on_failure hook ran",
    )
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


#: A web process: imports the app module, then celery_redlock, and sends twice.
WEB_PROCESS = """
import json, celery_redlock
from tests.apps.configonly_web import app
task = app.tasks["web.report"]
first, again = task.delay("mon"), task.delay("mon")
print(json.dumps([first.id, again.id, isinstance(task, celery_redlock.LockedTask)]))
"""


#: A web process that sends through the task imported from its module: Celery does not
#: finalize the app for that, so the task is not locked, and the send says so.
UNFINALIZED_WEB_PROCESS = """
import celery_redlock
from tests.apps.configonly_web import app, report
report.delay("tue"), report.delay("tue")
assert not app.finalized
"""


def run_web_process(redis_url, script):
    """``python -c script`` beside the test's servers; stdout and stderr, once it exits 0."""
    done = run_python({"REDLOCK_TEST_REDIS_URL": redis_url}, "-c", script)
    return done.stdout, done.stderr


def test_a_process_that_only_sends_deduplicates_once_the_app_finalizes(celery_redis):
    """redlock_tasks marks a plain task unique; a process that imports celery_redlock and
    sends twice, without lock_configured_tasks(app), publishes one message (the tasks
    are locked when the app finalizes). Where the app never finalizes, a WARNING says
    that the sends are not deduplicated and names lock_configured_tasks."""
    out, _ = run_web_process(celery_redis.url, WEB_PROCESS)
    first, again, locked = json.loads(out)
    assert locked, "locked when the app finalized"
    assert again == first, "the second send got the queued copy"
    broker = celery_redis.client(db=BROKER_DB)
    assert broker.llen("celery") == 1, "one message published"

    _, err = run_web_process(celery_redis.url, UNFINALIZED_WEB_PROCESS)
    (warning,) = [line for line in err.splitlines() if "without its lock" in line]
    assert "task web.report" in warning and "its app is not finalized" in warning
    assert "lock_configured_tasks(app)" in warning
    assert broker.llen("celery") == 3


def test_a_send_the_configuration_cannot_deduplicate_is_warned_once(celery_redis, caplog):
    """A task that redlock_tasks makes unique, registered after the app finalized (so not
    locked in this process), or sent by name: its sends are published, and a WARNING per
    task name says so and names lock_configured_tasks."""
    app = make_app(
        celery_redis.url,
        name="late",
        redlock_url=redis_url_with_db(celery_redis.url, 0),
        redlock_tasks={"late.*": {"unique": "until_started"}, "late.plain": {}},
    )
    try:
        app.finalize()

        @app.task(name="late.report", shared=False)
        def report(day):
            return day

        @app.task(name="late.plain.run", shared=False)
        def run(day):
            return day

        assert not isinstance(app.tasks["late.report"], LockedTask)
        with caplog.at_level(logging.WARNING, logger="celery_redlock.config_only"):
            report.delay("mon")
            report.delay("mon")
            app.send_task("late.other", ("mon",))
            run.delay("mon")  # late.* comes first: unique too
        said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(said) == 3, said
        assert "task late.report is sent from this process without its lock" in said[0]
        assert "registered after its app finalized" in said[0]
        assert "lock_configured_tasks(app)" in said[0]
        assert "task late.other" in said[1] and "send_task()" in said[1]
        assert "task late.plain.run" in said[2]
        assert celery_redis.client(db=BROKER_DB).llen("celery") == 4, "all published"
        assert lock_configured_tasks(app) == ["late.plain.run", "late.report"]
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="celery_redlock.config_only"):
            first = report.delay("tue")
            assert report.delay("tue").id == first.id
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    finally:
        close_app(app)
