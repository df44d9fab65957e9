"""Backlogs of deferred runs: how often a run goes through the broker, and how long a
backlog takes, for ``lock_rate`` alone and with ``lock_on_busy="requeue"``, beside
Celery's own ``rate_limit`` (how many windows it overruns), in one run.

Run from the repository root: ``python -m benchmarks.bench_backlog [--sizes 100,1000]
[--rates 5,50] [--workers 2,4] [--runs R] [--peers celery,ours,requeue]``. Starts one
redis-server (broker, locks, counters) and, per count of workers, that many ``celery
worker -P prefork -c 2`` subprocesses with Celery's default worker options, running
:data:`benchmarks.celery_apps.backlog_app`, and writes ``benchmarks/results/backlog.json``.

Per size B and rate N (a backlog of 1,000 at 5/s takes 200 s: left out unless
``--sizes`` and ``--rates`` both name it and ``--slow`` is given): B calls on one key
are sent onto a queue no worker consumes yet, then every worker consumes it. Reported
per peer: **re-publishes per run** (deliveries that ended IGNORED, each a run put back
and published again, over B: the target is at most 1.1), **drain** (the last start after
the queue was opened) against the issue's ideal, B / N seconds (the target: at most
1.1x), and against the earliest last start a sliding window of N allows, ``(B - 1) // N``
seconds (``drain_vs_ideal``: the stricter measure, reported), the most starts in
any window of 1 s (less 5 ms of body-side timing: the limit is N) and how many windows
of 1 s (one per start) held more than N starts; and whether any run started twice.
Celery's ``rate_limit`` is a token bucket per worker: two workers start up to 2N a
second.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import celery

from benchmarks import bench_rate
from benchmarks.bench_celery import Case
from benchmarks.bench_rate import RECORD_SLACK, accuracy_run
from benchmarks.celery_apps import (
    BACKLOG_RATES,
    STARTS_KEY,
    add_backlog_tasks,
    bench_worker,
    counter,
    create_app,
)
from benchmarks.common import environment, server_label, source_state, write_report
from celery_redlock.engine.rate import parse_rate
from tests.harness import RedisServer, WorkerProcess, unique_nodename


def peers(n: int) -> tuple[Case, ...]:
    """The three ways to start N runs a second, as benchmark cases (one key each)."""
    return (
        Case(f'Celery rate_limit="{n}/s"', f"backlog.celery{n}", one_key=True),
        Case(f'lock_rate="{n}/s"', f"backlog.ours{n}", one_key=True),
        Case(f'lock_rate="{n}/s" + lock_on_busy="requeue"', f"backlog.requeue{n}", one_key=True),
    )


#: The names ``--peers`` selects the cases of :func:`peers` by, in their order.
PEER_NAMES = ("celery", "ours", "requeue")


def windows_over(starts: list[float], limit: int) -> int:
    """Windows of 1 s (one beginning at each start) holding more than ``limit`` starts."""
    starts = sorted(starts)
    return sum(
        1
        for i, s in enumerate(starts)
        if sum(1 for t in starts[i:] if t < s + 1.0 - RECORD_SLACK) > limit
    )


def backlog_run(
    app: Any, workers: list[WorkerProcess], case: Case, tag: str, size: int, n: int
) -> dict[str, Any]:
    """One backlog of ``size`` calls of ``case`` at ``n``/s: its row."""
    bench_rate.BUDGET = parse_rate("rate", f"{n}/s")  # accuracy_run's pace and timeout
    try:
        row = accuracy_run(app, workers, case, tag, size)
    except AssertionError as exc:  # not drained within 60 s + 3x the ideal: say so
        done = counter(app.conf.bench_redis_url).llen(STARTS_KEY.format(key=f"{tag}:one"))
        return {"runs": size, "rate_per_s": n, "timed_out": str(exc)[:200], "started": done}
    entries = counter(app.conf.bench_redis_url).lrange(STARTS_KEY.format(key=f"{tag}:one"), 0, -1)
    fields = [e.decode().split() for e in entries]
    starts = [float(f[1]) for f in fields]
    # When each body's admission returned in its process (the bodies of Celery's own
    # rate_limit have none): the time from there to the body is spent in our prerun.
    pairs = [(float(f[1]), float(f[2])) for f in fields if len(f) > 2 and float(f[2])]
    admitted = [a for _, a in pairs]
    gaps = sorted(s - a for s, a in pairs)
    ideal = (size - 1) // n
    return {
        "runs": size,
        "rate_per_s": n,
        "republishes_per_run": round(row["deferrals"] / size, 3),
        "drain_s": row["last_start_s"],
        "ideal_drain_s": ideal,
        "drain_vs_ideal": round(row["last_start_s"] / ideal, 3) if ideal else None,
        "drain_vs_runs_over_rate": round(row["last_start_s"] * n / size, 3),
        "most_starts_in_any_window": row["most_starts_in_any_window"],
        "windows_over_limit": windows_over(starts, n),
        "windows_over_limit_at_admission": windows_over(admitted, n) if admitted else None,
        "admission_to_body_ms_p50_max": (
            [round(gaps[len(gaps) // 2] * 1000, 1), round(gaps[-1] * 1000, 1)] if gaps else None
        ),
        # Under 1 s only if the bodies' clock saw more than N starts in some window.
        "shortest_span_of_n_plus_1_starts_s": row[f"shortest_span_of_{n + 1}_starts_s"],
        "ran_more_than_once": row["ran_more_than_once"],
        "other_states": row["other_states"],
    }


def backlogs(
    app: Any, server: Any, count: int, sizes: list[int], rates: list[int], args: Any
) -> list[dict[str, Any]]:
    """Every backlog of ``sizes`` x ``rates`` x peers, drained by ``count`` workers: rows."""
    rows: list[dict[str, Any]] = []
    workers = [
        bench_worker(
            "benchmarks.celery_apps:backlog_app",
            server.url,
            args.concurrency,
            name=unique_nodename(f"backlog{i}"),
        )
        for i in range(count)
    ]
    try:
        for worker in workers:
            worker.start()
        for n in rates:
            for case in peers(n):  # warm: connections, script caches
                backlog_run(app, workers, case, f"warm{count}-{case.task}", 2, n)
        for r in range(args.runs):
            for size in sizes:
                for n in rates:
                    if size * 1.0 / n > 60 and not args.slow:
                        continue
                    for p, case in enumerate(peers(n)):
                        if PEER_NAMES[p] not in args.peers.split(","):
                            continue
                        tag = f"w{count}b{r}s{size}n{n}p{p}"
                        row = backlog_run(app, workers, case, tag, size, n)
                        rows.append({"case": case.name, "workers": count, **row})
                        print(rows[-1], flush=True)
    finally:
        for worker in workers:
            worker.stop()
    return rows


def targets(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue's targets over the ``lock_rate`` rows (alone and with requeue): the worst."""
    ours = [row for row in rows if row["case"].startswith("lock_rate") and "timed_out" not in row]
    if not ours:
        return {}
    return {
        "Issue 38: re-publishes per run, worst lock_rate row (<= 1.1)": max(
            row["republishes_per_run"] for row in ours
        ),
        "Issue 38: drain time over the ideal runs / rate, worst lock_rate row (<= 1.1)": max(
            row["drain_vs_runs_over_rate"] for row in ours
        ),
        "Issue 38: windows of 1 s over the limit, all lock_rate rows (== 0)": sum(
            row["windows_over_limit"] for row in ours
        ),
        "lock_rate rows timed out (== 0)": sum(
            1 for row in rows if row["case"].startswith("lock_rate") and "timed_out" in row
        ),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="100,1000", help="backlog sizes")
    parser.add_argument("--rates", default=",".join(map(str, BACKLOG_RATES)), help="N per s")
    parser.add_argument("--runs", type=int, default=1, help="runs per configuration")
    parser.add_argument("--slow", action="store_true", help="also 1,000 runs at 5/s")
    parser.add_argument("--concurrency", type=int, default=2, help="pool processes per worker")
    parser.add_argument("--workers", default="2,4", help="counts of workers")
    parser.add_argument(
        "--peers",
        default=",".join(PEER_NAMES),
        help="cases: celery, ours, requeue (a subset goes to results/tmp/backlog-partial.json)",
    )
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    rates = [int(r) for r in args.rates.split(",")]
    started = time.monotonic()
    rows: list[dict[str, Any]] = []
    with RedisServer() as server:
        app = add_backlog_tasks(create_app(server.url))
        try:
            for count in (int(w) for w in args.workers.split(",")):
                rows += backlogs(app, server, count, sizes, rates, args)
        finally:
            app.close()
        version = server.version
    report = {
        "benchmark": "Backlogs of deferred runs: re-publishes per run and drain time",
        **environment(),
        "redis_server": server_label(version),
        "celery": celery.__version__,
        "source": source_state(),
        "wall_s": round(time.monotonic() - started, 1),
        "targets": targets(rows),
        "results": rows,
    }
    whole = set(args.peers.split(",")) == set(PEER_NAMES)
    write_report("backlog" if whole else "tmp/backlog-partial", report)
    return report


if __name__ == "__main__":
    main()
