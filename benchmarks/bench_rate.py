"""Rate budgets (issue 26): ``lock_rate`` against Celery's ``rate_limit``, and what one
admission costs.

Run from the repository root: ``python -m benchmarks.bench_rate [--calls N] [--runs R]
[--tasks T] [--cost-runs C] [--count-tasks K]``. Starts two redis-servers (one for the
broker and the benchmark's counters, one for the locks alone, so that its command counts
are the locks') and two ``celery worker -P prefork -c 2`` subprocesses with Celery's
default worker options (mingle, gossip, heartbeat on) running
:data:`benchmarks.celery_apps.rate_app`, and writes ``benchmarks/results/rate.json``.
Both parts run on the same two workers, in one run.

1. **Accuracy and use of the budget.** ``--calls`` calls of a task limited to 5 starts a
   second are sent onto a queue the workers do not consume yet, then both workers are
   told to consume it (``add_consumer``); each body records its start (wall clock) and
   task id first thing. Peers, one after the other (never sharing the workers' time),
   alternating over ``--runs`` runs: Celery's ``rate_limit="5/s"`` (a token bucket in
   each worker's main process) and ours, ``LockedTask`` with ``lock_rate="5/s"``,
   ``lock_mode="shared"``, every call on one key (one budget in Redis: an early run goes
   back on the queue for its slot). Reported per run: the most starts in any sliding
   window of 1 s less :data:`RECORD_SLACK` (half-open, on the bodies' clock, which
   record a start a few ms after the node admitted it: the admission itself is exact
   on the node's clock, tests/unit/engine/test_rate.py); the shortest time spanned by 6
   consecutive starts (at least 1 s when every window holds 5 or fewer); when the last
   run started after the queue was opened against the earliest any schedule within the
   limit can start it, ``floor((N - 1) / 5)`` s; and the starts per second over the run,
   ``N / (last start - first start + 1 s)``, against the rate (utilization: at most 1.0
   for any schedule within the limit, 1.0 for the fastest).

2. **The cost of one admission.** ``--tasks`` empty tasks under our exclusive lock, one
   key each, against the same task with ``lock_rate="100000/s"`` (never reached: every
   start is admitted, so the difference is the admission itself), sent onto a fresh
   queue, then drained by both workers; cases interleaved over ``--cost-runs`` runs.
   Throughput is tasks / drain time; CPU per task is the drain's (``/proc`` for the
   workers' main processes and pool children, ``INFO cpu`` for each redis-server; the
   broker's also answers this process's polling of the counter); the lock server's
   ``INFO commandstats`` deltas count every command it ran (those inside scripts too).
   Then a counting pass of ``--count-tasks`` each under ``MONITOR`` on the lock server
   tells the commands that came over the network (round trips, at most) from those run
   inside scripts (counts only; ``MONITOR`` slows the server, so nothing is timed there).
"""

from __future__ import annotations

import argparse
import bisect
import statistics
import time
from collections.abc import Callable
from typing import Any

import celery

from benchmarks.bench_celery import Case, cpu_seconds, send
from benchmarks.bench_redis_cost import NetworkMeter, ServerMeter
from benchmarks.celery_apps import (
    DONE_KEY,
    EVENTS_ENV,
    LOCK_URL_ENV,
    NEVER_DEFERS,
    RATE,
    STARTS_KEY,
    add_rate_tasks,
    bench_worker,
    counter,
    create_app,
)
from benchmarks.common import (
    environment,
    redis_cpu_seconds,
    server_label,
    source_state,
    write_report,
)
from celery_redlock.engine.rate import Budget, parse_rate
from tests.harness import RedisServer, WorkerProcess, unique_nodename, wait_for

