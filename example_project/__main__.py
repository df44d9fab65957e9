"""The demo: ``python -m example_project`` (or ``bash scripts/demo.sh``).

Starts a Redis (unless ``EXAMPLE_REDIS_URL`` points at one), a real prefork worker and
beat for the example app, then walks through what celery_redlock does and prints it
in plain words: duplicates skipped, a long task renewed, a stolen lock aborting its
task, a configuration-only lock, and a periodic job that never overlaps itself. It
exits by itself and stops every process it started.
"""

from __future__ import annotations

import itertools
import os
import re
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import redis
from celery.exceptions import CeleryError

from celery_redlock import LockBusy, LockLost

from .support import (
    ROOT,
    Service,
    count_renewals,
    finished_runs,
    redis_base,
    say,
    step,
    task_lock,
    wait_until,
)

#: The keys of sync_account's locks (each account's, with its fence counter).
SYNC_LOCKS = "redlock:{example_project.tasks.sync_account:*}"


def outcome(result, timeout: float = 30) -> str:
    try:
        value = result.get(timeout=timeout)
    except LockBusy as busy:
        return f"skipped: held by task {busy.holder[:8]}..."
    except LockLost as lost:
        return f"aborted: LockLost ({lost.reason})"
    except CeleryError as exc:
        return f"failed: {exc!r}"
    return f"ran: {value}"


def duplicates(tasks) -> None:
    step("Three syncs of account 42 sent at the same moment")
    results = [tasks.sync_account.delay(42, 2.0) for _ in range(3)]
    for i, result in enumerate(results, 1):
        say(f"sync #{i} ({result.id[:8]}...): {outcome(result)}")
    say("one ran; the duplicates were refused before their bodies started")


def long_task(tasks, locks: redis.Redis) -> None:
    step("A sync that takes 5 s, with a lease of only 1.5 s")
    result = tasks.sync_account.delay(7, 5.0)
    key = task_lock(locks, SYNC_LOCKS, result.id, "the lock of account 7")
    competitor = tasks.sync_account.delay(7, 0.1)
    renewals = count_renewals(locks, key, result.ready)
    say(f"the watchdog renewed the lease {renewals} times while the task ran")
    say(f"the sync: {outcome(result)}")
    say(f"a second sync of account 7 meanwhile: {outcome(competitor)}")


def stolen_lock(tasks, locks: redis.Redis) -> None:
    step("Someone deletes the lock of a running sync (account 9)")
    result = tasks.sync_account.delay(9, 30.0)
    key = task_lock(locks, SYNC_LOCKS, result.id, "the lock of account 9")
    locks.delete(key)
    deleted = time.monotonic()
    say(f"lock deleted; the task: {outcome(result)}")
    say(f"it was stopped {time.monotonic() - deleted:.2f} s later, long before its 30 s of work")


def config_only(tasks) -> None:
    step("nightly_report has no lock in its code: redlock_tasks in celeryconfig.py adds one")
    results = [tasks.nightly_report.delay("2026-11-22") for _ in range(2)]
    for i, result in enumerate(results, 1):
        say(f"report #{i}: {outcome(result)}")


def periodic(worker: Service, backend: redis.Redis, seconds: float) -> None:
    step(f"Beat sends refresh_rates every second; each run takes 2.5 s (watched {seconds:.0f} s)")
    time.sleep(seconds)
    log = worker.text()
    skipped = len(re.findall(r"refresh_rates\[[^\]]+\] skipped", log))
    runs = sorted(
        (run["started"], run["ended"], run["fence"])
        for run in finished_runs(backend, "example_project.tasks.refresh_rates")
    )
    overlaps = sum(1 for a, b in itertools.pairwise(runs) if b[0] < a[1])
    say(
        f"{len(runs)} runs finished, {skipped} sends skipped because the previous run was "
        "still going"
    )
    say(f"overlapping runs: {overlaps}; fencing tokens in order: {[r[2] for r in runs]}")


def main() -> None:
    with ExitStack() as stack, tempfile.TemporaryDirectory(prefix="redlock-demo-") as tmp:
        logdir = Path(tmp)
        base = redis_base(stack)
        env = {
            **os.environ,
            "EXAMPLE_REDIS_URL": base,
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        }
        os.environ["EXAMPLE_REDIS_URL"] = base
        from . import tasks  # noqa: PLC0415 (its config reads the URL set just above)

        worker = Service(
            "worker",
            [
                "worker",
                "--pool=prefork",
                "--concurrency=4",
                "--loglevel=INFO",
                "-n",
                "demo@%h",
            ],
            env,
            logdir,
        )
        stack.callback(worker.stop)
        say("starting a prefork worker (4 processes)...")
        wait_until(
            lambda: "ready." in worker.text() or worker.proc.poll() is not None, 60, "the worker"
        )
        if worker.proc.poll() is not None:
            raise SystemExit(f"demo: the worker exited:\n{worker.text()}")
        locks = redis.Redis.from_url(f"{base}/0", decode_responses=True)

        duplicates(tasks)
        long_task(tasks, locks)
        stolen_lock(tasks, locks)
        config_only(tasks)

        beat = Service(
            "beat",
            [
                "beat",
                "--loglevel=INFO",
                "-s",
                str(logdir / "schedule"),
                "-S",
                "celery_redlock.beat:LeaderScheduler",
            ],
            env,
            logdir,
        )
        stack.callback(beat.stop)
        periodic(worker, redis.Redis.from_url(f"{base}/2", decode_responses=True), 10)
        beat.stop()
        print("\nDemo finished; stopping the worker and Redis.", flush=True)


if __name__ == "__main__":
    main()
