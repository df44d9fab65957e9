"""Real Celery workers for tests: an app factory, in-process workers and worker processes.

Three ways to run tasks against the real Redis servers of :mod:`tests.harness.servers`:

* :func:`make_app` builds a Celery app whose broker is db 1 and result backend db 2 of a
  test server (db 0 stays free for the locks themselves).
* :class:`InProcessWorker` runs a real ``WorkController`` in a thread of the test process,
  for the ``solo`` and ``threads`` pools only. It starts in a few tens of milliseconds and
  tasks can touch test-process state, but it shares the process with the test: it cannot
  be killed, and a task body that is running cannot be interrupted (Python cannot kill a
  thread). ``prefork`` does not belong in-process (it forks the pytest process, logs
  through queues and installs signal handlers): use :class:`WorkerProcess` for it, and
  for anything that must crash, be killed or be SIGTERMed.
* :class:`WorkerProcess` runs ``python -m celery -A <module> worker`` as a subprocess in
  its own session (so its own process group: a kill reaches its pool children), logging
  to a file. The app module reads its Redis URL from ``$REDLOCK_TEST_REDIS_URL``
  (:data:`APP_URL_ENV`); ``tests/apps/plain.py`` is such a module.

Every :class:`WorkerProcess` that was started is tracked in a module-level registry and
its process group SIGKILLed at interpreter exit as a safety net.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import celery
from celery import _state as celery_state
from celery.exceptions import WorkerTerminate
from celery.worker import WorkController
from kombu.asynchronous import set_event_loop

from .servers import WaitTimeout, wait_for

logger = logging.getLogger("tests.harness")

#: Repository root: the working directory and ``PYTHONPATH`` entry of worker processes.
REPO_ROOT = Path(__file__).resolve().parents[2]


def run_python(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """``python ARGS`` in the project's environment (``env`` added); once it exits 0."""
    done = subprocess.run(
        [sys.executable, *args],
        env={**os.environ, **env, "PYTHONPATH": str(REPO_ROOT)},
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done


#: Environment variable from which test app modules (``tests.apps.*``) read their Redis URL.
APP_URL_ENV = "REDLOCK_TEST_REDIS_URL"

#: Pools :class:`InProcessWorker` accepts.
IN_PROCESS_POOLS = ("solo", "threads")

BROKER_DB = 1
BACKEND_DB = 2

#: In-process workers keep Celery's default bootsteps: none of mingle, gossip and
#: heartbeat is turned off (a harness that always turned them off hid a crash at
#: start on kombu < 5.7).
DEFAULT_STEPS: dict[str, bool] = {
    "without_heartbeat": False,
    "without_mingle": False,
    "without_gossip": False,
}


# --------------------------------------------------------------------------- apps


def redis_url_with_db(redis_url: str, db: int) -> str:
    """Return ``redis_url`` with its database number replaced by ``db``.

    Keeps scheme, credentials, host, port and query: ``redis://:pw@h:1/0`` -> ``.../2``.
    """
    parts = urlsplit(redis_url)
    if parts.scheme not in ("redis", "rediss"):
        raise ValueError(f"not a redis:// URL: {redis_url!r}")
    return urlunsplit((parts.scheme, parts.netloc, f"/{db}", parts.query, parts.fragment))


def make_app(
    redis_url: str,
    *,
    name: str = "tests",
    visibility_timeout: float | None = None,
    **conf: Any,
) -> celery.Celery:
    """Return a Celery app using ``redis_url``'s server: broker db 1, result backend db 2.

    JSON task and result serialization, ``result_extended=True``, no root-logger
    hijacking, broker connection retried on startup. ``visibility_timeout`` (seconds) sets
    ``broker_transport_options={"visibility_timeout": ...}``, and only when given.
    ``conf`` is applied last with ``app.conf.update`` and so overrides everything.
    Call ``app.close()`` when done (the fixtures' apps are closed for you).
    """
    app = celery.Celery(
        name,
        broker=redis_url_with_db(redis_url, BROKER_DB),
        backend=redis_url_with_db(redis_url, BACKEND_DB),
        set_as_current=False,
    )
    app.conf.update(
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        result_accept_content=["json"],
        result_extended=True,
        worker_hijack_root_logger=False,
        broker_connection_retry_on_startup=True,
    )
    if visibility_timeout is not None:
        app.conf.broker_transport_options = {"visibility_timeout": visibility_timeout}
    if conf:
        app.conf.update(**conf)
    return app


def unique_nodename(prefix: str = "worker") -> str:
    """A worker name part unlikely to clash with any other: ``<prefix>-<8 hex>``."""
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


# --------------------------------------------------------------------------- records


@dataclass(frozen=True)
class Interval:
    """One run of the ``record`` test task: its label, monotonic start/end (ns) and pid."""

    label: str
    start_ns: int
    end_ns: int
    pid: int

    def overlaps(self, other: Interval) -> bool:
        """Whether both runs were inside their bodies at some common instant."""
        return self.start_ns < other.end_ns and other.start_ns < self.end_ns


def read_intervals(path: str | os.PathLike[str]) -> dict[str, Interval]:
    """Parse a file written by the ``record`` task into ``{label: Interval}``.

    Lines are ``start <label> <monotonic_ns> <pid>`` and ``end <label> <monotonic_ns>
    <pid>``; ``time.monotonic_ns`` is CLOCK_MONOTONIC, comparable between processes of
    one machine. Runs that have started but not ended are left out.
    """
    starts: dict[str, tuple[int, int]] = {}
    done: dict[str, Interval] = {}
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) != 4:
            continue
        kind, label, stamp, pid = parts
        if kind == "start":
            starts[label] = (int(stamp), int(pid))
        elif kind == "end" and label in starts:
            start_ns, start_pid = starts[label]
            done[label] = Interval(label, start_ns, int(stamp), start_pid)
    return done


