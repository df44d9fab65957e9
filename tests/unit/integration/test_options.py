"""The per-task options table: every lock_* option listed once, documented, and settable."""

from __future__ import annotations

from celery_redlock.integration.settings import OPTIONS, SETTING_OPTIONS, TASK_OPTIONS


def test_every_task_option_is_in_the_table_and_in_the_reference():
    """One table of options: redlock_tasks' documentation lists every key a worker
    accepts (mode, limit and fair were missing), and LockedTask has each as lock_<name>."""
    from celery_redlock import LockedTask
    from celery_redlock.integration.settings import reference

    assert {"mode", "limit", "fair"} <= set(TASK_OPTIONS)
    tasks_row = next(line for line in reference().splitlines() if "`redlock_tasks`" in line)
    for name, option in TASK_OPTIONS.items():
        assert name in tasks_row, name
        assert option.task_doc, name
        assert hasattr(LockedTask, option.attribute), option.attribute


def test_every_row_is_a_setting_a_task_option_or_both():
    """A setting has a parser for its values; a row that is both checks a task's value
    with the same parser, so the two cannot accept different things."""
    assert set(SETTING_OPTIONS) | set(TASK_OPTIONS) == set(OPTIONS)
    assert all(option.parse is not None for option in SETTING_OPTIONS.values())
    both = set(SETTING_OPTIONS) & set(TASK_OPTIONS)
    assert {"ttl", "on_busy", "unique", "rate"} <= both
    assert not {"args", "key", "mode", "limit", "fair"} & set(SETTING_OPTIONS)


def resolve(settings=None, **options):
    from celery_redlock.integration.settings import from_conf, resolve_task_options

    def run(account_id, other=None):
        return account_id

    return resolve_task_options(
        from_conf(settings or {"redlock_url": "redis://localhost"}),
        "proj.sync",
        run,
        options,
        source="redlock_tasks['proj.*']",
    )


def test_uniqueness_options_resolve_and_refuse_what_cannot_work():
    """lock_unique, lock_debounce and lock_throttle: one resource, one of debounce and
    throttle, and lock_unique left unset beside them; redlock_* defaults only where they fit."""
    import pytest

    from celery_redlock import ConfigurationError

    assert resolve(unique="until_started").unique == "until_started"
    assert resolve(throttle=2).throttle == 2.0 and resolve(throttle=2).unique is None
    with pytest.raises(ConfigurationError, match="lock_unique must be one of"):
        resolve(unique="always")
    with pytest.raises(ConfigurationError, match="choose one"):
        resolve(debounce=1, throttle=2)
    with pytest.raises(ConfigurationError, match="one resource"):
        resolve(unique="until_finished", key=["a:{account_id}", "b:{other}"])
    with pytest.raises(ConfigurationError, match="leave lock_unique unset"):
        resolve(unique="until_started", debounce=1)
    with pytest.raises(ConfigurationError, match="redlock_on_duplicate must be one of"):
        resolve({"redlock_url": "redis://x", "redlock_on_duplicate": "drop"})
    defaults = {"redlock_url": "redis://x", "redlock_unique": "until_finished"}
    assert resolve(defaults).unique == "until_finished"
    assert resolve(defaults, key=["a:{account_id}", "b:{other}"]).unique is None
    assert resolve(defaults, throttle=5).unique is None
