"""Helpers for the ``celery redlock`` tests: locks and budgets taken here, the ``ls`` table
parsed.

The ``cli`` fixture that runs the commands is in ``tests/unit/conftest.py`` (the node
tests use it too).
"""

from __future__ import annotations

import json
import os
import socket
from typing import Any

from celery_redlock import RateLimit, Redlock
from celery_redlock.engine.keys import parked_keys
from celery_redlock.engine.rate import judge, rate_calls
from celery_redlock.engine.scripts import PARK
from celery_redlock.integration.parking import line_of
from celery_redlock.nodes import NodeSet

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


def backlog_on(url: str, name: str = "api:acme", rate: str = "2/m", queued: int = 3) -> None:
    """``name``'s budget on the server at ``url`` used up, and ``queued`` runs refused by it
    (task ids ``run-0``...: each waits on the queue, recorded by its admission)."""
    limit = RateLimit(name, rate=rate, nodes=[url])
    while limit.try_acquire() == 0.0:  # until the budget is used up
        pass
    nodeset = NodeSet([url], timeout=1.0)
    try:
        for n in range(queued):
            call = rate_calls(limit.keys, limit.budget, f"m{n}", task_id=f"run-{n}", jitter=0.1)
            assert not judge(nodeset.call([call]), 1).admitted
    finally:
        nodeset.close()


def park_run(node, task_id, task_name, spot_kind, lock, delay_ms):
    """A run parked as ``park()`` parks it (park.lua, the record's fields)."""
    keys = parked_keys()
    record = {"kind": spot_kind, "lock": lock, "token": "t", "task": task_name, "body": ""}
    if spot_kind == "busy":  # it waits in its key's line
        record.update(gate=line_of(lock)[0], check=lock)
    call = PARK.call(
        due=keys.due, runs=keys.runs, taken=keys.taken, lines=keys.lines, line=line_of(lock),
        task_id=task_id,
        run=json.dumps(record), delay_ms=delay_ms, lifetime_ms=86_400_000,
    )  # fmt: skip
    nodeset = NodeSet([node.url], timeout=2)
    (reply,) = nodeset.call([call])
    nodeset.close()
    assert reply is not None and reply.values[0] == 1, reply
