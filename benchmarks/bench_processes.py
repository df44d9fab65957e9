"""Service across processes: P processes x T threads contending for one lock.

Run from the repository root:
``python -m benchmarks.bench_processes [--procs 2] [--threads 4] [--hold 1]
[--duration 12] [--timeout 5] [--runs 1] [--report]``.

Starts its own redis-server (through the test harness). Each of ``--procs`` spawned
processes runs ``--threads`` threads, each with its own ``Redlock`` on the same name,
looping ``acquire(timeout=--timeout)`` / hold ``--hold`` ms / ``release`` for
``--duration`` seconds, all from one common instant. Reports per process the
acquisitions and the acquisitions that timed out, the longest blocked ``acquire``,
and Jain's fairness index over the processes' acquisition counts (1.0: every process
served alike; 1/P: one process served alone).

Two shapes matter (DESIGN invariant 12): threads of several processes (a process must
not keep the lock among its own threads through in-process handoffs while another
process waits: ``--procs 2 --threads 4 --hold 1``), and one thread per process
(``--threads 1``: the performance issue's P8 wants Jain >= 0.99). ``--report`` writes
``benchmarks/results/processes.json``.
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import threading
import time
from typing import Any

from benchmarks.common import environment, server_label, write_report
from celery_redlock import Redlock
from tests.harness import RedisServer

LEAD = 0.3  # seconds between the last process being ready and the common start
DRAIN = 30.0  # seconds a run may overrun its duration (+ timeout) before it counts as hung


def jain(counts: list[int]) -> float:
    """Jain's fairness index of ``counts``: 1.0 when all equal, 1/n when one has all."""
    squares = sum(c * c for c in counts)
    return sum(counts) ** 2 / (len(counts) * squares) if squares else 1.0


def client(
    url: str, name: str, hold: float, timeout: float, start_at: float, deadline: float, out: dict
) -> None:
    """One thread: acquire / hold / release until ``deadline``; counts into ``out``."""
    lock = Redlock(name, nodes=[url], ttl=30)
    acquired = timeouts = 0
    longest = 0.0
    time.sleep(max(0.0, start_at - time.monotonic()))
    while time.monotonic() < deadline:
        began = time.monotonic()
        ok = lock.acquire(timeout=timeout)
        waited = time.monotonic() - began
        longest = max(longest, waited)
        if not ok:
            timeouts += 1
            continue
        if time.monotonic() < deadline:
            acquired += 1
        if hold:
            time.sleep(hold)
        lock.release()
    out.update(acquired=acquired, timeouts=timeouts, longest_s=longest)


def process_main(args: tuple, ready: Any, go: Any, start: Any, results: Any) -> None:
    url, name, threads, hold, timeout, duration = args
    ready.put(None)  # imported: spawned processes take different times to get here
    go.wait(120)
    start_at, deadline = start.value, start.value + duration
    outs: list[dict] = [{} for _ in range(threads)]
    workers = [
        threading.Thread(
            target=client, args=(url, name, hold, timeout, start_at, deadline, outs[i])
        )
        for i in range(threads)
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    results.put(outs)


def run_once(url: str, name: str, args: argparse.Namespace) -> dict[str, Any]:
    """One run: every process's threads' counts, and the figures across processes."""
    ctx = multiprocessing.get_context("spawn")
    ready, go, start, results = ctx.Queue(), ctx.Event(), ctx.Value("d", 0.0), ctx.Queue()
    job = (url, name, args.threads, args.hold / 1000, args.timeout, args.duration)
    procs = [
        ctx.Process(target=process_main, args=(job, ready, go, start, results))
        for _ in range(args.procs)
    ]
    for proc in procs:
        proc.start()
    for _ in procs:
        ready.get(timeout=120)
    start.value = time.monotonic() + LEAD  # CLOCK_MONOTONIC is system-wide on Linux
    deadline = start.value + args.duration
    go.set()
    per_process = []
    for _ in procs:
        outs = results.get(timeout=deadline + args.timeout + DRAIN - time.monotonic())
        per_process.append(
            {
                "acquired": sum(o["acquired"] for o in outs),
                "timeouts": sum(o["timeouts"] for o in outs),
                "longest_wait_s": round(max(o["longest_s"] for o in outs), 3),
                "threads": [o["acquired"] for o in outs],
            }
        )
    for proc in procs:
        proc.join(10)
    counts = [p["acquired"] for p in per_process]
    threads = [c for p in per_process for c in p["threads"]]
    return {
        "per_process": sorted(per_process, key=lambda p: p["acquired"]),
        "total_per_s": round(sum(counts) / args.duration, 1),
        "timeouts": sum(p["timeouts"] for p in per_process),
        "jain_processes": round(jain(counts), 3),
        "jain_threads": round(jain(threads), 3),
        "longest_wait_s": max(p["longest_wait_s"] for p in per_process),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--procs", type=int, default=2, help="contending processes")
    parser.add_argument("--threads", type=int, default=4, help="threads per process")
    parser.add_argument("--hold", type=float, default=1.0, help="ms held per acquisition")
    parser.add_argument("--duration", type=float, default=12.0, help="seconds per run")
    parser.add_argument("--timeout", type=float, default=5.0, help="acquire timeout, seconds")
    parser.add_argument("--runs", type=int, default=1, help="runs, one after another")
    parser.add_argument("--report", action="store_true", help="write results/processes.json")
    args = parser.parse_args(argv)
    started = time.monotonic()
    with RedisServer() as server:
        runs = [run_once(server.url, f"bench:processes:{i}", args) for i in range(args.runs)]
        version = server.version
    for i, run in enumerate(runs):
        counts = ", ".join(
            f"{p['acquired']} ({p['timeouts']} timeouts)" for p in run["per_process"]
        )
        print(
            f"run {i}: {args.procs} processes x {args.threads} threads, hold {args.hold:g} ms: "
            f"{run['total_per_s']}/s, Jain across processes {run['jain_processes']}, "
            f"across threads {run['jain_threads']}, longest wait {run['longest_wait_s']} s; "
            f"per process: {counts}"
        )
    report = {
        "benchmark": "service across processes: P processes x T threads on one lock",
        **environment(),
        "redis_server": server_label(version),
        "command": vars(args),
        "wall_s": round(time.monotonic() - started, 1),
        "runs": runs,
        "jain_processes_min": min(r["jain_processes"] for r in runs),
        "jain_processes_median": statistics.median(r["jain_processes"] for r in runs),
    }
    if args.report:
        write_report("processes", report)
    return report


if __name__ == "__main__":
    main()