# --------------------------------------------------------------------------- in-process


class _EmbeddedWorkController(WorkController):
    """A WorkController that reports readiness and can be told to stop from any thread."""

    def __init__(self, *args: Any, poll_timeout: float | None = None, **kwargs: Any) -> None:
        self.ready_event = threading.Event()
        self.stop_requested = threading.Event()
        self.poll_timeout = poll_timeout
        super().__init__(*args, **kwargs)

    def on_consumer_ready(self, consumer: Any) -> None:
        channel = getattr(getattr(consumer, "task_consumer", None), "channel", None)
        if self.poll_timeout is not None and hasattr(channel, "brpop_timeout"):
            # Read for every BRPOP the redis channel sends from now on.
            channel.brpop_timeout = self.poll_timeout
        self.ready_event.set()

    def request_stop(self) -> None:
        """Ask the worker thread to terminate (cold) as soon as its event loop runs."""
        self.stop_requested.set()
        hub = getattr(self, "hub", None)
        if hub is not None:
            # kombu's Hub.call_soon is thread-safe and wakes the poller; the callback
            # raises WorkerTerminate inside the worker thread's event loop.
            hub.call_soon(self._terminate_now)

    def _terminate_now(self) -> None:
        raise WorkerTerminate(0)

    def _process_task(self, req: Any) -> None:
        # No task starts after stop() was asked for, even one already read from the
        # broker in the same poll as the stop request (it stays unacked: redelivered).
        if self.stop_requested.is_set():
            raise WorkerTerminate(0)
        super()._process_task(req)


_inprocess_lock = threading.Lock()


