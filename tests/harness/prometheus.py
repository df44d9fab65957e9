"""A real Prometheus server for tests, and the queries of the Grafana board.

:class:`PrometheusServer` runs Debian's ``prometheus`` binary on a free loopback port,
with a storage directory and a scrape configuration of its own, and answers PromQL
through the HTTP API (``/api/v1/query``). :func:`board_queries` and
:func:`variable_queries` read every query out of ``dashboards/grafana/celery_redlock.json``
(panels nested in collapsed rows too), and :func:`substitute` turns Grafana's variables
into what Prometheus understands, so that a new panel is tested without a change here.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .celery_workers import REPO_ROOT
from .servers import free_port, wait_for

#: The board, as users import it into Grafana.
BOARD = REPO_ROOT / "dashboards" / "grafana" / "celery_redlock.json"
#: Debian's package that ships the binary (and the classic web UI the screenshot uses).
PROMETHEUS_PACKAGE = "prometheus"
#: What ``$__rate_interval`` becomes: four scrapes of 1 s, with room for a late one.
RATE_INTERVAL = "15s"

HOST = "127.0.0.1"


def find_prometheus() -> str | None:
    """The ``prometheus`` binary: on ``PATH``, else Debian's ``/usr/bin/prometheus``."""
    found = shutil.which("prometheus")
    if found is None and os.access("/usr/bin/prometheus", os.X_OK):
        found = "/usr/bin/prometheus"
    return found


def missing_prometheus_reason() -> str:
    """Why a test that needs Prometheus cannot run (for its skip or, in CI, its failure)."""
    return (
        f"no prometheus binary: install Debian's package '{PROMETHEUS_PACKAGE}' "
        f"(apt-get install {PROMETHEUS_PACKAGE})"
    )


def require_prometheus() -> str:
    """The binary; else skip the test, or fail it under ``CI=true`` (CI installs it)."""
    import pytest  # here: scripts import this module without pytest's plugins

    binary = find_prometheus()
    if binary is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"CI=true: {missing_prometheus_reason()}")
        pytest.skip(missing_prometheus_reason())
    return binary


def target_health(server: PrometheusServer) -> str:
    """One line per scrape target: its URL, health and last error."""
    try:
        active = server.api("targets", state="active")["activeTargets"]
    except (OSError, RuntimeError) as exc:
        return f"targets unknown: {exc}"
    return "\n".join(
        f"{t['scrapeUrl']}: {t['health']} {t.get('lastError') or ''}".rstrip() for t in active
    )


