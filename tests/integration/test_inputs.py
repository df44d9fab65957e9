"""Unclear task inputs are refused when the worker (or a leader beat) starts, naming the task
and the input."""

from __future__ import annotations

import pytest

from celery_redlock import ConfigurationError, LockedTask
from celery_redlock.integration.beat import LeaderScheduler
from celery_redlock.integration.names import check_key_template
from tests.apps import configonly_custom
from tests.apps.locked import create_app
from tests.apps.rated import make_rated_app
from tests.harness import InProcessWorker, close_app


def start_fails(app) -> str:
    """Start an in-process worker for ``app``; return the error that stopped it."""
    worker = InProcessWorker(app, pool="solo")
    try:
        with pytest.raises(ConfigurationError) as info:
            worker.start()
    finally:
        worker.stop()
        app.close()
    return str(info.value)


def beat_fails(app, tmp_path) -> str:
    """Start a LeaderScheduler for ``app`` (as ``celery beat -S`` does); the error."""
    try:
        with pytest.raises(ConfigurationError) as info:
            LeaderScheduler(app=app, schedule_filename=str(tmp_path / "schedule"))
    finally:
        close_app(app)
    return str(info.value)


#: Rates that are not "N/s", "N/m" or "N/h" with N >= 1.
BAD_RATES = ["fast", "0/s", "-3/m", "5/fortnight", 5]
#: The allowed form, as every refusal of a rate says it.
RATE_FORM = '"N/s", "N/m" or "N/h"'


def rated_app_with(url, where, rate, *, resources=1):
    """The rated app, with ``rate`` set ``where``; the error's start for it.

    ``where``: ``task`` (``lock_rate`` on a task), ``redlock_rate`` (the default of every
    locked task), ``redlock_tasks`` (an entry's ``rate``). With ``resources=2`` the task
    (or the entry) names two resources in its ``lock_key``.
    """
    key = "api:{key}" if resources == 1 else ["api:{key}", "file:{out}"]
    if where == "redlock_tasks":
        entry = {"rate": rate} if resources == 1 else {"rate": rate, "key": key}
        app = make_rated_app(url, redlock_tasks={"rated.plain": entry})
        return app, "task rated.plain: lock_rate"
    app = make_rated_app(url, **({"redlock_rate": rate} if where == "redlock_rate" else {}))
    if where == "task":

        @app.task(
            name="bad.rate", base=LockedTask, bind=True, shared=False, lock_rate=rate, lock_key=key
        )
        def bad_rate(self, key, out):
            return key

        return app, "task bad.rate: lock_rate"
    return app, "redlock_rate"


@pytest.mark.parametrize("starts", ["worker", "beat"])
@pytest.mark.parametrize("where", ["task", "redlock_rate", "redlock_tasks"])
@pytest.mark.parametrize("rate", BAD_RATES)
def test_a_bad_rate_stops_the_worker_and_beat_naming_it(
    celery_redis, tmp_path, starts, where, rate
):
    """A rate a budget cannot use never runs unlimited: the worker, and a LeaderScheduler
    beat, refuse to start, naming the option (or setting) and the allowed form."""
    app, names = rated_app_with(celery_redis.url, where, rate)
    message = start_fails(app) if starts == "worker" else beat_fails(app, tmp_path)
    assert f"{names} must be a rate {RATE_FORM}" in message, message
    assert repr(rate) in message
    if where == "redlock_tasks":
        assert "(options from redlock_tasks['rated.plain'])" in message


@pytest.mark.parametrize("starts", ["worker", "beat"])
@pytest.mark.parametrize("where", ["task", "redlock_tasks"])
def test_a_rate_on_a_key_of_several_resources_stops_the_worker_and_beat(
    celery_redis, tmp_path, starts, where
):
    """A budget is for one key: a rate on a lock_key list is refused at start, whoever
    sets it; the redlock_rate default does not apply to such a task."""
    app, names = rated_app_with(celery_redis.url, where, "5/s", resources=2)
    message = start_fails(app) if starts == "worker" else beat_fails(app, tmp_path)
    assert f"{names}: a rate budget is for one resource; lock_key names 2" in message


def test_args_given_as_a_string_is_refused_naming_the_task_and_the_setting(celery_redis):
    """ "args": "account_id" is not split into letters: the worker refuses to start."""
    app = configonly_custom.create_app(
        celery_redis.url, redlock_tasks={"custom.sync": {"args": "account_id"}}
    )
    message = start_fails(app)
    assert "redlock_tasks['custom.sync']" in message
    assert "task custom.sync" in message
    assert "'args' must be a list of argument names, got 'account_id'" in message
    assert "'a', 'c'" not in message


def test_args_naming_no_parameter_names_the_setting_entry(celery_redis):
    """An unknown name in a redlock_tasks entry's args: the error says which entry set it."""
    app = configonly_custom.create_app(
        celery_redis.url, redlock_tasks={"custom.*": {"args": ["acount_id"]}}
    )
    message = start_fails(app)
    assert "lock_args names 'acount_id'" in message
    assert "redlock_tasks['custom.*']" in message


@pytest.mark.parametrize(
    ("where", "key"),
    [("task", "x:{nope}"), ("task", ["acct:{source}", "acct:{nope}"]), ("config", "x:{nope}")],
)
def test_lock_key_with_an_unknown_field_stops_the_worker(celery_redis, where, key):
    """lock_key naming something that is not a parameter fails at start, not at every run."""
    if where == "task":
        app = create_app(celery_redis.url)

        @app.task(name="odd.key", base=LockedTask, bind=True, shared=False, lock_key=key)
        def odd_key(self, source, target=None):
            return source

        task_name = "odd.key"
    else:
        app = configonly_custom.create_app(
            celery_redis.url, redlock_tasks={"custom.sync": {"key": key}}
        )
        task_name = "custom.sync"
    message = start_fails(app)
    assert f"task {task_name}" in message
    assert "x:{nope}" in message or "acct:{nope}" in message
    assert "{nope}" in message and "nope is not a parameter" in message


def run(doc, account_id=0):
    """A task body's signature."""


@pytest.mark.parametrize(
    "template", ["d:{doc}", "d:{doc[id]}", "d:{doc.real!r:>5}", "{account_id}"]
)
def test_key_templates_over_parameters_are_accepted(template):
    """Fields that start with a parameter name, with indexing, attributes, conversions."""
    check_key_template("proj.t", run, template)


@pytest.mark.parametrize(
    ("template", "says"),
    [
        ("d:{}", "a positional field is not a parameter"),
        ("d:{0}", "0 is not a parameter"),
        ("d:{other[id]}", "other is not a parameter"),
        ("d:{doc", "not a valid format string"),
        ("d:{doc!z}", "unknown conversion !z"),
    ],
)
def test_key_templates_that_cannot_format_are_refused(template, says):
    """Positional, unknown, malformed fields: refused with the task, the key and the field."""
    with pytest.raises(ConfigurationError) as info:
        check_key_template("proj.t", run, template)
    assert "task proj.t" in str(info.value) and repr(template) in str(info.value)
    assert says in str(info.value)
