"""Tasks with rate budgets (``lock_rate``) and ``lock_on_busy="requeue"``, for in-process
and prefork workers.

The Redis URL comes from ``REDLOCK_TEST_REDIS_URL`` (broker on db 1, results on db 2,
locks on db 0), as in :mod:`tests.apps.unique`. Each body appends one line
``<task id> <key> <start> <end> <pid> <redelivered>`` (wall clock; ``redelivered`` 1 when
the broker delivered this message again, after the worker holding it died) to the file
``out``.

Three apps: :data:`app` (``-A tests.apps.rated``); :data:`late` (``-A
tests.apps.rated:late``), the same tasks acknowledged after the body (``acks_late``), on
a broker that gives a dead worker's messages to another within seconds
(:data:`VISIBILITY_TIMEOUT`); and :data:`beat`, with a schedule, for ``celery beat``.
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
    redelivered = int(bool((self.request.delivery_info or {}).get("redelivered")))
    line = f"{self.request.id} {key} {started:.6f} {time.time():.6f} {os.getpid()} {redelivered}\n"
    fd = os.open(out, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        os.write(fd, line.encode())  # one write: lines of several processes never mix
    finally:
        os.close(fd)
    return key


def record_counted(self, key, out, hold=0.0):
    """As :func:`record`, with a 7th field: how often the run was put back before this
    delivery (its ``redlock_deferrals`` header): the copies of it the broker carried."""
    from celery_redlock.integration.policies import deferrals

    started = time.time()
    if hold:
        time.sleep(hold)
    redelivered = int(bool((self.request.delivery_info or {}).get("redelivered")))
    line = (
        f"{self.request.id} {key} {started:.6f} {time.time():.6f} {os.getpid()} "
        f"{redelivered} {deferrals(self.request)}\n"
    )
    fd = os.open(out, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)
    return key


def add_backlog_tasks(app: Celery) -> Celery:
    """Tasks for backlogs of parked runs (tests/integration/test_parked.py).

    ``backlog.rate`` (20/s, shared: only the budget bounds it), ``backlog.rate_requeue``
    (20/s with the exclusive lock and ``lock_on_busy="requeue"``), ``backlog.requeue``
    (exclusive, ``lock_on_busy="requeue"``); each with a 3 s lease: a dead holder's key
    frees soon.
    """
    common = {"base": LockedTask, "bind": True, "shared": False, "max_retries": 0}
    app.task(
        name="backlog.rate",
        lock_key="fast:{key}",
        lock_rate="20/s",
        lock_mode="shared",
        lock_ttl=3.0,
        **common,
    )(record_counted)
    app.task(
        name="backlog.rate_requeue",
        lock_key="fast-one:{key}",
        lock_rate="20/s",
        lock_on_busy="requeue",
        lock_ttl=3.0,
        **common,
    )(record_counted)
    app.task(
        name="backlog.requeue",
        lock_key="turn:{key}",
        lock_on_busy="requeue",
        lock_ttl=3.0,
        **common,
    )(record_counted)
    return app


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
        # A budget per minute: a backlog's places in line are a minute apart, so that
        # which place each run got does not depend on how fast the machine is.
        (
            "rated.per_minute",
            {"lock_key": "slow:{key}", "lock_rate": "5/m", "lock_mode": "shared"},
        ),
        # No budget: starts at once whatever waits on the queue.
        ("rated.plain", {"lock_key": "plain:{key}"}),
    ):
        app.task(name=name, **common, **options)(record)
    return add_backlog_tasks(app)


#: Seconds after which the broker gives an unacknowledged message to another worker.
VISIBILITY_TIMEOUT = 5


def make_late_app(redis_url: str) -> Celery:
    """The rated tasks with ``acks_late``: a message is acknowledged after its body.

    A message a dead worker held comes back :data:`VISIBILITY_TIMEOUT` seconds after it
    was delivered: every worker looks for such messages every second (kombu's own
    defaults, 10 s between looks and 1 look in 10, would take minutes).
    """
    return make_rated_app(
        redis_url,
        # A dead run's share of its key ends within this lease: the message given again
        # finds the key held under its own task id, and waits on the queue until then.
        redlock_ttl=3.0,
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        broker_transport_options={
            "visibility_timeout": VISIBILITY_TIMEOUT,
            "unacked_restore_interval": 1,
            "unacked_restore_throttle": 1,
        },
    )


def make_beat_app(redis_url: str, where: str | None = None, rate: str | None = None) -> Celery:
    """The rated app with a schedule: beat sends ``rated.scheduled`` (5/s) every second.

    ``rate`` replaces the task's: on the task (``where="task"``), as the
    ``redlock_rate`` default (``"redlock_rate"``), or in its ``redlock_tasks`` entry
    (``"redlock_tasks"``).
    """
    conf: dict[str, object] = {
        "beat_schedule": {
            "scheduled": {"task": "rated.scheduled", "schedule": 1.0, "args": ("s", os.devnull)}
        }
    }
    if where == "redlock_rate":
        conf["redlock_rate"] = rate
    elif where == "redlock_tasks":
        conf["redlock_tasks"] = {"rated.scheduled": {"rate": rate}}
    app = make_rated_app(redis_url, **conf)
    app.task(
        name="rated.scheduled",
        base=LockedTask,
        bind=True,
        shared=False,
        lock_key="scheduled:{key}",
        lock_rate=rate if where == "task" else "5/s",
    )(record)
    return app


#: The app worker subprocesses load with ``-A tests.apps.rated``.
app = make_rated_app(REDIS_URL)
#: The same with ``acks_late`` (``-A tests.apps.rated:late``).
late = make_late_app(REDIS_URL)
#: The app ``celery -A tests.apps.rated:beat beat`` loads: the rate
#: ``$REDLOCK_TEST_RATE`` set where ``$REDLOCK_TEST_RATE_AT`` says (see make_beat_app).
beat = make_beat_app(
    REDIS_URL, os.environ.get("REDLOCK_TEST_RATE_AT"), os.environ.get("REDLOCK_TEST_RATE")
)
