"""What the beat test apps' tasks record: one line per dispatch, in ``$REDLOCK_TEST_STAMPS``."""

from __future__ import annotations

import os
from pathlib import Path

STAMPS = os.environ.get("REDLOCK_TEST_STAMPS", "/dev/null")


def write(line: str) -> None:
    """Append ``line`` to the stamps file."""
    with Path(STAMPS).open("a") as out:
        out.write(line + "\n")


def beat_run(task) -> str:
    """The run time the leader claimed for this message (header ``redlock_beat_run``)."""
    run = getattr(task.request, "redlock_beat_run", None)
    return str(run or (task.request.headers or {}).get("redlock_beat_run") or "-")