class PrometheusServer:
    """``prometheus`` scraping ``targets`` (``host:port``) every ``scrape_interval``.

    ``PrometheusServer(targets, data_dir, *, binary=None, scrape_interval="1s")``: the
    configuration file, the TSDB (``--storage.tsdb.path``) and the log go under
    ``data_dir``; it listens on a free loopback port. :meth:`start` returns once
    ``/-/ready`` answers 200; :meth:`stop` terminates it (killed if it lingers).
    """

    def __init__(
        self,
        targets: Sequence[str],
        data_dir: str | os.PathLike[str],
        *,
        binary: str | None = None,
        scrape_interval: str = "1s",
        job: str = "celery",
    ) -> None:
        self.targets = list(targets)
        self.data_dir = Path(data_dir)
        self.binary = binary or find_prometheus()
        self.scrape_interval = scrape_interval
        self.job = job
        self.port: int | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The server's base URL, ``http://127.0.0.1:PORT``."""
        return f"http://{HOST}:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.data_dir / "prometheus.log"

    def log_tail(self, lines: int = 30) -> str:
        with contextlib.suppress(FileNotFoundError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def config(self) -> str:
        """The configuration file: one job, the targets, no rule files."""
        targets = ", ".join(json.dumps(target) for target in self.targets)
        return (
            "global:\n"
            f"  scrape_interval: {self.scrape_interval}\n"
            f"  scrape_timeout: {self.scrape_interval}\n"
            "scrape_configs:\n"
            f"  - job_name: {json.dumps(self.job)}\n"
            "    static_configs:\n"
            f"      - targets: [{targets}]\n"
        )

    def start(self, timeout: float = 30.0) -> PrometheusServer:
        """Start the server and wait until it is ready; return ``self``."""
        if self.binary is None:
            raise RuntimeError(missing_prometheus_reason())
        self.data_dir.mkdir(parents=True, exist_ok=True)
        config = self.data_dir / "prometheus.yml"
        config.write_text(self.config())
        self.port = free_port()
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                [
                    self.binary,
                    f"--config.file={config}",
                    f"--storage.tsdb.path={self.data_dir / 'tsdb'}",
                    f"--web.listen-address={HOST}:{self.port}",
                    # Debian's default console directories are not ours to read.
                    f"--web.console.templates={self.data_dir}",
                    f"--web.console.libraries={self.data_dir}",
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            wait_for(self._ready, timeout=timeout, interval=0.05, message="prometheus ready")
        except BaseException:
            self.stop()
            raise
        return self

    def _ready(self) -> bool:
        if self._proc is None or self._proc.poll() is not None:
            raise RuntimeError(f"prometheus exited at start:\n{self.log_tail()}")
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as reply:
                return bool(reply.status == 200)
        except OSError:
            return False

    def stop(self, timeout: float = 10.0) -> None:
        """Terminate the server (SIGTERM, then SIGKILL after ``timeout``) and reap it."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout)

    def __enter__(self) -> PrometheusServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def api(self, path: str, **params: str) -> Any:
        """``GET /api/v1/<path>?params``: the reply's ``data``; RuntimeError on an error."""
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as reply:
                body = json.load(reply)
        except urllib.error.HTTPError as exc:  # 400 for a bad query, with its error
            body = json.load(exc)
        if body.get("status") != "success":
            raise RuntimeError(f"{body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """The instant vector (or scalar, as one item) ``expr`` evaluates to now."""
        data = self.api("query", query=expr)
        result = data["result"]
        if data["resultType"] in ("scalar", "string"):
            return [{"metric": {}, "value": result}]
        return list(result)

    def query_range(self, expr: str, start: float, step: str = "1s") -> list[dict[str, Any]]:
        """The range vector of ``expr`` from ``start`` (epoch seconds) to now."""
        now = time.time()
        data = self.api(
            "query_range", query=expr, start=f"{start:.3f}", end=f"{now:.3f}", step=step
        )
        return list(data["result"])


# --------------------------------------------------------------------------- the board


@dataclass(frozen=True)
class BoardQuery:
    """One target of one panel: the panel's title, the target's refId, its PromQL."""

    panel: str
    ref_id: str
    expr: str

    def __str__(self) -> str:
        return f"{self.panel} [{self.ref_id}]: {self.expr}"


def load_board(path: str | os.PathLike[str] = BOARD) -> dict[str, Any]:
    """The board's JSON."""
    board: dict[str, Any] = json.loads(Path(path).read_text())
    return board


def board_panels(board: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel of ``board`` that is not a row, those inside (collapsed) rows too."""

    def walk(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        for panel in panels:
            if panel.get("type") == "row":
                yield from walk(panel.get("panels") or [])
            else:
                yield panel
                yield from walk(panel.get("panels") or [])

    return walk(board.get("panels") or [])


def board_queries(board: dict[str, Any]) -> list[BoardQuery]:
    """Every ``targets[].expr`` of every panel of ``board``."""
    return [
        BoardQuery(panel.get("title", "?"), target.get("refId", "?"), target["expr"])
        for panel in board_panels(board)
        for target in panel.get("targets") or []
        if "expr" in target
    ]


#: Grafana's ``label_values(SELECTOR, LABEL)`` (``SELECTOR`` optional).
LABEL_VALUES = re.compile(r"^\s*label_values\((?:(?P<selector>.+),\s*)?(?P<label>\w+)\s*\)\s*$")


def variable_queries(board: dict[str, Any]) -> list[tuple[str, str, str]]:
    """``(name, selector, label)`` of each ``label_values`` query variable of ``board``."""
    found = []
    for variable in (board.get("templating") or {}).get("list") or []:
        if variable.get("type") != "query":
            continue
        query = variable.get("query")
        text = query.get("query", "") if isinstance(query, dict) else str(query or "")
        match = LABEL_VALUES.match(text)
        if match is None:
            raise ValueError(f"variable {variable.get('name')}: not label_values(...): {text!r}")
        found.append((variable["name"], match["selector"] or "", match["label"]))
    return found


#: Grafana's variable syntaxes: ``$name``, ``${name}``, ``${name:format}``, ``[[name]]``.
VARIABLE = re.compile(r"\$\{(?P<braced>\w+)(?::\w+)?\}|\$(?P<plain>\w+)|\[\[(?P<old>\w+)\]\]")


def substitute(expr: str, rate_interval: str = RATE_INTERVAL) -> str:
    """``expr`` as Grafana sends it with "All" chosen: every template variable is the
    regular expression ``.*``; ``$__rate_interval`` is ``rate_interval``. Another of
    Grafana's built-ins (``$__range``...) is a ValueError: give it a value here first."""

    def value(match: re.Match[str]) -> str:
        name = match["braced"] or match["plain"] or match["old"]
        if name == "__rate_interval":
            return rate_interval
        if name.startswith("__"):
            raise ValueError(f"no test value for Grafana's ${name} in {expr!r}")
        return ".*"

    return VARIABLE.sub(value, expr)
