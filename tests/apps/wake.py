"""A task that waits on the queue while its key is busy (``lock_on_busy="requeue"``),
for in-process and prefork workers: :mod:`tests.integration.test_requeue_wake`.

The lease is long (30 s) so that the busy run's backoff, capped at the holder's lease,
is not cut short by it: what starts a waiting copy promptly is its key's release.
Bodies record their runs as :mod:`tests.apps.rated` does (its ``record``).
"""

from __future__ import annotations

import os

from celery import Celery

from celery_redlock import LockedTask
from tests.apps.rated import record
from tests.harness.celery_workers import make_app, redis_url_with_db

REDIS_URL = os.environ.get("REDLOCK_TEST_REDIS_URL", "redis://127.0.0.1:6379")


def make_wake_app(redis_url: str, **conf: object) -> Celery:
    """An app with ``wake.export``: one run per key at once, busy runs requeued."""
    conf = {"redlock_url": redis_url_with_db(redis_url, 0), **conf}
    app = make_app(redis_url, name="wake", **conf)
    app.task(
        name="wake.export",
        base=LockedTask,
        bind=True,
        shared=False,
        max_retries=0,
        lock_key="export:{key}",
        lock_on_busy="requeue",
        lock_ttl=30,
    )(record)
    return app


#: The app worker subprocesses load with ``-A tests.apps.wake``.
app = make_wake_app(REDIS_URL)
