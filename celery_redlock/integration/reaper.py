"""Releasing the locks of a prefork pool child that died (SIGKILL, OOM, hard time limit).

A killed child cannot release its lock, and ``task_postrun`` never fires for it;
left alone the lock would block the task's key for up to one TTL. The worker's
main process releases it at once instead:

* Before taking a lock, the child announces ``["+", <task id>, <key>]`` (JSON) on a
  pipe the main process created before forking its children; ``"-"`` when the lock
  is released or was never obtained. JSON escapes every newline, so any task name,
  key and task id round-trips. A message is sent as lines ``<pid> <n> <+|.> <part>``
  of at most ``PIPE_BUF`` bytes, each within one ``write`` call (which may carry
  several), so children never interleave within a line; the main process joins a
  child's parts in order (``n`` = 0 starts a message, ``.`` ends it). The pipe is
  non-blocking, so a busy main process can never stall a task: what does not fit
  waits in the child for its next write (a child that dies meanwhile leaves that
  lock to its TTL).
* A ``"-"`` is not written on its own: it waits for the child's next ``"+"`` (or its
  exit), so a task costs its child one ``write``. Until then the main process
  believes the child still holds the key, which is harmless: see below.
* Each child says hello once, when it starts, on a second pipe that the main
  process reads at once: from then on it watches the child with a ``pidfd`` (Linux
  5.3+) from a thread of its own. The announcements themselves it reads every
  :data:`DRAIN_INTERVAL` seconds rather than on every write, and
  always when a child exits: then it runs ``release_if.lua`` for each lock the child
  announced. The lock is deleted only if it is still held by that task id *and*
  that pid, so a lock the child had released, and a later attempt of the same task
  (a redelivery, in another process), are never touched. (Watching a child only
  from its first announcement read left a window: a child killed within a drain
  interval of taking its lock kept it until the next read, and a redelivered copy
  found it busy.)

Why a thread and not the worker's event loop (kombu's hub): before kombu 5.7 the
Redis transport polls the hub's own poller in a *blocking* ``drain_events`` (mingle
at start, and again after each broker reconnect) and raises ``KeyError`` for any fd
it does not know: a readable pipe or pidfd of ours there killed the worker at start
(``Unrecoverable error: KeyError(6)``). A thread of our own depends on no version of
kombu, and a release for a dead child never waits behind the event loop.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import select
import threading
from typing import cast

from ..base import forksafe, metrics
from ..base.poll import readable
from ..engine.keys import keys_of
from ..engine.scripts import RELEASE_IF, ReleaseIfStatus
from ..engine.waiting import named_reserve_ms
from ..nodes import NodeSet
from . import events
from .settings import Settings

__all__ = ["DRAIN_INTERVAL", "Reaper", "announce", "encode", "flush", "forget", "in_pool_child"]

logger = logging.getLogger("celery_redlock.reaper")

#: Seconds between two reads of the pipe by the main process.
DRAIN_INTERVAL = 0.2

#: The pipe's capacity asked for: a main process busy for a whole drain interval
#: must find every child's messages there (Linux's default of 64 KiB holds ~500).
PIPE_SIZE = 1 << 20

# In a pool child: the pipe's write end, inherited from the main process, and the
# lines not written yet (each "-" until the next "+"; what a full pipe refused).
_write_fd: int | None = None
_pending: list[bytes] = []

#: ``write`` calls this process made on the pipe, for tests.
writes = 0


def in_pool_child() -> bool:
    """True in a prefork pool child that reports its locks to the main process."""
    return _write_fd is not None


def announce(task_id: str, key: str) -> None:
    """Tell the main process this child is about to hold ``key`` for ``task_id``."""
    if _write_fd is not None:
        _pending.extend(encode(forksafe.pid(), "+", task_id, key))
        flush()


def forget(task_id: str, key: str) -> None:
    """Tell the main process, with the next announcement, that ``key`` is no longer held."""
    if _write_fd is not None:
        _pending.extend(encode(forksafe.pid(), "-", task_id, key))


def flush() -> None:
    """Write the lines still pending, as few ``write`` calls as ``PIPE_BUF`` allows.

    A line leaves the list only once written: an exception in between (a soft time
    limit, an abort) sends it twice at worst, which the main process takes as is.
    """
    global writes  # noqa: PLW0603
    fd = _write_fd
    if fd is None:
        return
    try:
        while _pending:
            size, count = len(_pending[0]), 1
            while count < len(_pending) and size + len(_pending[count]) <= select.PIPE_BUF:
                size += len(_pending[count])
                count += 1
            os.write(fd, b"".join(_pending[:count]))
            writes += 1
            del _pending[:count]
    except BlockingIOError:
        logger.warning(
            "worker busy: %d lock announcement(s) wait for the next one (a lock of a child "
            "that dies meanwhile waits for its TTL)",
            len(_pending),
        )
    except OSError as exc:  # the main process is gone: nobody will read them
        _pending.clear()
        logger.warning("cannot announce locks to the worker: %s", exc)


def encode(pid: int, op: str, task_id: str, key: str) -> list[bytes]:
    """The pipe lines announcing ``op`` (``+``/``-``) of ``key`` for ``task_id``.

    Each line is at most ``PIPE_BUF`` bytes, so one ``write`` never interleaves
    with another child's.
    """
    message = json.dumps([op, task_id, key], ensure_ascii=False, separators=(",", ":"))
    data = message.encode("utf-8", "surrogatepass")
    room = select.PIPE_BUF - len(f"{pid} {len(data)} + \n")
    parts = [data[i : i + room] for i in range(0, len(data), room)]
    return [
        b"%d %d %s %s\n" % (pid, index, b"." if index == len(parts) - 1 else b"+", part)
        for index, part in enumerate(parts)
    ]


def _read_lines(fd: int, pending: bytes) -> tuple[list[bytes], bytes]:
    """Read what a non-blocking pipe holds: its complete lines, and the rest."""
    with contextlib.suppress(BlockingIOError):
        while chunk := os.read(fd, 65536):
            pending += chunk
    *lines, rest = pending.split(b"\n")
    return lines, rest


class Reaper:
    """The main process side: tracks what each child holds, releases it when it dies."""

    def __init__(self, nodeset: NodeSet, settings: Settings | None = None) -> None:
        self.nodeset = nodeset
        #: The app's settings, for the event log (None: no events).
        self.settings = settings
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.read_fd, False)
        os.set_blocking(self.write_fd, False)
        self._buffer = b""
        # pid -> the parts of a message that child is still sending
        self._parts: dict[int, bytes] = {}
        # pid -> pidfd, and pid -> {(task id, key)}
        self._pidfds: dict[int, int] = {}
        self._held: dict[int, set[tuple[str, str]]] = {}
        with contextlib.suppress(AttributeError, OSError):  # Linux only; capped by the OS
            fcntl.fcntl(self.write_fd, fcntl.F_SETPIPE_SZ, PIPE_SIZE)
        # Children's pids, one line each at their start: read as soon as written.
        self.hello_r, self.hello_w = os.pipe()
        os.set_blocking(self.hello_r, False)
        os.set_blocking(self.hello_w, False)
        self._hellos = b""
        #: Reads of the pipe, for tests.
        self.drains = 0
        self._thread: threading.Thread | None = None
        self._wake_r, self._wake_w = os.pipe()
        #: Locks released for dead children, for tests and logs.
        self.released = 0

    # -- in the child ---------------------------------------------------------------

    def child_init(self) -> None:
        """Run in a freshly forked pool child: announce locks on our pipe."""
        global _write_fd  # noqa: PLW0603
        _write_fd = self.write_fd
        _pending.clear()
        try:
            os.write(self.hello_w, b"%d\n" % os.getpid())
        except OSError as exc:  # its locks are still watched from its first announcement
            logger.warning("cannot tell the worker this pool process started: %s", exc)
        for fd in (self.read_fd, self.hello_r, self.hello_w, self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._pidfds.clear()
        self._held.clear()
        self._parts.clear()

    # -- in the main process ----------------------------------------------------------

    def start(self) -> None:
        """Watch the pipe and the children from a thread (see the module's docstring)."""
        self._thread = threading.Thread(target=self._run, name="celery_redlock-reaper", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop watching (worker shutdown)."""
        if self._thread is not None:
            os.write(self._wake_w, b"x")
            self._thread.join(5)

    def _run(self) -> None:
        while True:
            watched: dict[int, int | None] = {self._wake_r: None, self.hello_r: None}
            watched.update({fd: pid for pid, fd in self._pidfds.items()})
            ready = readable(watched, DRAIN_INTERVAL)
            if self._wake_r in ready:
                return
            if self.hello_r in ready:
                ready.remove(self.hello_r)
                self.on_hello()
            self.on_pipe_readable()
            for fd in ready:
                self.on_child_exit(cast(int, watched[fd]))  # a pidfd: a pid

    def on_hello(self) -> None:
        """Start watching the children that just started."""
        lines, self._hellos = _read_lines(self.hello_r, self._hellos)
        for line in lines:
            try:
                pid = int(line)
            except ValueError:
                logger.warning("ignoring a malformed pool process hello: %r", line)
                continue
            self._watch(pid)

    def on_pipe_readable(self) -> None:
        """Read the children's announcements and start watching new children."""
        self.drains += 1
        lines, self._buffer = _read_lines(self.read_fd, self._buffer)
        for raw in lines:
            try:
                pid_text, index, more, part = raw.split(b" ", 3)
                pid = int(pid_text)
                # A first part drops what an earlier, interrupted message left.
                data = part if index == b"0" else self._parts.pop(pid, b"") + part
                if more == b"+":
                    self._parts[pid] = data
                    continue
                op, task_id, key = json.loads(data.decode("utf-8", "surrogatepass"))
            except (ValueError, TypeError):
                logger.warning("ignoring a malformed lock announcement: %r", raw)
                continue
            held = self._held.setdefault(pid, set())
            if op == "+":
                held.add((task_id, key))
                self._watch(pid)
            else:
                held.discard((task_id, key))

    def _watch(self, pid: int) -> None:
        if pid in self._pidfds:
            return
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            self.on_child_exit(pid)
            return
        except OSError as exc:  # no pidfd support: the lock waits for its TTL
            logger.warning("cannot watch pool process %d (%s)", pid, exc)
            return
        self._pidfds[pid] = fd

    def on_child_exit(self, pid: int) -> None:
        """A child exited: release what it still held."""
        fd = self._pidfds.pop(pid, None)
        if fd is not None:
            os.close(fd)
        self.on_pipe_readable()  # anything it announced just before dying
        if metrics.enabled:
            metrics.process_died(pid)
        self._parts.pop(pid, None)
        for task_id, key in self._held.pop(pid, ()):
            self._release(pid, task_id, key)

    def _release(self, pid: int, task_id: str, key: str) -> None:
        # Named and kept for the oldest recorded waiter, as a release by its holder would.
        call = RELEASE_IF.on(keys_of(key), task_id=task_id, pid=pid, reserve_ms=named_reserve_ms())
        replies = self.nodeset.call([call])
        codes = [r.values[0] for r in replies if r is not None and r.ok]
        if ReleaseIfStatus.RELEASED in codes:
            self.released += 1
            if self.settings is not None:
                events.record(self.settings, self.nodeset, "reaped", (key,), None, task_id,
                              child=pid)  # fmt: skip
            logger.warning(
                "Pool process %d died while task %s held %s: lock released", pid, task_id, key
            )
        else:
            logger.info(
                "Pool process %d died; its lock %s for task %s was already free or taken over (%s)",
                pid,
                key,
                task_id,
                codes or "no node answered",
            )
