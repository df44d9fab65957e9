"""Shared pytest fixtures: real Redis servers and fault-injecting proxies.

The logic lives in ``tests/harness``; this file only wires it into pytest. Import the
harness as ``from tests.harness import ...`` (the repository root is put on ``sys.path``
below so that this works with both ``pytest`` and ``python -m pytest``).
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings as hypothesis_settings
from hypothesis.configuration import set_hypothesis_home_dir

_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

# Hypothesis keeps no example database: a failing example found once must not turn
# into a permanent failure of one checkout (it would replay from .hypothesis/ on every
# run there and nowhere else). A real failure is committed as an explicit @example;
# print_blob prints the @reproduce_failure line to replay it. Its caches (unicode
# tables) go to the temporary directory, not the working tree.
set_hypothesis_home_dir(
    os.path.join(tempfile.gettempdir(), f"celery_redlock-hypothesis-{os.getuid()}")
)
hypothesis_settings.register_profile("celery_redlock", database=None, print_blob=True)
hypothesis_settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "celery_redlock"))

from tests.harness import (  # noqa: E402
    FaultProxy,
    InProcessWorker,
    RedisServer,
    WorkerProcess,
    binary_summary,
    collect_garbage,
)
from tests.harness.celery_workers import quiesce_apps_on  # noqa: E402
from tests.harness.cluster import RedisCluster  # noqa: E402
from tests.harness.servers import close_all, used_binaries, wait_for  # noqa: E402

# pytester runs the testing plugin as a project would; the plugin, which celery_redlock
# installs (and which autoloads), is named here too so that the suite also runs with
# PYTEST_DISABLE_PLUGIN_AUTOLOAD set: its server is the suite's shared `redis_server`.
pytest_plugins = ["pytester", "celery_redlock.testing"]

#: The module of the process's renewer, looked up after every test by that name (a
#: name a move of the module would leave stale: tests/unit/engine/test_renewal.py
#: checks it).
RENEWAL_MODULE = "celery_redlock.engine.renewal"


@pytest.fixture(autouse=True)
def no_leftover_leases() -> Iterator[None]:
    """When a test ends, the leases it left to the process's renewer stop renewing.

    The renewer is one per process, so a lock a test leaves held used to be renewed
    during the next tests: its ticks and calls added to theirs (renewal call counts off
    by one), and once the next test flushed the server, the lease was lost there and
    moved that test's metrics (``redlock_locks_held`` at -2). Marking the leases
    released (under each lease's own lock, so no loss is reported after it) and
    waiting until the renewer is idle ends all of that before the next test starts;
    their keys expire on their own. The renewer and its thread stay, as in production.
    """
    yield
    renewal = sys.modules.get(RENEWAL_MODULE)  # never import it: that connects the
    if renewal is not None:  # worker signals, and changes what plain tests see
        _drain(renewal._renewer)


@pytest.fixture
def metrics_registry() -> Iterator[Any]:
    """Metrics enabled on a registry of this test's own; disabled again afterwards."""
    from prometheus_client import CollectorRegistry

    from celery_redlock.base import metrics

    registry = CollectorRegistry()
    metrics._metrics.clear()
    metrics.enabled = False
    metrics.enable(registry)
    yield registry
    metrics.enabled = False
    metrics._metrics.clear()


@pytest.fixture
def drain_renewer() -> Callable[[Any], None]:
    """What :func:`no_leftover_leases` does when a test ends, as a function of a renewer."""
    return _drain


def _drain(renewer: Any) -> None:
    """Release every lease ``renewer`` holds and wait until no tick is in flight."""
    if renewer is None or renewer.pid != os.getpid():
        return
    wait_for(renewer.abandon_all, timeout=30, message="the renewer to finish its tick")


@pytest.fixture(scope="session")
def redis_server(redlock_server: RedisServer) -> RedisServer:
    """One real server shared by the whole session (prefer ``redis_node`` in tests).

    The testing plugin's ``redlock_server``: the fixture projects use is the one our
    own tests run on most.
    """
    return redlock_server


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
    # What this test left for the garbage collector talks to these servers when
    # collected (AsyncResult.__del__): collect it while they still run, and make what
    # stays reachable inert (its app's result consumer stopped) before they stop.
    collect_garbage()
    quiesce_apps_on(server.port for server in started)
    _drop_unacked_restores()
    close_all(started)


def _drop_unacked_restores() -> None:
    """Forget kombu's restores of this test's unacknowledged messages.

    kombu restores a consumer's unacknowledged messages when it is collected or at
    interpreter exit (a ``multiprocessing`` finalizer); for a test's broker, which is
    gone by then, that printed a connection error traceback after the summary line.
    """
    from multiprocessing import util

    for finalizer in list(util._finalizer_registry.values()):
        if getattr(getattr(finalizer, "_callback", None), "__name__", "") == (
            "restore_unacked_once"
        ):
            finalizer.cancel()


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


@pytest.fixture
def redis_cluster(tmp_path: Path) -> Iterator[RedisCluster]:
    """A fresh 3-master Redis Cluster (:class:`tests.harness.cluster.RedisCluster`)."""
    with RedisCluster(tmp_path / "cluster") as cluster:
        yield cluster


#: used_binaries() of each pytest-xdist worker, sent when it finishes (scripts/test.sh
#: runs the suite in parallel): the controller starts no server of its own.
_workers_binaries: list[dict[str, dict[str, Any]]] = []


def pytest_sessionfinish(session: pytest.Session) -> None:
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:  # an xdist worker: tell the controller
        workeroutput["redis_binaries"] = used_binaries()


@pytest.hookimpl(optionalhook=True)  # an xdist hook: unknown without pytest-xdist
def pytest_testnodedown(node: Any, error: object) -> None:
    _workers_binaries.append(getattr(node, "workeroutput", {}).get("redis_binaries", {}))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Say which redis-server binary the session used (its workers', run in parallel)."""
    terminalreporter.write_line(binary_summary(_workers_binaries))


# --------------------------------------------------------------------------- Celery
#
# The worker fixtures depend on ``redis_factory`` so that they are torn down first:
# workers stop while their broker is still up.


@pytest.fixture
def celery_redis(redis_factory: Callable[..., list[RedisServer]]) -> RedisServer:
    """A fresh server of this test's own for Celery (broker db 1, results db 2) and locks."""
    return redis_factory()[0]


@pytest.fixture
def worker_process_factory(
    request: pytest.FixtureRequest,
    redis_factory: Callable[..., list[RedisServer]],
    tmp_path: Path,
) -> Iterator[Callable[..., WorkerProcess]]:
    """``make(app_module="tests.apps.plain", *, start=True, **kw)``: a ``WorkerProcess``.

    ``redis_url`` defaults to ``celery_redis``'s; ``log_dir`` to one under ``tmp_path``;
    other ``kw`` go to :class:`WorkerProcess` (``pool``, ``concurrency``, ``env``, ...).
    Started unless ``start=False``; every one is stopped (group killed) at test end.
    """
    workers: list[WorkerProcess] = []

    def make(
        app_module: str = "tests.apps.plain", *, start: bool = True, **kw: Any
    ) -> WorkerProcess:
        if kw.get("redis_url") is None:
            kw["redis_url"] = request.getfixturevalue("celery_redis").url
        kw.setdefault("log_dir", tmp_path / "celery-workers")
        worker = WorkerProcess(app_module, **kw)
        workers.append(worker)
        if start:
            worker.start()
        return worker

    yield make
    errors = []
    for worker in reversed(workers):
        try:
            worker.stop()
        except Exception as exc:  # stop every worker even if one fails
            errors.append(exc)
    if errors:
        raise errors[0]


@pytest.fixture
def inprocess_worker_factory(
    redis_factory: Callable[..., list[RedisServer]],
) -> Iterator[Callable[..., InProcessWorker]]:
    """``make(app, pool="solo", concurrency=1, **kw)``: a started ``InProcessWorker``.

    ``kw`` go to :class:`InProcessWorker`. Each is stopped at test end; only one runs at
    a time. The apps given are closed at test end too.
    """
    workers: list[InProcessWorker] = []

    def make(app: Any, pool: str = "solo", concurrency: int = 1, **kw: Any) -> InProcessWorker:
        worker = InProcessWorker(app, pool, concurrency, **kw)
        workers.append(worker)
        return worker.start()

    yield make
    errors = []
    for worker in reversed(workers):
        try:
            worker.stop()
        except Exception as exc:
            errors.append(exc)
    for app in {id(w.app): w.app for w in workers}.values():
        app.close()
    if errors:
        raise errors[0]