WORKERS = 2
BUDGET = parse_rate("lock_rate", RATE)
PEERS = (
    Case(f'Celery rate_limit="{RATE}"', "rate.celery", one_key=True),
    Case(f'LockedTask lock_rate="{RATE}", shared', "rate.ours", one_key=True),
)
CELERY, OURS = (peer.name for peer in PEERS)
CASES = (
    Case("LockedTask, distinct keys", "rate.locked", one_key=False),
    Case(f'LockedTask lock_rate="{NEVER_DEFERS}", distinct keys', "rate.admitted", one_key=False),
)
PLAIN, ADMITTED = (case.name for case in CASES)
#: The shortest time ``limit + 1`` consecutive starts spanned (:func:`pace`).
SPAN = f"shortest_span_of_{BUDGET.limit + 1}_starts_s"
#: The last start of ours within this many times its earliest possible moment (the
#: integration test's bound, tests/integration/test_rate.py).
LAST_START_BOUND = 1.5


def drain(
    app: celery.Celery,
    workers: list[WorkerProcess],
    queue: str,
    done: Callable[[dict[str, int]], bool],
    timeout: float,
) -> dict[str, int]:
    """Let every worker consume ``queue`` until ``done(final states counted)``."""
    states = counter(app.conf.bench_redis_url)

    def counted() -> dict[str, int] | None:
        counts = {k.decode(): int(v) for k, v in states.hgetall(DONE_KEY).items()}
        return counts if done(counts) else None

    nodes = [worker.nodename for worker in workers]
    app.control.add_consumer(queue, destination=nodes)  # no reply wanted: it would wait
    try:
        return wait_for(counted, timeout=timeout, interval=0.002, message=f"{queue} drained")
    finally:
        app.control.cancel_consumer(queue, destination=nodes)


#: Seconds between the node's admission of a start and the body's record of it, at
#: most (the admission's reply, Celery's trace): windows are counted that much shorter.
RECORD_SLACK = 0.005


def pace(starts: list[float], opened: float, budget: Budget) -> dict[str, Any]:
    """How ``starts`` (wall clock) kept to ``budget``; times from ``opened``."""
    starts = sorted(starts)
    calls, limit, window = len(starts), budget.limit, budget.window
    span = starts[-1] - starts[0]
    ideal = (calls - 1) // limit * window
    last = starts[-1] - opened
    per_s = calls / (span + window)
    return {
        "starts": calls,
        # Windows of RECORD_SLACK less than the rate's: a body records its start a few
        # ms after the node admitted it, later in one process than in another.
        "most_starts_in_any_window": max(
            bisect.bisect_left(starts, s + window - RECORD_SLACK) - i for i, s in enumerate(starts)
        ),
        f"shortest_span_of_{limit + 1}_starts_s": round(
            min((starts[i + limit] - s for i, s in enumerate(starts[:-limit])), default=0.0), 4
        ),
        "first_start_s": round(starts[0] - opened, 3),
        "last_start_s": round(last, 3),
        "ideal_last_start_s": ideal,
        "last_start_vs_ideal": round(last / ideal, 3) if ideal else None,
        "starts_per_s": round(per_s, 3),
        "utilization": round(per_s * window / limit, 3),
    }


def accuracy_run(
    app: celery.Celery, workers: list[WorkerProcess], case: Case, tag: str, calls: int
) -> dict[str, Any]:
    """``calls`` calls of ``case``'s task on one key, all queued before any is consumed."""
    client = counter(app.conf.bench_redis_url)
    client.delete(DONE_KEY)
    queue = f"bench-rate-{tag}"
    send(app, case, queue, tag, calls)
    opened = time.time()
    timeout = 60 + 3 * calls * BUDGET.window / BUDGET.limit  # 3x the time N starts take
    states = drain(app, workers, queue, lambda s: s.get("SUCCESS", 0) >= calls, timeout)
    recorded = client.lrange(STARTS_KEY.format(key=f"{tag}:one"), 0, -1)
    entries = [entry.decode().split() for entry in recorded]
    row = pace([float(entry[1]) for entry in entries], opened, BUDGET)
    row["ran_more_than_once"] = len(entries) - len({entry[0] for entry in entries})
    # An early run of ours goes back on the queue: its delivery ends IGNORED.
    row["deferrals"] = states.get("IGNORED", 0)
    row["other_states"] = {k: v for k, v in states.items() if k not in ("SUCCESS", "IGNORED")}
    return row


