"""What a waiting process of ours does, counted (tests and benchmarks count, not time).

:func:`count_waiting` wraps, in the calling process and once, the three steps of a
blocked ``acquire()``: an acquisition attempt (``Redlock._attempt``: *attempts*, and
*failed_attempts* for those that did not get the lock), a release announcement that
reached this process (the listener's dispatch: *deliveries*), and a wait that ended
(``Subscription.wait``: *woken* by an announcement, or *wait_timeouts*). Issue 27's P8
benchmark and ``tests/unit/engine/test_wake_one.py`` read them per acquisition.
"""

from __future__ import annotations

import collections
from typing import Any

__all__ = ["COUNTS", "count_waiting"]

#: This process's counts (clear it to start a count).
COUNTS: collections.Counter[str] = collections.Counter()

_wrapped = False


def count_waiting() -> collections.Counter[str]:
    """Count this process's waiting steps into :data:`COUNTS` from now on; returns it."""
    global _wrapped  # noqa: PLW0603
    if _wrapped:
        return COUNTS
    _wrapped = True
    from celery_redlock.engine import lock as lock_module
    from celery_redlock.engine import waiting

    attempt, dispatch, wait = (
        lock_module.Redlock._attempt,
        waiting._Listener._dispatch,
        waiting.Subscription.wait,
    )

    def counted_attempt(self: Any, waiter: Any) -> Any:
        result = attempt(self, waiter)
        COUNTS["attempts"] += 1
        COUNTS["failed_attempts"] += result is not None
        return result

    def counted_dispatch(self: Any, message: Any) -> None:
        if isinstance(message, list) and message and message[0] in ("message", b"message"):
            COUNTS["deliveries"] += 1  # a release announcement reached this process
        dispatch(self, message)

    def counted_wait(self: Any, timeout: float) -> bool:
        woken = wait(self, timeout)
        COUNTS["woken" if woken else "wait_timeouts"] += 1
        return woken

    lock_module.Redlock._attempt = counted_attempt  # type: ignore[method-assign]
    waiting._Listener._dispatch = counted_dispatch  # type: ignore[method-assign]
    waiting.Subscription.wait = counted_wait  # type: ignore[method-assign]
    return COUNTS
