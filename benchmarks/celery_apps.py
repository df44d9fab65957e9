"""The Celery app of the end-to-end benchmark: one task per locking style, same empty body.

The benchmark's worker runs ``python -m celery -A benchmarks.celery_apps worker
-P prefork -c 2 -Q bench-idle`` (through ``tests.harness.WorkerProcess``); the Redis URL
comes from ``$REDLOCK_TEST_REDIS_URL``. One redis-server holds everything: broker on
db 1, locks (ours, celery-once's, celery-singleton's) on db 0, the completion counter
on db 3. Results are not stored (``task_ignore_result``): completions are counted by a
``task_postrun`` receiver instead, one ``HINCRBY`` per task keyed by its final state, the
same for every task, so a skipped delivery counts too (``IGNORED``).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import redis
from celery import Celery, Task, signals
from celery_once import QueueOnce
from celery_singleton import Singleton

from celery_redlock import LockedTask
from tests.harness.celery_workers import make_app, redis_url_with_db

REDIS_URL = os.environ.get("REDLOCK_TEST_REDIS_URL", "redis://127.0.0.1:6379")
LOCK_DB, COUNTER_DB = 0, 3
#: Hash of ``{final state: tasks}`` the worker increments after every benchmark task.
DONE_KEY = "bench:celery:done"
#: The queue the worker listens to at start; nothing is sent there.
IDLE_QUEUE = "bench-idle"
#: A lease far longer than any run, for every locking style.
LEASE_S = 60
#: Set in the benchmark worker's environment: only there are the loggers below quieted.
WORKER_ENV = "BENCH_CELERY_WORKER"
#: Per-task INFO lines (received, succeeded, skipped) would be most of a task's cost.
QUIET_LOGGERS = ("celery.app.trace", "celery.worker.strategy", "celery_redlock")

_counters: dict[str, redis.Redis] = {}


def counter(url: str) -> redis.Redis:
    """This process's client for the counter db (redis-py reconnects after a fork)."""
    if url not in _counters:
        _counters[url] = redis.Redis.from_url(redis_url_with_db(url, COUNTER_DB))
    return _counters[url]


def _count(sender: Task | None = None, state: str | None = None, **_: Any) -> None:
    counter(sender.app.conf.bench_redis_url).hincrby(DONE_KEY, state or "UNKNOWN", 1)


def create_app(redis_url: str = REDIS_URL) -> Celery:
    """The app, its tasks named ``bench.<style>``, each counted by :func:`_count`."""
    locks = redis_url_with_db(redis_url, LOCK_DB)
    app = make_app(
        redis_url,
        name="bench",
        bench_redis_url=redis_url,
        task_ignore_result=True,
        redlock_url=locks,
        ONCE={"backend": "celery_once.backends.Redis", "settings": {"url": locks}},
        singleton_backend_url=locks,
        # The worker's BRPOP returns every 10 ms when idle (default 1 s), so a queue it is
        # told to consume is picked up within 10 ms instead of up to a second.
        broker_transport_options={"polling_interval": 0.01},
    )

    @app.task(name="bench.plain", shared=False)
    def plain(key: str) -> None:
        """No lock."""

    @app.task(
        name="bench.locked",
        shared=False,
        base=LockedTask,
        lock_args=("key",),
        lock_on_busy="skip",
        lock_ttl=LEASE_S,
    )
    def locked(key: str) -> None:
        """Our lock, taken by the worker around the run; a busy key skips the run."""

    @app.task(
        name="bench.unique",
        shared=False,
        base=LockedTask,
        lock_args=("key",),
        lock_unique="until_started",
        lock_ttl=LEASE_S,
    )
    def unique(key: str) -> None:
        """Our lock with send-time uniqueness: a duplicate is not queued."""

    @app.task(
        name="bench.once",
        shared=False,
        base=QueueOnce,
        once={"graceful": True, "timeout": LEASE_S},
    )
    def once(key: str) -> None:
        """celery-once: locked at send time, a duplicate is not queued, unlocked after run."""

    @app.task(name="bench.singleton", shared=False, base=Singleton, lock_expiry=LEASE_S)
    def singleton(key: str) -> None:
        """celery-singleton: locked at send time, a duplicate returns the queued task."""

    for task in (plain, locked, unique, once, singleton):
        # After celery_redlock's own receiver (connected at import): counts include
        # the release of our lock.
        signals.task_postrun.connect(_count, sender=task, weak=False)
    return app


@signals.after_setup_logger.connect(weak=False)
def _quiet(**_: Any) -> None:
    if not os.environ.get(WORKER_ENV):
        return
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)


#: The app the worker loads with ``-A benchmarks.celery_apps``.
app = create_app()