def cpu_now(workers: list[WorkerProcess], locks: Any, broker: Any) -> dict[str, float]:
    """CPU seconds so far: both workers' main processes, their pool children, each server."""
    return {
        "workers_main": sum(cpu_seconds(worker.pid) for worker in workers),
        "pool_children": sum(cpu_seconds(pid) for w in workers for pid in w.child_pids()),
        "lock_redis": redis_cpu_seconds(locks),
        "broker_redis": redis_cpu_seconds(broker),
    }


def admission_run(
    app: celery.Celery,
    workers: list[WorkerProcess],
    clients: tuple[Any, Any],
    case: Case,
    tag: str,
    tasks: int,
    meter: Callable[..., dict[str, Any]],
) -> dict[str, Any]:
    """Send ``tasks`` of ``case``, then drain them under ``meter`` (lock server counts)."""
    counter(app.conf.bench_redis_url).delete(DONE_KEY)
    queue = f"bench-rate-{tag}"
    send(app, case, queue, tag, tasks)
    timed: dict[str, Any] = {}

    def run() -> None:
        before = cpu_now(workers, *clients)
        started = time.perf_counter()
        timed["states"] = drain(
            app, workers, queue, lambda s: sum(s.values()) >= tasks, 60 + tasks * 0.05
        )
        timed["drain_s"] = time.perf_counter() - started
        after = cpu_now(workers, *clients)
        timed["cpu_ms_per_task"] = {k: (after[k] - v) * 1000 / tasks for k, v in before.items()}

    counts = meter(run, tasks)
    states = timed.pop("states")
    return {
        **counts,
        **timed,
        "tasks_per_s": tasks / timed["drain_s"],
        "ran": states.get("SUCCESS", 0),
        "other_states": {k: v for k, v in states.items() if k != "SUCCESS"},
    }


def median(values: list[float], digits: int = 3) -> float:
    return round(statistics.median(values), digits)


