"""One node of three slow or blackholed: acquisitions against the fault-free rate (issue 37).

Run from the repository root:
``python -m benchmarks.bench_slow_node [--duration 5] [--runs 2] [--workers 4]
[--slow 0.2] [--ttl 2]``.

Starts three redis-server processes (through the test harness), each behind a
:class:`~tests.harness.faultproxy.FaultProxy` in this process. Per cell, one spawned
process (so the proxies' thread never competes with the workers for the GIL) runs
``--workers`` threads with a ``Redlock`` each, or as many asyncio tasks with an
``AsyncRedlock`` each, on one key or a key each, looping blocking ``acquire`` /
``release`` (nothing held in between) for ``--duration`` seconds from a common
instant; the acquisitions counted are those made within the window. Node faults, on
the first node for the whole cell: none, ``--slow`` seconds added to each round trip
(the proxy delays each way by half), and blackholed (connections accepted, nothing
answered). Cells are interleaved run by run (``--runs``); each cell's figure is its
median rate.

Target (issue 37, DESIGN "a minority does not set the pace"): with one node of three
slow or blackholed, at least 0.7x the fault-free rate of the same lock, workers and
keys. Outside testers saw 1,347 acquisitions in 5 s fault-free and 22 with one node
slow (one key). Writes ``benchmarks/results/slow_node.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.common import environment, server_label, source_state, verdict, write_report
from celery_redlock import AsyncRedlock, NodeUnavailable, Redlock
from tests.harness.faultproxy import FaultProxy
from tests.reliability.workload import Lab

LOCKS = ("Redlock threads", "AsyncRedlock tasks")
KEYS = ("one key", "a key each")
FAULTS = ("none", "slow", "blackhole")
TARGET = 0.7
LEAD = 0.5  # seconds between the worker process being ready and the common start
DRAIN = 30.0  # seconds a cell may overrun its window before it counts as hung


def thread_loop(lock: Redlock, start_at: float, deadline: float, counts: list[int], i: int) -> None:
    """One thread: acquire / release until ``deadline``; acquisitions within the window."""
    while time.monotonic() < start_at:
        time.sleep(min(0.01, max(0.0, start_at - time.monotonic())))  # the common start
    while time.monotonic() < deadline:
        try:
            if not lock.acquire(timeout=1.0):
                continue
        except NodeUnavailable:
            counts[-1] += 1
            continue
        if time.monotonic() < deadline:
            counts[i] += 1
        try:
            lock.release()
        except NodeUnavailable:
            counts[-1] += 1


async def task_loop(
    lock: AsyncRedlock, start_at: float, deadline: float, counts: list[int], i: int
) -> None:
    """One asyncio task: :func:`thread_loop`, awaited."""
    await asyncio.sleep(max(0.0, start_at - time.monotonic()))  # the common start
    while time.monotonic() < deadline:
        try:
            if not await lock.acquire(timeout=1.0):
                continue
        except NodeUnavailable:
            counts[-1] += 1
            continue
        if time.monotonic() < deadline:
            counts[i] += 1
        try:
            await lock.release()
        except NodeUnavailable:
            counts[-1] += 1


def names(name: str, workers: int, keys: str) -> list[str]:
    """The key each worker takes."""
    return [f"{name}.{i}" if keys == KEYS[1] else name for i in range(workers)]


def worker_process(job: tuple, ready: Any, start: Any, go: Any, results: Any) -> None:
    """One cell's worker process: warm up (connections, scripts), say ready, run, report."""
    kind, urls, name, workers, keys, ttl, duration = job
    counts = [0] * (workers + 1)  # the last one: NodeUnavailable seen
    if kind == LOCKS[0]:
        locks = [Redlock(n, nodes=urls, ttl=ttl) for n in names(name, workers, keys)]
        for lock in locks[:1]:
            with lock:
                pass
        ready.put(None)
        go.wait(120)
        start_at = start.value
        threads = [
            threading.Thread(
                target=thread_loop, args=(lock, start_at, start_at + duration, counts, i)
            )
            for i, lock in enumerate(locks)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    else:

        async def run() -> None:
            locks = [AsyncRedlock(n, nodes=urls, ttl=ttl) for n in names(name, workers, keys)]
            async with locks[0]:
                pass
            ready.put(None)
            go.wait(120)  # blocks the loop before any task runs
            start_at = start.value
            await asyncio.gather(
                *(
                    task_loop(lock, start_at, start_at + duration, counts, i)
                    for i, lock in enumerate(locks)
                )
            )

        asyncio.run(run())
    results.put(counts)


def cell(
    proxies: list[FaultProxy], kind: str, keys: str, fault: str, name: str, args: Any
) -> dict[str, Any]:
    """One cell: the fault on the first proxy, one worker process, its counts."""
    if fault == "slow":
        proxies[0].delay(args.slow / 2)
    elif fault == "blackhole":
        proxies[0].blackhole()
    ctx = multiprocessing.get_context("spawn")
    ready, go, start, results = ctx.Queue(), ctx.Event(), ctx.Value("d", 0.0), ctx.Queue()
    job = (kind, [p.url for p in proxies], name, args.workers, keys, args.ttl, args.duration)
    proc = ctx.Process(target=worker_process, args=(job, ready, start, go, results))
    proc.start()
    try:
        ready.get(timeout=120)
        start.value = time.monotonic() + LEAD  # CLOCK_MONOTONIC is system-wide on Linux
        go.set()
        counts = results.get(timeout=LEAD + args.duration + DRAIN)
        proc.join(30)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(5)
        proxies[0].restore()
    acquired = sum(counts[:-1])
    return {
        "acquired": acquired,
        "per_s": round(acquired / args.duration, 1),
        "unavailable": counts[-1],
        "per_worker": counts[:-1],
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per cell")
    parser.add_argument("--runs", type=int, default=2, help="interleaved runs per cell")
    parser.add_argument("--workers", type=int, default=4, help="threads or tasks, one process")
    parser.add_argument("--slow", type=float, default=0.2, help="seconds added per round trip")
    parser.add_argument("--ttl", type=float, default=2.0, help="lease, seconds")
    args = parser.parse_args(argv)
    started = time.monotonic()
    cells = [(kind, keys, fault) for kind in LOCKS for keys in KEYS for fault in FAULTS]
    raw: dict[tuple[str, str, str], list[dict[str, Any]]] = {c: [] for c in cells}
    lab = Lab(Path(tempfile.mkdtemp(prefix="bench-slow-node-")))
    try:
        servers = lab.servers(3)
        proxies = lab.proxies(servers)
        version = servers[0].version
        for run in range(args.runs):
            for n, (kind, keys, fault) in enumerate(cells):
                name = f"bench:slow-node:{run}:{n}"
                row = cell(proxies, kind, keys, fault, name, args)
                raw[(kind, keys, fault)].append(row)
                print(f"run {run}: {kind}, {keys}, fault {fault}: {row}", flush=True)
    finally:
        lab.close()
    results = []
    targets: dict[str, Any] = {}
    for kind in LOCKS:
        for keys in KEYS:
            rates = {f: statistics.median(r["per_s"] for r in raw[(kind, keys, f)]) for f in FAULTS}
            for fault in FAULTS:
                results.append(
                    {
                        "lock": kind,
                        "keys": keys,
                        "fault": fault,
                        "per_s": rates[fault],
                        "run_per_s": [r["per_s"] for r in raw[(kind, keys, fault)]],
                        "unavailable": [r["unavailable"] for r in raw[(kind, keys, fault)]],
                    }
                )
                if fault == "none":
                    continue
                what = f"{args.slow * 1000:g} ms slow" if fault == "slow" else "blackholed"
                label = (
                    f"Issue 37: {kind}, {args.workers} workers, {keys}, 1 of 3 nodes {what} / "
                    f"fault-free (>= {TARGET})"
                )
                targets[label] = round(rates[fault] / rates["none"], 3) if rates["none"] else 0.0
    print(f"{'lock':<19} {'keys':<11} {'none/s':>8} {'slow/s':>8} {'blackhole/s':>11}")
    for kind in LOCKS:
        for keys in KEYS:
            per = {
                r["fault"]: r["per_s"] for r in results if (r["lock"], r["keys"]) == (kind, keys)
            }
            print(f"{kind:<19} {keys:<11} {per['none']:>8} {per['slow']:>8} {per['blackhole']:>11}")
    for label, value in targets.items():
        print(f"{verdict(label, value).upper():>8}  {label}: {value}")
    report: dict[str, Any] = {
        "benchmark": "one node of three slow or blackholed: acquisitions vs fault-free",
        **environment(),
        **source_state(),
        "redis_server": server_label(version),
        "command": vars(args),
        "wall_s": round(time.monotonic() - started, 1),
        "results": results,
        "targets": targets,
    }
    write_report("slow_node", report)
    return report


if __name__ == "__main__":
    main()
