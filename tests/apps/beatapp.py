"""A beat schedule for the leader-election tests: ``celery -A tests.apps.beatapp beat``.

Environment: ``REDLOCK_TEST_REDIS_URL`` (broker db 1, results db 2, locks db 0),
``REDLOCK_TEST_STAMPS`` (file the dispatched tasks append to),
``REDLOCK_TEST_BEAT_TTL`` (the leader's lease), and optionally
``REDLOCK_TEST_LOCK_URL`` (locks elsewhere: two projects sharing one lock Redis) and
``REDLOCK_TEST_BEAT_NAME`` (an explicit ``redlock_beat_name``).
"""

from __future__ import annotations

import os
import time

from celery_redlock import LockedTask
from tests.apps.stamps import beat_run, write
from tests.harness.celery_workers import make_app, redis_url_with_db

REDIS_URL = os.environ.get("REDLOCK_TEST_REDIS_URL", "redis://127.0.0.1:6379")

app = make_app(
    REDIS_URL,
    name="beatapp",
    redlock_url=os.environ.get("REDLOCK_TEST_LOCK_URL") or redis_url_with_db(REDIS_URL, 0),
    redlock_beat_name=os.environ.get("REDLOCK_TEST_BEAT_NAME") or None,
    redlock_ttl=1.0,
    redlock_beat_ttl=float(os.environ.get("REDLOCK_TEST_BEAT_TTL", "2.0")),
    beat_schedule={
        # sent with apply_async: the task is registered in beat's app
        "stamp": {"task": "tests.apps.beatapp.stamp", "schedule": 1.0, "args": ("stamp",)},
        # sent with send_task: only the worker registers this task
        "remote-stamp": {
            "task": "tests.apps.beat_worker_tasks.remote_stamp",
            "schedule": 1.0,
            "args": ("remote",),
        },
        # slower than their interval: must never overlap themselves, whether sent with
        # apply_async (a LockedTask beat knows), send_task (a LockedTask only the worker
        # registers) or locked by configuration alone (redlock_tasks below)
        "slow": {"task": "tests.apps.beatapp.slow", "schedule": 1.0, "args": ("slow",)},
        "remote-slow": {
            "task": "tests.apps.beat_worker_tasks.remote_slow",
            "schedule": 1.0,
            "args": ("remote-slow",),
        },
        "plain-slow": {
            "task": "tests.apps.beatapp.plain_slow",
            "schedule": 1.0,
            "args": ("plain-slow",),
        },
    },
    redlock_tasks={"tests.apps.beatapp.plain_slow": {"args": []}},
)


@app.task(bind=True, shared=False)
def stamp(self, label):
    """Record one dispatch of ``label``: arrival time and the run the leader claimed."""
    write(f"{label} {time.time():.6f} {beat_run(self)}")


def run_slowly(label: str, fence: int) -> None:
    """A 2.5 s run, recorded as ``<label>-start|end <monotonic_ns> <fence>`` lines."""
    write(f"{label}-start {time.monotonic_ns()} {fence}")
    time.sleep(2.5)
    write(f"{label}-end {time.monotonic_ns()} {fence}")


@app.task(base=LockedTask, bind=True, shared=False, lock_args=())
def slow(self, label):
    """A 2.5 s run every second: overlapping sends are skipped by the lock."""
    run_slowly(label, self.lock.fence)


@app.task(bind=True, shared=False)
def plain_slow(self, label):
    """The same, with no lock in the code: redlock_tasks locks it in the worker."""
    run_slowly(label, self.lock.fence)
