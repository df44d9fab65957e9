"""Unclear task inputs are refused when the worker starts, naming the task and the input."""

from __future__ import annotations

import pytest

from celery_redlock import ConfigurationError, LockedTask
from celery_redlock.engine.names import check_key_template
from tests.apps import configonly_custom
from tests.apps.locked import create_app
from tests.harness import InProcessWorker


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
