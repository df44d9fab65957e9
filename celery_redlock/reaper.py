"""Releasing the locks of a prefork pool child that died (SIGKILL, OOM, hard time limit).

A killed child cannot release its lock, and ``task_postrun`` never fires for it;
left alone the lock would block the task's key for up to one TTL. The worker's
main process releases it at once instead:

* Before taking a lock, the child announces ``["+", <task id>, <key>]`` (JSON) on a
  pipe the main process created before forking its children (``"-"`` when the lock
  is released or was never obtained). JSON escapes every newline, so any task name,
  key and task id round-trips. A message is sent as lines ``<pid> <n> <+|.> <part>``
  each written by one ``write`` call of at most ``PIPE_BUF`` bytes, so children
  never interleave within a line; the main process joins a child's parts in order
  (``n`` = 0 starts a message, ``.`` ends it). The pipe is non-blocking, so a busy
  main process can never stall a task (a dropped message only means that lock
  waits for its TTL).
* The main process watches each announcing child with a ``pidfd`` (Linux 5.3+) in
  the worker's event loop (a thread when the worker has none). When the child
  exits it runs ``release_if.lua`` for each lock the child announced: the lock is
  deleted only if it is still held by that task id *and* that pid, so a later
  attempt of the same task (a redelivery, in another process) is never touched.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import threading
from collections.abc import Callable
from typing import Any, cast

from . import metrics
from .engine.keys import keys_of
from .engine.scripts import RELEASE_IF, ReleaseIfStatus
from .nodes import Call, NodeSet

__all__ = ["Reaper", "announce", "encode", "forget", "in_pool_child"]

logger = logging.getLogger("celery_redlock.reaper")

# In a pool child: the pipe's write end, inherited from the main process.
_write_fd: int | None = None


def in_pool_child() -> bool:
    """True in a prefork pool child that reports its locks to the main process."""
    return _write_fd is not None


def announce(task_id: str, key: str) -> None:
    """Tell the main process this child is about to hold ``key`` for ``task_id``."""
    _send("+", task_id, key)


def forget(task_id: str, key: str) -> None:
    """Tell the main process this child no longer holds ``key`` for ``task_id``."""
    _send("-", task_id, key)


def _send(op: str, task_id: str, key: str) -> None:
    fd = _write_fd
    if fd is None:
        return
    try:
        for line in encode(os.getpid(), op, task_id, key):
            os.write(fd, line)
    except BlockingIOError:
        logger.warning("worker busy; lock %r of a dead child would wait for its TTL", key)
    except OSError as exc:
        logger.warning("cannot announce lock %r to the worker: %s", key, exc)


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


class Reaper:
    """The main process side: tracks what each child holds, releases it when it dies."""

    def __init__(self, nodeset: NodeSet) -> None:
        self.nodeset = nodeset
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.read_fd, False)
        os.set_blocking(self.write_fd, False)
        self._buffer = b""
        # pid -> the parts of a message that child is still sending
        self._parts: dict[int, bytes] = {}
        # pid -> pidfd, and pid -> {(task id, key)}
        self._pidfds: dict[int, int] = {}
        self._held: dict[int, set[tuple[str, str]]] = {}
        self._add_reader: Callable[..., Any] | None = None
        self._remove_reader: Callable[[int], Any] | None = None
        self._thread: threading.Thread | None = None
        self._wake_r, self._wake_w = os.pipe()
        #: Locks released for dead children, for tests and logs.
        self.released = 0

    # -- in the child ---------------------------------------------------------------

    def child_init(self) -> None:
        """Run in a freshly forked pool child: announce locks on our pipe."""
        global _write_fd  # noqa: PLW0603
        _write_fd = self.write_fd
        for fd in (self.read_fd, self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._pidfds.clear()
        self._held.clear()
        self._parts.clear()

    # -- in the main process ----------------------------------------------------------

    def start(self, hub: Any = None) -> None:
        """Watch the pipe and the children, in ``hub`` (kombu's event loop) or a thread."""
        if hub is not None:
            self._add_reader, self._remove_reader = hub.add_reader, hub.remove_reader
            hub.add_reader(self.read_fd, self.on_pipe_readable)
            return
        self._thread = threading.Thread(target=self._run, name="celery_redlock-reaper", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop watching (worker shutdown)."""
        if self._remove_reader is not None:
            for fd in [self.read_fd, *self._pidfds.values()]:
                with contextlib.suppress(Exception):
                    self._remove_reader(fd)
        elif self._thread is not None:
            os.write(self._wake_w, b"x")
            self._thread.join(5)

    def _run(self) -> None:
        while True:
            watched: dict[int, int | None] = {self.read_fd: None, self._wake_r: None}
            watched.update({fd: pid for pid, fd in self._pidfds.items()})
            ready, _, _ = select.select(list(watched), [], [])
            if self._wake_r in ready:
                return
            for fd in ready:
                if fd == self.read_fd:
                    self.on_pipe_readable()
                else:
                    self.on_child_exit(cast(int, watched[fd]))  # a pidfd: a pid

    def on_pipe_readable(self) -> None:
        """Read the children's announcements and start watching new children."""
        try:
            while chunk := os.read(self.read_fd, 65536):
                self._buffer += chunk
        except BlockingIOError:
            pass
        *lines, self._buffer = self._buffer.split(b"\n")
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
        if self._add_reader is not None:
            self._add_reader(fd, self.on_child_exit, pid)

    def on_child_exit(self, pid: int) -> None:
        """A child exited: release what it still held."""
        fd = self._pidfds.pop(pid, None)
        if fd is not None:
            if self._remove_reader is not None:
                with contextlib.suppress(Exception):
                    self._remove_reader(fd)
            os.close(fd)
        self.on_pipe_readable()  # anything it announced just before dying
        if metrics.enabled:
            metrics.process_died(pid)
        self._parts.pop(pid, None)
        for task_id, key in self._held.pop(pid, ()):
            self._release(pid, task_id, key)

    def _release(self, pid: int, task_id: str, key: str) -> None:
        replies = self.nodeset.call([Call(RELEASE_IF, keys_of(key).release_if, (task_id, pid))])
        codes = [r.values[0] for r in replies if r is not None and r.ok]
        if ReleaseIfStatus.RELEASED in codes:
            self.released += 1
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
