"""Redis memory left behind by N distinct keys, against the peers (issue 28).

Run from the repository root: ``python -m benchmarks.bench_memory [--keys N]``. Starts
its own redis-server (through the test harness) and writes
``benchmarks/results/memory.json``.

For each lock, on the same server emptied in between: take ``--keys`` distinct names
with a 1 s lease and release each, then read ``DBSIZE`` and ``INFO memory``
``used_memory`` (less the empty server's, its scripts loaded) at once, and again
once our horizon has passed (the fence counters' ``FENCE_HORIZON_LEASES`` leases, at
least ``FENCE_HORIZON_MIN`` seconds, plus a second). Peers: redis-py ``Lock`` and
python-redis-lock, whose releases delete their keys (python-redis-lock's signal list
expires after a second).

Target (issue 28): once the horizon has passed, ours leaves no more than theirs.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from importlib.metadata import version as dist_version
from typing import Any

import redis
import redis_lock

from benchmarks.common import environment, server_label, write_report
from celery_redlock import Redlock
from celery_redlock.engine.keys import FENCE_HORIZON_LEASES, FENCE_HORIZON_MIN
from tests.harness import RedisServer

TTL = 1.0
HORIZON = max(FENCE_HORIZON_LEASES * TTL, FENCE_HORIZON_MIN)


def take_and_release(url: str, client: redis.Redis) -> dict[str, Callable[[str], None]]:
    """name -> one acquire and release of a distinct key, for each lock."""

    def ours(name: str) -> None:
        lock = Redlock(name, nodes=[url], ttl=TTL, auto_renew=False)
        if not lock.acquire(blocking=False):
            raise RuntimeError(f"celery_redlock: {name} busy")
        lock.release()

    def redis_py(name: str) -> None:
        lock = client.lock(name, timeout=TTL)
        if not lock.acquire(blocking=False):
            raise RuntimeError(f"redis-py: {name} busy")
        lock.release()

    def python_redis_lock(name: str) -> None:
        lock = redis_lock.Lock(client, name, expire=int(TTL))
        if not lock.acquire(blocking=False):
            raise RuntimeError(f"python-redis-lock: {name} busy")
        lock.release()

    return {"celery_redlock": ours, "redis-py": redis_py, "python-redis-lock": python_redis_lock}


def used_memory(client: redis.Redis) -> int:
    return int(client.info("memory")["used_memory"])


def measure(server: RedisServer, keys: int) -> dict[str, Any]:
    client = server.client()
    rows: dict[str, Any] = {}
    for name, once in take_and_release(server.url, client).items():
        # One acquisition first: its scripts are loaded (memory the server keeps,
        # whatever the number of keys), then every key goes (FLUSHALL keeps scripts).
        once("bench-memory:warm-up")
        client.flushall()
        baseline = used_memory(client)
        began = time.monotonic()
        for n in range(keys):
            once(f"bench-memory:{n}")
        took = time.monotonic() - began
        at_once = {"keys": client.dbsize(), "bytes": used_memory(client) - baseline}
        deadline = time.monotonic() + HORIZON + 1.0
        while client.dbsize() and time.monotonic() < deadline:
            time.sleep(0.1)  # expiry is the server's: poll it until the horizon
        after = {"keys": client.dbsize(), "bytes": used_memory(client) - baseline}
        rows[name] = {"seconds": round(took, 2), "at_once": at_once, "after_horizon": after}
        print(
            f"{name:18} {keys} keys in {took:.1f}s: left {at_once['keys']} keys "
            f"({at_once['bytes'] / 1e6:.2f} MB) at once, {after['keys']} keys "
            f"({after['bytes'] / 1e6:.2f} MB) after {HORIZON:g}s"
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=100_000)
    args = parser.parse_args(argv)
    with RedisServer() as server:
        rows = measure(server, args.keys)
        label = server_label(server.version)
    ours = rows["celery_redlock"]["after_horizon"]
    worst_peer = min(
        (rows[p]["after_horizon"] for p in ("redis-py", "python-redis-lock")),
        key=lambda r: r["keys"],
    )
    least_bytes = min(rows[p]["after_horizon"]["bytes"] for p in ("redis-py", "python-redis-lock"))
    targets = {
        f"P28 keys left after the horizon, {args.keys:,} distinct keys, ours minus the "
        "fewest a peer left (<= 0)": ours["keys"] - worst_peer["keys"],
        # used_memory moves by a few KB with allocator bookkeeping: 64 KiB of slack
        f"P28 bytes left after the horizon, {args.keys:,} distinct keys, ours minus the "
        "least a peer left (<= 65536)": ours["bytes"] - least_bytes,
    }
    write_report(
        "memory",
        {
            "environment": {
                **environment(),
                "server": label,
                "python_redis_lock": dist_version("python-redis-lock"),
            },
            "keys": args.keys,
            "ttl": TTL,
            "horizon": HORIZON,
            "results": rows,
            "targets": targets,
        },
    )
    for target, value in targets.items():
        print(f"{target}: {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
