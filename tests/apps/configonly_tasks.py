"""Plain tasks: no LockedTask, no import of celery_redlock."""

import os
import time
from pathlib import Path

from tests.apps.configonly import app


def _record(path, label, seconds):
    with Path(path).open("a") as out:
        out.write(f"start {label} {time.monotonic_ns()} {os.getpid()}\n")
    time.sleep(seconds)
    with Path(path).open("a") as out:
        out.write(f"end {label} {time.monotonic_ns()} {os.getpid()}\n")
    return label


@app.task
def sync_account(account_id, path, label, seconds=0.0):
    """Locked per account by configuration."""
    return _record(path, label, seconds)


@app.task
def nightly_report(path, label, seconds=0.0):
    """Locked as a whole: ``args: []`` keys it by the task name alone."""
    return _record(path, label, seconds)


@app.task
def unlocked(path, label, seconds=0.0):
    """Not named in redlock_tasks: never locked."""
    return _record(path, label, seconds)
