"""A TCP proxy on 127.0.0.1 that injects network faults between clients and a server.

One background thread runs a selector loop for all connections of a proxy (the thread
count does not grow with connections). Control methods are called from the test thread;
each one is executed by the proxy thread and has taken effect when it returns.

Modes:

* forwarding (the initial mode, and after :meth:`FaultProxy.restore`): bytes are copied
  both ways as they arrive;
* :meth:`FaultProxy.delay`: every chunk read from either side is delivered ``seconds``
  later (per-direction order is preserved, so a request/response round trip takes at
  least ``2 * seconds``);
* :meth:`FaultProxy.slow_current`: the same delay, for the connections open now only;
  connections opened later are forwarded at once. A request on an old connection can
  then arrive after a later one on a new connection, as when one TCP stream waits for
  a retransmission while a fresh one gets through;
* :meth:`FaultProxy.blackhole`: connections are still accepted, but nothing is forwarded
  or answered in either direction. Bytes that arrive are read and **dropped** (so kernel
  buffers never fill), and bytes still queued for delayed delivery are dropped too. If
  the server closes a connection while blackholed, the client is not told (silence).

:meth:`FaultProxy.restore` goes back to plain forwarding without delay. Dropped bytes are
not replayed, so a connection that was mid-request is desynchronised; redis-py drops a
connection after a timeout anyway. Connections accepted during the blackhole are
connected to the server at restore; connections whose server side went away during the
blackhole are closed (FIN) at restore.

:meth:`FaultProxy.reset` aborts every current connection with a TCP RST (``SO_LINGER``
0) on both the client and the server side; the proxy keeps listening in its current
mode. :meth:`FaultProxy.close` aborts all connections, closes the listening socket and
joins the thread.

If the target refuses a connection (server down), the client connection is reset.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import logging
import selectors
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

import redis

from .servers import HOST, make_client

logger = logging.getLogger("tests.harness")

_CHUNK = 65536
_HIGH_WATER = 4 * 1024 * 1024  # stop reading a side while this much is pending for the other
_COMMAND_TIMEOUT = 10.0
_LISTENER = object()
_WAKE = object()


def _set_rst_on_close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


class _Pipe:
    """One direction of a proxied connection."""

    __slots__ = ("buf", "eof", "last_due", "pending", "queue", "shut")

    def __init__(self) -> None:
        self.queue: deque[tuple[float, bytes]] = deque()  # (due time, chunk)
        self.buf = bytearray()  # due bytes not yet accepted by the kernel
        self.pending = 0  # bytes in queue + buf
        self.eof = False  # source sent EOF
        self.shut = False  # EOF propagated to destination
        self.last_due = 0.0

    def push(self, data: bytes, now: float, delay: float) -> None:
        due = max(now + delay, self.last_due)
        self.last_due = due
        self.pending += len(data)
        if due <= now and not self.queue:
            self.buf += data
        else:
            self.queue.append((due, data))

    def promote(self, now: float) -> None:
        while self.queue and self.queue[0][0] <= now:
            self.buf += self.queue.popleft()[1]

    def drop(self) -> None:
        self.queue.clear()
        self.buf.clear()
        self.pending = 0
        self.last_due = 0.0


class _Conn:
    __slots__ = (
        "client",
        "closed",
        "connecting",
        "delay",
        "down",
        "events",
        "lost_upstream",
        "up",
        "upstream",
    )

    def __init__(self, client: socket.socket) -> None:
        self.client = client
        self.upstream: socket.socket | None = None
        self.connecting = False
        self.lost_upstream = False
        self.closed = False
        self.up = _Pipe()  # client -> server
        self.down = _Pipe()  # server -> client
        self.events: dict[socket.socket, int] = {}
        self.delay: float | None = None  # this connection's own delay (slow_current)


class FaultProxy:
    """TCP proxy from a free 127.0.0.1 port to ``target_host:target_port``.

    ``password`` only affects :attr:`url` and :meth:`client` (pass the target server's).
    """

    def __init__(self, target_host: str, target_port: int, *, password: str | None = None) -> None:
        infos = socket.getaddrinfo(target_host, target_port, socket.AF_INET, socket.SOCK_STREAM)
        address = infos[0][4]
        if not ipaddress.ip_address(address[0]).is_loopback:
            raise ValueError(f"FaultProxy only targets loopback addresses, not {target_host}")
        self.target: tuple[str, int] = (address[0], int(address[1]))
        self.password = password
        self._delay = 0.0
        self._blackhole = False
        self._stopping = False
        self._closed = False
        self._error: BaseException | None = None
        self._conns: set[_Conn] = set()
        self._commands: deque[tuple[Callable[[], Any], threading.Event, dict[str, Any]]] = deque()
        self._commands_lock = threading.Lock()
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            self._listener.bind((HOST, 0))
            self._listener.listen(128)
            self._listener.setblocking(False)
        except OSError:
            self._close_own_sockets()
            raise
        self.port: int = self._listener.getsockname()[1]
        self._thread = threading.Thread(
            target=self._run, name=f"FaultProxy:{self.port}->{self.target[1]}", daemon=True
        )
        self._thread.start()

    # ------------------------------------------------------------------ public API

    @property
    def url(self) -> str:
        """``redis://[:password@]127.0.0.1:PORT/0`` of the proxy."""
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        return f"redis://{auth}{HOST}:{self.port}/0"

    @property
    def mode(self) -> str:
        """``"forward"``, ``"delay"`` or ``"blackhole"``."""
        if self._blackhole:
            return "blackhole"
        return "delay" if self._delay > 0 else "forward"

    def client(self, **kwargs: Any) -> redis.Redis:
        """A ``redis.Redis`` connected through the proxy (harness defaults, no retries)."""
        kwargs.setdefault("password", self.password)
        return make_client(HOST, self.port, **kwargs)

    def delay(self, seconds: float) -> None:
        """Forward again, delaying every chunk in both directions by ``seconds``."""
        if seconds < 0:
            raise ValueError("delay must be >= 0")
        self._call(lambda: self._do_forward(float(seconds)))

    def slow_current(self, seconds: float) -> None:
        """Delay the connections open now by ``seconds``; forward later ones at once."""
        if seconds < 0:
            raise ValueError("delay must be >= 0")

        def slow() -> None:
            for conn in self._conns:
                conn.delay = float(seconds)

        self._call(slow)

    def pending(self) -> int:
        """Bytes read from either side and not yet handed to the other (delayed ones)."""
        return int(self._call(lambda: sum(c.up.pending + c.down.pending for c in self._conns)))

    def blackhole(self) -> None:
        """Accept connections but forward and answer nothing (data is dropped)."""
        self._call(self._do_blackhole)

    def reset(self) -> None:
        """Abort every current connection with a TCP RST; keep listening in this mode."""
        self._call(self._do_reset)

    def restore(self) -> None:
        """Back to plain forwarding with no delay (dropped data is not replayed)."""
        self._call(lambda: self._do_forward(0.0))

    def connection_count(self) -> int:
        """Number of client connections the proxy currently holds."""
        return int(self._call(lambda: len(self._conns)))

    def close(self) -> None:
        """Abort all connections, stop listening and join the proxy thread (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._thread.is_alive():
            with contextlib.suppress(RuntimeError):
                self._call(self._do_close, check_closed=False)
            self._thread.join(_COMMAND_TIMEOUT)
            if self._thread.is_alive():
                raise RuntimeError(f"{self._thread.name} did not stop")
        self._close_own_sockets()
        if self._error is not None:
            raise RuntimeError(f"FaultProxy thread failed: {self._error!r}") from self._error

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<FaultProxy {HOST}:{self.port} -> {self.target[0]}:{self.target[1]} {self.mode}>"

    # ------------------------------------------------------------------ control plumbing

    def _call(self, fn: Callable[[], Any], *, check_closed: bool = True) -> Any:
        if check_closed and self._closed:
            raise RuntimeError(f"{self!r} is closed")
        if not self._thread.is_alive():
            raise RuntimeError(f"FaultProxy thread is not running (error: {self._error!r})")
        done = threading.Event()
        box: dict[str, Any] = {}
        with self._commands_lock:
            self._commands.append((fn, done, box))
        self._wake()
        if not done.wait(_COMMAND_TIMEOUT):
            raise RuntimeError(f"FaultProxy thread did not respond (error: {self._error!r})")
        if "error" in box:
            raise box["error"]
        return box.get("result")

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # BlockingIOError: a wake-up is already pending
            self._wake_w.send(b"\0")

    def _close_own_sockets(self) -> None:
        for sock in (self._listener, self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                sock.close()
        with contextlib.suppress(Exception):
            self._sel.close()

    # ------------------------------------------------------------------ commands (proxy thread)

    def _do_forward(self, delay: float) -> None:
        was_blackhole = self._blackhole
        self._blackhole = False
        self._delay = delay
        for conn in self._conns:
            conn.delay = None
        if not was_blackhole:
            return
        for conn in list(self._conns):
            conn.up.last_due = conn.down.last_due = 0.0
            if conn.upstream is None:
                if conn.lost_upstream:
                    self._close_conn(conn, rst=False)
                else:
                    self._connect_upstream(conn)

    def _do_blackhole(self) -> None:
        self._blackhole = True
        self._delay = 0.0
        for conn in self._conns:
            conn.up.drop()
            conn.down.drop()

    def _do_reset(self) -> None:
        for conn in list(self._conns):
            self._close_conn(conn, rst=True)

    def _do_close(self) -> None:
        self._stopping = True
        self._do_reset()

    def _run_commands(self) -> None:
        while True:
            with self._commands_lock:
                if not self._commands:
                    return
                fn, done, box = self._commands.popleft()
            try:
                box["result"] = fn()
            except Exception as exc:
                box["error"] = exc
            finally:
                done.set()

    # ------------------------------------------------------------------ event loop

    def _run(self) -> None:
        try:
            self._sel.register(self._listener, selectors.EVENT_READ, _LISTENER)
            self._sel.register(self._wake_r, selectors.EVENT_READ, _WAKE)
            while not self._stopping:
                self._update_interest()
                for key, mask in self._sel.select(self._next_timeout()):
                    if key.data is _LISTENER:
                        self._accept()
                    elif key.data is _WAKE:
                        with contextlib.suppress(OSError):
                            while self._wake_r.recv(4096):
                                pass
                    else:
                        conn, from_client = key.data
                        self._on_event(conn, from_client, mask)
                self._run_commands()
                self._pump()
        except BaseException as exc:  # a harness bug: surfaced by close(), never printed
            self._error = exc
        finally:
            for conn in list(self._conns):
                with contextlib.suppress(Exception):
                    self._close_conn(conn, rst=True)
            with contextlib.suppress(OSError):
                self._listener.close()
            # Fail any command still waiting so callers do not hang.
            with self._commands_lock:
                pending, self._commands = list(self._commands), deque()
            for _fn, done, box in pending:
                box["error"] = RuntimeError("FaultProxy thread stopped")
                done.set()

    def _next_timeout(self) -> float | None:
        due = [
            pipe.queue[0][0] for conn in self._conns for pipe in (conn.up, conn.down) if pipe.queue
        ]
        if not due:
            return None
        return max(0.0, min(due) - time.monotonic())

    def _accept(self) -> None:
        while True:
            try:
                sock, _addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # ECONNABORTED, EMFILE, ...
                logger.debug("FaultProxy accept failed: %s", exc)
                return
            sock.setblocking(False)
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = _Conn(sock)
            self._conns.add(conn)
            if not self._blackhole:
                self._connect_upstream(conn)

    def _connect_upstream(self, conn: _Conn) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        err = sock.connect_ex(self.target)
        if err not in (0, errno.EINPROGRESS, errno.EWOULDBLOCK, errno.EAGAIN):
            sock.close()
            self._close_conn(conn, rst=True)
            return
        conn.upstream = sock
        conn.connecting = err != 0
        conn.lost_upstream = False

    def _on_event(self, conn: _Conn, from_client: bool, mask: int) -> None:
        if conn.closed:
            return
        if not from_client and conn.connecting:
            if conn.upstream is None or not mask & selectors.EVENT_WRITE:
                return
            err = conn.upstream.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            if err and self._blackhole:
                self._drop_upstream(conn)  # the client keeps hearing silence
            elif err:  # target refused / unreachable: reset the client
                self._close_conn(conn, rst=True)
            else:
                conn.connecting = False
            return
        if mask & selectors.EVENT_READ:
            self._read(conn, from_client)
        # EVENT_WRITE needs nothing here: _pump() flushes every buffer each iteration.

    def _read(self, conn: _Conn, from_client: bool) -> None:
        sock = conn.client if from_client else conn.upstream
        if sock is None:
            return
        pipe = conn.up if from_client else conn.down
        try:
            data = sock.recv(_CHUNK)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = None  # reset by peer etc.
        if self._blackhole:
            if data:
                return  # dropped
            if from_client:
                self._close_conn(conn, rst=True)  # the client went away; quietly
            else:
                self._drop_upstream(conn)  # the client keeps hearing silence
            return
        if data is None:
            self._close_conn(conn, rst=True)  # propagate the abort to the other side
        elif not data:
            pipe.eof = True
        else:
            pipe.push(data, time.monotonic(), self._delay if conn.delay is None else conn.delay)

    def _pump(self) -> None:
        now = time.monotonic()
        for conn in list(self._conns):
            for pipe, dst in ((conn.up, conn.upstream), (conn.down, conn.client)):
                if conn.closed:
                    break
                pipe.promote(now)
                if dst is None or (dst is conn.upstream and conn.connecting):
                    continue
                if pipe.buf:
                    try:
                        sent = dst.send(pipe.buf)
                    except (BlockingIOError, InterruptedError):
                        sent = 0
                    except OSError:
                        self._close_conn(conn, rst=True)
                        break
                    del pipe.buf[:sent]
                    pipe.pending -= sent
                if pipe.eof and not pipe.shut and not pipe.buf and not pipe.queue:
                    with contextlib.suppress(OSError):
                        dst.shutdown(socket.SHUT_WR)
                    pipe.shut = True
            if not conn.closed and conn.up.shut and conn.down.shut:
                self._close_conn(conn, rst=False)

    def _update_interest(self) -> None:
        for conn in self._conns:
            wanted: dict[socket.socket, int] = {}
            read_client = not conn.up.eof and (self._blackhole or conn.up.pending < _HIGH_WATER)
            wanted[conn.client] = (selectors.EVENT_READ if read_client else 0) | (
                selectors.EVENT_WRITE if conn.down.buf else 0
            )
            if conn.upstream is not None:
                if conn.connecting:
                    wanted[conn.upstream] = selectors.EVENT_WRITE
                else:
                    read_up = not conn.down.eof and (
                        self._blackhole or conn.down.pending < _HIGH_WATER
                    )
                    wanted[conn.upstream] = (selectors.EVENT_READ if read_up else 0) | (
                        selectors.EVENT_WRITE if conn.up.buf else 0
                    )
            for sock, events in wanted.items():
                current = conn.events.get(sock, 0)
                if events == current:
                    continue
                data = (conn, sock is conn.client)
                if current and events:
                    self._sel.modify(sock, events, data)
                elif events:
                    self._sel.register(sock, events, data)
                else:
                    self._sel.unregister(sock)
                conn.events[sock] = events

    def _forget(self, conn: _Conn, sock: socket.socket, *, rst: bool) -> None:
        if conn.events.pop(sock, 0):
            with contextlib.suppress(KeyError, ValueError, OSError):
                self._sel.unregister(sock)
        if rst:
            _set_rst_on_close(sock)
        with contextlib.suppress(OSError):
            sock.close()

    def _drop_upstream(self, conn: _Conn) -> None:
        if conn.upstream is not None:
            self._forget(conn, conn.upstream, rst=True)
        conn.upstream = None
        conn.connecting = False
        conn.lost_upstream = True
        conn.up.drop()
        conn.down.drop()

    def _close_conn(self, conn: _Conn, *, rst: bool) -> None:
        if conn.closed:
            return
        conn.closed = True
        self._conns.discard(conn)
        self._forget(conn, conn.client, rst=rst)
        if conn.upstream is not None:
            self._forget(conn, conn.upstream, rst=rst)
            conn.upstream = None


__all__ = ["FaultProxy"]
