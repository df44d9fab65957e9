"""Regenerate docs/img/grafana-queries.png: the Grafana board's queries in Prometheus.

Prometheus's own web UI graphs them: Grafana itself cannot be installed here.

``python scripts/screenshot_metrics.py [--out PATH] [--rounds N]``, from the repository
root in the project's virtualenv (``pip install -e '.[test]'``). Needs Debian's
``prometheus`` (whose package ships the classic web UI, ``/classic/graph``), ``chromium``
and a redis-server. It starts two redis-servers (broker, locks), a Prometheus scraping
every second, and a prefork worker of ``tests.apps.metered`` serving its metrics
(``PROMETHEUS_MULTIPROC_DIR``); makes the worker go through every kind of lock event
(tests/harness/metered.py) ``--rounds`` times, with quick locked runs in between; then
opens the graph page of the board's queries in headless chromium and saves the
screenshot. Everything it starts is stopped at the end.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import urllib.parse
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.apps.metered import make_metered_app  # noqa: E402
from tests.harness import RedisServer, WorkerProcess, close_app  # noqa: E402
from tests.harness.browser import FLAGS as CHROMIUM_FLAGS  # noqa: E402
from tests.harness.metered import make_every_event  # noqa: E402
from tests.harness.prometheus import (  # noqa: E402
    PrometheusServer,
    board_queries,
    find_prometheus,
    load_board,
    missing_prometheus_reason,
    substitute,
)
from tests.harness.servers import free_port  # noqa: E402

#: The board's queries the screenshot graphs, as ``(panel title, refId)``: one graph each.
GRAPHS = (
    ("Acquired and released per second", "A"),
    ("Acquire latency (p50, p99)", "B"),
    ("Deferred per second, by reason", "A"),
    ("Locks held", "A"),
)
#: The classic UI's page: its header, then each graph with its form (CSS pixels). The
#: window holds the whole page: the UI focuses the last expression, and scrolls to it.
PAGE_TOP, GRAPH_HEIGHT = 120, 760
#: The page drawn at this scale, so that four graphs fit a picture 1280 pixels wide.
SCALE = 0.6
WIDTH = 1280


def graph_url(prometheus: PrometheusServer, exprs: list[str], seconds: int) -> str:
    """The classic UI's page graphing ``exprs``, one graph each, the last ``seconds``."""
    params = {}
    for i, expr in enumerate(exprs):
        params[f"g{i}.expr"] = expr
        params[f"g{i}.tab"] = "0"  # the graph, not the table
        params[f"g{i}.range_input"] = f"{seconds}s"
        params[f"g{i}.stacked"] = "0"
    return f"{prometheus.url}/classic/graph?{urllib.parse.urlencode(params)}"


def screenshot(url: str, graphs: int, out: Path, workdir: Path) -> None:
    """Save the page at ``url`` (``graphs`` graphs) as ``out``, :data:`WIDTH` pixels wide.

    Headless chromium, with a profile of its own.
    """
    size = f"{round(WIDTH / SCALE)},{PAGE_TOP + GRAPH_HEIGHT * graphs}"
    subprocess.run(
        [
            "chromium",
            *CHROMIUM_FLAGS,
            f"--user-data-dir={workdir / 'chromium-profile'}",
            f"--window-size={size}",
            f"--force-device-scale-factor={SCALE}",
            "--virtual-time-budget=15000",  # the page's queries are answered first
            f"--screenshot={out}",
            url,
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )


def main() -> int:
    """Start everything, make the events, take the screenshot; the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "img" / "grafana-queries.png")
    parser.add_argument("--rounds", type=int, default=6, help="rounds of every event")
    args = parser.parse_args()
    if find_prometheus() is None:
        print(missing_prometheus_reason(), file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory(prefix="screenshot-metrics-") as tmp:
        workdir = Path(tmp)
        broker = RedisServer(data_dir=workdir / "broker")
        locks = RedisServer(data_dir=workdir / "locks")
        broker.start()
        locks.start()
        port = free_port()
        (workdir / "multiproc").mkdir()
        prometheus = PrometheusServer([f"127.0.0.1:{port}"], workdir / "prometheus")
        app = make_metered_app(broker.url, locks.url)
        worker = WorkerProcess(
            "tests.apps.metered",
            redis_url=broker.url,
            log_dir=workdir,
            env={
                "METERED_LOCK_URL": locks.url,
                "METERED_METRICS_PORT": str(port),
                "PROMETHEUS_MULTIPROC_DIR": str(workdir / "multiproc"),
            },
        )
        try:
            prometheus.start()
            began = time.monotonic()
            worker.start()
            for round_ in range(args.rounds):
                make_every_event(
                    app, locks, port, worker.nodename, str(round_), workdir / f"gate-{round_}"
                )
                runs = [app.tasks["metered.hold"].delay(f"quick-{i}") for i in range(20)]
                for run in runs:
                    run.get(timeout=30)
            queries = {(q.panel, q.ref_id): q.expr for q in board_queries(load_board())}
            exprs = [substitute(queries[graph]) for graph in GRAPHS]
            seconds = 10 * (int(time.monotonic() - began) // 10 + 1)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            screenshot(graph_url(prometheus, exprs, seconds), len(exprs), args.out, workdir)
        finally:
            worker.stop()
            prometheus.stop()
            close_app(app)
            locks.close()
            broker.close()
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    os.chdir(ROOT)
    sys.exit(main())
