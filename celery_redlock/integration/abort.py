"""Stopping a running task body when its lock is lost.

The renewer notices the loss on its own thread; the body runs elsewhere. How the
:class:`~celery_redlock.LockLost` reaches the body depends on where it runs:

* **Main thread** (prefork pool children, the solo pool): the renewer sends the
  process ``SIGUSR1``, as billiard does for a soft time limit. Our handler, chained
  in front of whatever handler is installed (billiard's soft time limit, Celery's
  stack dump in solo), raises ``LockLost`` in the body; a signal interrupts
  ``time.sleep`` and blocking socket reads, so a blocked body is stopped too. A
  ``SIGUSR1`` that is not ours goes to the previous handler unchanged.
* **Other threads** (the threads pool): ``LockLost`` is raised asynchronously in the
  task's thread (without arguments: CPython raises a class there; the task base
  class re-raises the full exception when it reaches ``__call__``). CPython
  delivers it at the thread's next bytecode: a body blocked inside one long C
  call (``time.sleep(600)``, a socket read without timeout) finishes that call
  first. Use timeouts on blocking calls, or the prefork pool.
* **gevent greenlets**: the greenlet is killed with ``LockLost``, which also
  interrupts gevent's cooperative sleeps and socket reads.

A stale abort (the body ended before the signal arrived) is dropped: the handler
raises only for the lease that is still running in that thread.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
from typing import Any, cast

from ..base import forksafe
from ..exceptions import LockLost

__all__ = ["abort", "ensure_signal_handler", "track", "untrack"]

logger = logging.getLogger("celery_redlock.abort")

ABORT_SIGNAL = signal.SIGUSR1


class _AsyncLockLost(LockLost):
    """What CPython raises in another thread: it instantiates the class without arguments."""

    def __init__(self) -> None:
        super().__init__("", "lock lost (delivered to the task's thread)", None)


class _Running:
    """The lease a body is running under, and where that body runs."""

    __slots__ = ("greenlet", "lease", "task_id", "thread")

    def __init__(self, lease: Any, task_id: str | None) -> None:
        self.lease = lease
        self.task_id = task_id
        self.thread = threading.get_ident()
        self.greenlet = _current_greenlet()


# thread ident -> the bodies running there, innermost last (one thread can run
# locked bodies nested in each other: eager ``apply()``, errbacks run inline). Each
# thread replaces its own tuple (track/untrack); the renewer only reads, and a tuple
# read while the owner swaps in a new one is still a consistent snapshot.
_running: dict[int, tuple[_Running, ...]] = {}
# Losses waiting for the main thread's signal handler to raise them.
_pending_main: list[LockLost] = []
_previous_handler: Any = None


def track(lease: Any, task_id: str | None) -> None:
    """Record that the calling thread now runs a body under ``lease`` (nested or not)."""
    entry = _Running(lease, task_id)
    _running[entry.thread] = (*_running.get(entry.thread, ()), entry)
    if entry.thread == threading.main_thread().ident and entry.greenlet is None:
        ensure_signal_handler()


def task_of(lease: Any) -> str | None:
    """The task id of the body running under ``lease`` in this process, if one does."""
    for entries in list(_running.values()):
        for entry in entries:
            if entry.lease is lease:
                return entry.task_id
    return None


def untrack(lease: Any) -> None:
    """The calling thread's body under ``lease`` has ended: later aborts for it are stale."""
    thread = threading.get_ident()
    left = tuple(entry for entry in _running.get(thread, ()) if entry.lease is not lease)
    if left:
        _running[thread] = left
    else:
        _running.pop(thread, None)


def _entries() -> list[_Running]:
    return [entry for entries in list(_running.values()) for entry in entries]


def abort(lease: Any, exc: LockLost) -> bool:
    """Raise ``exc`` in the body running under ``lease``; False if none runs any more.

    When that body has a nested one running (an eager ``apply()`` in its thread), the
    exception surfaces in the nested body first, and reaches the outer body through it.
    """
    for entry in _entries():
        if entry.lease is lease:
            break
    else:
        return False
    if entry.greenlet is not None:
        entry.greenlet.kill(exc, block=False)
        return True
    if entry.thread == threading.main_thread().ident:
        _pending_main.append(exc)
        os.kill(os.getpid(), ABORT_SIGNAL)
        return True
    return _raise_in_thread(entry.thread, exc)


def ensure_signal_handler() -> None:
    """Chain our SIGUSR1 handler in front of the current one (main thread only).

    Called at each task start in the main thread, because billiard installs its
    soft-time-limit handler after the worker process initialiser has run.
    """
    global _previous_handler  # noqa: PLW0603
    current = signal.getsignal(ABORT_SIGNAL)
    if current is _handler:
        return
    _previous_handler = current
    signal.signal(ABORT_SIGNAL, _handler)


def _handler(signum: int, frame: Any) -> None:
    if _pending_main:
        exc = _pending_main.pop()
        entries = _running.get(cast(int, threading.main_thread().ident), ())
        if any(entry.lease.lost is exc for entry in entries):
            raise exc
        logger.debug("dropping a stale lock-loss abort: %s", exc)
        return
    previous = _previous_handler
    if callable(previous):
        previous(signum, frame)


def _raise_in_thread(thread: int, exc: LockLost) -> bool:
    done = ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread), ctypes.py_object(_AsyncLockLost)
    )
    # While the target thread starts a thread of its own, the newborn thread's state
    # briefly carries the target's id, and CPython may deliver the exception to it
    # instead (returning 1: undetectable here). The body then runs on, but the
    # LockedTask checks its lease when the body returns, so the result is still a
    # LockLost failure: never a silent success. More than one match is undone, as
    # the CPython docs ask.
    if done > 1:
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread), None)
        return False
    return bool(done == 1)


def _current_greenlet() -> Any:
    """The running gevent greenlet, if gevent drives this process; else None."""
    gevent = sys.modules.get("gevent")
    if gevent is None:
        return None
    from gevent import monkey  # noqa: PLC0415 (only when gevent is already loaded)

    if not monkey.is_module_patched("threading"):
        return None
    current = gevent.getcurrent()
    return current if isinstance(current, gevent.Greenlet) else None


@forksafe.at_fork_in_child
def _after_fork_in_child() -> None:
    global _previous_handler  # noqa: PLW0603
    # The parent's bodies are not running here.
    _running.clear()
    _pending_main.clear()
    _previous_handler = signal.getsignal(ABORT_SIGNAL)
