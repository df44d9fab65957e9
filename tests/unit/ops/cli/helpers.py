"""Helpers for the ``celery redlock`` tests: locks taken here, and the ``ls`` table parsed.

The ``cli`` fixture that runs the commands is in ``tests/unit/conftest.py`` (the node
tests use it too).
"""

from __future__ import annotations

import os
import socket
from typing import Any

from celery_redlock import Redlock

HOST = socket.gethostname()
HOLDER = f"{HOST}:{os.getpid()}"


def lock_on(server: Any, name: str, **kwargs: Any) -> Redlock:
    """A lock taken on ``server`` (db 0, where the CLI app keeps its locks)."""
    kwargs.setdefault("ttl", 30)
    kwargs.setdefault("auto_renew", False)
    lock = Redlock(name, nodes=[server.url], **kwargs)
    assert lock.acquire(blocking=False)
    return lock


def rows(output: str) -> dict[str, dict[str, str]]:
    """Parse the ``ls`` table into ``{key: {column: cell}}`` using the header's columns."""
    lines = [line for line in output.splitlines() if line.strip()]
    header = lines[0]
    names = [n for n in header.split("  ") if n.strip()]
    starts = [header.index(n.strip()) for n in names]
    table = {}
    for line in lines[1:]:
        cells = [
            line[start : (starts[i + 1] if i + 1 < len(starts) else None)].strip()
            for i, start in enumerate(starts)
        ]
        table[cells[0]] = dict(zip([n.strip() for n in names], cells, strict=True))
    return table
