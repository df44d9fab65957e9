"""How fast a SIGKILLed prefork child's lock is freed by the worker's main process.

Run from the repository root: ``python -m benchmarks.bench_reaper [--trials N]``.
Starts its own redis-server and a real prefork worker (tests/apps/locked.py, lease
30 s), then N times: start a task that holds a lock, SIGKILL the pool child holding
it, and time until the lock key is gone. Without the main process's help the lock
would stay for the whole 30 s lease. Writes ``benchmarks/results/reaper.json``.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import time

from benchmarks.common import environment, write_report
from tests.apps.locked import create_app
from tests.harness import RedisServer, WorkerProcess, holder_pid, lock_keys, wait_for


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=10)
    args = parser.parse_args()
    samples = []
    with RedisServer() as server:
        app = create_app(server.url)
        worker = WorkerProcess(
            "tests.apps.locked",
            pool="prefork",
            concurrency=2,
            redis_url=server.url,
            env={"REDLOCK_TEST_TTL": "30"},
        )
        worker.start()
        try:
            for i in range(args.trials):
                app.tasks["tests.apps.locked.sleeper"].delay(f"victim-{i}", 60)
                pid = wait_for(lambda: holder_pid(server), timeout=20)
                os.kill(pid, signal.SIGKILL)
                killed = time.monotonic()
                wait_for(lambda: not lock_keys(server), timeout=40, interval=0.001)
                samples.append((time.monotonic() - killed) * 1000)
                wait_for(lambda: len(worker.child_pids()) == 2, timeout=20)
        finally:
            worker.stop()
            app.close()
    samples.sort()
    report = {
        "benchmark": "lock release after SIGKILL of the holding prefork child (lease 30 s)",
        **environment(),
        "trials": len(samples),
        "median_ms": round(statistics.median(samples), 1),
        "max_ms": round(samples[-1], 1),
        "samples_ms": [round(s, 1) for s in samples],
        "target": "within 1 s (DESIGN: at once)",
    }
    write_report("reaper", report)
    print(
        f"released after SIGKILL: median {report['median_ms']} ms, max {report['max_ms']} ms "
        f"over {len(samples)} kills (lease 30 s)"
    )


if __name__ == "__main__":
    main()
