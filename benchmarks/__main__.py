"""Every benchmark in turn, then the plots: ``python -m benchmarks``.

Run from the repository root (``pip install -e '.[benchmarks]'`` first)::

    python -m benchmarks                      # everything: about 13 minutes on 2 cores
    python -m benchmarks --only celery,redis_cost
    python -m benchmarks --quick              # seconds per benchmark, a smoke run
    python -m benchmarks --render-docs        # only docs/benchmarks.md and README's table

Each benchmark runs as its own ``python -m benchmarks.bench_<name>`` process (each
starts its own redis-server processes) and writes ``benchmarks/results/<name>.json``;
then :mod:`benchmarks.plot` draws ``docs/img/bench-<name>.png`` from them. ``--results
DIR`` puts results and plots in DIR instead; ``--quick`` uses the smallest
configurations and always writes elsewhere (DIR, or a new temporary directory), never
over the published figures.

Last, :mod:`benchmarks.render` writes ``docs/benchmarks.md`` and README's headline table
from the published results (a run with ``--results`` or ``--quick`` writes its page
beside its results instead), so the documentation always shows the results files;
``--render-docs`` does only that, from the files already there.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import plot, render
from benchmarks.common import RESULTS, RESULTS_ENV, issue_targets

ROOT = Path(__file__).resolve().parents[1]

#: name -> the arguments of its --quick run (the full run uses each script's defaults).
BENCHMARKS: dict[str, list[str]] = {
    "latency": ["--ops", "100", "--runs", "1"],
    "handoff": ["--handoffs", "5", "--runs", "1"],
    "redlock": ["--ops", "50", "--runs", "1", "--nodes", "1,3"],
    "contention": ["--duration", "0.3", "--runs", "1", "--threads", "1,4", "--procs", "2"],
    "renewal": [
        *("--ticks", "1", "--window", "1", "--max-locks", "1000"),
        *("--hold-locks", "1000", "--hold-ttl", "1.5", "--hold-periods", "2"),
    ],
    "processes": [
        *("--procs", "2", "--threads", "2", "--duration", "0.5"),
        *("--p8-procs", "2", "--p8-holds", "0", "--p8-duration", "0.3", "--p8-runs", "1"),
    ],
    "reaper": ["--trials", "1"],
    "celery": ["--tasks", "30", "--runs", "1"],
    "redis_cost": ["--ops", "30", "--batch", "30"],
    "family": ["--ops", "50", "--runs", "1"],
    "memory": ["--keys", "2000"],
    "rate": [
        *("--calls", "12", "--runs", "1"),
        *("--tasks", "30", "--cost-runs", "1", "--count-tasks", "30"),
    ],
    "slow_node": ["--duration", "0.5", "--runs", "1"],
    "backlog": ["--sizes", "20", "--rates", "50"],
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smallest configurations")
    parser.add_argument("--only", help=f"comma-separated subset of {','.join(BENCHMARKS)}")
    parser.add_argument("--results", type=Path, help="results and plots here instead")
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument(
        "--render-docs",
        action="store_true",
        help="only write docs/benchmarks.md and README's table from the results files",
    )
    args = parser.parse_args(argv)
    if args.render_docs:
        source = args.results or RESULTS
        for path in render.write_docs(
            source, readme=render.README if args.results is None else None
        ):
            print(f"wrote {path}")
        return 0
    names = args.only.split(",") if args.only else list(BENCHMARKS)
    unknown = sorted(set(names) - set(BENCHMARKS))
    if unknown:
        parser.error(f"unknown benchmark(s): {', '.join(unknown)}")
    results = args.results
    if results is None and args.quick:
        results = Path(tempfile.mkdtemp(prefix="bench-quick-"))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    if results is not None:
        results.mkdir(parents=True, exist_ok=True)
        env[RESULTS_ENV] = str(results)
    failed = []
    for name in names:
        command = [sys.executable, "-m", f"benchmarks.bench_{name}"]
        command += BENCHMARKS[name] if args.quick else []
        print(f"\n=== {' '.join(command[1:])}", flush=True)
        started = time.monotonic()
        code = subprocess.call(command, cwd=ROOT, env=env)
        print(f"=== {name}: exit {code} after {time.monotonic() - started:.0f} s", flush=True)
        if code:
            failed.append(name)
    plotted = [name for name in names if name in plot.PLOTS]
    if plotted and not args.no_plots:
        plot_args = ["--only", ",".join(plotted)]
        if results is not None:  # plots beside those results, not over the published ones
            plot_args += ["--results", str(results), "--out", str(results)]
        plot.main(plot_args)
    print("\n=== performance targets, from the results files")
    for name, label, value, verdict in issue_targets(results or RESULTS):
        shown = {k: v for k, v in value.items() if k != "met"} if isinstance(value, dict) else value
        print(f"{verdict.upper():>8}  {label}: {shown}  [{name}]")
    if results is None:
        written = render.write_docs(RESULTS)
    else:  # a partial or smoke run: its page beside its results, the published one kept
        written = render.write_docs(results, page=results / "benchmarks.md", readme=None)
    print("wrote " + ", ".join(str(path) for path in written))
    if results is not None:
        print(f"results in {results}")
    if failed:
        print(f"FAILED: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
