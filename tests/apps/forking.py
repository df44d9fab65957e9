"""A worker whose main process takes and releases locks from its own threads while
the prefork pool forks children (``celery -A tests.apps.forking worker``).

The main process's threads share the process's nodes (their connection pools and
locks) with the reaper and with every child forked from it: a child forked while one
of them was inside a lock call inherits that call's locks held. With
``--max-tasks-per-child=1`` every task runs in a freshly forked child, whose first
lock call is its task's.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from celery import signals

from celery_redlock import LockedTask, Redlock
from tests.apps.locked import REDIS_URL, create_app
from tests.harness.celery_workers import redis_url_with_db

app = create_app(REDIS_URL)
LOCK_URL = redis_url_with_db(REDIS_URL, 0)


@app.task(base=LockedTask, bind=True, shared=False, lock_args=("resource",))
def pid_of(self: Any, resource: str) -> int:
    """The pid of the pool child that ran it, under its lock."""
    self.lock.check()
    return os.getpid()


def _take_and_release(name: str) -> None:
    while True:
        lock = Redlock(name, nodes=[LOCK_URL], ttl=1)
        if lock.acquire(timeout=1):
            lock.release()


@signals.worker_init.connect
def _start_main_process_threads(**kwargs: Any) -> None:
    # worker_init runs in the main process, before the pool forks its children.
    for n in range(2):
        threading.Thread(
            target=_take_and_release, args=("main:hot",), name=f"main-locker-{n}", daemon=True
        ).start()
