"""Beat failover: ``python -m example_project.failover``.

Starts Redis (unless ``EXAMPLE_REDIS_URL`` is set), a worker and two beats running
``celery_redlock.beat:LeaderScheduler`` with a 3 s leader lease. One beat leads and
sends ``heartbeat`` every second; the demo SIGKILLs it, the standby takes over, and the
demo checks that no run was sent twice and how long the schedule paused.
"""

from __future__ import annotations

import itertools
import os
import signal
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import redis

from celery_redlock.beat import parse_beat_holder

from .support import ROOT, Service, finished_runs, redis_base, say, step, wait_until

LEASE = 3.0


def leader_pid(locks: redis.Redis) -> int | None:
    # The leader lock's name carries a digest of the broker: find it by its pattern.
    keys = [
        key
        for key in locks.scan_iter("redlock:{beat:example_project@*}")
        if not key.endswith((":fence", ":state"))
    ]
    holder = parse_beat_holder(locks.hget(keys[0], "task_name") if keys else None)
    return int(holder["pid"]) if holder else None


def main() -> None:
    with ExitStack() as stack, tempfile.TemporaryDirectory(prefix="redlock-failover-") as tmp:
        logdir = Path(tmp)
        base = redis_base(stack)
        env = {
            **os.environ,
            "EXAMPLE_REDIS_URL": base,
            "EXAMPLE_BEAT_TTL": str(LEASE),
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        }
        worker = Service(
            "worker",
            ["worker", "--pool=prefork", "--concurrency=2", "--loglevel=INFO", "-n", "failover@%h"],
            env,
            logdir,
        )
        stack.callback(worker.stop)
        wait_until(lambda: "ready." in worker.text(), 60, "the worker")
        beats = {}
        for name in ("beat-a", "beat-b"):
            beat = Service(
                name,
                [
                    "beat",
                    "--loglevel=INFO",
                    "-s",
                    str(logdir / name),
                    "-S",
                    "celery_redlock.beat:LeaderScheduler",
                ],
                env,
                logdir,
            )
            stack.callback(beat.stop)
            beats[beat.proc.pid] = (name, beat)
        locks = redis.Redis.from_url(f"{base}/0", decode_responses=True)
        backend = redis.Redis.from_url(f"{base}/2", decode_responses=True)

        step(f"Two beats with LeaderScheduler, leader lease {LEASE:.0f} s")
        pid = wait_until(lambda: leader_pid(locks) in beats and leader_pid(locks), 30, "a leader")
        name, beat = beats[pid]
        say(f"{name} (pid {pid}) leads; the other stands by")
        time.sleep(5)  # let the leader send a few heartbeats
        say(f"heartbeats so far: {len(finished_runs(backend, 'example_project.tasks.heartbeat'))}")

        step(f"SIGKILL {name}")
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        new_pid = wait_until(
            lambda: leader_pid(locks) not in (None, pid) and leader_pid(locks),
            LEASE * 4,
            "the standby to take over",
        )
        say(
            f"{beats[new_pid][0]} (pid {new_pid}) took over "
            f"{time.monotonic() - killed:.1f} s after the kill (lease {LEASE:.0f} s)"
        )
        time.sleep(5)

        runs = sorted(finished_runs(backend, "example_project.tasks.heartbeat"))
        gaps = [b - a for a, b in itertools.pairwise(runs)]
        step("What the worker received")
        say(
            f"{len(runs)} heartbeats; closest two {min(gaps):.2f} s apart "
            f"(a run sent twice would be ~0 s); longest pause {max(gaps):.1f} s (the failover)"
        )
        print("\nFailover demo finished.", flush=True)


if __name__ == "__main__":
    main()
