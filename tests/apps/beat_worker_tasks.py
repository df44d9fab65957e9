"""A task only the worker registers (``-I tests.apps.beat_worker_tasks``): beat must
use ``send_task`` for it."""

from __future__ import annotations

import time

from celery_redlock import LockedTask
from tests.apps.beatapp import app, beat_run, run_slowly, write


@app.task(bind=True, shared=False)
def remote_stamp(self, label):
    """Record one dispatch of ``label``: arrival time and the run the leader claimed."""
    write(f"{label} {time.time():.6f} {beat_run(self)}")


@app.task(base=LockedTask, bind=True, shared=False, lock_args=())
def remote_slow(self, label):
    """A locked 2.5 s run that beat can only send by name."""
    run_slowly(label, self.lock.fence)
