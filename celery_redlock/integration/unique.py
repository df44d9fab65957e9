"""Uniqueness over a task's lifecycle: one queued copy per key, decided at send time.

With ``lock_unique`` set, :meth:`LockedTask.apply_async` claims the task's lock name
for the new task id *before* publishing (one claim per task and name: two tasks naming
one resource are never duplicates of each other) (:mod:`celery_redlock.integration.claims`). When a
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
                                                           (and keeps its claim while it
                                                           waits for the running copy)
``"until_finished"`` from ``apply_async()`` until the      gets the queued or running copy
                     copy finishes (any final state);
                     while it runs, through its
                     execution lock (renewed with the
                     lease: ``claim.lua`` reads it)
===================  ====================================  ===============================

A claim lives as long as its copy: ``self.retry()``, a copy put back on the queue and
a copy parked until its turn carry it (the ``redlock_claimed`` header marks a copy sent
with one, :func:`carry`: as it is parked, for ``lock_unique_ttl`` and its countdown, and
again when a worker publishes it), over any countdown; a task id sent twice while
queued publishes once. An ``acks_late``
``until_finished`` copy that starts extends its claim by the broker's visibility timeout
(:func:`_outlive_the_worker`): if its whole worker dies, the broker's redelivery is
still that copy, and no send in between publishes another.

The claim is freed (by the worker that had the copy, keyed by its task id, so a
freed claim is never someone else's) when the copy starts (``until_started``) or ends
(``until_finished``); when it ends without running its body (busy lock skipped or
raised, a failure before the body, rejected); when it is revoked or its ``expires``
passes (``task_revoked``, which the worker sends when it discards the message); and
after ``lock_unique_ttl`` (plus any countdown or eta, an ISO string too) at the latest,
for a copy lost on the way (a purged queue; ``celery redlock release KEY --force``
clears it sooner). A copy whose result backend already has a final state (revoked
under Celery 5.7 by a worker that received the revoke, which stores REVOKED at once,
or killed with its child) no longer holds its key: the next send takes the claim
over. A revoke no worker receives does nothing (docs/failure-modes.md).

``lock_debounce`` and ``lock_throttle`` give the claim other lives: a debounced claim
is pushed back by every call and carries the last call's arguments; the copy runs
only once the last call is ``lock_debounce`` old by the lock node's clock (no
countdown from the sender's), with its arguments, or is parked until then as that call
(:func:`started`). A throttle claim lives ``lock_throttle``
seconds from the call that opened the window, whatever its run does, and the worker
admits one run per key per window (``throttle.lua``).

Whatever the claim says, the execution lock is still taken when the copy starts:
two bodies of one key never run at once. A copy retried (``self.retry()``, a busy
lock with ``lock_on_busy="retry"``) is the same copy: its re-publication is never
deduplicated against itself.

Not deduplicated (published as usual, still guarded by the execution lock):
members of a canvas (chain, group, chord: their task ids are already promised to a
result the canvas waits for) and ``link`` callbacks (sent with their parent's id),
``apply()`` and ``task_always_eager``, and ``app.send_task()`` by name (no task class
to read ``lock_unique`` from). Configuration-only enablement (``redlock_tasks``) is
applied when the app finalizes in any process that imported :mod:`celery_redlock`, and
again by workers and beat when they start; a task registered later is locked by
:func:`celery_redlock.lock_configured_tasks` (its sends meanwhile are warned about:
:mod:`celery_redlock.integration.config_only`).

Redis unreachable at send time: the copy is published anyway, with a WARNING (the
execution lock still guards its body); with ``lock_on_duplicate="raise"``
:class:`~celery_redlock.NodeUnavailable` is raised instead and nothing is published.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any, NoReturn

from celery import Task, states
from celery.utils import uuid
from celery.utils.time import maybe_iso8601

from ..base import metrics
from ..engine.keys import LockKeys, lock_keys
from ..engine.scripts import UnclaimStatus
from ..engine.timing import MAX_SECONDS
from ..exceptions import LockBusy, LockKeyError, NodeUnavailable
from ..nodes import NodeSet
from . import budgets, events, parking
from .claims import admit, claim, start, unclaim
from .names import call_lock_name
from .parking import PARKED_HEADER
from .policies import CLAIMED_HEADER, Requeued, defer, request_header
from .settings import Settings, TaskLockOptions

__all__ = ["active", "ended", "revoked", "send", "started"]

logger = logging.getLogger("celery_redlock.unique")


#: Options that make a send part of a canvas (its task id is promised to it already):
#: a chain's next step, a group's or chord's member, and a ``link``/``link_error``
#: callback, which the worker sends with the parent's id.
CANVAS_OPTIONS = ("chain", "group_id", "chord", "parent_id")

# Task ids whose claim this thread handed over when their body started
# (``until_started``), so that their end does not free it a second time.
_handed_over = threading.local()


def send(
    task: Task,
    options: TaskLockOptions,
    settings: Settings,
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
    if not active(options) or task.app.conf.task_always_eager:
        return publish(send_options)
    headers = send_options.get("headers") or {}
    if task_id is not None and (task_id == task.request.id or headers.get(PARKED_HEADER)):
        # The running copy sends itself again (self.retry(), or put back on the queue:
        # a busy lock, a debounced or throttled run), or a worker publishes a parked
        # run's copy. It stays the one copy, and one sent with a claim carries it over
        # the time it waits on the queue.
        if request_header(task.request, CLAIMED_HEADER) or headers.get(CLAIMED_HEADER):
            carry(task, options, settings, task_id, args, kwargs, send_options)
        return publish(send_options)
    if any(send_options.get(name) is not None for name in CANVAS_OPTIONS):
        return publish(send_options)
    keys = _keys(task, options, settings, args, kwargs)
    if keys is None:
        return publish(send_options)
    nodeset = NodeSet.get(settings.node_urls(), timeout=options.timing.node_timeout)
    task_id = send_options["task_id"] = task_id or uuid()
    debounce, payload = options.debounce, ""
    if options.throttle is not None:
        ttl = options.throttle  # the window, from the call that opens it
    else:
        ttl = options.unique_ttl + _delay(send_options) + (debounce or 0.0)
    if debounce is not None:
        # No countdown: the copy is due `debounce` after the last call by the lock
        # node's clock, which the worker asks when it starts the copy (start.lua). A
        # countdown would be the sender's clock, and a sender running ahead would
        # delay the run by as much.
        payload = _payload(task, args, kwargs)
    replace = ""
    for _ in range(2):
        try:
            found = claim(
                nodeset,
                keys,
                task_id,
                min(ttl, MAX_SECONDS),
                task_name=task.name,
                replace=replace,
                debounce=debounce,
                args=payload,
                running=options.unique == "until_finished",
            )
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
        if found.claimed and found.again:
            # A second send of one task id (a deterministic id makes a send
            # idempotent): that copy is queued already.
            break
        if found.claimed:
            # Marks the copy (and its retries, which keep its headers) as one that
            # holds a claim: see carry.
            send_options["headers"] = {**(send_options.get("headers") or {}), CLAIMED_HEADER: 1}
            try:
                result = publish(send_options)
            except BaseException:
                unclaim(nodeset, keys, task_id, task.name)
                raise
            events.record(task.app, nodeset, "claimed", (keys.lock,), task.name, task_id)
            return result
        assert found.holder is not None
        # A throttle window outlives its run: only its time ends it.
        if replace or options.throttle is not None or not _ended(task, found.holder):
            break
        replace = found.holder  # that copy ended without freeing its claim: take it over
    holder = task_id if found.again else found.holder
    assert holder is not None
    logger.debug("Task %s: a copy is queued already (%s)", task.name, holder)
    if metrics.enabled:
        metrics.duplicate(task.name)
    then = "raise" if options.on_duplicate == "raise" and debounce is None else "return"
    events.record(task.app, nodeset, "duplicate", (keys.lock,), task.name, holder, then=then)
    if then == "raise":
        raise LockBusy(keys.lock, holder, found.ttl)
    return task.AsyncResult(holder)


def carry(
    task: Task,
    options: TaskLockOptions,
    settings: Settings,
    task_id: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    send_options: dict[str, Any],
) -> None:
    """Keep the copy's claim while it waits again (on the queue, or parked).

    Taken again if it was handed back at start (``until_started``) or has expired
    while the body ran: until the copy is delivered again, and ``lock_unique_ttl``
    more. A throttle window ends with its time only. A claim another copy holds (a
    follow-up queued while this one ran) stays that copy's. Best effort: Redis
    unreachable leaves the copy to its execution lock, as a send does.
    """
    keys = _keys(task, options, settings, args, kwargs)
    if options.throttle is not None or keys is None:
        return
    ttl = options.unique_ttl + _delay(send_options) + (options.debounce or 0.0)
    nodeset = NodeSet.get(settings.node_urls(), timeout=options.timing.node_timeout)
    try:
        claim(nodeset, keys, task_id, min(ttl, MAX_SECONDS), task_name=task.name)
    except NodeUnavailable as exc:
        logger.warning(
            "Task %s[%s] goes back on the queue without its claim: %s", task.name, task_id, exc
        )


def active(options: TaskLockOptions) -> bool:
    """Whether sends of a task with ``options`` are deduplicated."""
    return not (options.unique is None and options.debounce is None and options.throttle is None)


def started(
    task: Task,
    options: TaskLockOptions,
    settings: Settings,
    task_id: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> None:
    """The copy's body is about to run: hand its claim back, or put the copy back.

    ``until_started`` frees the claim. ``lock_debounce`` runs the copy only once the
    last call's due time has passed, and with that call's arguments; else the copy
    goes back on the queue (as that call). ``lock_throttle`` admits one run per
    window; a copy that comes too soon goes back on the queue until the window ends.

    Raises:
        Requeued: the copy was put back on the queue; its body must not run.
    """
    if options.unique == "until_finished" and _acks_late(task):
        _outlive_the_worker(task, options, settings, task_id, args, kwargs)
    if options.unique != "until_started" and options.debounce is None and options.throttle is None:
        return
    keys = _keys(task, options, settings, args, kwargs)
    if keys is None:
        return
    nodeset = NodeSet.get(settings.node_urls(), timeout=options.timing.node_timeout)
    if options.throttle is not None:
        # One node timeout more than the window: the admission's reply may take that
        # long, and the gap is between the bodies' starts.
        wait = admit(nodeset, keys, task_id, options.throttle + options.timing.node_timeout)
        if wait is not None:
            why, spot = "waits for its throttle window", parking.Spot(nodeset, "later", keys.lock)
            _requeue(task, task_id, wait, args, kwargs, why, spot, "throttle")
        return
    if options.debounce is not None:
        verdict = start(nodeset, keys, task_id, task.name, _payload(task, args, kwargs))
        if verdict is not None:
            wait, payload = verdict
            last_args, last_kwargs = json.loads(payload)
            spot = parking.Spot(nodeset, "later", keys.lock)
            last = tuple(last_args)
            _requeue(task, task_id, wait, last, last_kwargs, "was called again", spot, "debounce")
    else:
        _free(task, options, settings, keys, task_id)
    _handed().add(task_id)


def _acks_late(task: Task) -> bool:
    """Whether this delivery is acknowledged after its body (given again if its worker dies)."""
    late = getattr(task.request, "acks_late", None)
    return bool(task.acks_late if late is None else late) and not task.request.is_eager


def _outlive_the_worker(
    task: Task,
    options: TaskLockOptions,
    settings: Settings,
    task_id: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> None:
    """An ``acks_late`` copy starts: its claim lives until the broker could give it again.

    If the whole worker dies now, nothing frees the claim and nothing stores a result;
    the broker gives the message to another worker after its ``visibility_timeout``
    (Redis, SQS; at once on AMQP, as the connection drops). That delivery is the same
    copy, so the claim must last until then, and ``lock_unique_ttl`` more for it to
    start: else a send in between (once the dead worker's lease, which stands in for
    the claim while the copy runs, has ended) would publish a second copy. The claim is
    freed as usual when the copy ends. One call, for such copies only.
    """
    keys = _keys(task, options, settings, args, kwargs)
    if keys is None:
        return
    visibility = budgets.broker_visibility(task.app)
    ttl = options.unique_ttl + (visibility[1] if visibility else 0.0)
    nodeset = NodeSet.get(settings.node_urls(), timeout=options.timing.node_timeout)
    try:
        claim(nodeset, keys, task_id, min(ttl, MAX_SECONDS), task_name=task.name)
    except NodeUnavailable as exc:
        logger.warning("Task %s[%s]: its claim is not extended: %s", task.name, task_id, exc)


def ended(
    task: Task,
    options: TaskLockOptions,
    settings: Settings,
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
    if (
        options.throttle is not None  # a window ends with its time, not with its run
        or not active(options)
        or state == states.RETRY
        or isinstance(retval, Requeued)
    ):
        return
    if task_id in _handed():
        _handed().discard(task_id)
        return
    keys = _keys(task, options, settings, args, kwargs)
    if keys is not None:
        _free(task, options, settings, keys, task_id)


def revoked(task: Task, options: TaskLockOptions, settings: Settings, request: Any) -> None:
    """A copy was revoked, or expired, before or while running: free its claim."""
    if options.throttle is not None or not active(options):
        return
    args = tuple(getattr(request, "args", None) or ())
    kwargs = dict(getattr(request, "kwargs", None) or {})
    keys = _keys(task, options, settings, args, kwargs)
    if keys is not None and request.id:
        _free(task, options, settings, keys, request.id, expected=False)


def _free(
    task: Task,
    options: TaskLockOptions,
    settings: Settings,
    keys: LockKeys,
    task_id: str,
    *,
    expected: bool = True,
) -> None:
    """Free ``task_id``'s claim; count it as expired if ``expected`` and it was gone."""
    try:
        nodeset = NodeSet.get(settings.node_urls(), timeout=options.timing.node_timeout)
        status = unclaim(nodeset, keys, task_id, task.name)
    except Exception:  # the claim ends with its TTL
        logger.exception("Task %s[%s]: freeing its send-time claim failed", task.name, task_id)
        return
    if expected and status == UnclaimStatus.GONE:
        if metrics.enabled:
            metrics.claim_expired(task.name)
        events.record(task.app, nodeset, "claim_expired", (keys.lock,), task.name, task_id)
    elif status != UnclaimStatus.GONE:
        events.record(task.app, nodeset, "claim_freed", (keys.lock,), task.name, task_id)


