"""Uniqueness over a task's lifecycle: one queued copy per key, decided at send time.

With ``lock_unique`` set, :meth:`LockedTask.apply_async` claims the task's lock name
for the new task id *before* publishing (:mod:`celery_redlock.engine.claims`). When a
copy of the same key is queued (or, ``until_finished``, running), nothing is
published: ``apply_async()`` returns that copy's ``AsyncResult``
(``lock_on_duplicate="return"``) or raises :class:`~celery_redlock.LockBusy` naming it
(``"raise"``).

===================  ====================================  ===============================
``lock_unique``      the claim is held                     a second send while it is held
===================  ====================================  ===============================
``None`` (default)   never: the execution lock only        is published; skipped (or
                                                           retried, waited) at start
``"until_started"``  from ``apply_async()`` until a        gets the queued copy; once that
                     worker starts the copy                copy runs, a new one may queue
``"until_finished"`` from ``apply_async()`` until the      gets the queued or running copy
                     copy finishes (any final state)
===================  ====================================  ===============================

The claim is freed (by the worker that had the copy, keyed by its task id, so a
freed claim is never someone else's) when the copy starts (``until_started``) or ends
(``until_finished``); when it ends without running its body (busy lock skipped or
raised, a failure before the body, rejected); when it is revoked or its ``expires``
passes (``task_revoked``, which the worker sends when it discards the message); and
after ``lock_unique_ttl`` (plus any countdown or eta) at the latest, for a copy lost
on the way (a purged queue). A copy whose result backend already has a final state
(revoked by a Celery that stores REVOKED at once, or killed with its worker) no
longer holds its key: the next send takes the claim over.

Whatever the claim says, the execution lock is still taken when the copy starts:
two bodies of one key never run at once. A copy retried (``self.retry()``, a busy
lock with ``lock_on_busy="retry"``) is the same copy: its re-publication is never
deduplicated against itself.

Not deduplicated (published as usual, still guarded by the execution lock):
members of a canvas (chain, group, chord: their task ids are already promised to a
result the canvas waits for), ``apply()`` and ``task_always_eager``, and
``app.send_task()`` by name (no task class to read ``lock_unique`` from).

Redis unreachable at send time: the copy is published anyway, with a WARNING (the
execution lock still guards its body); with ``lock_on_duplicate="raise"``
:class:`~celery_redlock.NodeUnavailable` is raised instead and nothing is published.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

from celery import Task, states
from celery.utils import uuid

from . import metrics
from .engine.claims import claim, unclaim
from .engine.keys import LockKeys, lock_keys
from .engine.names import call_lock_name
from .engine.scripts import UnclaimStatus
from .engine.timing import MAX_SECONDS
from .exceptions import LockBusy, LockKeyError, NodeUnavailable
from .nodes import NodeSet
from .options import TaskLockOptions
from .policies import Requeued

__all__ = ["ended", "revoked", "send", "started"]

logger = logging.getLogger("celery_redlock.unique")

#: Options that make a send part of a canvas (its task id is promised to it already).
CANVAS_OPTIONS = ("chain", "group_id", "chord")

# Task ids whose claim this thread handed over when their body started
# (``until_started``), so that their end does not free it a second time.
_handed_over = threading.local()


def send(
    task: Task,
    options: TaskLockOptions,
    settings: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    send_options: dict[str, Any],
    publish: Callable[[dict[str, Any]], Any],
) -> Any:
    """Publish a copy unless one of its key is queued; the result ``apply_async()`` returns.

    ``publish(send_options)`` publishes (Celery's own ``apply_async``);
    ``send_options`` gets the task id the claim was taken for.
    """
    task_id = send_options.get("task_id")
    if (
        options.unique is None
        or task.app.conf.task_always_eager
        or any(send_options.get(name) is not None for name in CANVAS_OPTIONS)
        or (task_id is not None and task_id == task.request.id)  # a retry of this copy
    ):
        return publish(send_options)
    keys = _keys(task, options, settings, args, kwargs)
    if keys is None:
        return publish(send_options)
    task_id = send_options["task_id"] = task_id or uuid()
    nodeset = NodeSet.get(settings.node_urls(), timeout=options.timing.node_timeout)
    ttl = min(options.unique_ttl + _delay(send_options), MAX_SECONDS)
    replace = ""
    for _ in range(2):
        try:
            found = claim(nodeset, keys, task_id, ttl, task_name=task.name, replace=replace)
        except NodeUnavailable as exc:
            if options.on_duplicate == "raise":
                raise
            logger.warning(
                "Task %s[%s] is sent without checking for a queued copy: %s",
                task.name,
                task_id,
                exc,
            )
            return publish(send_options)
        if found.claimed:
            try:
                return publish(send_options)
            except BaseException:
                unclaim(nodeset, keys, task_id)
                raise
        assert found.holder is not None
        if replace or not _ended(task, found.holder):
            break
        replace = found.holder  # that copy ended without freeing its claim: take it over
    logger.debug("Task %s: a copy is queued already (%s)", task.name, found.holder)
    if metrics.enabled:
        metrics.duplicate(task.name)
    if options.on_duplicate == "raise":
        raise LockBusy(keys.lock, found.holder, found.ttl)
    return task.AsyncResult(found.holder)


def started(
    task: Task,
    options: TaskLockOptions,
    settings: Any,
    task_id: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> None:
    """The copy's body is about to run: hand its ``until_started`` claim back."""
    if options.unique != "until_started":
        return
    keys = _keys(task, options, settings, args, kwargs)
    if keys is not None:
        _free(task, options, settings, keys, task_id)
        _handed().add(task_id)


def ended(
    task: Task,
    options: TaskLockOptions,
    settings: Any,
    task_id: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    state: str | None,
    retval: Any,
) -> None:
    """A delivery ended (``task_postrun``): free the claim unless the copy goes on.

    It goes on when it retries (the retry is the same copy, still queued) or when
    this delivery was only a duplicate of a running one, put back on the queue.
    """
    if options.unique is None or state == states.RETRY or isinstance(retval, Requeued):
        return
    if task_id in _handed():
        _handed().discard(task_id)
        return
    keys = _keys(task, options, settings, args, kwargs)
    if keys is not None:
        _free(task, options, settings, keys, task_id)


def revoked(task: Task, options: TaskLockOptions, settings: Any, request: Any) -> None:
    """A copy was revoked, or expired, before or while running: free its claim."""
    if options.unique is None:
        return
    args = tuple(getattr(request, "args", None) or ())
    kwargs = dict(getattr(request, "kwargs", None) or {})
    keys = _keys(task, options, settings, args, kwargs)
    if keys is not None and request.id:
        _free(task, options, settings, keys, request.id, expected=False)


def _free(
    task: Task,
    options: TaskLockOptions,
    settings: Any,
    keys: LockKeys,
    task_id: str,
    *,
    expected: bool = True,
) -> None:
    """Free ``task_id``'s claim; count it as expired if ``expected`` and it was gone."""
    try:
        nodeset = NodeSet.get(settings.node_urls(), timeout=options.timing.node_timeout)
        status = unclaim(nodeset, keys, task_id)
    except Exception:  # the claim ends with its TTL
        logger.exception("Task %s[%s]: freeing its send-time claim failed", task.name, task_id)
        return
    if expected and status == UnclaimStatus.GONE and metrics.enabled:
        metrics.claim_expired(task.name)


def _handed() -> set[str]:
    handed = getattr(_handed_over, "ids", None)
    if handed is None:
        handed = _handed_over.ids = set()
    return handed


def _keys(
    task: Task,
    options: TaskLockOptions,
    settings: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> LockKeys | None:
    """The keys of the claim a call with ``args`` takes; None if they do not bind.

    Arguments that do not bind to the task's signature are published as they are:
    the worker fails the copy with Python's own TypeError.
    """
    name = call_lock_name(
        task.name, task.run, args, kwargs, lock_args=options.args, lock_key=options.key
    )
    if name is None:
        return None
    if not isinstance(name, str):
        raise LockKeyError(task.name, "lock_key", "lock_unique needs one resource, got several")
    return lock_keys(name, settings.key_prefix)


def _delay(send_options: dict[str, Any]) -> float:
    """Seconds until the copy may start: its countdown or eta (the claim waits that long)."""
    countdown = send_options.get("countdown")
    if countdown:
        return max(0.0, float(countdown))
    eta = send_options.get("eta")
    if isinstance(eta, datetime):
        now = datetime.now(eta.tzinfo or timezone.utc)
        if eta.tzinfo is None:
            now = now.replace(tzinfo=None)
        return max(0.0, (eta - now).total_seconds())
    return 0.0


def _ended(task: Task, task_id: str) -> bool:
    """Whether the result backend has a final state for ``task_id`` (False if unknown)."""
    try:
        return task.backend.get_state(task_id) in states.READY_STATES
    except Exception:  # no usable backend: the claim's TTL is the bound
        return False
