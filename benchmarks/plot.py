"""PNG plots of the benchmark results, for the README.

Run from the repository root: ``python -m benchmarks.plot [--results DIR] [--out DIR]``.
Reads ``benchmarks/results/*.json`` and writes one PNG per results file found to
``docs/img/bench-<name>.png`` (a missing results file is reported and skipped). Every
plot carries the date, Python, Redis and load average of its run in a footer.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from benchmarks.common import RESULTS

OUT = Path(__file__).resolve().parents[1] / "docs" / "img"
OURS = "celery_redlock"
COLORS = {
    f"{OURS} (fair)": "tab:cyan",
    OURS: "tab:blue",
    "redis-py Lock": "tab:orange",
    "python-redis-lock": "tab:green",
    "pottery": "tab:red",
    "WATCH/MULTI baseline": "tab:gray",
}


def color(name: str) -> str:
    """Ours in blue, each peer always in its own colour."""
    for prefix, value in COLORS.items():
        if name.startswith(prefix):
            return value
    return "tab:purple"


def footer(fig: Figure, report: dict[str, Any]) -> None:
    load = report.get("loadavg")
    text = (
        f"{report.get('date', '?')} · {report.get('machine', '?')} · {report.get('cpus', '?')} CPUs"
        f" · Python {report.get('python', '?')} · {report.get('redis_server', '?')}"
        f" · redis-py {report.get('redis_py', '?')}" + (f" · load {load[0]}" if load else "")
    )
    fig.get_layout_engine().set(rect=(0, 0.04, 1, 0.96))  # room for the footer
    fig.text(0.01, 0.005, text, fontsize=7, color="dimgray")


def bars(ax: Axes, names: list[str], values: list[float], highs: list[float] | None) -> None:
    """Horizontal bars (first name on top), with a marker at ``highs`` (p99 or max)."""
    ys = range(len(names))[::-1]
    ax.barh(list(ys), values, color=[color(n) for n in names])
    if highs is not None:
        ax.scatter(highs, list(ys), marker="|", s=200, color="black", zorder=3)
    ax.set_yticks(list(ys), names)


def latency_bars(report: dict[str, Any], fig: Figure, title: str) -> None:
    ax = fig.subplots()
    rows = report["results"]
    names = list(rows)
    bars(ax, names, [rows[n]["median_us"] for n in names], [rows[n]["p99_us"] for n in names])
    ax.set_xlabel("acquire + release, µs (bar: median, tick: p99)")
    ax.set_title(title)


def plot_latency(report: dict[str, Any], fig: Figure) -> None:
    latency_bars(report, fig, "Uncontended acquire + release, one node (lower is better)")


def plot_family(report: dict[str, Any], fig: Figure) -> None:
    latency_bars(report, fig, "The lock family, uncontended, one node (lower is better)")


def plot_contention(report: dict[str, Any], fig: Figure) -> None:
    rows = report["results"]
    holds = sorted({r["hold_ms"] for r in rows})
    axes = fig.subplots(1, len(holds), sharey=True, squeeze=False)[0]
    for ax, hold in zip(axes, holds, strict=True):
        for lock in dict.fromkeys(r["lock"] for r in rows):
            for mode, style in (("threads", "-o"), ("processes", "--s")):
                cells = sorted(
                    (r for r in rows if (r["lock"], r["mode"], r["hold_ms"]) == (lock, mode, hold)),
                    key=lambda r: r["clients"],
                )
                if cells:
                    ax.plot(
                        [r["clients"] for r in cells],
                        [r["total_per_s"] for r in cells],
                        style,
                        color=color(lock),
                        label=f"{lock} ({mode})",
                    )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("clients")
        ax.set_title(f"hold {hold:g} ms")
    axes[0].set_ylabel("acquisitions per second, all clients")
    axes[-1].legend(fontsize=7)
    fig.suptitle("Contended throughput on one lock (higher is better)")


def plot_redlock(report: dict[str, Any], fig: Figure) -> None:
    ax = fig.subplots()
    rows = report["results"]
    for lock in dict.fromkeys(r["lock"] for r in rows):
        cells = sorted((r for r in rows if r["lock"] == lock), key=lambda r: r["nodes"])
        nodes = [r["nodes"] for r in cells]
        ax.plot(nodes, [r["median_us"] for r in cells], "-o", color=color(lock), label=lock)
        ax.plot(nodes, [r["p99_us"] for r in cells], ":", color=color(lock), label=f"{lock} p99")
    ax.set_yscale("log")
    ax.set_xticks(sorted({r["nodes"] for r in rows}))
    ax.set_xlabel("Redis nodes")
    ax.set_ylabel("acquire + release, µs (median; dotted p99)")
    ax.set_title("Redlock: latency against the number of nodes (lower is better)")
    ax.legend(fontsize=8)


def plot_renewal(report: dict[str, Any], fig: Figure) -> None:
    left, right = fig.subplots(1, 2)
    ticks = report["ticks"]
    sizes = sorted(ticks, key=int)
    for method in ("celery_redlock Renewer.renew", "one call per lock (extend)"):
        cells = [(int(n), ticks[n][method]) for n in sizes if method in ticks[n]]
        label = "celery_redlock (one batched tick)" if method.startswith(OURS) else method
        style = color(OURS) if method.startswith(OURS) else "tab:gray"
        left.plot([n for n, _ in cells], [c["median_ms"] for _, c in cells], "-o", color=style)
        right.plot(
            [n for n, _ in cells],
            [c["round_trips_per_tick"] for _, c in cells],
            "-o",
            color=style,
            label=label,
        )
    for ax in (left, right):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("held locks")
    left.set_ylabel("time to renew them all, ms (median)")
    right.set_ylabel("round trips, counted on the server")
    right.legend(fontsize=8)
    fig.suptitle("Renewal cost against the number of held locks (lower is better)")


def plot_celery(report: dict[str, Any], fig: Figure) -> None:
    rate, cpu = fig.subplots(1, 2, width_ratios=(3, 2))
    rows = report["results"]
    names = list(rows)
    ys = list(range(len(names)))[::-1]
    palette = {"plain": "tab:gray", "LockedTask": color(OURS), "celery-once": "tab:green"}
    colors = [next((c for k, c in palette.items() if n.startswith(k)), "tab:red") for n in names]
    spread = [rows[n]["tasks_per_s"] for n in names]
    medians = [s["median"] for s in spread]
    errors = [[s["median"] - s["min"] for s in spread], [s["max"] - s["median"] for s in spread]]
    rate.barh(ys, medians, xerr=errors, color=colors, capsize=3)
    rate.set_yticks(ys, names)
    rate.set_xlabel(
        f"submissions per second, end to end\n(median, min-max of {report['runs']} runs "
        f"of {report['tasks_per_run']})"
    )
    # CPU per task only where the worker drained every submission (not where the
    # sender turned all but one away: one task's CPU is below the 10 ms clock tick).
    drained = [n for n in names if not max(rows[n]["rejected_at_send"])]
    left = [0.0] * len(drained)
    for where, shade in (("worker_main", 1.0), ("pool_children", 0.6), ("redis_server", 0.3)):
        values = [rows[n]["cpu_ms_per_task_median"][where] for n in drained]
        cpu.barh(
            range(len(drained))[::-1],
            values,
            left=left,
            color="tab:gray",
            alpha=shade,
            label=where.replace("_", " "),
        )
        left = [a + b for a, b in zip(left, values, strict=True)]
    cpu.set_yticks(range(len(drained))[::-1], drained, fontsize=7)
    cpu.set_xlabel("CPU ms per task while draining (median)")
    cpu.legend(fontsize=7)
    fig.suptitle(
        f"Celery, prefork worker, concurrency {report['concurrency']}, empty tasks "
        "(throughput: higher is better)"
    )


def plot_redis_cost(report: dict[str, Any], fig: Figure) -> None:
    commands, volume = fig.subplots(1, 2, sharey=True)
    rows = report["results"]
    labels, network, server, bytes_in = [], [], [], []
    for lock, phases in rows.items():
        for phase, row in phases.items():
            labels.append(f"{lock}: {phase}")
            network.append(row["network_commands"])
            server.append(row["server_commands"])
            bytes_in.append(row["bytes_in"] + row["bytes_out"])
    ys = list(range(len(labels)))[::-1]
    colors = [color(label) for label in labels]
    commands.barh(ys, server, color=colors, alpha=0.4, label="run by the server (incl. Lua)")
    commands.barh(ys, network, color=colors, label="sent over the network")
    commands.set_yticks(ys, labels, fontsize=7)
    commands.set_xlabel("commands per operation (per lock renewed)")
    commands.legend(fontsize=7)
    volume.barh(ys, bytes_in, color=colors)
    volume.set_xlabel("bytes in + out per operation")
    fig.suptitle("Redis-side cost per operation, one node (lower is better)")


PLOTS: dict[str, tuple[Callable[[dict[str, Any], Figure], None], tuple[float, float]]] = {
    "latency": (plot_latency, (8, 3.2)),
    "contention": (plot_contention, (10, 4.5)),
    "redlock": (plot_redlock, (7, 4.2)),
    "renewal": (plot_renewal, (10, 4.2)),
    "celery": (plot_celery, (12, 4.2)),
    "redis_cost": (plot_redis_cost, (11, 7)),
    "family": (plot_family, (8, 3.6)),
}


def main(argv: list[str] | None = None) -> list[Path]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=RESULTS, help="results directory")
    parser.add_argument("--out", type=Path, default=OUT, help="where the PNGs go")
    parser.add_argument("--only", help="comma-separated results names")
    args = parser.parse_args(argv)
    names = args.only.split(",") if args.only else list(PLOTS)
    args.out.mkdir(parents=True, exist_ok=True)
    written = []
    for name in names:
        source = args.results / f"{name}.json"
        if not source.exists():
            print(f"plot {name}: no {source}, skipped")
            continue
        draw, size = PLOTS[name]
        report = json.loads(source.read_text())
        fig = plt.figure(figsize=size, layout="constrained")
        try:
            draw(report, fig)
            footer(fig, report)
            path = args.out / f"bench-{name}.png"
            fig.savefig(path, dpi=110)
        finally:
            plt.close(fig)
        written.append(path)
        print(f"plot {name}: wrote {path}")
    return written


if __name__ == "__main__":
    main()
