"""Helpers shared by the demo commands: printing, waiting, and celery subprocesses."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def say(text: str = "") -> None:
    print(f"  {text}" if text else "", flush=True)


def step(title: str) -> None:
    print(f"\n== {title}", flush=True)


def wait_until(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise SystemExit(f"demo: gave up waiting for {what}")
        time.sleep(0.05)


def task_lock(locks, pattern: str, task_id: str, what: str) -> str:
    """The key of the lock that task ``task_id`` holds, once it holds it.

    Found by its holder's task id: any other key matching ``pattern`` (a fence counter,
    the lock of a sync that is still being released) is not this task's lease.
    """
    return wait_until(
        lambda: next(
            (
                k
                for k in locks.scan_iter(pattern)
                if not k.endswith(":fence") and locks.hget(k, "task_id") == task_id
            ),
            None,
        ),
        20,
        what,
    )


def count_renewals(locks, key: str, done, interval: float = 0.05) -> int:
    """How often the lease at ``key`` was extended until ``done()`` or its release.

    A renewal moves the lease's end (now + PTTL) later; sampling the end, rather than
    comparing PTTLs, counts it however late a sample comes (several renewals between
    two samples count once, so this is a lower bound).
    """
    renewals, end = 0, None
    while not done():
        ttl = locks.pttl(key)
        if ttl < 0:  # released (or lost): no lease left to renew
            break
        now_end = time.monotonic() + ttl / 1000
        if end is not None and now_end > end + 0.05:  # later than the last seen end
            renewals += 1
        end = now_end if end is None else max(end, now_end)
        time.sleep(interval)
    return renewals


class Service:
    """A ``celery`` subprocess with its log in a file."""

    def __init__(self, name: str, args: list[str], env: dict[str, str], logdir: Path) -> None:
        self.log = logdir / f"{name}.log"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "example_project.app", *args],
            cwd=ROOT,
            env=env,
            stdout=self.log.open("w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)


def finished_runs(backend, task: str) -> list:
    """Results of the finished runs of ``task``, from the result backend (db 2)."""
    metas = (
        json.loads(raw) for raw in map(backend.get, backend.scan_iter("celery-task-meta-*")) if raw
    )
    return [m["result"] for m in metas if m.get("name") == task and m.get("status") == "SUCCESS"]


def redis_base(stack, say_started: bool = True) -> str:
    """``$EXAMPLE_REDIS_URL``, or a redis-server started for the demo (stopped by ``stack``)."""
    from .redis_runner import RedisProcess  # noqa: PLC0415 (only when none is configured)

    base = os.environ.get("EXAMPLE_REDIS_URL")
    if base:
        return base
    server = RedisProcess()
    stack.callback(server.stop)
    if say_started:
        say(f"started {server.description} on port {server.port}")
        say("(set EXAMPLE_REDIS_URL to use a Redis of yours)")
    return f"redis://127.0.0.1:{server.port}"