def _requeue(
    task: Task,
    task_id: str,
    countdown: float,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    why: str,
    spot: parking.Spot,
    reason: str,
) -> NoReturn:
    """Park this copy until due (same task id, keeping its claim) and end this delivery.

    Where no node takes it, it goes back on the queue with the countdown
    (:func:`~celery_redlock.integration.policies.defer`).
    """
    defer(task, task_id, countdown, why, reason=reason, spot=spot, args=args, kwargs=kwargs)


def _payload(task: Task, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """A call's arguments as a debounced claim keeps them (JSON, as the broker carries them).

    Raises:
        LockKeyError: an argument JSON cannot carry, naming the task.
    """
    try:
        return json.dumps([list(args), kwargs], sort_keys=True, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        raise LockKeyError(
            task.name, "args", f"lock_debounce keeps the last call's arguments as JSON: {exc}"
        ) from None


def _handed() -> set[str]:
    handed = getattr(_handed_over, "ids", None)
    if handed is None:
        handed = _handed_over.ids = set()
    return handed


def _keys(
    task: Task,
    options: TaskLockOptions,
    settings: Settings,
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
    if isinstance(eta, str):  # Celery accepts an ISO 8601 string too
        try:
            eta = maybe_iso8601(eta)
        except ValueError:
            return 0.0  # Celery refuses it when it publishes
    if isinstance(eta, datetime):
        now = datetime.now(eta.tzinfo or timezone.utc)
        if eta.tzinfo is None:
            now = now.replace(tzinfo=None)
        return max(0.0, (eta - now).total_seconds())
    return 0.0


def _ended(task: Task, task_id: str) -> bool:
    """Whether the result backend has a final state for ``task_id`` (False if unknown).

    A task that stores no result has none to read: no round trip for nothing.
    """
    if task.ignore_result:
        return False
    try:
        return task.backend.get_state(task_id) in states.READY_STATES
    except Exception:  # no usable backend: the claim's TTL is the bound
        return False
