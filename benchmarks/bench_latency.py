"""Uncontended acquire + release latency on one node, against the peers, in one run.

Run from the repository root: ``python -m benchmarks.bench_latency [--ops N] [--runs R]``.
Starts its own redis-server (through the test harness), measures every lock on the
same server in interleaved runs, and writes ``benchmarks/results/latency.json``.

Peers: redis-py's ``redis.lock.Lock`` (SET NX PX + a Lua release) and the WATCH /
MULTI / EXEC lock that the seed articles start from. Target: celery_redlock at most
1.05x redis-py's Lock and at most 0.5x the WATCH baseline (medians); P1 of the third
performance round (issue 27): at most 1.0x redis-py's Lock.
"""

from __future__ import annotations

import argparse
import uuid

import redis

from benchmarks.common import environment, interleaved_latency, write_report
from celery_redlock import Redlock
from tests.harness import RedisServer


class WatchLock:
    """The WATCH/MULTI/EXEC lock of the seed articles: optimistic check-and-set."""

    def __init__(self, client: redis.Redis, name: str, ttl: int = 30) -> None:
        self.client, self.name, self.ttl = client, name, ttl
        self.token = ""

    def acquire(self) -> bool:
        token = uuid.uuid4().hex
        with self.client.pipeline() as pipe:
            try:
                pipe.watch(self.name)
                if pipe.get(self.name) is not None:
                    return False
                pipe.multi()
                pipe.set(self.name, token, ex=self.ttl)
                pipe.execute()
            except redis.WatchError:
                return False
        self.token = token
        return True

    def release(self) -> None:
        with self.client.pipeline() as pipe:
            try:
                pipe.watch(self.name)
                if pipe.get(self.name) == self.token.encode():
                    pipe.multi()
                    pipe.delete(self.name)
                    pipe.execute()
            except redis.WatchError:
                pass

    def extend(self) -> bool:
        """Reset the lease to ``ttl`` if we still hold the lock (the same check-and-set)."""
        with self.client.pipeline() as pipe:
            try:
                pipe.watch(self.name)
                if pipe.get(self.name) != self.token.encode():
                    return False
                pipe.multi()
                pipe.expire(self.name, self.ttl)
                pipe.execute()
            except redis.WatchError:
                return False
        return True


def contenders(url: str) -> dict:
    client = redis.Redis.from_url(url)
    ours = Redlock("bench:ours", nodes=[url], ttl=30)
    ours_plain = Redlock("bench:ours-norenew", nodes=[url], ttl=30, auto_renew=False)
    watch = WatchLock(client, "bench:watch")

    def redis_py() -> None:
        lock = client.lock("bench:redis-py", timeout=30)
        lock.acquire()
        lock.release()

    def celery_redlock_() -> None:
        ours.acquire()
        ours.release()

    def celery_redlock_no_renew() -> None:
        ours_plain.acquire()
        ours_plain.release()

    def watch_multi() -> None:
        watch.acquire()
        watch.release()

    return {
        "celery_redlock": celery_redlock_,
        "celery_redlock (auto_renew=False)": celery_redlock_no_renew,
        "redis-py Lock": redis_py,
        "WATCH/MULTI baseline": watch_multi,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=2000, help="operations per run")
    parser.add_argument("--runs", type=int, default=5, help="interleaved runs per lock")
    args = parser.parse_args()
    with RedisServer() as server:
        rows = interleaved_latency(contenders(server.url), args.ops, args.runs)
        version = server.version
    base = rows["redis-py Lock"]["median_us"]
    watch = rows["WATCH/MULTI baseline"]["median_us"]
    ours = rows["celery_redlock"]["median_us"]
    report = {
        "benchmark": "uncontended acquire + release, one node",
        **environment(),
        "redis_server": f"{version[0]} {'.'.join(map(str, version[1]))}",
        "ops_per_run": args.ops,
        "runs": args.runs,
        "results": rows,
        "targets": {
            "vs redis-py Lock (<= 1.05)": round(ours / base, 3),
            "vs WATCH baseline (<= 0.5)": round(ours / watch, 3),
            # Performance round three (issue 27) asks for parity with redis-py's Lock.
            "P1 celery_redlock (watchdog on) / redis-py Lock, median (<= 1.0)": round(
                ours / base, 3
            ),
        },
    }
    write_report("latency", report)
    width = max(map(len, rows))
    print(f"{'lock':<{width}}  median µs   p99 µs")
    for name, row in rows.items():
        print(f"{name:<{width}}  {row['median_us']:>9}  {row['p99_us']:>7}")
    for target, ratio in report["targets"].items():
        print(f"{target}: {ratio}")


if __name__ == "__main__":
    main()
