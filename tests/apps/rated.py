"""Tasks with rate budgets (``lock_rate``) and ``lock_on_busy="requeue"``, for in-process
and prefork workers.

The Redis URL comes from ``REDLOCK_TEST_REDIS_URL`` (broker on db 1, results on db 2,
locks on db 0), as in :mod:`tests.apps.unique`. Each body appends one line
``<task id> <key> <start> <end> <pid>`` (wall clock) to the file ``out``.
"""

from __future__ import annotations

import os
import time

from celery import Celery

from celery_redlock import LockedTask
from tests.harness.celery_workers import make_app, redis_url_with_db

REDIS_URL = os.environ.get("REDLOCK_TEST_REDIS_URL", "redis://127.0.0.1:6379")


def record(self, key, out, hold=0.0):
    started = time.time()
    if hold:
        time.sleep(hold)  # the run's work: what lock_limit bounds
    line = f"{self.request.id} {key} {started:.6f} {time.time():.6f} {os.getpid()}\n"
    fd = os.open(out, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        os.write(fd, line.encode())  # one write: lines of several processes never mix
    finally:
        os.close(fd)
    return key


def make_rated_app(redis_url: str, **conf: object) -> Celery:
    """An app with rate-limited tasks; ``max_retries=0`` on each (a retry would fail)."""
    conf = {"redlock_url": redis_url_with_db(redis_url, 0), **conf}
    app = make_app(redis_url, name="rated", **conf)
    common = {"base": LockedTask, "bind": True, "shared": False, "max_retries": 0}
    for name, options in (
        # A rate alone: runs of a key may overlap (shared, no limit), 5 starts per second.
        ("rated.call", {"lock_key": "api:{key}", "lock_rate": "5/s", "lock_mode": "shared"}),
        # With the exclusive lock: one at a time, and 5 starts per second.
        (
            "rated.exclusive",
            {"lock_key": "one:{key}", "lock_rate": "5/s", "lock_on_busy": "requeue"},
        ),
        # A budget of runs at once, never failing one, never blocking a worker.
        (
            "rated.limited",
            {"lock_key": "export:{key}", "lock_limit": 3, "lock_on_busy": "requeue", "lock_ttl": 5},
        ),
        # No budget: starts at once whatever waits on the queue.
        ("rated.plain", {"lock_key": "plain:{key}"}),
    ):
        app.task(name=name, **common, **options)(record)
    return app


#: The app worker subprocesses load with ``-A tests.apps.rated``.
app = make_rated_app(REDIS_URL)
