"""Shared pytest fixtures: real Redis servers and fault-injecting proxies.

The logic lives in ``tests/harness``; this file only wires it into pytest. Import the
harness as ``from tests.harness import ...`` (the repository root is put on ``sys.path``
below so that this works with both ``pytest`` and ``python -m pytest``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from tests.harness import FaultProxy, RedisServer, binary_summary  # noqa: E402


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """One real server shared by the whole session (prefer ``redis_node`` in tests)."""
    server = RedisServer(data_dir=tmp_path_factory.mktemp("redis-session"))
    server.start()
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def redis_node(redis_server: RedisServer) -> RedisServer:
    """The shared server, running, after FLUSHALL + SCRIPT FLUSH + CONFIG RESETSTAT."""
    redis_server.ensure_running()  # a previous test may have paused/killed it
    with redis_server.client() as conn:
        conn.flushall()
        conn.script_flush()
        conn.config_resetstat()
    return redis_server


@pytest.fixture
def redis_factory(tmp_path: Path) -> Iterator[Callable[..., list[RedisServer]]]:
    """``make(n=1, *extra_args, **kw)``: start ``n`` fresh servers, stopped at test end.

    ``extra_args`` are redis-server options (``"--appendonly", "yes"``); ``kw`` goes
    to :class:`RedisServer` (e.g. ``password="secret"``).
    """
    started: list[RedisServer] = []

    def make(n: int = 1, *extra_args: str, **kw: Any) -> list[RedisServer]:
        servers = []
        for _ in range(n):
            options = dict(kw)
            if options.get("data_dir") is None:
                options["data_dir"] = tmp_path / f"redis-{len(started)}"
            server = RedisServer(extra_args, **options)
            started.append(server)
            server.start()
            servers.append(server)
        return servers

    yield make
    errors = []
    for server in started:
        try:
            server.close()
        except Exception as exc:  # close every server even if one fails
            errors.append(exc)
    if errors:
        raise errors[0]


@pytest.fixture
def fault_proxy() -> Iterator[Callable[[RedisServer | int], FaultProxy]]:
    """``make(server_or_port)``: a :class:`FaultProxy` in front of it, closed at test end."""
    proxies: list[FaultProxy] = []

    def make(server_or_port: RedisServer | int) -> FaultProxy:
        if isinstance(server_or_port, RedisServer):
            if server_or_port.port is None:
                raise ValueError("start the server before proxying it")
            proxy = FaultProxy(
                server_or_port.host, server_or_port.port, password=server_or_port.password
            )
        else:
            proxy = FaultProxy("127.0.0.1", int(server_or_port))
        proxies.append(proxy)
        return proxy

    yield make
    errors = []
    for proxy in proxies:
        try:
            proxy.close()
        except Exception as exc:
            errors.append(exc)
    if errors:
        raise errors[0]


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Say which redis-server binary the session used."""
    terminalreporter.write_line(binary_summary())
