"""The soak: every reliability scenario again and again, with larger counts, for N minutes.

    python -m tests.reliability.soak --minutes 10

Each round runs every scenario once, each in a fresh set of redis-server processes;
rounds repeat until the time is up (a round that started always finishes). The report
(acquisitions, faults injected by kind, violations, which must be zero, durations)
goes to ``benchmarks/results/soak.json`` and, as a table, between the soak markers of
``docs/reliability.md``. The exit status is 1 if any violation or failed expectation
was seen.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common import environment, write_report
from tests.harness.servers import used_binaries
from tests.reliability import scenarios
from tests.reliability.celery_scenario import celery_faults
from tests.reliability.workload import Lab, Outcome

DOC = Path(__file__).resolve().parents[2] / "docs" / "reliability.md"
BEGIN, END = "<!-- soak:begin -->", "<!-- soak:end -->"

#: Stats whose figures are reported (min / median / max over the runs), in ms, and
#: Jain's index across processes (x 1000) of the threads x processes scenarios. The
#: frozen waiters' longest time the lock went unused during a freeze is also a
#: ``held-up`` violation past its bound; holds below a quorum are violations.
TIMINGS = (
    "child_kill_release_ms",
    "worker_kill_release_ms",
    "jain_processes_x1000",
    "freeze_gap_max_ms",
)


def soak_scenarios(root: Path) -> list[tuple[str, Callable[[Lab], Outcome]]]:
    """The soak's scenarios, with the counts of a long run."""
    return [
        ("contention, 1 node, 8 processes", lambda lab: scenarios.contention(lab, 1, 8, 200)),
        ("contention, 5 nodes, 8 processes", lambda lab: scenarios.contention(lab, 5, 8, 100)),
        (
            "threads x processes, 1 node, 4 x 4",
            lambda lab: scenarios.mixed(lab, 1, processes=4, threads=4, iterations=50),
        ),
        (
            "threads x processes, 3 nodes, 3 x 3",
            lambda lab: scenarios.mixed(lab, 3, processes=3, threads=3, iterations=50),
        ),
        (
            "asyncio tasks x processes, 3 nodes, 3 x 3",
            lambda lab: scenarios.mixed(lab, 3, processes=3, threads=3, iterations=50, aio=True),
        ),
        ("SIGKILL 1 of 3 nodes", lambda lab: scenarios.node_kill(lab, 3, 1, 6, rounds=3)),
        ("SIGKILL 2 of 5 nodes", lambda lab: scenarios.node_kill(lab, 5, 2, 6, rounds=3)),
        ("2 of 3 nodes down", scenarios.majority_down),
        (
            "restart without persistence, delayed",
            lambda lab: scenarios.restart_without_persistence(lab, delayed=True),
        ),
        ("network delay and blackhole", lambda lab: scenarios.network(lab, 6, rounds=3)),
        (
            "network delay and blackhole, asyncio 6 x 2",
            lambda lab: scenarios.network(lab, 6, rounds=3, aio=True, threads=2),
        ),
        ("SIGSTOP holder, 1 node", lambda lab: scenarios.process_pause(lab, 1)),
        ("SIGSTOP holder, 3 nodes", lambda lab: scenarios.process_pause(lab, 3)),
        ("wall clock jumps", lambda lab: scenarios.wall_clock_jump(lab, renewals=10)),
        (
            "frozen waiters, 1 node, 4 x 4, ttl 2 s",
            lambda lab: scenarios.frozen_waiters(lab, 4, 4, ttl=2.0, freezes=8),
        ),
        (
            "moving slow nodes, 3 nodes, threads 3 x 4",
            lambda lab: scenarios.moving_slow_nodes(lab, 3, 4, seconds=45.0, hold=0.5),
        ),
        (
            "moving slow nodes, 3 nodes, asyncio 3 x 4",
            lambda lab: scenarios.moving_slow_nodes(lab, 3, 4, aio=True, seconds=45.0, hold=0.5),
        ),
        *(
            (
                f"1 of 3 nodes {fault}, {'asyncio' if aio else 'threads'} x 4, {keys}",
                lambda lab, fault=fault, aio=aio, keys=keys: scenarios.slow_node(
                    lab, fault, aio=aio, distinct_keys=keys == "a key each", seconds=5.0
                ),
            )
            for fault in ("slow", "blackhole")
            for aio in (False, True)
            for keys in ("one key", "a key each")
        ),
        ("celery workers", lambda lab: celery_faults(lab, root / "celery-logs", tasks=50)),
    ]


