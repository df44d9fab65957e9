"""A task only the worker registers (``-I tests.apps.beat_worker_tasks``): beat must
use ``send_task`` for it."""

from __future__ import annotations

import time

from tests.apps.beatapp import app, write


@app.task(shared=False)
def remote_stamp(label):
    """Record that one dispatch of ``label`` arrived."""
    write(f"{label} {time.time():.6f}")
