"""A run put back because its key was busy starts when the key is released.

``lock_on_busy="requeue"`` parks a busy run on its lock node
(:mod:`celery_redlock.integration.parking`); where no node takes it (a Redis Cluster), it goes back
on the queue with a countdown (:func:`celery_redlock.integration.policies.apply_on_busy`), as does a
second delivery of a task id that holds its lock: the copy is an ETA message, which
the worker that receives it keeps in its timer until the countdown ends, holding no
pool process. The countdown is a guess (a backoff, capped at the holder's lease); the
holder usually ends long before. So the copy carries the busy key
(:data:`~celery_redlock.integration.policies.WAKE_HEADER`), and the worker's main process that
holds it listens for that key's release (:mod:`celery_redlock.engine.waiting`: the
process's one pub/sub connection per node). When a release is announced, the
longest-waiting such copy in the process is started at once, through Celery's own
path for a due ETA task (``Consumer.apply_eta_task``) after cancelling its timer
entry. A release lets one holder in, so it starts one copy per worker process that
waits for the key; a copy that finds the key busy again is put back again.

What stays as it was:

* Only a copy whose timer entry is still pending is started (looked up in the
  consumer's timer and cancelled first, in the timer's own thread): never twice.
* A task with Celery's own ``rate_limit`` (its ETA goes through a token bucket) and
  a fair lock (its release names the next waiter) keep their countdown.
* A lock that expires publishes nothing, and a notification can be lost with a
  dropped connection: the countdown is the fallback, as for any waiter.
* A release that names a recorded waiter (a blocked ``acquire()`` of the key,
  :mod:`celery_redlock.engine.waiting`) announces itself to that waiter's process
  only, and keeps the key for it: a copy starts at the next release that names nobody,
  or at its countdown.

The check runs on the consumer's timer every :data:`TICK` seconds while copies wait
(only then), so a copy starts within :data:`TICK` of its key's release announcement.
The timer entries Celery keeps per ETA request (``Request._eta_timer_entry`` since
Celery 5.6; before, found in the timer's queue) are the one piece of Celery's
internals this module reads.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from ..base import forksafe
from ..engine.keys import keys_of
from ..engine.waiting import Subscription
from ..nodes import NodeSet
from .policies import WAKE_HEADER
from .task import app_settings

__all__ = ["on_task_received", "stop"]

logger = logging.getLogger("celery_redlock.worker")

#: Seconds between two looks at the waiting copies (on the consumer's timer).
TICK = 0.05


@dataclass(eq=False)
class _Sleeper:
    """One copy in this worker's timer that its key's release may start early."""

    request: Any
    consumer: Any
    subscription: Subscription
    entry: Any = None
    since: float = field(default_factory=time.monotonic)


_sleepers: dict[str, _Sleeper] = {}
_mutex = threading.Lock()
#: Each consumer timer's repeating entry, while copies received by its consumer wait
#: (a consumer restarted, or a second worker in the process, has a timer of its own).
_tick_entries: dict[Any, Any] = {}


def on_task_received(consumer: Any, request: Any) -> None:
    """Register ``request`` if it is a busy run's copy waiting in this worker's timer.

    Called in the consumer's thread for every message received (``task_received``,
    sent before Celery puts an ETA request in its timer): cheap for the others.
    """
    key = _wake_key(request)
    if key is None or not getattr(request, "eta", None):
        return
    try:
        settings = app_settings(consumer.app)
        nodeset = NodeSet.get(settings.node_urls(), timeout=settings.timing.node_timeout)
        # No confirmation wait: the consumer must not block. A release before the
        # subscription is confirmed leaves this copy its countdown.
        subscription = Subscription(nodeset.nodes, keys_of(key).channel, confirm_timeout=None)
        subscription.watch()  # it never waits in wait(): the listener thread reads for it
    except Exception:  # the countdown still starts it
        logger.debug("celery_redlock: cannot listen for %s's release", key, exc_info=True)
        return
    with _mutex:
        old = _sleepers.pop(request.id, None)
        _sleepers[request.id] = _Sleeper(request, consumer, subscription)
        timer = consumer.timer
        if timer not in _tick_entries:
            _tick_entries[timer] = timer.call_repeatedly(TICK, _tick, (consumer,))
    if old is not None:
        old.subscription.close()


def _tick(consumer: Any) -> None:
    """Start the copies whose key was released; forget those the timer started."""
    try:
        _start_released(consumer)
    except Exception:  # the countdowns still start them; never break the timer
        logger.exception("celery_redlock: starting released copies failed")


def _start_released(consumer: Any) -> None:
    with _mutex:
        sleepers = [s for s in _sleepers.values() if s.consumer is consumer]
    pending = _pending_entries(consumer.timer) if sleepers else {}
    for sleeper in sleepers:
        entry = sleeper.entry or getattr(sleeper.request, "_eta_timer_entry", None)
        entry = sleeper.entry = entry or pending.get(id(sleeper.request))
        due = entry is not None and id(entry) in pending and not entry.canceled
        if not due and entry is None and time.monotonic() - sleeper.since < 1.0:
            continue  # received, not yet in the timer
        woken = due and sleeper.subscription.event.is_set()
        if due and not woken:
            continue
        if woken and entry is not None and entry.fun == consumer.apply_eta_task:
            entry.cancel()
            sleeper.subscription.event.clear()  # used here: not passed on when it leaves
            logger.info(
                "Task %s[%s] starts now: its key was released",
                sleeper.request.name,
                sleeper.request.id,
            )
            consumer.apply_eta_task(sleeper.request)
        _forget(sleeper)
    with _mutex:
        if not any(s.consumer is consumer for s in _sleepers.values()):
            entry = _tick_entries.pop(consumer.timer, None)
            if entry is not None:
                entry.cancel()


def _pending_entries(timer: Any) -> dict[int, Any]:
    """The timer's pending entries for requests, by ``id`` of their request (and own)."""
    pending: dict[int, Any] = {}
    for item in timer.queue:
        entry = getattr(item, "entry", item)  # kombu's timer lists (eta, priority, entry)
        pending[id(entry)] = entry
        args = getattr(entry, "args", None) or ()
        if args:
            pending.setdefault(id(args[0]), entry)
    return pending


def _forget(sleeper: _Sleeper) -> None:
    with _mutex:
        if _sleepers.get(sleeper.request.id) is sleeper:
            del _sleepers[sleeper.request.id]
    sleeper.subscription.close()


def _wake_key(request: Any) -> str | None:
    """The busy key a received copy waits for (None for any other message)."""
    headers = getattr(request, "request_dict", None) or {}
    key = headers.get(WAKE_HEADER)
    return key if isinstance(key, str) and key else None


def stop() -> None:
    """Stop listening for every waiting copy (the worker stops; its timer is gone)."""
    with _mutex:
        sleepers = list(_sleepers.values())
        _sleepers.clear()
        entries = list(_tick_entries.values())
        _tick_entries.clear()
    for entry in entries:
        entry.cancel()
    for sleeper in sleepers:
        sleeper.subscription.close()


@forksafe.at_fork_in_child
def _after_fork_in_child() -> None:
    # A pool child starts no copies (its parent's consumer does): it drops the parent's.
    global _mutex  # noqa: PLW0603
    _mutex = threading.Lock()
    _sleepers.clear()
    _tick_entries.clear()