class InProcessWorker:
    """A real Celery worker running in a thread of the test process.

    ``InProcessWorker(app, pool="solo", concurrency=1, *, hostname=None,
    loglevel="INFO", start_timeout=10.0, shutdown_timeout=10.0, poll_timeout=0.1,
    **worker_options)``; ``worker_options`` go to :class:`celery.worker.WorkController`
    (``queues=...``, ``prefetch_multiplier=...``, ...).

    ``poll_timeout`` is the server-side timeout of the worker's BRPOP on the task queues
    (kombu's default is 1 s). Closing the redis channel reads the reply of the BRPOP in
    flight, so it bounds how long :meth:`stop` takes when idle; message delivery is not
    delayed by it either way. ``None`` keeps kombu's value.

    Pools: ``solo`` (tasks run inline in the worker thread) and ``threads`` (a
    ``ThreadPoolExecutor`` of ``concurrency`` threads). Not ``prefork``: see the module
    docstring; use :class:`WorkerProcess`.

    * :meth:`start` returns once the consumer is ready (queues declared, consuming);
      raises ``RuntimeError`` after ``start_timeout``. Only one in-process worker can run
      at a time: Celery keeps worker state (active requests, the "join will block" flag,
      the event loop) in module globals. Start/stop as often as needed.
    * :meth:`stop` is a cold shutdown (like ``start_worker``'s): no new task starts, the
      consumer and the broker connection are closed, and it returns within
      ``shutdown_timeout``. A task body still running then cannot be interrupted: with
      ``threads`` it keeps running in its (daemon) executor thread; with ``solo`` the
      worker thread itself is busy, so ``stop`` gives up waiting, returns ``False``, and
      the thread terminates as soon as the body returns. Either way the task's message
      was already acknowledged (unless ``acks_late``) and its result may still be written
      afterwards.

    While running, the ``celery`` logger's level is set to ``loglevel`` and records
    propagate to the root logger, so pytest captures them; nothing else of logging is
    configured. The app is the default app while the worker runs (as with
    ``start_worker``), so code using ``current_app`` in executor threads finds it.

    Celery's own ``celery.contrib.testing.worker.start_worker`` is not used because it
    stops workers through the global ``state.should_terminate`` flag, which it leaves set
    when a task outlives ``shutdown_timeout`` (every later embedded worker then dies at
    startup, and its ``ensure_started`` waits without a deadline).
    """

    #: The in-process worker currently running, if any (one at a time per process).
    _running: InProcessWorker | None = None

    def __init__(
        self,
        app: celery.Celery,
        pool: str = "solo",
        concurrency: int = 1,
        *,
        hostname: str | None = None,
        loglevel: str | int = "INFO",
        start_timeout: float = 10.0,
        shutdown_timeout: float = 10.0,
        poll_timeout: float | None = 0.1,
        **worker_options: Any,
    ) -> None:
        if pool not in IN_PROCESS_POOLS:
            raise ValueError(
                f"pool {pool!r} cannot run in-process; use one of {IN_PROCESS_POOLS}, or "
                "WorkerProcess for prefork (and for anything that must be killed)"
            )
        self.app = app
        self.pool = pool
        self.concurrency = concurrency
        self.hostname = hostname or f"{unique_nodename('inproc')}@{socket.gethostname()}"
        self.loglevel = loglevel
        self.start_timeout = start_timeout
        self.shutdown_timeout = shutdown_timeout
        self.poll_timeout = poll_timeout
        self.worker_options = worker_options
        self.worker: _EmbeddedWorkController | None = None
        self.thread: threading.Thread | None = None
        self.abandoned: list[threading.Thread] = []
        self._saved: dict[str, Any] = {}

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"<InProcessWorker {self.hostname} pool={self.pool}x{self.concurrency} {state}>"

    @property
    def running(self) -> bool:
        """Whether the worker was started and not stopped since."""
        return self.worker is not None

    def start(self) -> InProcessWorker:
        """Start the worker thread and wait until it consumes; return ``self``."""
        with _inprocess_lock:
            running = InProcessWorker._running
            if running is not None:
                raise RuntimeError(
                    f"{running!r} is still running; only one in-process worker can run at "
                    "a time (Celery's worker state is process-global)"
                )
            InProcessWorker._running = self
        try:
            self._start()
        except BaseException:
            if self.worker is None:  # failed before the thread existed: stop() cannot undo
                self._restore_globals()
                self._release_slot()
            raise
        return self

    def _start(self) -> None:
        app = self.app
        app.finalize()
        # Fail fast on an unreachable broker, before a worker thread exists: a worker's
        # own connection retries cannot be interrupted from outside.
        with app.connection_for_write() as conn:
            try:
                conn.ensure_connection(max_retries=1, interval_start=0, interval_step=0.1)
            except Exception as exc:
                raise RuntimeError(
                    f"broker {app.conf.broker_url} unreachable: {exc!r}; worker not started"
                ) from exc
        celery_logger = logging.getLogger("celery")
        self._saved = {
            "default_app": celery_state.default_app,
            "join_will_block": celery_state.task_join_will_block(),
            "log_level": celery_logger.level,
        }
        celery_logger.setLevel(self.loglevel)
        app.set_default()
        # A fresh kombu event loop for each worker. The loop is a process global that the
        # next worker would otherwise reuse, still bound to the old worker's timer (and
        # shared with a worker thread abandoned by stop()).
        set_event_loop(None)
        worker = _EmbeddedWorkController(
            app=app,
            hostname=self.hostname,
            pool=self.pool,
            concurrency=self.concurrency,
            loglevel=self.loglevel,
            logfile=None,
            poll_timeout=self.poll_timeout,
            # Celery's default bootsteps (mingle, gossip, heartbeat on), as users run
            # workers; a test about turning one off passes e.g. without_mingle=True.
            **{**DEFAULT_STEPS, **self.worker_options},
        )
        thread = threading.Thread(
            target=self._run, args=(worker,), name=f"celery-{self.hostname}", daemon=True
        )
        self.worker, self.thread = worker, thread
        thread.start()

        def ready_or_dead() -> bool:
            return worker.ready_event.is_set() or not thread.is_alive()

        try:
            wait_for(
                ready_or_dead,
                timeout=self.start_timeout,
                interval=0.005,
                message=f"{self.hostname} to become ready",
            )
        except AssertionError:
            self.stop(timeout=min(self.shutdown_timeout, 5.0))
            raise RuntimeError(
                f"in-process worker {self.hostname} was not ready after "
                f"{self.start_timeout}s; see the captured log"
            ) from None
        if not worker.ready_event.is_set():
            exitcode = getattr(worker, "exitcode", None)
            self.stop(timeout=1.0)
            raise RuntimeError(
                f"in-process worker {self.hostname} exited during startup "
                f"(exitcode {exitcode}); its error is in the captured log"
            )
        # The Pool bootstep sets the process-global "join will block" flag (True for
        # solo/threads), which would make result.get() in the test thread raise.
        celery_state._set_task_join_will_block(False)

    def _run(self, worker: _EmbeddedWorkController) -> None:
        self.app.set_current()
        try:
            worker.start()  # returns after (cold or warm) shutdown; logs its own errors
        except BaseException:
            logger.exception("in-process worker %s crashed", self.hostname)

    def stop(self, timeout: float | None = None) -> bool:
        """Stop the worker (cold); return whether its thread ended within ``timeout``.

        ``timeout`` defaults to ``shutdown_timeout``. Idempotent: ``True`` if not running.
        """
        worker, thread = self.worker, self.thread
        if worker is None or thread is None:
            return True
        timeout = self.shutdown_timeout if timeout is None else timeout
        try:
            worker.request_stop()
            thread.join(timeout)
            finished = not thread.is_alive()
            if not finished:
                self.abandoned.append(thread)
                logger.warning(
                    "in-process worker %s still busy after %.1fs (a task body still running, "
                    "or broker connection retries); its thread ends when that returns",
                    self.hostname,
                    timeout,
                )
            executor = getattr(getattr(worker, "pool", None), "executor", None)
            if executor is not None:
                # Celery's cold shutdown leaves the threads pool's executor alive; free
                # its idle threads now without waiting for a body that is still running.
                executor.shutdown(wait=False, cancel_futures=True)
            return finished
        finally:
            self._restore_globals()
            self.worker = self.thread = None
            self._release_slot()

    def _restore_globals(self) -> None:
        """Undo what :meth:`start` changed in process-global state."""
        saved, self._saved = self._saved, {}
        if saved:
            celery_state._set_task_join_will_block(saved["join_will_block"])
            celery_state.set_default_app(saved["default_app"])
            logging.getLogger("celery").setLevel(saved["log_level"])

    def _release_slot(self) -> None:
        with _inprocess_lock:
            if InProcessWorker._running is self:
                InProcessWorker._running = None

    def __enter__(self) -> InProcessWorker:
        if not self.running:
            self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


