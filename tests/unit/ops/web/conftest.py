"""Fixtures of the web dashboard's tests: a served dashboard and a headless Chromium.

``dashboard`` serves :class:`celery_redlock.ops.web.Dashboard` in a thread of the test
process, on a free port, for an app the test gives (its lock nodes are the app's).
``browser`` is Debian's chromium driven through its chromedriver with Selenium; where
either is missing the browser tests skip with the packages to install, except in CI
(``CI=true``), where they fail: CI installs them.
"""

from __future__ import annotations

import base64
import json
import os
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from celery_redlock.integration.settings import from_conf
from celery_redlock.nodes import NodeSet
from celery_redlock.ops.web import Dashboard, make_server
from tests.harness.browser import missing, start_chromium


def basic(credentials: str) -> str:
    """The ``Authorization`` header value for ``user:password``."""
    return "Basic " + base64.b64encode(credentials.encode()).decode()


@dataclass
class Served:
    """A dashboard being served: its URL, and JSON requests to it."""

    url: str
    dashboard: Dashboard

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        auth: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> tuple[int, Any, dict[str, str]]:
        """``(status, JSON body or text, headers)`` of one request (errors included)."""
        data = None if body is None else json.dumps(body).encode()
        all_headers = {"Content-Type": "application/json"} if body is not None else {}
        if auth is not None:
            all_headers["Authorization"] = basic(auth)
        all_headers.update(headers or {})
        request = urllib.request.Request(self.url + path, data, all_headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                status, raw, got = response.status, response.read(), dict(response.headers)
        except urllib.error.HTTPError as error:
            status, raw, got = error.code, error.read(), dict(error.headers)
        text = raw.decode()
        is_json = got.get("Content-Type", "").startswith("application/json")
        return status, json.loads(text) if is_json else text, got

    def get(self, path: str, **kwargs: Any) -> Any:
        """The JSON of a GET that must succeed."""
        status, body, _ = self.request("GET", path, **kwargs)
        assert status == 200, (path, status, body)
        return body


@pytest.fixture
def dashboard() -> Iterator[Callable[..., Served]]:
    """``serve(app, *, allow_release=False, basic_auth=None, worker_timeout=1.0)``."""
    running: list[tuple[Any, threading.Thread, Dashboard]] = []

    def serve(
        app: Any,
        *,
        allow_release: bool = False,
        basic_auth: str | None = None,
        worker_timeout: float = 1.0,
        node_timeout: float = 1.0,
    ) -> Served:
        settings = from_conf(app.conf)
        board = Dashboard(
            app,
            settings,
            NodeSet(settings.node_urls(), timeout=node_timeout),
            worker_timeout=worker_timeout,
            allow_release=allow_release,
        )
        server = make_server(board, "127.0.0.1", 0, basic_auth=basic_auth)
        thread = threading.Thread(target=server.serve_forever, name="dashboard", daemon=True)
        thread.start()
        running.append((server, thread, board))
        return Served(f"http://127.0.0.1:{server.server_address[1]}", board)

    yield serve
    for server, thread, board in running:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
        board.close()


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Any]:
    """A headless Chromium (Selenium WebDriver) with a fresh profile, 1280x800.

    Started by :func:`tests.harness.browser.start_chromium`.

    Skips when chromium, chromium-driver or selenium is missing, naming what to
    install; fails instead when ``CI=true`` (CI installs them, so a skip would hide
    that the browser tests stopped running).
    """
    why = missing()
    if why is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(f"browser tests cannot run in CI: {why}")
        pytest.skip(f"browser tests need a headless Chromium: {why}")
    driver = start_chromium(tmp_path / "chromium-profile", tmp_path / "chromedriver.log")
    try:
        yield driver
    finally:
        driver.quit()
