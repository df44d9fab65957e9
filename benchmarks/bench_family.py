"""The lock family, uncontended, one node: what a share, a slot, two resources or fair
waiting cost over a plain exclusive lock, against redis-py's Lock.

Run from the repository root: ``python -m benchmarks.bench_family [--ops N] [--runs R]``.
Starts its own redis-server, measures every variant on the same server in interleaved
runs, and writes ``benchmarks/results/family.json``.

redis-py's ``Lock`` is the only Python peer, and it has no shared, limited, multi-key or
fair variant: it is the baseline each row is compared with. Target (ours): a share, a
slot and a fair acquisition within 1.5x of our exclusive lock, two resources within 2x
(one script call either way; the extra cost is server-side work and key count).
"""

from __future__ import annotations

import argparse

import redis

from benchmarks.common import environment, interleaved_latency, server_label, write_report
from celery_redlock import Redlock
from tests.harness import RedisServer


def variants(url: str) -> dict:
    client = redis.Redis.from_url(url)
    locks = {
        "exclusive": Redlock("bench:x", nodes=[url], ttl=30),
        "shared": Redlock("bench:s", nodes=[url], ttl=30, mode="shared"),
        "limit=3": Redlock("bench:l", nodes=[url], ttl=30, limit=3),
        "two resources": Redlock(["bench:a", "bench:b"], nodes=[url], ttl=30),
        "fair": Redlock("bench:f", nodes=[url], ttl=30, fair=True),
    }

    def cycle(lock: Redlock):
        def run() -> None:
            lock.acquire()
            lock.release()

        return run

    def redis_py() -> None:
        lock = client.lock("bench:redis-py", timeout=30)
        lock.acquire()
        lock.release()

    return {**{name: cycle(lock) for name, lock in locks.items()}, "redis-py Lock": redis_py}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", type=int, default=2000, help="operations per run")
    parser.add_argument("--runs", type=int, default=5, help="interleaved runs per variant")
    args = parser.parse_args()
    with RedisServer() as server:
        rows = interleaved_latency(variants(server.url), args.ops, args.runs)
        version = server.version
    exclusive = rows["exclusive"]["median_us"]
    base = rows["redis-py Lock"]["median_us"]
    for row in rows.values():
        row["vs_exclusive"] = round(row["median_us"] / exclusive, 2)
        row["vs_redis_py"] = round(row["median_us"] / base, 2)
    limits = {"shared": 1.5, "limit=3": 1.5, "fair": 1.5, "two resources": 2.0}
    report = {
        "benchmark": "lock family, uncontended acquire + release, one node",
        **environment(),
        "redis_server": server_label(version),
        "ops_per_run": args.ops,
        "runs": args.runs,
        "results": rows,
        "targets": {
            f"{name} vs exclusive (<= {limit})": rows[name]["vs_exclusive"] <= limit
            for name, limit in limits.items()
        },
    }
    path = write_report("family", report)
    print(f"{'variant':<16}{'median µs':>11}{'p99 µs':>9}{'vs excl.':>10}{'vs redis-py':>13}")
    for name, row in rows.items():
        print(
            f"{name:<16}{row['median_us']:>11}{row['p99_us']:>9}"
            f"{row['vs_exclusive']:>10}{row['vs_redis_py']:>13}"
        )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
