"""The Celery app of the end-to-end benchmark: one task per locking style, same empty body.

The benchmark's worker runs ``python -m celery -A benchmarks.celery_apps worker
-P prefork -c 2 -Q bench-idle`` (through ``tests.harness.WorkerProcess``); the Redis URL
comes from ``$REDLOCK_TEST_REDIS_URL``. One redis-server holds everything: broker on
db 1, locks (ours, celery-once's, celery-singleton's) on db 0, the completion counter
on db 3. Results are not stored (``task_ignore_result``): completions are counted by a
``task_postrun`` receiver instead, one ``HINCRBY`` per task keyed by its final state, the
same for every task, so a skipped delivery counts too (``IGNORED``).

:data:`rate_app` is the same app with the tasks of the rate benchmark added
(:func:`add_rate_tasks`), its locks on a server of their own (``$BENCH_RATE_LOCK_URL``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

import redis
from celery import Celery, Task, signals
from celery_once import QueueOnce
from celery_singleton import Singleton

from celery_redlock import LockedTask
from celery_redlock.integration import budgets
from tests.harness.celery_workers import WorkerProcess, make_app, redis_url_with_db

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
#: Set to ``0`` in a worker's environment: its app keeps no event log
#: (``redlock_events=False``), for the benchmark row that measures the log's cost.
EVENTS_ENV = "BENCH_REDLOCK_EVENTS"
#: Per-task INFO lines (received, succeeded, skipped) would be most of a task's cost.
QUIET_LOGGERS = ("celery.app.trace", "celery.worker.strategy", "celery_redlock")

_counters: dict[str, redis.Redis] = {}


def bench_worker(
    app: str,
    redis_url: str,
    concurrency: int,
    *,
    name: str | None = None,
    env: dict[str, str] | None = None,
) -> WorkerProcess:
    """A ``celery worker -P prefork`` subprocess running the benchmark app ``app``.

    Celery's default options otherwise; it consumes :data:`IDLE_QUEUE` only, until a
    run adds its own queue, and its per-task log lines are quiet (:data:`WORKER_ENV`).
    """
    return WorkerProcess(
        app,
        name=name,
        pool="prefork",
        concurrency=concurrency,
        redis_url=redis_url,
        env={WORKER_ENV: "1", **(env or {})},
        extra_args=["-Q", IDLE_QUEUE],
    )


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
        redlock_events=os.environ.get(EVENTS_ENV, "1") != "0",
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


# --------------------------------------------------------------------------- rate budgets

#: The rate benchmark's workers read their lock server's URL here (a redis-server of
#: its own, so that its command counts are the locks' alone).
LOCK_URL_ENV = "BENCH_RATE_LOCK_URL"
#: The limit both peers of the rate benchmark are given, in Celery's syntax.
RATE = "5/s"
#: A rate no run of the admission benchmark reaches: every start is admitted.
NEVER_DEFERS = "100000/s"
#: List of ``"<task id> <start, wall clock>"``, one per body run, per key.
STARTS_KEY = "bench:rate:starts:{key}"


#: When this thread's last rate admission returned (wall clock), for :func:`_started`.
_admission = threading.local()


def _timed_admit(*args: Any, **kwargs: Any) -> Any:
    """:func:`budgets.admit`, noting when it returned (the gap to the body is ours too).

    Also the admissions :func:`budgets.keep_on_time` makes again: the last one counts.
    """
    stamp = _REAL_ADMIT(*args, **kwargs)
    _admission.at = time.time()
    return stamp


_REAL_ADMIT = budgets.admit
budgets.admit = _timed_admit  # type: ignore[assignment]


def _started(self: Task, key: str) -> None:
    """Record this body's start (the first thing it does) under ``key``.

    With the moment its rate admission returned in this process, when it had one (``0``
    otherwise): a window over the limit on the bodies' clock but not on the admissions'
    is time spent between the admission and the body.
    """
    started = time.time()
    admitted, _admission.at = getattr(_admission, "at", 0.0), 0.0
    entry = f"{self.request.id} {started:.6f} {admitted:.6f}"
    counter(self.app.conf.bench_redis_url).rpush(STARTS_KEY.format(key=key), entry)


def add_rate_tasks(app: Celery, lock_url: str | None = None) -> Celery:
    """``app`` with the rate benchmark's tasks, its locks on ``lock_url`` when given.

    ``rate.celery`` (Celery's ``rate_limit``) and ``rate.ours`` (``lock_rate``, shared,
    one budget per key) record their starts (:data:`STARTS_KEY`); ``rate.locked`` and
    ``rate.admitted`` (the same with a rate that never defers) have empty bodies.
    """
    if lock_url:
        app.conf.redlock_url = lock_url
    common: dict[str, Any] = {"bind": True, "shared": False}
    locked = {**common, "base": LockedTask, "lock_ttl": LEASE_S}
    tasks = [
        app.task(name="rate.celery", rate_limit=RATE, **common)(_started),
        app.task(
            name="rate.ours", lock_key="bench-rate:{key}", lock_rate=RATE, lock_mode="shared",
            **locked,
        )(_started),
    ]  # fmt: skip
    for name, options in (("rate.locked", {}), ("rate.admitted", {"lock_rate": NEVER_DEFERS})):

        @app.task(name=name, lock_args=("key",), **locked, **options)
        def empty(self: Task, key: str) -> None:
            """An empty body under our lock (one key per call)."""

        tasks.append(empty)
    for task in tasks:
        signals.task_postrun.connect(_count, sender=task, weak=False)
    return app


#: The app the rate benchmark's workers load with ``-A benchmarks.celery_apps:rate_app``.
rate_app = add_rate_tasks(create_app(), os.environ.get(LOCK_URL_ENV))


# ---------------------------------------------------------------- backlogs of deferred runs

#: The rates of the backlog benchmark, starts per second (:func:`add_backlog_tasks`).
BACKLOG_RATES = (5, 50)


def add_backlog_tasks(app: Celery) -> Celery:
    """``app`` with the backlog benchmark's tasks, one trio per rate N of :data:`BACKLOG_RATES`.

    ``backlog.celeryN`` (Celery's ``rate_limit="N/s"``), ``backlog.oursN`` (``lock_rate``,
    shared: only the budget), ``backlog.requeueN`` (``lock_rate`` with the exclusive lock
    and ``lock_on_busy="requeue"``); each records its start (:data:`STARTS_KEY`).
    """
    common: dict[str, Any] = {"bind": True, "shared": False}
    locked = {**common, "base": LockedTask, "lock_ttl": LEASE_S, "lock_key": "backlog:{key}"}
    tasks = []
    for n in BACKLOG_RATES:
        rate = f"{n}/s"
        tasks += [
            app.task(name=f"backlog.celery{n}", rate_limit=rate, **common)(_started),
            app.task(name=f"backlog.ours{n}", lock_rate=rate, lock_mode="shared", **locked)(
                _started
            ),
            app.task(name=f"backlog.requeue{n}", lock_rate=rate, lock_on_busy="requeue", **locked)(
                _started
            ),
        ]
    for task in tasks:
        signals.task_postrun.connect(_count, sender=task, weak=False)
    return app


#: The app the backlog benchmark's workers load (``benchmarks.celery_apps:backlog_app``).
backlog_app = add_backlog_tasks(create_app())
