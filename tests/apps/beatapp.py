"""A beat schedule for the leader-election tests: ``celery -A tests.apps.beatapp beat``.

Environment: ``REDLOCK_TEST_REDIS_URL`` (broker db 1, results db 2, locks db 0),
``REDLOCK_TEST_STAMPS`` (file the dispatched tasks append to) and
``REDLOCK_TEST_BEAT_TTL`` (the leader's lease).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from celery_redlock import LockedTask
from tests.harness.celery_workers import make_app, redis_url_with_db

REDIS_URL = os.environ.get("REDLOCK_TEST_REDIS_URL", "redis://127.0.0.1:6379")
STAMPS = os.environ.get("REDLOCK_TEST_STAMPS", "/dev/null")

app = make_app(
    REDIS_URL,
    name="beatapp",
    redlock_url=redis_url_with_db(REDIS_URL, 0),
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
        # slower than its interval: must never overlap itself
        "slow": {"task": "tests.apps.beatapp.slow", "schedule": 1.0},
    },
)


def write(line: str) -> None:
    with Path(STAMPS).open("a") as out:
        out.write(line + "\n")


@app.task(shared=False)
def stamp(label):
    """Record that one dispatch of ``label`` arrived."""
    write(f"{label} {time.time():.6f}")


@app.task(base=LockedTask, bind=True, shared=False, lock_args=())
def slow(self):
    """A 2.5 s run every second: overlapping sends are skipped by the lock."""
    write(f"slow-start {time.monotonic_ns()} {self.lock.fence}")
    time.sleep(2.5)
    write(f"slow-end {time.monotonic_ns()} {self.lock.fence}")