# --------------------------------------------------------------------------- processes


def _proc_stat(pid: int) -> tuple[str, int, int] | None:
    """``(state, ppid, pgid)`` of ``pid`` from /proc, or None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return fields[0], int(fields[1]), int(fields[2])


def _all_pids() -> Iterable[int]:
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            yield int(entry.name)


def child_pids_of(pid: int) -> list[int]:
    """Live (non-zombie) direct children of ``pid``, sorted.

    Reads ``/proc/<pid>/task/*/children`` when the kernel has it
    (``CONFIG_PROC_CHILDREN``; every thread's list, since a child forked by a thread is
    listed under that thread), and otherwise scans ``/proc/*/stat`` for processes whose
    parent is ``pid``. Both are snapshots: poll with ``wait_for`` for a change.
    """
    found: set[int] = set()
    task_dir = Path(f"/proc/{pid}/task")
    children_files = list(task_dir.glob("*/children"))
    if children_files:
        for path in children_files:
            with contextlib.suppress(OSError):
                found.update(int(p) for p in path.read_text().split())
    elif task_dir.is_dir():
        for other in _all_pids():
            stat = _proc_stat(other)
            if stat is not None and stat[1] == pid:
                found.add(other)
    return sorted(p for p in found if (s := _proc_stat(p)) is not None and s[0] not in "ZX")


def group_pids(pgid: int) -> list[int]:
    """Live (non-zombie) processes whose process group is ``pgid``, from /proc, sorted."""
    pids = []
    for pid in _all_pids():
        stat = _proc_stat(pid)
        if stat is not None and stat[2] == pgid and stat[0] not in "ZX":
            pids.append(pid)
    return sorted(pids)


class WorkerExited(AssertionError):
    """The worker process exited while a test was waiting for something from it."""


_process_registry: set[WorkerProcess] = set()
_registry_lock = threading.Lock()


class WorkerProcess:
    """``python -m celery -A <app_module> worker`` as a subprocess, in its own session.

    ``WorkerProcess(app_module="tests.apps.plain", *, pool="prefork", concurrency=2,
    redis_url=None, env=None, name=None, loglevel="INFO", log_dir=None, extra_args=(),
    cwd=REPO_ROOT, ready_timeout=60.0, stop_timeout=15.0)``.

    The command line is ``<python> -m celery -A <app_module> worker --pool=<pool>
    --concurrency=<n> --loglevel=<loglevel> -n <name>@%h <extra_args...>``: Celery's default
    bootsteps (mingle, gossip, heartbeat), as users start workers; a test about turning one
    off passes ``--without-mingle`` etc. in ``extra_args``. Run with ``cwd`` (the repository
    root) and ``PYTHONPATH`` starting with the repository root, so ``tests.apps.*`` imports.
    The environment is the test process's, plus ``PYTHONUNBUFFERED=1``,
    ``$REDLOCK_TEST_REDIS_URL=redis_url`` when given, and then ``env``. stdout and stderr go
    to :attr:`log_path` (``<log_dir>/<name>.log``; ``log_dir`` defaults to a new temporary
    directory, kept for post-mortems).

    The worker is a session leader, so its pid is also its process-group id and the pool
    children (which do not change group) are in that group: :meth:`kill` and the last
    resort of :meth:`stop` SIGKILL the whole group. The main process is reaped only after
    the group was killed, so the group id cannot have been reused by then.
    """

    def __init__(
        self,
        app_module: str = "tests.apps.plain",
        *,
        pool: str = "prefork",
        concurrency: int = 2,
        redis_url: str | None = None,
        env: dict[str, str] | None = None,
        name: str | None = None,
        loglevel: str = "INFO",
        log_dir: str | os.PathLike[str] | None = None,
        extra_args: Sequence[str] = (),
        cwd: str | os.PathLike[str] = REPO_ROOT,
        ready_timeout: float = 60.0,
        stop_timeout: float = 15.0,
    ) -> None:
        self.app_module = app_module
        self.pool = pool
        self.concurrency = concurrency
        self.redis_url = redis_url
        self.env = dict(env or {})
        self.name = name or unique_nodename(app_module.rsplit(".", 1)[-1])
        if "@" in self.name:
            raise ValueError("name is the part before '@'; the host part is %h")
        self.loglevel = loglevel
        self.extra_args = tuple(str(a) for a in extra_args)
        self.cwd = Path(cwd)
        self.ready_timeout = ready_timeout
        self.stop_timeout = stop_timeout
        self._log_dir = Path(log_dir) if log_dir is not None else None
        self._proc: subprocess.Popen[bytes] | None = None
        self._last_pid: int | None = None
        self.returncode: int | None = None
        self.startup_seconds: float | None = None
        self._log_offset = 0
        self._lock = threading.RLock()

    # ----------------------------------------------------------------- properties

    @property
    def nodename(self) -> str:
        """The full node name, ``<name>@<hostname>`` (what ``-n <name>@%h`` expands to)."""
        return f"{self.name}@{socket.gethostname()}"

    @property
    def pid(self) -> int | None:
        """Pid of the main worker process (the last one after stop/kill)."""
        return self._last_pid

    @property
    def log_dir(self) -> Path:
        if self._log_dir is None:
            self._log_dir = Path(tempfile.mkdtemp(prefix="celery-worker-"))
        return self._log_dir

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"{self.name}.log"

    def alive(self) -> bool:
        """Whether the main process is running (not exited, not a zombie)."""
        return self._proc is not None and not self._main_exited()

    def command_line(self) -> list[str]:
        """The full command line used to start the worker."""
        return [
            sys.executable, "-m", "celery", "-A", self.app_module, "worker",
            f"--pool={self.pool}",
            f"--concurrency={self.concurrency}",
            f"--loglevel={self.loglevel}",
            "-n", f"{self.name}@%h",
            *self.extra_args,
        ]  # fmt: skip

    def ready_pattern(self) -> re.Pattern[str]:
        """The log line that says the process is ready."""
        return re.compile(re.escape(self.name) + r"@\S+ ready\.")

    def environment(self) -> dict[str, str]:
        """The environment the worker is started with."""
        env = dict(os.environ)
        pythonpath = [str(REPO_ROOT)]
        if env.get("PYTHONPATH"):
            pythonpath.append(env["PYTHONPATH"])
        env["PYTHONPATH"] = os.pathsep.join(pythonpath)
        env["PYTHONUNBUFFERED"] = "1"
        if self.redis_url is not None:
            env[APP_URL_ENV] = self.redis_url
        env.update(self.env)
        return env

    def __repr__(self) -> str:
        state = "running" if self.alive() else "stopped"
        return f"<WorkerProcess {self.name} pid={self._last_pid} {self.pool} {state}>"

    # ----------------------------------------------------------------- logs

    def log_text(self, *, since_start: bool = False) -> str:
        """What the worker wrote to stdout/stderr so far (all runs, or since the last start)."""
        try:
            with open(self.log_path, "rb") as log:
                if since_start:
                    log.seek(self._log_offset)
                return log.read().decode(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def wait_for_log(
        self, pattern: str | re.Pattern[str], timeout: float = 10.0, *, since_start: bool = True
    ) -> re.Match[str] | str:
        """Wait until the log contains ``pattern``; return the substring or the match.

        A ``str`` is a plain substring, a compiled pattern is searched with ``search``.
        Only what was logged since the last :meth:`start` counts, unless ``since_start``
        is false (the log file is appended to by every start of this worker).
        Raises ``WaitTimeout`` with the log tail, or :class:`WorkerExited` as soon as the
        worker exits without having logged it (both are AssertionErrors).
        """

        def found() -> re.Match[str] | str | None:
            text = self.log_text(since_start=since_start)
            if isinstance(pattern, re.Pattern):
                match = pattern.search(text)
            else:
                match = pattern if pattern in text else None
            if match is None and not self.alive():
                raise WorkerExited(
                    f"{self!r} exited (code {self._exit_code()}) before logging "
                    f"{pattern!r}:\n--- {self.log_path} ---\n{self.log_tail()}"
                )
            return match

        try:
            return wait_for(found, timeout=timeout, interval=0.02, message=f"log {pattern!r}")
        except WaitTimeout as exc:
            raise WaitTimeout(f"{exc}\n--- {self.log_path} ---\n{self.log_tail()}") from None

    # ----------------------------------------------------------------- processes

    def child_pids(self) -> list[int]:
        """Live direct children of the main process: the prefork pool processes.

        See :func:`child_pids_of` for how they are found. Empty for solo/threads pools.
        """
        pid = self._proc.pid if self._proc is not None else None
        return [] if pid is None else child_pids_of(pid)

    def group_pids(self) -> list[int]:
        """Live processes in the worker's process group (main, pool children, their kids)."""
        return [] if self._last_pid is None else group_pids(self._last_pid)

    # ----------------------------------------------------------------- lifecycle

    def start(self, timeout: float | None = None) -> WorkerProcess:
        """Start the worker and wait for its ``<name>@<host> ready.`` log line.

        Raises ``RuntimeError`` with the log tail if it exits or is not ready within
        ``timeout`` (default ``ready_timeout``); the process group is killed then.
        """
        timeout = self.ready_timeout if timeout is None else timeout
        with self._lock:
            if self.alive():
                raise RuntimeError(f"{self!r} is already running")
            if self._proc is not None:
                self._finish()
            self.log_dir.mkdir(parents=True, exist_ok=True)
            started = time.monotonic()
            with open(self.log_path, "ab") as log:
                self._log_offset = log.tell()
                proc = subprocess.Popen(
                    self.command_line(),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=self.cwd,
                    env=self.environment(),
                    start_new_session=True,
                )
            self._proc, self._last_pid, self.returncode = proc, proc.pid, None
            with _registry_lock:
                _process_registry.add(self)
            ready = self.ready_pattern()
            try:
                self.wait_for_log(ready, timeout=timeout)
            except BaseException as exc:
                self.kill()
                if isinstance(exc, AssertionError):
                    raise RuntimeError(
                        f"celery worker {self.name} did not become ready within {timeout}s: "
                        f"{exc}\ncommand: {' '.join(self.command_line())}"
                    ) from None
                raise
            self.startup_seconds = time.monotonic() - started
            return self

    def stop(self, timeout: float | None = None) -> int | None:
        """SIGTERM (warm shutdown), wait ``timeout`` (default ``stop_timeout``), else SIGKILL.

        Then SIGKILLs whatever is left in the process group, reaps the main process and
        waits until no process of the group remains. Returns the exit code.
        """
        timeout = self.stop_timeout if timeout is None else timeout
        with self._lock:
            proc = self._proc
            if proc is None:
                return self.returncode
            try:
                if not self._main_exited():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(proc.pid, signal.SIGTERM)
                    try:
                        wait_for(self._main_exited, timeout=timeout, interval=0.02)
                    except AssertionError:
                        logger.warning(
                            "%r ignored SIGTERM for %.1fs; killing its process group", self, timeout
                        )
            finally:
                self._finish()
            return self.returncode

    def kill(self) -> None:
        """SIGKILL the main process and every process of its group; reap."""
        with self._lock:
            if self._proc is not None:
                self._finish()

    def __enter__(self) -> WorkerProcess:
        if not self.alive():
            self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # ----------------------------------------------------------------- internals

    def _main_exited(self) -> bool:
        """Whether the main process has exited, without reaping it (its pid stays ours)."""
        proc = self._proc
        if proc is None:
            return True
        if proc.returncode is not None:
            return True
        try:
            info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return True
        return info is not None

    def _exit_code(self) -> int | None:
        proc = self._proc
        if proc is None or not self._main_exited():
            return self.returncode
        with contextlib.suppress(OSError):
            info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            if info is not None:
                if info.si_code == os.CLD_EXITED:
                    return info.si_status
                return -info.si_status
        return proc.returncode

    def _finish(self) -> None:
        """SIGKILL the group (the unreaped main pins the pgid), reap, wait for the group."""
        proc = self._proc
        if proc is None:
            return
        try:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=max(self.stop_timeout, 5.0))
        finally:
            self.returncode = proc.returncode
            self._proc = None
            with _registry_lock:
                _process_registry.discard(self)
        # Pool children killed above are reparented and reaped by init; wait until none
        # is alive so that "stopped" means "no process left".
        pgid = proc.pid
        wait_for(
            lambda: not group_pids(pgid),
            timeout=10,
            interval=0.02,
            message=f"process group {pgid} of {self.name} to be empty",
        )


