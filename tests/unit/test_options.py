"""The per-task options table: every lock_* option listed once, documented, and settable."""

from __future__ import annotations

from celery_redlock.options import TASK_OPTIONS
from celery_redlock.settings import OPTIONS


def test_every_task_option_is_in_the_table_and_in_the_reference():
    """One table of task options: redlock_tasks' documentation lists every key a worker
    accepts (mode, limit and fair were missing), and LockedTask has each as lock_<name>."""
    from celery_redlock import LockedTask
    from celery_redlock.settings import reference

    assert {"mode", "limit", "fair"} <= set(TASK_OPTIONS)
    tasks_row = next(line for line in reference().splitlines() if "`redlock_tasks`" in line)
    for name, option in TASK_OPTIONS.items():
        assert name in tasks_row, name
        assert option.doc, name
        assert option.setting is None or option.setting in OPTIONS, name
        assert hasattr(LockedTask, option.attribute), option.attribute
