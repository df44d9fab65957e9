"""Handoff latency: from the holder's ``release()`` to the blocked waiter holding the lock.

Run from the repository root: ``python -m benchmarks.bench_handoff [--handoffs N] [--runs R]``.
Starts its own redis-server (through the test harness) and measures, in one process,
a holder thread and a waiter thread that is already blocked in ``acquire()``: a
``time.perf_counter_ns`` stamp just before the holder's ``release()``, another just
after the waiter's ``acquire()`` returns. The holder keeps the lock for a random
20-120 ms after the waiter started, so the release falls at a random phase of any
polling interval. The same again with the waiter in another process (spawned once per
lock; ``time.monotonic`` stamps, one clock for both processes): the *processes*
shape, where a release of ours grants the lock to the waiter and no thread of the
holder's process can take it over. Locks are measured in interleaved runs; writes
``benchmarks/results/handoff.json``.

Peers: redis-py's ``redis.lock.Lock`` with its default ``sleep=0.1`` polling, and
python-redis-lock (``redis_lock.Lock``, BLPOP on a signal list). Target: celery_redlock
p50 at most 2 ms and at least 20x better (lower) than redis-py's Lock; P2 (issue 41):
at most 0.6x python-redis-lock's p50, threads and processes.
"""

from __future__ import annotations

import argparse
import multiprocessing
import random
import statistics
import threading
import time
from collections.abc import Callable

import redis
import redis_lock

from benchmarks.common import environment, write_report
from celery_redlock import Redlock
from tests.harness import RedisServer

WAIT_LIMIT = 10.0  # seconds; a handoff slower than this aborts the run


def factories(url: str) -> dict[str, Callable[[str], tuple[Callable, Callable]]]:
    """Per lock: make(name) -> (acquire, release) for one thread's own lock object."""
    client = redis.Redis.from_url(url)

    def ours(name: str):
        lock = Redlock(name, nodes=[url], ttl=30)
        return lock.acquire, lock.release

    def redis_py(name: str):
        lock = client.lock(name, timeout=30)  # default sleep=0.1
        return lock.acquire, lock.release

    def python_redis_lock(name: str):
        box: dict[str, redis_lock.Lock] = {}

        def acquire() -> bool:
            # A Lock object is single-use per acquisition; expire bounds a lost holder.
            box["lock"] = redis_lock.Lock(client, name, expire=30)
            return box["lock"].acquire(blocking=True)

        def release() -> None:
            box["lock"].release()

        return acquire, release

    return {
        "celery_redlock": ours,
        "redis-py Lock (sleep=0.1)": redis_py,
        "python-redis-lock": python_redis_lock,
    }


def measure(make, name: str, handoffs: int, rng: random.Random) -> list[float]:
    """``handoffs`` handoffs holder -> waiter; latencies in µs."""
    hold_acquire, hold_release = make(name)
    wait_acquire, wait_release = make(name)
    go, done = threading.Event(), threading.Event()
    stamps: list[int] = []
    failure: list[BaseException] = []
    stop = False

    def waiter() -> None:
        try:
            while True:
                go.wait()
                go.clear()
                if stop:
                    return
                wait_acquire()
                stamps.append(time.perf_counter_ns())
                wait_release()
                done.set()
        except BaseException as exc:
            failure.append(exc)
            done.set()

    thread = threading.Thread(target=waiter, daemon=True)
    thread.start()
    samples = []
    try:
        for _ in range(handoffs):
            hold_acquire()
            done.clear()
            go.set()
            time.sleep(rng.uniform(0.02, 0.12))  # the waiter is blocked by now
            released_at = time.perf_counter_ns()
            hold_release()
            if not done.wait(WAIT_LIMIT) or failure:
                raise RuntimeError(f"handoff failed or took over {WAIT_LIMIT}s: {failure}")
            samples.append((stamps[-1] - released_at) / 1000)
    finally:
        stop = True
        go.set()
        thread.join(WAIT_LIMIT)
    return samples


def _waiting_process(
    url: str, label: str, inbox: multiprocessing.Queue, outbox: multiprocessing.Queue
) -> None:
    """A waiter in its own process: per name received, block in ``acquire()``, stamp."""
    make = factories(url)[label]
    while (name := inbox.get()) is not None:
        acquire, release = make(name)
        outbox.put("waiting")
        acquire()
        outbox.put(time.monotonic())
        release()


def measure_processes(
    url: str, label: str, name: str, handoffs: int, rng: random.Random, waiter: tuple
) -> list[float]:
    """``handoffs`` handoffs from this process to the waiting process; latencies in µs."""
    inbox, outbox = waiter
    samples = []
    for n in range(handoffs):
        acquire, release = factories(url)[label](f"{name}:{n}")
        acquire()
        inbox.put(f"{name}:{n}")
        assert outbox.get(timeout=WAIT_LIMIT) == "waiting"
        time.sleep(rng.uniform(0.02, 0.12))  # the waiter is blocked by now
        released_at = time.monotonic()
        release()
        acquired_at = outbox.get(timeout=WAIT_LIMIT)
        samples.append((acquired_at - released_at) * 1e6)
    return samples