def _kill_all_workers() -> None:
    """Atexit safety net: SIGKILL the process group of every worker still running."""
    with _registry_lock:
        workers = list(_process_registry)
        _process_registry.clear()
    for worker in workers:
        proc = worker._proc
        if proc is None:
            continue
        if proc.returncode is None:
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired, OSError):
            proc.wait(5)


atexit.register(_kill_all_workers)


__all__ = [
    "APP_URL_ENV",
    "IN_PROCESS_POOLS",
    "REPO_ROOT",
    "BeatProcess",
    "InProcessWorker",
    "Interval",
    "WorkerExited",
    "WorkerProcess",
    "child_pids_of",
    "close_app",
    "collect_garbage",
    "group_pids",
    "make_app",
    "quiesce_apps_on",
    "read_intervals",
    "redis_url_with_db",
    "unique_nodename",
]


class BeatProcess(WorkerProcess):
    """``python -m celery -A <app_module> beat`` as a subprocess (see :class:`WorkerProcess`).

    ``scheduler`` is passed as ``-S``; each beat gets its own schedule file in its log
    directory. Ready once it logs ``beat: Starting...``.
    """

    def __init__(self, app_module: str, *, scheduler: str | None = None, **kwargs: Any) -> None:
        kwargs.setdefault("name", unique_nodename("beat"))
        super().__init__(app_module, pool="solo", concurrency=1, **kwargs)
        self.scheduler = scheduler

    def command_line(self) -> list[str]:
        """The full command line used to start beat."""
        scheduler = ["-S", self.scheduler] if self.scheduler else []
        return [
            sys.executable, "-m", "celery", "-A", self.app_module, "beat",
            f"--loglevel={self.loglevel}",
            "-s", str(self.log_dir / f"{self.name}.schedule"),
            "--pidfile=",
            *scheduler,
            *self.extra_args,
        ]  # fmt: skip

    def ready_pattern(self) -> re.Pattern[str]:
        """Beat is up once it logs that it starts."""
        return re.compile(r"beat: Starting\.\.\.")

    def __repr__(self) -> str:
        state = "running" if self.alive() else "stopped"
        return f"<BeatProcess {self.name} pid={self._last_pid} {state}>"


