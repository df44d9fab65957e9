"""What every benchmark script shares: timing, the environment stamp, the results file."""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import redis

import celery_redlock

#: Environment variable naming another results directory (``--quick`` runs use one, so a
#: smoke run never overwrites the published figures).
RESULTS_ENV = "CELERY_REDLOCK_BENCH_RESULTS"
RESULTS = Path(os.environ.get(RESULTS_ENV) or Path(__file__).parent / "results")


def environment() -> dict[str, Any]:
    """Date, machine and versions, stamped into every results file."""
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "celery_redlock": celery_redlock.__version__,
        "redis_py": redis.__version__,
        # Other jobs share the machine: the 1, 5 and 15 minute load when the run began.
        "loadavg": [round(x, 2) for x in os.getloadavg()],
    }


def server_label(version: tuple[str, tuple[int, ...]]) -> str:
    """``RedisServer.version`` as the results files show it: ``"redis 7.0.15"``."""
    return f"{version[0]} {'.'.join(map(str, version[1]))}"


def measure_us(fn: Callable[[], object], ops: int) -> list[float]:
    """Run ``fn`` ``ops`` times; each call's duration in microseconds."""
    samples = []
    for _ in range(ops):
        start = time.perf_counter_ns()
        fn()
        samples.append((time.perf_counter_ns() - start) / 1000)
    return samples


def write_report(name: str, report: dict[str, Any]) -> Path:
    """Write ``benchmarks/results/<name>.json``."""
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    return path
