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
(``--threads 1``: the performance issue's P8 wants Jain >= 0.99).

The second part is the performance issue's **P8** (issue 27): ``--procs 4,16,32`` processes
x 1 thread each, blocking ``acquire`` / hold ``--holds`` ms / ``release``, ours (as is and
``fair=True``), python-redis-lock and redis-py's ``Lock`` interleaved in the same run
(``--p8-runs`` runs of ``--p8-duration`` s per cell, the processes of
:class:`benchmarks.bench_contention.ProcessPool`, started once). Per cell: total
acquisitions per second, Jain's index across processes, the slowest process, and, from
the server's ``INFO commandstats`` / ``INFO cpu`` around the cell, the script calls,
PUBLISHes, BLPOPs, SETs and Redis CPU *per acquisition*. With ``--counts`` each of our
processes also counts its attempts (failed per success), the release announcements its
listener received (deliveries) and its waits that ended by a wake-up or by a timeout
(another pass, uncounted in the throughput figures: the counters cost a little;
``--no-counts`` skips it).

Targets (P8): ours at least 1.2x python-redis-lock's total, Jain across processes at
least 0.99, no process starved, ``fair=True`` at least 0.8x of ours. Writes
``benchmarks/results/processes.json`` (``--report`` is kept for the old spelling).
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing
import statistics
import threading
import time
from typing import Any

import redis

from benchmarks.bench_contention import FAIR, ProcessPool, client_loop
from benchmarks.common import environment, server_label, write_report
from celery_redlock import Redlock
from tests.harness import RedisServer
from tests.harness.waits import COUNTS, count_waiting

OURS, PRL, REDIS_PY = "celery_redlock", "python-redis-lock", "redis-py Lock"
P8_KINDS = (OURS, FAIR, PRL, REDIS_PY)
P8_LEAD = 0.3  # seconds between handing out a cell and its common start
P8_WARMUP = 0.1  # seconds of the uncounted first pass per cell
#: Server commands counted per acquisition (scripts' own calls included: Redis counts them).
SERVER_COMMANDS = ("evalsha", "eval", "publish", "set", "blpop", "lpush", "hget", "subscribe")

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


def counted_loop(*job: Any) -> tuple[int, list[float], dict[str, int]]:
    """:func:`client_loop`, and what this process's waiting did meanwhile (ours only)."""
    if job[0] in (OURS, FAIR):
        count_waiting()
    COUNTS.clear()
    count, waits = client_loop(*job)
    return count, waits, dict(COUNTS)


def server_counters(client: redis.Redis) -> dict[str, float]:
    """The server's command calls (those of scripts included) and its CPU seconds."""
    stats = client.info("commandstats")
    cpu = client.info("cpu")
    out = {
        name: float(stats.get(f"cmdstat_{name}", {}).get("calls", 0)) for name in SERVER_COMMANDS
    }
    out["redis_cpu_s"] = float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])
    return out