class Tally:
    """Totals of one scenario over the rounds."""

    def __init__(self) -> None:
        self.runs = 0
        self.acquisitions = 0
        self.faults: Counter[str] = Counter()
        self.violations: list[dict[str, Any]] = []
        self.failures: list[str] = []
        self.seconds = 0.0
        self.timings: dict[str, list[int]] = {}

    def add(self, outcome: Outcome) -> None:
        self.runs += 1
        self.acquisitions += outcome.acquisitions
        self.faults.update(outcome.faults)
        self.violations += [v.__dict__ for v in outcome.violations]
        self.seconds += outcome.duration
        for name in TIMINGS:
            if name in outcome.stats:
                self.timings.setdefault(name, []).append(int(outcome.stats[name]))

    def as_dict(self) -> dict[str, Any]:
        return {
            "runs": self.runs,
            "acquisitions": self.acquisitions,
            "faults": dict(sorted(self.faults.items())),
            "violations": self.violations,
            "failures": self.failures,
            "seconds": round(self.seconds, 1),
            "timings_ms": {
                name: {"min": min(v), "median": sorted(v)[len(v) // 2], "max": max(v)}
                for name, v in self.timings.items()
            },
        }


def run(minutes: float) -> dict[str, Any]:
    """Loop over the scenarios until ``minutes`` have passed; return the report."""
    root = Path(tempfile.mkdtemp(prefix="redlock-soak-"))
    tallies: dict[str, Tally] = {}
    began = time.monotonic()
    stop_at = began + minutes * 60
    rounds = 0
    while time.monotonic() < stop_at or rounds == 0:
        rounds += 1
        for label, scenario in soak_scenarios(root):
            tally = tallies.setdefault(label, Tally())
            lab = Lab(root / f"round-{rounds}")
            started = time.monotonic()
            try:
                outcome = scenario(lab)
                outcome.duration = outcome.duration or time.monotonic() - started
                tally.add(outcome)
            except Exception:
                tally.runs += 1
                tally.failures.append(traceback.format_exc(limit=3))
            finally:
                lab.close()
            print(f"round {rounds}: {label}: {time.monotonic() - started:.1f}s", flush=True)
    totals = {
        "rounds": rounds,
        "minutes": round((time.monotonic() - began) / 60, 1),
        "acquisitions": sum(t.acquisitions for t in tallies.values()),
        "faults": sum(sum(t.faults.values()) for t in tallies.values()),
        "violations": sum(len(t.violations) for t in tallies.values()),
        "failures": sum(len(t.failures) for t in tallies.values()),
    }
    return {
        "environment": {**environment(), "redis_server": used_binaries()},
        "command": f"python -m tests.reliability.soak --minutes {minutes:g}",
        "totals": totals,
        "scenarios": {label: tally.as_dict() for label, tally in tallies.items()},
    }


def markdown(report: dict[str, Any]) -> str:
    """The report as the table of docs/reliability.md."""
    totals = report["totals"]
    env = report["environment"]
    lines = [
        f"`{report['command']}`, {env['date']}, {env['cpus']} CPUs, Python {env['python']}: "
        f"{totals['rounds']} rounds in {totals['minutes']} min, "
        f"**{totals['acquisitions']:,} acquisitions, {totals['faults']:,} faults injected, "
        f"{totals['violations']} violations, {totals['failures']} failed expectations**.",
        "",
        "| scenario | runs | acquisitions | faults injected | violations | seconds |",
        "|---|---:|---:|---|---:|---:|",
    ]
    for label, s in report["scenarios"].items():
        faults = ", ".join(f"{kind} {n}" for kind, n in s["faults"].items()) or "—"
        bad = len(s["violations"]) + len(s["failures"])
        lines.append(
            f"| {label} | {s['runs']} | {s['acquisitions']:,} | {faults} | {bad} | {s['seconds']} |"
        )
    for label, s in report["scenarios"].items():
        for name, t in s["timings_ms"].items():
            lines.append("")
            if name == "jain_processes_x1000":
                lines.append(
                    f"{label}: Jain's index across processes: min {t['min'] / 1000:.3f}, "
                    f"median {t['median'] / 1000:.3f} over {s['runs']} runs."
                )
                continue
            what = name.removesuffix("_ms").replace("_", " ")
            lines.append(
                f"{label}: {what}: min {t['min']} ms, median {t['median']} ms, "
                f"max {t['max']} ms over {s['runs']} runs."
            )
    return "\n".join(lines) + "\n"


def update_doc(report: dict[str, Any], doc: Path = DOC) -> None:
    """Replace the text between the soak markers of ``doc`` with the report's table."""
    text = doc.read_text()
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    doc.write_text(f"{head}{BEGIN}\n{markdown(report)}{END}{tail}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="how long to loop")
    parser.add_argument("--no-doc", action="store_true", help="do not update the docs table")
    args = parser.parse_args(argv)
    # Losses and failed renewals are the point of the fault scenarios; the checker and
    # the expectations judge them, so the library's own alarms would only be noise.
    logging.getLogger("celery_redlock").setLevel(logging.CRITICAL)
    report = run(args.minutes)
    path = write_report("soak", report)
    if not args.no_doc:
        update_doc(report)
    print(json.dumps(report["totals"]), f"-> {path}")
    return 1 if report["totals"]["violations"] or report["totals"]["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