def summarize_pace(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The worst window and span over the runs, the medians of the rest."""
    return {
        "most_starts_in_any_window": max(r["most_starts_in_any_window"] for r in runs),
        SPAN: min(r[SPAN] for r in runs),
        **{
            f"{field}_median": median([r[field] for r in runs])
            for field in ("last_start_s", "last_start_vs_ideal", "starts_per_s", "utilization")
        },
        "ideal_last_start_s": runs[0]["ideal_last_start_s"],
        "ran_more_than_once": sum(r["ran_more_than_once"] for r in runs),
        "runs": runs,
    }


def summarize_cost(runs: list[dict[str, Any]], counted: dict[str, Any]) -> dict[str, Any]:
    """Medians over the runs; the lock server's commands per task, by name."""
    cpu = {k: median([r["cpu_ms_per_task"][k] for r in runs]) for k in runs[0]["cpu_ms_per_task"]}
    names = sorted({name for r in runs for name in r["server_commands_by_name"]})
    return {
        "tasks_per_s": {
            "median": median([r["tasks_per_s"] for r in runs], 1),
            "min": round(min(r["tasks_per_s"] for r in runs), 1),
            "max": round(max(r["tasks_per_s"] for r in runs), 1),
        },
        "cpu_ms_per_task_median": {**cpu, "total": round(sum(cpu.values()), 3)},
        "lock_server_commands_per_task": median([r["server_commands"] for r in runs]),
        "lock_server_commands_per_task_by_name": {
            name: median([r["server_commands_by_name"].get(name, 0.0) for r in runs])
            for name in names
        },
        "lock_server_bytes_in_per_task": median([r["bytes_in"] for r in runs], 1),
        "network_commands_per_task": counted["network_commands"],
        "network_commands_per_task_by_name": counted["network_commands_by_name"],
        "commands_in_scripts_per_task": counted["script_commands"],
        "ran": [r["ran"] for r in runs],
        "other_states": [r["other_states"] for r in runs if r["other_states"]],
    }


def script_calls(row: dict[str, Any]) -> float:
    """Script calls per task that came over the network (EVALSHA; EVAL after a flush)."""
    by_name = row["network_commands_per_task_by_name"]
    return by_name.get("evalsha", 0.0) + by_name.get("eval", 0.0)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=50, help="calls per accuracy run")
    parser.add_argument("--runs", type=int, default=3, help="accuracy runs per peer")
    parser.add_argument("--tasks", type=int, default=2000, help="tasks per admission run")
    parser.add_argument("--cost-runs", type=int, default=3, help="admission runs per case")
    parser.add_argument("--count-tasks", type=int, default=500, help="tasks under MONITOR")
    parser.add_argument("--concurrency", type=int, default=2, help="pool processes per worker")
    args = parser.parse_args(argv)
    started = time.monotonic()
    with RedisServer() as broker, RedisServer() as locks:
        app = add_rate_tasks(create_app(broker.url), locks.url)
        workers = [
            bench_worker(
                "benchmarks.celery_apps:rate_app",
                broker.url,
                args.concurrency,
                name=unique_nodename(f"rate{i}"),
                # The admission's own round trips are counted: the event log's batched
                # writes (off the task's path) are measured by bench_celery instead.
                env={LOCK_URL_ENV: locks.url, EVENTS_ENV: "0"},
            )
            for i in range(WORKERS)
        ]
        clients = (locks.client(), broker.client())
        try:
            for worker in workers:
                worker.start()
            for case in PEERS:  # warm: pool children's connections, script caches
                accuracy_run(app, workers, case, f"warm-{case.task}", BUDGET.limit - 1)
            for case in CASES:
                admission_run(
                    app, workers, clients, case, f"warm-{case.task}", 20, ServerMeter(locks.url)
                )
            paced: dict[str, list[dict[str, Any]]] = {peer.name: [] for peer in PEERS}
            for r in range(args.runs):
                for p, peer in enumerate(PEERS):
                    paced[peer.name].append(
                        accuracy_run(app, workers, peer, f"a{r}p{p}", args.calls)
                    )
            costs: dict[str, list[dict[str, Any]]] = {case.name: [] for case in CASES}
            for r in range(args.cost_runs):
                for c, case in enumerate(CASES):
                    meter = ServerMeter(locks.url)
                    costs[case.name].append(
                        admission_run(app, workers, clients, case, f"c{r}c{c}", args.tasks, meter)
                    )
            counted = {
                case.name: admission_run(
                    app, workers, clients, case, f"m{c}", args.count_tasks, NetworkMeter(locks.url)
                )
                for c, case in enumerate(CASES)
            }
        finally:
            for worker in workers:
                worker.stop()
            app.close()
        version = broker.version
    accuracy = {name: summarize_pace(runs) for name, runs in paced.items()}
    cost = {name: summarize_cost(costs[name], counted[name]) for name in costs}
    plain, admitted = cost[PLAIN], cost[ADMITTED]
    ratios = {
        "tasks_per_s": round(admitted["tasks_per_s"]["median"] / plain["tasks_per_s"]["median"], 3),
        "cpu_ms_per_task": round(
            admitted["cpu_ms_per_task_median"]["total"] / plain["cpu_ms_per_task_median"]["total"],
            3,
        ),
        "lock_server_commands_per_task": round(
            admitted["lock_server_commands_per_task"] / plain["lock_server_commands_per_task"], 3
        ),
        "network_commands_per_task": round(
            admitted["network_commands_per_task"] / plain["network_commands_per_task"], 3
        ),
        "script_calls_per_task": round(script_calls(admitted) / script_calls(plain), 3),
    }
    ours, theirs = accuracy[OURS], accuracy[CELERY]
    window = f"{BUDGET.window:g} s"
    targets = {
        f"P26 lock_rate {RATE} on {WORKERS} workers: most starts in any {window} window, "
        f"worst of {args.runs} runs (<= {BUDGET.limit})": ours["most_starts_in_any_window"],
        f"P26 lock_rate {RATE}: shortest time spanned by {BUDGET.limit + 1} consecutive "
        f"starts, s, worst run (reported)": ours[SPAN],
        f"P26 lock_rate {RATE}: last start / the earliest the limit allows, median "
        f"(<= {LAST_START_BOUND})": ours["last_start_vs_ideal_median"],
        f"P26 lock_rate {RATE}: utilization, starts per second over the run / the rate, "
        "median (reported)": ours["utilization_median"],
        f"P26 Celery rate_limit {RATE} on {WORKERS} workers: most starts in any {window} "
        "window / the limit (reported)": round(
            theirs["most_starts_in_any_window"] / BUDGET.limit, 2
        ),
        "P26 admission: script calls per task, with lock_rate minus without (<= 1.05)": round(
            script_calls(admitted) - script_calls(plain), 3
        ),
        **{
            f"P26 admission: {what.replace('_', ' ')}, with lock_rate / without (reported)": value
            for what, value in ratios.items()
        },
    }
    report = {
        "benchmark": "Rate budgets: lock_rate against Celery's rate_limit; one admission's cost",
        **environment(),
        "redis_server": server_label(version),
        "celery": celery.__version__,
        # Other work goes on in this tree: what was measured, exactly.
        "source": source_state(),
        "workers": WORKERS,
        "pool": "prefork",
        "concurrency": args.concurrency,
        "rate": RATE,
        "calls_per_run": args.calls,
        "runs": args.runs,
        "tasks_per_run": args.tasks,
        "cost_runs": args.cost_runs,
        "count_tasks": args.count_tasks,
        "wall_s": round(time.monotonic() - started, 1),
        "notes": [
            "two `celery worker -P prefork` processes, Celery's default options (mingle, "
            "gossip, heartbeat); one redis-server for the broker and counters, one for locks",
            "accuracy: N calls on one key queued first, then both workers consume the queue; "
            "each body records time.time() first; peers run one after the other, alternating",
            "most_starts_in_any_window: starts in [t, t + 1 s - RECORD_SLACK) at most, on "
            "the bodies' clock (ours are admitted on the lock server's clock, a few ms "
            f"earlier; RECORD_SLACK = {RECORD_SLACK} s)",
            "ideal_last_start_s: floor((N - 1) / limit) windows, the earliest the N-th start "
            "can come within the limit; last_start_s from the moment the queue was opened",
            "utilization: N / (last start - first start + 1 window) / the rate; at most 1.0 "
            "for a schedule within the limit",
            "admission: empty tasks, one key each, drained by both workers; cpu_ms_per_task "
            "over the drain; lock server commands from INFO commandstats (scripts' included)",
            "network_commands / commands_in_scripts: a separate pass under MONITOR on the "
            "lock server (counts only)",
        ],
        "accuracy": accuracy,
        "admission": {"results": cost, "with_rate_vs_without": ratios},
        "targets": targets,
    }
    write_report("rate", report)
    print(f"{'peer':<36} {'most/window':>11} {'6 starts span s':>15} {'last s':>7} {'util':>5}")
    for name, row in accuracy.items():
        print(
            f"{name:<36} {row['most_starts_in_any_window']:>11} {row[SPAN]:>15} "
            f"{row['last_start_s_median']:>7} {row['utilization_median']:>5}"
        )
    print(f"{'case':<44} {'tasks/s':>8} {'CPU ms':>7} {'lock cmds':>9} {'network':>8}")
    for name, row in cost.items():
        print(
            f"{name:<44} {row['tasks_per_s']['median']:>8} "
            f"{row['cpu_ms_per_task_median']['total']:>7} "
            f"{row['lock_server_commands_per_task']:>9} {row['network_commands_per_task']:>8}"
        )
    for target, value in targets.items():
        print(f"{target}: {value}")
    return report


if __name__ == "__main__":
    main()