def round_trips(url: str, rng: random.Random, count: int = 40) -> dict[str, float]:
    """PING round trips, p50 in µs: after an idle gap like the one before each release
    (*cold*: the server and this thread wake from idle) and back to back (*warm*).

    The floor under every lock's handoff here: a release is at least one cold round
    trip.
    """
    client = redis.Redis.from_url(url)
    client.ping()
    cold, warm = [], []
    for _ in range(count):
        time.sleep(rng.uniform(0.02, 0.12))
        started = time.perf_counter_ns()
        client.ping()
        cold.append((time.perf_counter_ns() - started) / 1000)
        started = time.perf_counter_ns()
        client.ping()
        warm.append((time.perf_counter_ns() - started) / 1000)
    client.close()
    return {
        "cold_p50": round(statistics.median(cold), 1),
        "warm_p50": round(statistics.median(warm), 1),
    }


def p99(values: list[float]) -> float:
    values = sorted(values)
    return values[max(0, int(len(values) * 0.99) - 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--handoffs", type=int, default=200, help="handoffs per lock")
    parser.add_argument("--runs", type=int, default=4, help="interleaved runs per lock")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    per_run = max(1, args.handoffs // args.runs)
    ctx = multiprocessing.get_context("spawn")
    with RedisServer() as server:
        locks = factories(server.url)
        waiters = {}
        for label in locks:
            inbox, outbox = ctx.Queue(), ctx.Queue()
            proc = ctx.Process(
                target=_waiting_process, args=(server.url, label, inbox, outbox), daemon=True
            )
            proc.start()
            waiters[label] = (proc, inbox, outbox)
        shapes = [*locks, *(f"{label} (processes)" for label in locks)]
        samples: dict[str, list[float]] = {name: [] for name in shapes}
        medians: dict[str, list[float]] = {name: [] for name in shapes}
        try:
            for label, make in locks.items():  # warm connections, scripts, listeners
                measure(make, f"bench:handoff:warm:{label}", 3, rng)
                queues = waiters[label][1:]
                measure_processes(server.url, label, f"bench:pwarm:{label}", 3, rng, queues)
            for run in range(args.runs):
                for label, make in locks.items():
                    values = measure(make, f"bench:handoff:{run}:{label}", per_run, rng)
                    samples[label].extend(values)
                    medians[label].append(statistics.median(values))
                    name = f"bench:phandoff:{run}:{label}"
                    queues = waiters[label][1:]
                    values = measure_processes(server.url, label, name, per_run, rng, queues)
                    samples[f"{label} (processes)"].extend(values)
                    medians[f"{label} (processes)"].append(statistics.median(values))
        finally:
            for proc, inbox, _ in waiters.values():
                inbox.put(None)
                proc.join(5)
                if proc.is_alive():
                    proc.kill()
        ping_us = round_trips(server.url, rng)
        version = server.version
    rows = {
        label: {
            "median_us": round(statistics.median(values), 1),
            "p99_us": round(p99(values), 1),
            "max_us": round(max(values), 1),
            "handoffs": len(values),
            "run_medians_us": [round(m, 1) for m in medians[label]],
        }
        for label, values in samples.items()
    }
    ours = rows["celery_redlock"]["median_us"]
    redis_py = rows["redis-py Lock (sleep=0.1)"]["median_us"]
    report = {
        "benchmark": "handoff latency release() -> blocked waiter's acquire() returns, one node",
        **environment(),
        "redis_server": f"{version[0]} {'.'.join(map(str, version[1]))}",
        "python_redis_lock": redis_lock.__version__,
        "handoffs_per_lock": per_run * args.runs,
        "runs": args.runs,
        "hold_before_release_s": [0.02, 0.12],
        "ping_round_trip_us": ping_us,
        "results": rows,
        "targets": {
            "celery_redlock p50 ms (<= 2)": round(ours / 1000, 3),
            "redis-py p50 / celery_redlock p50 (>= 20)": round(redis_py / ours, 1),
            "P2 celery_redlock p50 / python-redis-lock p50 (<= 0.6)": round(
                ours / rows["python-redis-lock"]["median_us"], 2
            ),
            "P2 processes: celery_redlock p50 / python-redis-lock p50 (<= 0.6)": round(
                rows["celery_redlock (processes)"]["median_us"]
                / rows["python-redis-lock (processes)"]["median_us"],
                2,
            ),
        },
    }
    write_report("handoff", report)
    width = max(map(len, rows))
    print(f"{'lock':<{width}}  median µs     p99 µs")
    for label, row in rows.items():
        print(f"{label:<{width}}  {row['median_us']:>9}  {row['p99_us']:>9}")
    for target, value in report["targets"].items():
        print(f"{target}: {value}")


if __name__ == "__main__":
    main()
