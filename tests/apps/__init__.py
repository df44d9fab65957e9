"""Celery apps for tests, importable by worker subprocesses (``celery -A tests.apps.plain``).

An app module builds its app at import from ``$REDLOCK_TEST_REDIS_URL`` (see
``tests/apps/plain.py``). The tasks themselves are defined by functions here, so that a
test can register the very same tasks (same names, same code) on an app of its own for
an in-process worker, or to send them to a worker process::

    tasks = register_plain_tasks(make_app(celery_redis.url))
    tasks.add.delay(2, 3)
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

import celery

from tests.harness.celery_workers import APP_URL_ENV

__all__ = ["APP_URL_ENV", "PlainTasks", "register_plain_tasks"]


@dataclass(frozen=True)
class PlainTasks:
    """The plain test tasks registered on one app."""

    add: Any
    sleep_then: Any
    pid: Any
    record: Any

    @property
    def app(self) -> celery.Celery:
        """The app they are registered on."""
        return self.add.app


def _append_line(path: str, line: str) -> None:
    # One write(2) on an O_APPEND descriptor: lines from concurrent tasks never interleave.
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def register_plain_tasks(app: celery.Celery) -> PlainTasks:
    """Register the plain tasks (``plain.add``, ``plain.sleep_then``, ``plain.pid``,
    ``plain.record``) on ``app`` and return them.

    ``shared=False``: a shared task (Celery's default) is also added to every app
    finalized later in the process, so the next test's app would get this call's
    closures too (and a ``DuplicateTaskNameWarning``, an error under this suite).
    """

    @app.task(name="plain.add", shared=False)
    def add(x: int, y: int) -> int:
        return x + y

    @app.task(name="plain.sleep_then", shared=False)
    def sleep_then(seconds: float, value: Any) -> Any:
        time.sleep(seconds)  # the workload itself: a task that takes this long
        return value

    @app.task(name="plain.pid", shared=False)
    def pid() -> int:
        return os.getpid()

    @app.task(name="plain.record", shared=False)
    def record(path: str, label: str, seconds: float) -> str:
        """Append ``start``/``end`` lines (label, monotonic ns, pid) around a sleep.

        Read them back with ``tests.harness.read_intervals``.
        """
        _append_line(path, f"start {label} {time.monotonic_ns()} {os.getpid()}")
        time.sleep(seconds)
        _append_line(path, f"end {label} {time.monotonic_ns()} {os.getpid()}")
        return label

    return PlainTasks(add=add, sleep_then=sleep_then, pid=pid, record=record)
