"""Classifying a lock's holder from the workers' answers: stale only when proven dead."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from celery_redlock.ops.inventory import LockView, NodeView
from celery_redlock.ops.workers import Workers, classify


def test_classify_names_a_running_task_and_a_task_less_holder():
    """A task active on any worker is active; a holder that is no task is never stale."""
    view = NodeView("n", pttl=1000, fields={"token": "t", "task_id": "a", "host": "web-1.example"})
    lock = LockView("redlock:{x}", "x", [view], 1)
    running = Workers(("celery@web-2",), {"a": "celery@web-2"})
    assert classify(lock, running) == ("active", "task a is running on celery@web-2")
    here = Workers(("celery@web-1.example",), {}, {"celery@web-1.example": (1,)})
    no_task = LockView("redlock:{y}", "y", [NodeView("n", pttl=1, fields={"token": "t"})], 1)
    assert classify(no_task, here)[0] == "no-task"


def test_classify_needs_the_holders_own_worker_or_its_pid_gone():
    """Stale only when the holder's own worker (host and pid) answered idle, or its pid
    is gone on this host; another worker on the same host proves nothing."""
    here = socket.gethostname()
    me = os.getpid()

    def lock_of(pid: int, host: str = here) -> LockView:
        fields = {"token": "t", "task_id": "a", "host": host, "pid": str(pid)}
        return LockView("redlock:{x}", "x", [NodeView("n", pttl=1000, fields=fields)], 1)

    other = Workers(("celery@" + here,), {}, {"celery@" + here: (me + 1_000_000,)}, {})
    own_idle = Workers(("celery@" + here,), {}, {"celery@" + here: (me,)}, {})
    own_busy = Workers(("celery@" + here,), {"b": "celery@" + here},
                       {"celery@" + here: (me,)}, {"celery@" + here: (me,)})  # fmt: skip
    assert classify(lock_of(me), other)[0] == "unknown", "another worker on the host"
    assert classify(lock_of(me), own_idle)[0] == "stale"
    assert classify(lock_of(me), own_busy)[0] == "unknown", "its process runs another task"
    assert classify(lock_of(me, "elsewhere"), own_idle)[0] == "unknown"
    assert classify(lock_of(me), None)[0] == "unknown"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    assert classify(lock_of(dead.pid), None)[0] == "stale", "pid gone on this host"
    assert classify(lock_of(dead.pid, "elsewhere"), None)[0] == "unknown"