def p8_cells(args: argparse.Namespace, url: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Every (processes, hold, lock) cell, runs interleaved; rows and P8 targets."""
    procs = [int(n) for n in args.p8_procs.split(",") if n]
    holds = [float(h) for h in args.p8_holds.split(",") if h]
    kinds = [k for k in args.p8_kinds.split(",") if k]
    cells = [(n, hold, kind) for n in procs for hold in holds for kind in kinds]
    raw: dict[tuple, list] = {cell: [] for cell in cells}
    server: dict[tuple, list] = {cell: [] for cell in cells}
    counted: dict[tuple, list] = {cell: [] for cell in cells}
    admin = redis.Redis.from_url(url)
    pool = ProcessPool(max(procs))
    try:
        passes = [("warmup", -1)] + [("run", r) for r in range(args.p8_runs)]
        if args.counts:
            passes.append(("counts", args.p8_runs))
        for what, run in passes:
            for cell in cells:
                n, hold, kind = cell
                if what == "counts" and kind not in (OURS, FAIR, PRL):
                    continue
                name = f"bench:p8:{run}:{n}:{hold}:{kind}"
                start_at = time.monotonic() + P8_LEAD
                deadline = start_at + (P8_WARMUP if run < 0 else args.p8_duration)
                job = (kind, url, name, hold / 1000, start_at, deadline)
                if what == "counts":
                    job = (counted_loop, *job)
                before = server_counters(admin)
                result = pool.run(n, job, deadline)
                after = server_counters(admin)
                if what == "run":
                    raw[cell].append([r[0] for r in result])
                    server[cell].append({k: after[k] - before[k] for k in after})
                elif what == "counts":
                    totals: collections.Counter[str] = collections.Counter()
                    for r in result:
                        totals.update(r[2])
                    totals["acquisitions"] = sum(r[0] for r in result)
                    delta = {k: after[k] - before[k] for k in after}
                    counted[cell].append((dict(totals), delta))
    finally:
        pool.close()
        admin.close()
    rows = []
    for (n, hold, kind), runs in raw.items():
        totals_s = [sum(run) / args.p8_duration for run in runs]
        slowest = [min(run) / args.p8_duration for run in runs]
        jains = [jain(run) for run in runs]
        acquired = sum(sum(run) for run in runs) or 1
        spent = {k: sum(d[k] for d in server[(n, hold, kind)]) for k in server_counters_keys()}
        row: dict[str, Any] = {
            "processes": n,
            "hold_ms": hold,
            "lock": kind,
            "total_per_s": round(statistics.median(totals_s), 1),
            "run_totals_per_s": [round(t, 1) for t in totals_s],
            "jain_processes": round(min(jains), 3),
            "run_jains": [round(j, 3) for j in jains],
            "slowest_process_per_s": round(min(slowest), 2),
            "per_acquisition": {
                ("redis_cpu_us" if k == "redis_cpu_s" else f"{k}_calls"): round(
                    v / acquired * (1e6 if k == "redis_cpu_s" else 1), 2
                )
                for k, v in spent.items()
                if v
            },
        }
        if counted[(n, hold, kind)]:
            clients, delta = counted[(n, hold, kind)][0]
            got = clients.pop("acquisitions") or 1
            row["counted_per_acquisition"] = {
                **{k: round(v / got, 2) for k, v in sorted(clients.items())},
                **{
                    f"server_{k}_calls": round(v / got, 2)
                    for k, v in delta.items()
                    if v and k != "redis_cpu_s"
                },
                "acquisitions": got,
            }
        rows.append(row)
    targets: dict[str, Any] = {}
    for row in rows:
        if row["lock"] != OURS:
            continue
        same = {
            r["lock"]: r
            for r in rows
            if (r["processes"], r["hold_ms"]) == (row["processes"], row["hold_ms"])
        }
        if PRL not in same:
            continue
        p8: dict[str, Any] = {
            "total / python-redis-lock (>= 1.2)": round(
                row["total_per_s"] / (same[PRL]["total_per_s"] or 1), 2
            ),
            "Jain across processes (>= 0.99)": row["jain_processes"],
            "slowest process per s (> 0)": row["slowest_process_per_s"],
        }
        if REDIS_PY in same:
            p8["total / redis-py (reported)"] = round(
                row["total_per_s"] / (same[REDIS_PY]["total_per_s"] or 1), 2
            )
        if FAIR in same:
            p8["fair / non-fair (>= 0.8)"] = round(
                same[FAIR]["total_per_s"] / (row["total_per_s"] or 1), 2
            )
            p8["fair Jain (>= 0.99)"] = same[FAIR]["jain_processes"]
        p8["met"] = (
            p8["total / python-redis-lock (>= 1.2)"] >= 1.2
            and p8["Jain across processes (>= 0.99)"] >= 0.99
            and p8["slowest process per s (> 0)"] > 0
            and p8.get("fair / non-fair (>= 0.8)", 1) >= 0.8
        )
        label = (
            f"P8 processes={row['processes']} hold={row['hold_ms']:g}ms: "
            "total / python-redis-lock (>= 1.2), Jain (>= 0.99), no process starved (> 0)"
        )
        targets[label] = p8
    return rows, targets


def server_counters_keys() -> tuple[str, ...]:
    return (*SERVER_COMMANDS, "redis_cpu_s")


def print_p8(rows: list[dict[str, Any]], targets: dict[str, Any]) -> None:
    print(
        f"{'procs':>5} {'hold':>4}  {'lock':<21} {'total/s':>8} {'slowest/s':>9} {'jain':>5}"
        "  per acquisition"
    )
    for row in rows:
        per = ", ".join(f"{k} {v}" for k, v in row["per_acquisition"].items())
        print(
            f"{row['processes']:>5} {row['hold_ms']:>4g}  {row['lock']:<21} "
            f"{row['total_per_s']:>8} "
            f"{row['slowest_process_per_s']:>9} {row['jain_processes']:>5}  {per}"
        )
        if "counted_per_acquisition" in row:
            print(f"{'':>33}counted: {row['counted_per_acquisition']}")
    for label, p8 in targets.items():
        shown = {k: v for k, v in p8.items() if k != "met"}
        print(f"{label}: {'met' if p8['met'] else 'MISSED'} {shown}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--procs", type=int, default=2, help="contending processes (0: skip)")
    parser.add_argument("--threads", type=int, default=4, help="threads per process")
    parser.add_argument("--hold", type=float, default=1.0, help="ms held per acquisition")
    parser.add_argument("--duration", type=float, default=12.0, help="seconds per run")
    parser.add_argument("--timeout", type=float, default=5.0, help="acquire timeout, seconds")
    parser.add_argument("--runs", type=int, default=1, help="runs, one after another")
    parser.add_argument("--p8-procs", default="4,16,32", help="P8 process counts ('': skip)")
    parser.add_argument("--p8-holds", default="0,1", help="P8 hold times, ms")
    parser.add_argument("--p8-kinds", default=",".join(P8_KINDS), help="P8 locks compared")
    parser.add_argument("--p8-duration", type=float, default=1.5, help="P8 seconds per cell")
    parser.add_argument("--p8-runs", type=int, default=3, help="P8 interleaved runs per cell")
    parser.add_argument(
        "--counts",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="P8: a counting pass as well (default on)",
    )
    parser.add_argument("--report", action="store_true", help="(always) results/processes.json")
    args = parser.parse_args(argv)
    started = time.monotonic()
    runs: list[dict[str, Any]] = []
    rows: list[dict[str, Any]] = []
    targets: dict[str, Any] = {}
    with RedisServer() as server:
        if args.procs:
            runs = [run_once(server.url, f"bench:processes:{i}", args) for i in range(args.runs)]
        if args.p8_procs:
            rows, targets = p8_cells(args, server.url)
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
    if rows:
        print_p8(rows, targets)
    report: dict[str, Any] = {
        "benchmark": "service across processes: P processes x T threads on one lock; P8",
        **environment(),
        "redis_server": server_label(version),
        "command": vars(args),
        "wall_s": round(time.monotonic() - started, 1),
        "runs": runs,
        "p8": rows,
        "targets": targets,
    }
    if runs:
        report["jain_processes_min"] = min(r["jain_processes"] for r in runs)
        report["jain_processes_median"] = statistics.median(r["jain_processes"] for r in runs)
    write_report("processes", report)
    return report


if __name__ == "__main__":
    main()
