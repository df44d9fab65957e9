"""Cost of one renewal tick on a 3-master Redis Cluster vs one plain Redis node.

Run from the repository root: ``python -m benchmarks.bench_cluster [--ticks T] [--sizes N...]``.
Starts its own servers (through the test harness: a 3-master cluster and one plain
node) and writes ``benchmarks/results/cluster.json``.

For each N, N locks are held (``Redlock(ttl=60, auto_renew=False)``, acquired one by
one) on the cluster and, separately, on the plain node; then ``Renewer().renew(leases)``
renews all N in one tick, ``--ticks`` times after one warm-up tick (which loads the
script). Measured per tick: wall time, the ``renew_many`` calls each server ran
(``INFO commandstats``) and whether every lease was confirmed (a tick that overruns
its budget leaves leases unconfirmed). Redis Cluster refuses a script whose keys span
slots, so on the cluster ``renew_many`` is one call per slot (almost one per lock),
pipelined per master; on one node it is one call per 1,000 locks.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from benchmarks.common import environment, write_report
from celery_redlock import Redlock
from celery_redlock.engine.lease import CHUNK
from celery_redlock.engine.renewal import CHUNK_BUDGET, Renewer
from tests.harness import RedisServer
from tests.harness.cluster import RedisCluster


def run(url: str, servers: list[RedisServer], n: int, ticks: int, prefix: str) -> dict:
    """Hold ``n`` locks on ``url`` and time ``ticks`` renewal ticks."""
    locks = [Redlock(f"{prefix}{i}", nodes=[url], ttl=60, auto_renew=False) for i in range(n)]
    for lock in locks:
        assert lock.acquire(blocking=False)
    leases = [lock.lease for lock in locks]
    renewer = Renewer()
    renewer.renew(leases)  # warm-up: SCRIPT LOAD on every server
    for server in servers:
        server.reset_stats()
    walls, unconfirmed = [], 0
    for _ in range(ticks):
        before = [lease.deadline for lease in leases]
        start = time.perf_counter()
        renewer.renew(leases)
        walls.append(time.perf_counter() - start)
        unconfirmed += sum(
            1 for lease, old in zip(leases, before, strict=True) if lease.deadline <= old
        )
    calls = [server.commandstats().get("evalsha", 0) / ticks for server in servers]
    for lock in locks:
        lock.release()
    chunks = -(-n // CHUNK)
    return {
        "locks": n,
        "tick_s": {
            "median": round(statistics.median(walls), 4),
            "min": round(min(walls), 4),
            "max": round(max(walls), 4),
        },
        "budget_s": round(leases[0].nodeset.timeout + CHUNK_BUDGET * (chunks - 1), 4),
        "renew_many_calls_per_tick_per_server": calls,
        "leases_unconfirmed": unconfirmed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ticks", type=int, default=5)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000, 20000])
    options = parser.parse_args()
    results = []
    with RedisCluster(tempfile.mkdtemp(prefix="bench-cluster-")) as cluster, RedisServer() as plain:
        for n in options.sizes:
            for kind, url, servers in (
                ("cluster", cluster.url(), cluster.masters),
                ("plain", plain.url, [plain]),
            ):
                row = {"topology": kind, **run(url, servers, n, options.ticks, f"{kind}{n}-")}
                results.append(row)
                print(row, flush=True)
    path = write_report(
        "cluster", {"environment": environment(), "ticks": options.ticks, "results": results}
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
