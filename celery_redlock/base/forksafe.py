"""Fork safety in one place: what a forked child must not inherit from its parent.

``fork()`` copies a process's memory but only the thread that called it. Any
``threading.Lock`` another thread of the parent held at that instant stays held in
the child for ever, with no thread left to release it: the child's first call that
takes it never returns. Prefork workers fork children (``max_tasks_per_child``, a
killed child replaced) while the main process's own threads (the reaper, a
renewer, user code) are inside lock calls, so this is not a corner case: 30 of 300
children hung in an outside test before this module existed.

Every object of the package that owns a lock, condition, pool or registry registers
here, and one ``os.register_at_fork(after_in_child=...)`` hook resets them all in
the child, before any of its code runs:

* :func:`track` an instance whose ``_after_fork_in_child()`` method replaces its
  locks (and drops what belonged to the parent's threads: their sockets, waiters);
* :func:`at_fork_in_child` a module-level function that does the same for the
  module's globals.

The same hook keeps :func:`pid`, the process id without a system call (``os.getpid()``
is one on every call; a lock's acquire and release asked it 12 times).

Module hooks run first, in registration order, then instances. A hook that fails
is logged and the others still run: one broken reset must not leave the rest held.
``tests/integration/test_fork_safety.py`` checks that every module creating a lock
registers here, and forks while other threads are inside every kind of lock call.

Locks the package does not own can be held too: Python's lock of a module being
imported for the first time. ``socket.getaddrinfo`` imports the ``idna`` codec the
first time a host name is looked up; a worker thread connecting for the first time
while the main process forked left a pool child waiting for ever on that import (its
first connect). So the codec is imported here, once, by whichever thread imports
the package.

This module imports nothing from the package, so every layer may use it.
"""

from __future__ import annotations

import encodings.idna  # noqa: F401 (imported before any thread can be first: see above)
import logging
import os
import weakref
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

__all__ = ["ForkAware", "at_fork_in_child", "pid", "track", "tracked"]

logger = logging.getLogger("celery_redlock.forksafe")


class ForkAware(Protocol):
    """An object whose locks a forked child must replace."""

    def _after_fork_in_child(self) -> None: ...


F = TypeVar("F", bound=Callable[[], None])

# Weak: a tracked object lives as long as its users keep it, not because of us. Keyed
# by id(): the objects need not be hashable, and a dead one's entry goes with it.
_objects: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
_hooks: list[Callable[[], None]] = []


def track(obj: ForkAware) -> None:
    """Reset ``obj`` (its ``_after_fork_in_child()``) in every child forked from now on."""
    _objects[id(obj)] = obj


_pid = [os.getpid()]  # (a list: the fork hook replaces its item, no `global`)


def pid() -> int:
    """The process's id: ``os.getpid()``, read once per process instead of per call.

    Read again in every child forked through ``os.fork()`` (multiprocessing, billiard,
    Celery's prefork pool), before any reset hook runs. A child forked by C code that
    bypasses Python's fork hooks would see its parent's id; such a child could not use
    the package anyway (its locks would stay held), and the connection pools still ask
    ``os.getpid()`` before they hand out a socket.
    """
    return _pid[0]


def at_fork_in_child(hook: F) -> F:
    """Run ``hook`` in every forked child (a decorator for module-level resets)."""
    _hooks.append(hook)
    return hook


def tracked() -> int:
    """How many live objects are tracked (for tests)."""
    return len(_objects)


def _after_fork_in_child() -> None:
    _pid[0] = os.getpid()  # first: the resets below may ask for it
    # Only this thread exists now: nothing else can touch the registries meanwhile.
    resets: list[Callable[[], None]] = list(_hooks)
    resets.extend(obj._after_fork_in_child for obj in list(_objects.values()))
    for reset in resets:
        try:
            reset()
        except Exception:  # pragma: no cover - a bug in one reset must not keep the rest
            logger.exception("celery_redlock: resetting %r after fork failed", reset)


os.register_at_fork(after_in_child=_after_fork_in_child)
