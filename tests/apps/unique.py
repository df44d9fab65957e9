"""Tasks with send-time uniqueness (``lock_unique``), for in-process and prefork workers.

The Redis URL comes from ``REDLOCK_TEST_REDIS_URL`` (broker on db 1, results on db 2,
locks on db 0), as in :mod:`tests.apps.locked`.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from celery import Celery
from celery.exceptions import Reject

from celery_redlock import LockedTask
from tests.harness.celery_workers import make_app, redis_url_with_db
from tests.harness.servers import wait_for

REDIS_URL = os.environ.get("REDLOCK_TEST_REDIS_URL", "redis://127.0.0.1:6379")


def make_unique_app(redis_url: str, **conf: object) -> Celery:
    """An app with unique tasks; the body records its task id, then waits for ``gate``."""
    conf = {"redlock_url": redis_url_with_db(redis_url, 0), **conf}
    app = make_app(redis_url, name="unique", **conf)

    def body(self, item, gate="", out=""):
        if out:
            with Path(out).open("a") as log:
                log.write(f"{self.request.id}\n")
        if gate:
            wait_for(Path(gate).exists, timeout=30)
        return item

    for unique in ("until_started", "until_finished"):
        for on_duplicate in ("return", "raise"):
            app.task(
                base=LockedTask,
                bind=True,
                shared=False,
                name=f"unique.{unique}.{on_duplicate}",
                lock_key="item:{item}",
                lock_unique=unique,
                lock_on_duplicate=on_duplicate,
            )(body)

    @app.task(
        base=LockedTask,
        bind=True,
        shared=False,
        name="unique.retrying",
        lock_key="retry:{item}",
        lock_unique="until_finished",
    )
    def retrying(self, item, out):
        with Path(out).open("a") as log:
            log.write(f"{self.request.id} {self.request.retries}\n")
        if self.request.retries < 2:
            raise self.retry(countdown=0.05)
        return self.request.retries

    @app.task(
        base=LockedTask,
        bind=True,
        shared=False,
        name="unique.busy_raise",
        lock_key="item:{item}",
        lock_unique="until_finished",
        lock_on_busy="raise",
    )
    def busy_raise(self, item):
        return item

    @app.task(
        base=LockedTask,
        bind=True,
        shared=False,
        name="unique.short_claim",
        lock_key="short:{item}",
        lock_unique="until_started",
        lock_unique_ttl=0.3,
    )
    def short_claim(self, item):
        return item

    @app.task(
        base=LockedTask,
        bind=True,
        shared=False,
        name="unique.rejected",
        lock_key="item:{item}",
        lock_unique="until_finished",
    )
    def rejected(self, item):
        raise Reject("not for this worker", requeue=False)

    def record(self, key, n, out):
        with Path(out).open("a") as log:
            log.write(f"{self.request.id} {n} {time.time()}\n")
        return n

    # Claims far shorter than what they protect (issue 25): the body, the countdown of a
    # retry, a follow-up's wait on the queue.
    for name, options in (
        ("unique.brief.until_finished", {"lock_unique": "until_finished"}),
        ("unique.brief.until_started", {"lock_unique": "until_started"}),
    ):
        app.task(
            base=LockedTask,
            bind=True,
            shared=False,
            name=name,
            lock_key="brief:{item}",
            lock_unique_ttl=1,
            **options,
        )(body)

    @app.task(
        base=LockedTask,
        bind=True,
        shared=False,
        name="unique.brief.retrying",
        lock_key="later:{item}",
        lock_unique="until_finished",
        lock_unique_ttl=1,
    )
    def retry_later(self, item, out, countdown=3.0):
        with Path(out).open("a") as log:
            log.write(f"{self.request.id} {self.request.retries}\n")
        if self.request.retries < 1:
            raise self.retry(countdown=countdown)
        return item

    # Two tasks on one resource: their bodies exclude each other; neither is a
    # duplicate of the other.
    for name in ("unique.sync_account", "unique.close_account"):
        app.task(
            base=LockedTask,
            bind=True,
            shared=False,
            name=name,
            lock_key="account:{item}",
            lock_unique="until_started",
        )(body)

    @app.task(base=LockedTask, bind=True, shared=False, name="unique.echo", lock_key="echo:{item}")
    def echo(self, item):
        return item

    for name, options in (
        ("unique.digest", {"lock_key": "digest:{key}", "lock_debounce": 1.0}),
        ("unique.poll", {"lock_key": "poll:{key}", "lock_throttle": 2.0}),
    ):
        app.task(base=LockedTask, bind=True, shared=False, name=name, **options)(record)

    return app


#: The app worker subprocesses load with ``-A tests.apps.unique``.
app = make_unique_app(REDIS_URL)


def make_late_unique_app(redis_url: str, **conf: object) -> Celery:
    """The unique tasks acknowledged after the body (``acks_late``), with a 3 s lease, a
    2 s claim (``lock_unique_ttl``) and a broker that gives a dead worker's messages to
    another within seconds (5 s)."""
    return make_unique_app(
        redis_url,
        **{
            "redlock_ttl": 3.0,
            "redlock_unique_ttl": 2.0,
            "task_acks_late": True,
            "broker_transport_options": {
                "visibility_timeout": 5,
                "unacked_restore_interval": 1,
                "unacked_restore_throttle": 1,
            },
            **conf,
        },
    )


#: ``-A tests.apps.unique:late``.
late = make_late_unique_app(REDIS_URL)
#: ``-A tests.apps.unique:short``: a 3 s lease (a dead worker's lock ends soon).
short = make_unique_app(REDIS_URL, redlock_ttl=3.0)
