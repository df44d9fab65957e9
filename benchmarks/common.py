"""What every benchmark script shares: timing, the environment stamp, the results file."""

from __future__ import annotations

import json
import os
import platform
import re
import statistics
import subprocess
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


def source_state() -> dict[str, Any]:
    """The commit measured, and the package's files that differ from it (uncommitted)."""
    root = Path(__file__).resolve().parents[1]

    def git(*args: str) -> str:
        command = ["git", *args]
        done = subprocess.run(command, cwd=root, capture_output=True, text=True, check=False)
        return done.stdout if done.returncode == 0 else ""

    changed = git("status", "--porcelain", "--", "celery_redlock")
    return {
        "commit": git("rev-parse", "--short", "HEAD").strip() or None,
        "uncommitted": [line[3:] for line in changed.splitlines()],
    }


def server_label(version: tuple[str, tuple[int, ...]]) -> str:
    """``RedisServer.version`` as the results files show it: ``"redis 7.0.15"``."""
    return f"{version[0]} {'.'.join(map(str, version[1]))}"


def redis_cpu_seconds(client: redis.Redis) -> float:
    """User + system CPU seconds the server of ``client`` has used (``INFO cpu``)."""
    used = client.info("cpu")
    return float(used["used_cpu_user"]) + float(used["used_cpu_sys"])


def measure_us(fn: Callable[[], object], ops: int) -> list[float]:
    """Run ``fn`` ``ops`` times; each call's duration in microseconds."""
    samples = []
    for _ in range(ops):
        start = time.perf_counter_ns()
        fn()
        samples.append((time.perf_counter_ns() - start) / 1000)
    return samples


def interleaved_latency(
    fns: dict[str, Callable[[], object]], ops: int, runs: int
) -> dict[str, dict[str, Any]]:
    """Warm each ``fn`` up, then time ``runs`` interleaved rounds of ``ops`` calls each.

    Returns per name: ``median_us``, ``p99_us`` over every call, and ``run_medians_us``.
    Interleaving spreads a noisy moment of a shared machine over every contender.
    """
    for fn in fns.values():  # warm connections and script caches
        measure_us(fn, 200)
    samples: dict[str, list[float]] = {name: [] for name in fns}
    medians: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(runs):
        for name, fn in fns.items():
            run = measure_us(fn, ops)
            samples[name].extend(run)
            medians[name].append(statistics.median(run))
    rows = {}
    for name, values in samples.items():
        values.sort()
        rows[name] = {
            "median_us": round(statistics.median(values), 1),
            "p99_us": round(values[int(len(values) * 0.99) - 1], 1),
            "run_medians_us": [round(m, 1) for m in medians[name]],
        }
    return rows


def write_report(name: str, report: dict[str, Any]) -> Path:
    """Write ``benchmarks/results/<name>.json``."""
    path = RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    return path


_BOUND = re.compile(r"\((<=|>=|==|<|>) ([0-9.]+)\)")


def verdict(label: str, value: Any) -> str:
    """ "met" or "missed" for one target of a report, "reported" if it sets no bound.

    A label states its bound, e.g. ``"... (>= 1.2)"``; a value may be a number, a dict
    saying ``"met"`` itself (a cell with several bounds), or ``"k of n"`` (every one of
    ``n`` runs must meet it).
    """
    if isinstance(value, dict):
        return "met" if value.get("met") else "missed"
    if isinstance(value, str) and " of " in value:
        done, total = value.split(" of ")
        return "met" if done == total else "missed"
    bound = _BOUND.search(label)
    if bound is None or not isinstance(value, int | float):
        return "reported"
    op, limit = bound.group(1), float(bound.group(2))
    ok = {
        "<=": value <= limit,
        ">=": value >= limit,
        "==": value == limit,
        "<": value < limit,
        ">": value > limit,
    }[op]
    return "met" if ok else "missed"


def issue_targets(results: Path) -> list[tuple[str, str, Any, str]]:
    """(benchmark, target, value, verdict) for every "P<n>" target (the performance
    issue's) and every "Issue <n>: ..." target (another issue's) in ``results``."""
    rows = []
    for path in sorted(results.glob("*.json")):
        targets = json.loads(path.read_text()).get("targets", {})
        for label, value in targets.items():
            if label.startswith(("P", "Issue ")):
                rows.append((path.stem, label, value, verdict(label, value)))
    return sorted(rows, key=lambda row: row[1])
