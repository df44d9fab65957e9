"""Celery end to end: tasks per second through a real prefork worker, against the peers.

Run from the repository root: ``python -m benchmarks.bench_celery [--tasks N] [--runs R]
[--concurrency C]``. Starts its own redis-server (broker, locks and a counter) and one
``celery worker -P prefork -c 2`` subprocess running :mod:`benchmarks.celery_apps`, and
writes ``benchmarks/results/celery.json``.

One measurement of a case, N submissions:

1. *send*: this process calls ``apply_async`` N times onto a fresh queue the worker
   does not consume yet (celery-once and celery-singleton take their lock here, and
   turn away duplicates; those are counted as rejected at send);
2. *drain*: the worker is told to consume the queue (``add_consumer``; its idle BRPOP
   returns every 10 ms, so it starts within 10 ms), and the time runs until the
   ``task_postrun`` counter (see :mod:`benchmarks.celery_apps`) has counted every queued
   task, run or skipped.

Throughput is N / (send + drain): submissions dealt with per second, end to end. The
worker's rate alone (queued / drain) is reported beside it. The two phases are kept
apart so that the producer and the worker do not compete for this 2-core machine's
CPUs. Cases are interleaved across runs; medians and min/max over the runs.

Cases: a plain task; ``LockedTask`` on distinct keys; ``LockedTask`` on one key with
``lock_on_busy="skip"``; celery-once ``QueueOnce`` and celery-singleton ``Singleton``
on distinct keys and on one key. Those two lock at send time, we lock at run time: on
one key they queue one task and reject the other N-1 submissions, while ours queues all
N and runs each that finds the key free (never two at once), skipping the others.
Target: LockedTask on distinct keys at least 0.85x the plain task.

``lock_unique="until_started"`` moves our deduplication to send time as well: on one
key it queues one task and returns the queued copy's result to the other N-1 (the
execution lock still guards the run). P7 (issue 17): that one-key flood at least as
fast as celery-once's and celery-singleton's, end to end.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import dataclass
from importlib.metadata import version as dist_version
from pathlib import Path
from typing import Any

import celery
import redis
from celery.result import EagerResult

from benchmarks.celery_apps import DONE_KEY, EVENTS_ENV, bench_worker, counter, create_app
from benchmarks.common import environment, server_label, write_report
from tests.harness import RedisServer, WorkerProcess, wait_for

TARGET = 0.95
CPU_TARGET = 1.15
#: The event log on by default only if it costs at most 5% (issue 40): throughput with
#: it at least this share of throughput without, CPU per task at most 1.05x.
EVENTS_TARGET = 0.95


@dataclass(frozen=True)
class Case:
    """One row: which task, and whether every submission uses the same key."""

    name: str
    task: str
    one_key: bool
    #: Run by the worker whose app keeps the event log (the default); False: by the
    #: worker with ``redlock_events=False``, for the log's cost.
    events: bool = True


CASES = (
    Case("plain task", "bench.plain", one_key=False),
    Case("LockedTask, distinct keys", "bench.locked", one_key=False),
    Case("LockedTask, distinct keys, no event log", "bench.locked", one_key=False, events=False),
    Case("LockedTask, one key (skip)", "bench.locked", one_key=True),
    Case("LockedTask unique, distinct keys", "bench.unique", one_key=False),
    Case("LockedTask unique, one key", "bench.unique", one_key=True),
    Case("celery-once, distinct keys", "bench.once", one_key=False),
    Case("celery-once, one key", "bench.once", one_key=True),
    Case("celery-singleton, distinct keys", "bench.singleton", one_key=False),
    Case("celery-singleton, one key", "bench.singleton", one_key=True),
)


def send(app: celery.Celery, case: Case, queue: str, tag: str, n: int) -> int:
    """Submit ``n`` tasks onto ``queue``; how many the sender's lock turned away."""
    task = app.tasks[case.task]
    rejected = 0
    for i in range(n):
        key = f"{tag}:one" if case.one_key else f"{tag}:{i}"
        task_id = f"{tag}-{i}"
        result = task.apply_async((key,), queue=queue, task_id=task_id)
        # celery-once answers a duplicate with a REJECTED EagerResult, celery-singleton
        # with the queued task's result (another id); neither is queued.
        if isinstance(result, EagerResult) or result.id != task_id:
            rejected += 1
    return rejected


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far (Linux ``/proc/<pid>/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_snapshot(worker: WorkerProcess, server: redis.Redis) -> dict[str, float]:
    """CPU seconds so far of the worker's main process, its pool children and Redis."""
    used = server.info("cpu")
    return {
        "worker_main": cpu_seconds(worker.pid),
        "pool_children": sum(cpu_seconds(pid) for pid in worker.child_pids()),
        "redis_server": used["used_cpu_user"] + used["used_cpu_sys"],
    }


def measure(
    app: celery.Celery, worker: WorkerProcess, case: Case, tag: str, n: int, timeout: float
) -> dict[str, Any]:
    """One measurement of ``case``: send ``n``, then let the worker drain them."""
    done = counter(app.conf.bench_redis_url)
    done.delete(DONE_KEY)
    queue = f"bench-{tag}"
    started = time.perf_counter()
    rejected = send(app, case, queue, tag, n)
    sent = time.perf_counter()
    queued = n - rejected
    cpu_before = cpu_snapshot(worker, done)
    # No reply wanted: collecting it would add up to a second to the drain.
    app.control.add_consumer(queue, destination=[worker.nodename])
    states = wait_for(
        lambda: (s := done.hgetall(DONE_KEY)) and sum(map(int, s.values())) >= queued and s,
        timeout=timeout,
        interval=0.002,
    )
    drained = time.perf_counter()
    cpu_after = cpu_snapshot(worker, done)
    app.control.cancel_consumer(queue, destination=[worker.nodename])
    counts = {k.decode(): int(v) for k, v in states.items()}
    send_s, drain_s = sent - started, drained - sent
    return {
        "send_s": send_s,
        "drain_s": drain_s,
        "tasks_per_s": n / (send_s + drain_s),
        "worker_tasks_per_s": queued / drain_s,
        "rejected_at_send": rejected,
        "ran": counts.get("SUCCESS", 0),
        "skipped_by_worker": counts.get("IGNORED", 0),
        "other_states": {k: v for k, v in counts.items() if k not in ("SUCCESS", "IGNORED")},
        # CPU per task the worker drained (clock ticks of 10 ms: meaningful over many tasks).
        "cpu_ms_per_task": {
            where: (cpu_after[where] - cpu_before[where]) * 1000 / max(queued, 1)
            for where in cpu_before
        },
    }


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    def spread(field: str, digits: int = 1) -> dict[str, float]:
        values = [run[field] for run in runs]
        return {
            "median": round(statistics.median(values), digits),
            "min": round(min(values), digits),
            "max": round(max(values), digits),
        }

    cpu = {
        where: round(statistics.median(run["cpu_ms_per_task"][where] for run in runs), 3)
        for where in runs[0]["cpu_ms_per_task"]
    }
    return {
        "tasks_per_s": spread("tasks_per_s"),
        "cpu_ms_per_task_median": cpu,
        "worker_tasks_per_s": spread("worker_tasks_per_s"),
        "send_s": spread("send_s", 3),
        "drain_s": spread("drain_s", 3),
        # Counts per run: they differ between runs only for the one-key cases.
        "rejected_at_send": [run["rejected_at_send"] for run in runs],
        "ran": [run["ran"] for run in runs],
        "skipped_by_worker": [run["skipped_by_worker"] for run in runs],
        "other_states": [run["other_states"] for run in runs if run["other_states"]],
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=2000, help="submissions per measurement")
    parser.add_argument("--runs", type=int, default=5, help="interleaved runs per case")
    parser.add_argument("--concurrency", type=int, default=2, help="prefork pool processes")
    args = parser.parse_args(argv)
    started = time.monotonic()
    timeout = 60 + args.tasks * 0.05  # a hung worker fails the run instead of hanging it
    with RedisServer() as server:
        app = create_app(server.url)
        # Two workers, idle but for the case at hand: one with the event log (the
        # default), one without it, so its cost is measured in the same run.
        workers = {
            True: bench_worker("benchmarks.celery_apps", server.url, args.concurrency),
            False: bench_worker(
                "benchmarks.celery_apps",
                server.url,
                args.concurrency,
                name="nolog",
                env={EVENTS_ENV: "0"},
            ),
        }
        for worker in workers.values():
            worker.start()
        try:
            for c, case in enumerate(CASES):  # warm: pool connections, script caches
                measure(app, workers[case.events], case, f"warm-{c}", 20, timeout)
            runs: dict[str, list[dict[str, Any]]] = {case.name: [] for case in CASES}
            for r in range(args.runs):
                for c, case in enumerate(CASES):
                    runs[case.name].append(
                        measure(app, workers[case.events], case, f"r{r}c{c}", args.tasks, timeout)
                    )
        finally:
            for worker in workers.values():
                worker.stop()
            app.close()
        version = server.version
    results = {name: summarize(values) for name, values in runs.items()}
    plain = results["plain task"]
    locked = results["LockedTask, distinct keys"]
    ratio = locked["tasks_per_s"]["median"] / plain["tasks_per_s"]["median"]
    worker_ratio = locked["worker_tasks_per_s"]["median"] / plain["worker_tasks_per_s"]["median"]
    quiet = results["LockedTask, distinct keys, no event log"]
    log_ratio = locked["tasks_per_s"]["median"] / quiet["tasks_per_s"]["median"]
    log_cpu = sum(locked["cpu_ms_per_task_median"].values()) / sum(
        quiet["cpu_ms_per_task_median"].values()
    )
    flood = results["LockedTask unique, one key"]["tasks_per_s"]["median"]
    p7 = {
        peer: round(flood / results[f"{peer}, one key"]["tasks_per_s"]["median"], 3)
        for peer in ("celery-once", "celery-singleton")
    }
    report = {
        "benchmark": "Celery end to end, prefork worker, Redis broker",
        **environment(),
        "redis_server": server_label(version),
        "celery": celery.__version__,
        "celery_once": dist_version("celery-once"),
        "celery_singleton": dist_version("celery-singleton"),
        "pool": "prefork",
        "concurrency": args.concurrency,
        "tasks_per_run": args.tasks,
        "runs": args.runs,
        "wall_s": round(time.monotonic() - started, 1),
        "notes": [
            "tasks_per_s = submissions / (send + drain), end to end; worker_tasks_per_s = "
            "queued tasks / drain, the worker alone; median, min and max over the runs",
            "send: apply_async N times onto a queue the worker does not consume yet; "
            "drain: add_consumer, then until a task_postrun counter (one HINCRBY per task, "
            "every case) has counted every queued task; results are not stored",
            "celery-once and celery-singleton lock at send time (duplicates are not queued: "
            "rejected_at_send); LockedTask locks at run time (a busy key is skipped by "
            "the worker: skipped_by_worker); LockedTask unique does both (a duplicate is "
            "not queued, and the run takes the execution lock)",
            "worker loggers for per-task INFO lines set to WARNING in every case",
            "cpu_ms_per_task_median: CPU time used during the drain (/proc/<pid>/stat of the "
            "worker's main process and pool children; INFO cpu of redis-server, which also "
            "serves this process's polling of the counter) per queued task",
        ],
        "results": results,
        "targets": {
            f"P5 LockedTask distinct keys vs plain, end to end (>= {TARGET})": round(ratio, 3),
            "P5 LockedTask distinct keys vs plain, worker alone (reported)": round(worker_ratio, 3),
            f"P5 LockedTask distinct keys CPU per task vs plain (<= {CPU_TARGET})": round(
                sum(locked["cpu_ms_per_task_median"].values())
                / sum(plain["cpu_ms_per_task_median"].values()),
                3,
            ),
            f"Event log on vs off, LockedTask distinct keys, end to end (>= {EVENTS_TARGET})": (
                round(log_ratio, 3)
            ),
            "Event log on vs off, LockedTask distinct keys, CPU per task (<= 1.05)": round(
                log_cpu, 3
            ),
            **{
                f"P7 one-key flood, LockedTask unique vs {peer} (>= 1.0)": ratio_
                for peer, ratio_ in p7.items()
            },
        },
    }
    write_report("celery", report)
    print(
        f"{'case':<34} {'tasks/s':>8} {'(min-max)':>13} {'worker/s':>9} "
        f"{'rejected':>8} {'ran':>6} {'skipped':>7}  CPU ms/task main, children, redis"
    )
    for name, row in results.items():
        rate, work = row["tasks_per_s"], row["worker_tasks_per_s"]
        cpu = ", ".join(str(v) for v in row["cpu_ms_per_task_median"].values())
        print(
            f"{name:<34} {rate['median']:>8} {rate['min']:>6}-{rate['max']:<6} "
            f"{work['median']:>9} {statistics.median(row['rejected_at_send']):>8} "
            f"{statistics.median(row['ran']):>6} {statistics.median(row['skipped_by_worker']):>7}"
            f"  {cpu}"
        )
    for target, value in report["targets"].items():
        print(f"{target}: {value}")
    return report


if __name__ == "__main__":
    main()
