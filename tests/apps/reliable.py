"""Locked tasks that record their critical sections for the history checker.

Read at import from the environment (worker subprocesses get it from the test):

* ``REDLOCK_TEST_REDIS_URL``: broker db 1, results db 2;
* ``REDLOCK_REL_LOCK_URL``: the lock node (default: db 0 of the broker's server); a
  worker may be pointed at a fault proxy in front of the same server;
* ``REDLOCK_REL_STORAGE_URL`` and ``REDLOCK_REL_RUN``: where the history is recorded
  (see :class:`tests.harness.history.History`);
* ``REDLOCK_TEST_TTL``: the lease of ``section`` (``long_section`` holds 30 s).
"""

from __future__ import annotations

import os
from collections import Counter

from celery import Celery

from celery_redlock import LockedTask
from tests.harness.celery_workers import make_app, redis_url_with_db
from tests.harness.history import History
from tests.reliability.workload import run_section

REDIS_URL = os.environ.get("REDLOCK_TEST_REDIS_URL", "redis://127.0.0.1:6379")
LOCK_URL = os.environ.get("REDLOCK_REL_LOCK_URL") or redis_url_with_db(REDIS_URL, 0)
STORAGE_URL = os.environ.get("REDLOCK_REL_STORAGE_URL", "redis://127.0.0.1:6379/3")
RUN = os.environ.get("REDLOCK_REL_RUN", "celery")
TTL = float(os.environ.get("REDLOCK_TEST_TTL", "1.0"))


def create_app(redis_url: str = REDIS_URL, lock_url: str = LOCK_URL) -> Celery:
    """The app of the Celery reliability scenario (task names ``tests.apps.reliable.*``)."""
    app = make_app(redis_url, name="reliable", redlock_url=lock_url, redlock_ttl=TTL)
    history = History(STORAGE_URL, RUN)

    def body(task, resource: str, hold: float) -> dict:
        stats: Counter[str] = Counter()
        run_section(task.lock, history, resource, stats, hold=hold, release=False)
        task.lock.check()  # a lost lease fails the task with LockLost
        return dict(stats)

    @app.task(
        base=LockedTask,
        bind=True,
        shared=False,
        lock_args=("resource",),
        lock_on_busy="wait",
        lock_wait_timeout=60,
    )
    def section(self, resource, hold=0.0):
        """A recorded section; waits for the lock when busy."""
        return body(self, resource, hold)

    @app.task(base=LockedTask, bind=True, shared=False, lock_args=("resource",), lock_ttl=30)
    def long_section(self, resource, hold=60.0):
        """A recorded section with a 30 s lease: only its parent can free it quickly."""
        return body(self, resource, hold)

    return app


app = create_app()