def close_app(app: celery.Celery) -> None:
    """Close ``app`` and collect its garbage while its Redis is still up.

    AsyncResult.__del__ talks to the result backend, and sockets of Celery's pools may be
    collected only at the next GC: left to chance, both happen during a later test,
    whose Redis is another one (an unraisable error or a ResourceWarning there). Sockets
    this app leaves unclosed are collected here, quietly. Results that stay reachable
    (Celery keeps apps alive past ``close()``) unsubscribe through the result consumer
    when collected; it is closed here, so that they do no I/O then.
    """
    stop_result_consumer(app)
    app.close()
    collect_garbage()


def stop_result_consumer(app: celery.Celery) -> None:
    """Stop ``app``'s result consumer, so that its AsyncResults do no I/O when collected."""
    backend = getattr(app._local, "backend", None) or getattr(app, "_backend_cache", None)
    consumer = getattr(backend, "result_consumer", None)
    if getattr(consumer, "_pubsub", None) is not None:
        consumer.stop()
        consumer._pubsub = None


def quiesce_apps_on(ports: Iterable[int | None]) -> None:
    """Stop the result consumers of every app whose result backend is on ``ports``.

    For servers about to stop: an AsyncResult of such an app that a test left behind
    (an app it did not close) would otherwise try to reconnect when collected, during
    whichever later test that happens in, and fail there (an unraisable error).
    """
    wanted = {f"127.0.0.1:{port}" for port in ports if port is not None}
    for app in list(celery_state._get_active_apps()):
        backend_url = str(app.conf.get("result_backend") or "")
        if any(address in backend_url for address in wanted):
            stop_result_consumer(app)


def collect_garbage() -> None:
    """Collect unreachable objects now, quietly about the sockets among them.

    Run while the servers they talk to still run: an AsyncResult's ``__del__``
    unsubscribes from the result backend (before Celery 5.7, raising when the server
    is gone, an unraisable error in whichever later test the collection happens).
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        gc.collect()
