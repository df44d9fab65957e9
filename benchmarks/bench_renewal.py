"""Cost of keeping N locks alive: one batched renewer vs a call or a thread per lock.

Run from the repository root: ``python -m benchmarks.bench_renewal [--ticks T] [--window S]``.
Starts its own redis-server (through the test harness) and writes
``benchmarks/results/renewal.json``; ``--only-hold`` runs the P4 hold alone (below) and
prints its figures.

Part 1, one renewal tick with N = 10, 1,000, 10,000 and 50,000 held locks
(``Redlock(ttl=60, auto_renew=False)``, acquired one by one, no pipelining):

* celery_redlock: ``Renewer().renew(leases)`` renews all N in one tick, one
  ``renew_many`` script call per node per chunk of 1,000 keys;
* one call per lock: ``lock.extend()`` on each of the same N locks.

Each tick is timed (wall and ``time.process_time``), and the server counts the
script calls (round trips) of each tick (``CONFIG RESETSTAT`` / ``INFO commandstats``).

Part 2, background renewal over a fixed window, N = 10 and 1,000 only:
python-redis-lock with ``auto_renewal=True`` starts one thread per lock, and more than
1,000 threads is not a reasonable thing to run on a 2-core machine. Both sides hold N
locks with a 3 s lease and are left alone for the window; the process CPU time, the
threads added and the server round trips are measured.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import statistics
import threading
import time

import redis
import redis_lock

from benchmarks.common import environment, write_report
from celery_redlock import Redlock
from celery_redlock.engine.lease import CHUNK, clock
from celery_redlock.engine.renewal import Renewer, get_renewer
from tests.harness import RedisServer

SIZES = (10, 1_000, 10_000, 50_000)
THREAD_SIZES = (10, 1_000)
THREAD_LIMIT_NOTE = (
    "python-redis-lock auto_renewal starts one thread per lock; measured for N = 10 and "
    "1,000 only: more threads than that is not reasonable on this 2-core machine"
)


def script_calls(server: RedisServer) -> int:
    stats = server.commandstats()
    return stats.get("evalsha", 0) + stats.get("eval", 0)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (with 5 samples, p99 is the maximum)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(len(ordered) * q / 100) - 1)]


def timed_ticks(server: RedisServer, tick, ticks: int, leases: list) -> dict:
    tick()  # warm-up: script cache, connections
    walls, cpus, calls, threads, renewed = [], [], [], [], []
    for _ in range(ticks):
        server.reset_stats()
        before_threads = threading.active_count()
        start = clock()
        cpu0, wall0 = time.process_time(), time.perf_counter()
        tick()
        walls.append((time.perf_counter() - wall0) * 1000)
        cpus.append((time.process_time() - cpu0) * 1000)
        threads.append(threading.active_count() - before_threads)
        calls.append(script_calls(server))
        # A confirmed renewal moves the deadline to (send time >= start) + ttl - drift.
        renewed.append(
            sum(1 for x in leases if x.deadline >= start + x.timing.ttl - x.timing.drift)
        )
    return {
        "leases_renewed_per_tick_min": min(renewed),
        "all_renewed_every_tick": min(renewed) == len(leases),
        "ticks": ticks,
        "median_ms": round(statistics.median(walls), 3),
        "p99_ms": round(percentile(walls, 99), 3),
        "cpu_ms_median": round(statistics.median(cpus), 3),
        "round_trips_per_tick": statistics.median(calls),
        "threads_added_by_tick": max(threads),
    }


def acquire_many(url: str, prefix: str, start: int, stop: int, **options) -> list[Redlock]:
    locks = []
    for i in range(start, stop):
        lock = Redlock(f"{prefix}:{i}", nodes=[url], ttl=60, auto_renew=False, **options)
        if not lock.acquire(blocking=False):
            raise RuntimeError(f"could not acquire {lock.key}")
        locks.append(lock)
    return locks


def tick_benchmark(server: RedisServer, sizes: list[int], ticks: int) -> tuple[dict, dict]:
    locks: list[Redlock] = []
    acquire_s: dict[int, float] = {}
    rows: dict[int, dict] = {}
    for n in sizes:
        start = time.perf_counter()
        locks += acquire_many(server.url, "bench:renew", len(locks), n)
        acquire_s[n] = round(time.perf_counter() - start, 2)
        held = locks[:n]
        leases = [lock.lease for lock in held]
        renewer = Renewer()

        def batched(leases=leases, renewer=renewer) -> None:
            renewer.renew(leases)

        def per_lock(held=held) -> None:
            for lock in held:
                lock.extend()

        n_ticks = ticks if n > 1_000 else 4 * ticks
        rows[n] = {
            "celery_redlock Renewer.renew": timed_ticks(server, batched, n_ticks, leases),
            "one call per lock (extend)": timed_ticks(server, per_lock, n_ticks, leases),
        }
        if n > 10_000:
            # At the default node timeout (min(0.25 s, ttl/10)) one tick must get every
            # chunk's reply within 0.25 s; measure a longer budget too.
            extra = acquire_many(server.url, "bench:renew-t2", 0, n, node_timeout=2.0)
            extra_leases = [lock.lease for lock in extra]

            def batched_t2(leases=extra_leases, renewer=renewer) -> None:
                renewer.renew(leases)

            rows[n]["celery_redlock Renewer.renew (node_timeout=2s)"] = timed_ticks(
                server, batched_t2, n_ticks, extra_leases
            )
            locks += extra
        print(f"  N={n}: acquired the new locks in {acquire_s[n]} s; ticks measured", flush=True)
    for lock in locks:  # mark released locally; the server is discarded anyway
        lock.lease.released = True
    return rows, acquire_s


def window_redis_lock(server: RedisServer, n: int, window: float) -> dict:
    # redis-py 8 caps a client's pool at 100 connections: with 1,000 renewal threads
    # most renewals then fail with MaxConnectionsError and the locks expire. Give every
    # thread a connection, as an application using python-redis-lock at scale must.
    client = redis.StrictRedis.from_url(server.url, max_connections=n + 10)
    threads0 = threading.active_count()
    locks = []
    for i in range(n):
        lock = redis_lock.Lock(client, f"bench:rl:{n}:{i}", expire=3, auto_renewal=True)
        if not lock.acquire(blocking=False):
            raise RuntimeError("python-redis-lock: could not acquire")
        locks.append(lock)
    threads = threading.active_count() - threads0
    failures: list[str] = []
    previous_hook = threading.excepthook
    threading.excepthook = lambda args: failures.append(type(args.exc_value).__name__)
    server.reset_stats()
    cpu0 = time.process_time()
    time.sleep(window)
    cpu = time.process_time() - cpu0
    calls = script_calls(server)
    held = sum(1 for lock in locks if client.get(lock._name) == lock.id.encode())
    threading.excepthook = previous_hook
    for lock in locks:
        with contextlib.suppress(redis_lock.NotAcquired):  # counted above as not held
            lock.release()
    client.close()
    return {
        "threads_added": threads,
        "renewal_threads": threads,
        "renew_interval_s": 2.0,
        "cpu_ms_window": round(cpu * 1000, 1),
        "round_trips_window": calls,
        "cpu_us_per_lock_renewal": round(cpu * 1e6 / calls, 1) if calls else None,
        "still_held_after_window": held,
        "renewal_threads_died": len(failures),
        "renewal_thread_errors": sorted(set(failures)),
    }


def window_celery_redlock(server: RedisServer, n: int, window: float) -> dict:
    renewer = get_renewer()
    threads0 = threading.active_count()
    locks = []
    for i in range(n):
        lock = Redlock(f"bench:cr:{n}:{i}", nodes=[server.url], ttl=3)
        if not lock.acquire(blocking=False):
            raise RuntimeError("celery_redlock: could not acquire")
        locks.append(lock)
    threads = threading.active_count() - threads0
    server.reset_stats()
    ticks0, cpu0 = renewer.ticks, time.process_time()
    time.sleep(window)
    cpu = time.process_time() - cpu0
    ticks = renewer.ticks - ticks0
    calls = script_calls(server)
    held = sum(1 for lock in locks if lock.remaining() > 0)
    for lock in locks:
        lock.release()
    interval = locks[0].timing.renew_interval
    lock_renewals = n * window / interval  # approximate: every lease, every interval
    return {
        # The renewer thread is started once per process; its delta is 1 only for the
        # first window that uses it (0 afterwards: the same thread serves every N).
        "threads_added": threads,
        "renewal_threads": sum(
            1 for t in threading.enumerate() if t.name == "celery_redlock-renewer"
        ),
        "renew_interval_s": interval,
        "cpu_ms_window": round(cpu * 1000, 1),
        "round_trips_window": calls,
        "ticks_window": ticks,
        "cpu_us_per_lock_renewal": round(cpu * 1e6 / lock_renewals, 1),
        "still_held_after_window": held,
    }


def hold_benchmark(server: RedisServer, n: int, periods: int, ttl: float) -> dict:
    """P4: hold ``n`` auto-renewed locks for ``periods`` renewal intervals.

    Counts losses, samples the thread count every second, measures the process CPU
    over the window (only the renewer thread works in it) and reads every script
    call's execution time from the server's SLOWLOG (threshold 0): the longest is
    how long one renewal call kept that Redis from serving anyone else.
    """
    lost: list[object] = []
    locks = []
    started = time.perf_counter()
    for i in range(n):
        lock = Redlock(f"bench:hold:{i}", nodes=[server.url], ttl=ttl, on_lost=lost.append)
        if not lock.acquire(blocking=False):
            raise RuntimeError(f"could not acquire {lock.key}")
        locks.append(lock)
    acquire_s = time.perf_counter() - started
    renewer = get_renewer()
    interval = locks[0].timing.renew_interval
    window = periods * interval
    client = server.client()
    client.config_set("slowlog-max-len", 1_000_000)
    client.config_set("slowlog-log-slower-than", 0)
    client.slowlog_reset()
    server.reset_stats()
    threads = [threading.active_count()]
    ticks0, cpu0, wall0 = renewer.ticks, time.process_time(), time.perf_counter()
    while time.perf_counter() - wall0 < window:
        time.sleep(1.0)  # a sampling period, not a wait for a condition
        threads.append(threading.active_count())
    wall = time.perf_counter() - wall0
    cpu = time.process_time() - cpu0
    entries = client.slowlog_get(1_000_000)
    client.config_set("slowlog-log-slower-than", 10_000)
    scripts = [
        e["duration"]
        for e in entries
        if str(e["command"]).lower().startswith(("evalsha", "b'evalsha"))
    ]
    held = sum(1 for lock in locks if lock.remaining() > 0)
    for lock in locks:
        lock.lease.abandon()
    client.flushall()
    client.close()
    return {
        "locks": n,
        "ttl_s": ttl,
        "renew_interval_s": interval,
        "periods": periods,
        "acquire_s": round(acquire_s, 1),
        "window_s": round(wall, 1),
        "ticks": renewer.ticks - ticks0,
        "script_calls": len(scripts),
        "lost": len(lost),
        "still_held_after_window": held,
        "threads_min_max": [min(threads), max(threads)],
        "client_cpu_share_of_a_core": round(cpu / wall, 4),
        "script_call_ms_max": round(max(scripts, default=0) / 1000, 2),
        "script_call_ms_median": round(statistics.median(scripts) / 1000, 2) if scripts else None,
    }


def _shown(value: object) -> object:
    """A table cell: '-' where a short window measured nothing."""
    return "-" if value is None else value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ticks", type=int, default=5, help="ticks per N >= 10,000 (x4 below)")
    parser.add_argument("--window", type=float, default=5.0, help="background window, seconds")
    parser.add_argument("--max-locks", type=int, default=SIZES[-1], help="largest N")
    parser.add_argument("--hold-locks", type=int, default=100_000, help="P4: locks held")
    parser.add_argument("--hold-ttl", type=float, default=30.0, help="P4: their ttl, seconds")
    parser.add_argument("--hold-periods", type=int, default=3, help="P4: renewal periods held")
    parser.add_argument(
        "--only-hold",
        action="store_true",
        help="P4 alone: print its figures, skip the rest and write no results file",
    )
    args = parser.parse_args()
    if args.only_hold:
        with RedisServer() as server:
            print(f"holding {args.hold_locks} locks for {args.hold_periods} renewal periods ...")
            print(hold_benchmark(server, args.hold_locks, args.hold_periods, args.hold_ttl))
        return
    sizes = sorted({min(n, args.max_locks) for n in SIZES})
    started = time.perf_counter()
    with RedisServer() as server:
        print("background renewal windows ...", flush=True)
        windows = {}
        for n in THREAD_SIZES:
            windows[n] = {
                "python-redis-lock (thread per lock)": window_redis_lock(server, n, args.window),
                "celery_redlock (one renewer)": window_celery_redlock(server, n, args.window),
            }
        print("renewal ticks ...", flush=True)
        ticks, acquire_s = tick_benchmark(server, sizes, args.ticks)
        print(f"holding {args.hold_locks} locks for {args.hold_periods} renewal periods ...")
        hold = hold_benchmark(server, args.hold_locks, args.hold_periods, args.hold_ttl)
        version = server.version
    total = round(time.perf_counter() - started, 1)
    report = {
        "benchmark": "renewal cost of N held locks, one local node",
        **environment(),
        "redis_server": f"{version[0]} {'.'.join(map(str, version[1]))}",
        "python_redis_lock": getattr(redis_lock, "__version__", "?"),
        "chunk": CHUNK,
        "notes": [
            "ticks: locks Redlock(ttl=60, auto_renew=False), acquired one by one; "
            "p99 is nearest-rank over the ticks (= max with 5 ticks); "
            "round trips = evalsha/eval calls counted by the server per tick",
            "one call per lock measured at every N (no cap was needed)",
            "renewed (min): fewest leases whose deadline one tick confirmed; below N "
            "means that tick did not renew every lock (the renewer retries them later); "
            "at N > 10,000 the batched tick is also measured with node_timeout=2s, "
            "since the default budget (0.25 s) covers all chunks of one tick",
            "Renewer.renew runs in the calling thread; in production the one "
            "background renewer thread does it, whatever N (see windows.renewal_threads)",
            THREAD_LIMIT_NOTE,
            "python-redis-lock's client gets max_connections=N+10: with redis-py 8's "
            "default pool (100) the 1,000 renewal threads failed with "
            "MaxConnectionsError and the locks expired (first attempt of this benchmark)",
            f"windows: {args.window} s, leases of 3 s; python-redis-lock renews every 2 s "
            "(expire*2/3), celery_redlock every 1 s (ttl/3, its default), so "
            "cpu_us_per_lock_renewal normalises for the frequency "
            "(celery_redlock's count is approximated as N*window/interval)",
        ],
        "acquire_seconds_for_new_locks": acquire_s,
        "ticks": ticks,
        "windows": windows,
        "hold": hold,
        "targets": {
            "P4 locks lost (== 0)": hold["lost"],
            "P4 threads added while holding (== 0)": hold["threads_min_max"][1]
            - hold["threads_min_max"][0],
            "P4 client CPU, share of a core (<= 0.10)": hold["client_cpu_share_of_a_core"],
            "P4 longest script call, ms (<= 10)": hold["script_call_ms_max"],
        },
        "total_seconds": total,
    }
    written = write_report("renewal", report)

    print(f"\nOne renewal tick ({report['redis_server']}, Python {report['python']})")
    print(
        f"{'N':>7}  {'method':<46} {'median ms':>10} {'p99 ms':>9} {'cpu ms':>9} "
        f"{'RTT/tick':>9} {'renewed (min)':>13}"
    )
    for n, methods in ticks.items():
        for name, row in methods.items():
            print(
                f"{n:>7}  {name:<46} {row['median_ms']:>10} {row['p99_ms']:>9} "
                f"{row['cpu_ms_median']:>9} {row['round_trips_per_tick']:>9} "
                f"{row['leases_renewed_per_tick_min']:>13}"
            )
    print(f"\nBackground renewal over {args.window} s, 3 s leases ({THREAD_LIMIT_NOTE})")
    print(
        f"{'N':>7}  {'method':<36} {'threads':>7} {'every s':>7} {'cpu ms':>8} "
        f"{'RTTs':>6} {'cpu µs/lock renewal':>20} {'held after':>10}"
    )
    for n, methods in windows.items():
        for name, row in methods.items():
            cell = {key: _shown(value) for key, value in row.items()}
            print(
                f"{n:>7}  {name:<36} {cell['renewal_threads']:>7} {cell['renew_interval_s']:>7} "
                f"{cell['cpu_ms_window']:>8} {cell['round_trips_window']:>6} "
                f"{cell['cpu_us_per_lock_renewal']:>20} {cell['still_held_after_window']:>10}"
            )
    print(
        f"\nHolding {hold['locks']} locks (ttl {hold['ttl_s']} s) for {hold['window_s']} s: "
        f"{hold['ticks']} ticks, {hold['script_calls']} script calls, lost {hold['lost']}, "
        f"threads {hold['threads_min_max']}, client CPU {hold['client_cpu_share_of_a_core']:.1%} "
        f"of a core, script call max {hold['script_call_ms_max']} ms "
        f"(median {hold['script_call_ms_median']})"
    )
    print(f"\ntotal {total} s; wrote {written}")


if __name__ == "__main__":
    main()
