"""Starting the library's daemon threads (renewer, release listeners) safely.

``threading.Thread.start()`` waits until the new thread says it has started. In
CPython, an exception raised asynchronously in the *starting* thread
(``PyThreadState_SetAsyncExc``: the threads pool's abort, a debugger, a peer
library) can land in the newborn thread instead: until it runs, the new thread's
state carries the starter's id, and CPython delivers the exception to the first
thread state it finds with that id, the newest. The new thread then dies before
saying it started, and the starter waits in ``Thread.start()`` for ever: a task
thread would hang while starting the renewer (``tests/unit/engine/test_lock_handles.py``).

:func:`start_daemon` never waits. A thread started this way claims its role once it
runs (the renewer takes its run lock); a starter that finds nobody claimed it after
:data:`START_GRACE` starts another.
"""

from __future__ import annotations

import _thread
import threading
from collections.abc import Callable

__all__ = ["START_GRACE", "start_daemon"]

#: How long a started thread may take to claim its role before another is started.
START_GRACE = 1.0


def start_daemon(target: Callable[[], object], name: str) -> None:
    """Run ``target`` in a new daemon thread called ``name``; return at once."""

    def bootstrap() -> None:
        # Registers the thread with ``threading`` (as a daemon), so that it shows in
        # threading.enumerate() under its name.
        threading.current_thread().name = name
        target()

    # Looked up at call time: gevent's monkey patching replaces it with a greenlet spawn.
    _thread.start_new_thread(bootstrap, ())
