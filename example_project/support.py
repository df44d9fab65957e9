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
