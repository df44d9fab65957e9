"""What a locked task does when its lock is busy, held by itself, or lost.

:func:`celery_redlock.integration.task.acquire_for` takes the lock; when it cannot, or when the
renewer later finds the lease gone, the task's policy decides what happens.

What a busy lock does (``lock_on_busy``, :func:`apply_on_busy`):

===========  ======================================================================
``skip``     The body does not run. Logged at INFO with the holder's task id. The
             result is stored as FAILURE with :class:`~celery_redlock.LockBusy`, so
             ``AsyncResult.get()`` raises ``LockBusy`` at once (``propagate=False``
             returns it); no callbacks or errbacks run; the worker logs it as ignored.
             ``apply()`` returns the same: an eager result in state FAILURE (stored
             nowhere else, as Celery stores no eager result).
``retry``    ``self.retry(countdown=lock_retry_countdown, exc=LockBusy(...))``;
             counts against ``max_retries``, after which the task fails with LockBusy.
``raise``    The task fails with ``LockBusy`` (key, holder task id, holder's TTL).
``wait``     Waits up to ``lock_wait_timeout`` seconds, woken by the holder's release;
             then fails with ``LockBusy`` if still held.
``requeue``  Parked on the lock node until the key is free (same task id, arguments
             and options; not a retry: ``max_retries`` does not count it), then
             published once by a live worker (:mod:`celery_redlock.integration.parking`); holds
             no pool process meanwhile (:func:`defer`). Where no node takes it, it
             goes back on the queue after a jittered backoff that doubles per
             requeue from 0.25 s, capped at the holder's lease left, and starts as
             soon as the key's release is announced (:mod:`celery_redlock.integration.wakeups`).
===========  ======================================================================

A second delivery of a task id whose first delivery still holds the lock (acks_late
redelivery, ``retry(countdown=0)`` picked up before the release, redelivery after the
first delivery's worker died) is put back on the queue with a growing delay, whatever
the policy, storing nothing (:func:`requeue_duplicate`); it runs once the lock is
free, unless the first delivery stored a final result meanwhile (:func:`already_done`).

What a lost lock does (``lock_on_lost``, :func:`apply_on_lost`): ``abort`` raises
:class:`~celery_redlock.LockLost` in the body (:mod:`celery_redlock.integration.abort`),
``revoke`` terminates it through Celery's revoke (prefork; else it aborts), and
``ignore`` only logs.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from typing import Any, NoReturn

from celery import Task, states
from celery.exceptions import Ignore

from ..base import metrics
from ..engine.keys import keys_of
from ..engine.lease import clock
from ..engine.lock import Redlock
from ..exceptions import LockBusy, LockLost
from ..nodes import NodeSet
from . import abort, events, parking, reaper
from .queued import note_queued
from .settings import TaskLockOptions

__all__ = [
    "DEFERRALS_HEADER",
    "REQUEUES_HEADER",
    "UNAVAILABLE_BUDGET",
    "UNAVAILABLE_HEADER",
    "Requeued",
    "Skipped",
    "already_done",
    "apply_on_busy",
    "apply_on_lost",
    "defer",
    "defer_unavailable",
    "deferrals",
    "put_back",
    "request_header",
    "requeue_duplicate",
    "requeues",
]

# The task's logger: these are the task's messages, and logger names are API.
logger = logging.getLogger("celery_redlock.task")

#: Header counting how often a duplicate delivery was put back; sets its backoff.
REQUEUES_HEADER = "redlock_requeues"

#: Header counting how often a run was put back on the queue to wait for its turn
#: (``lock_on_busy="requeue"``, ``lock_rate``): not a retry, so not ``retries``.
DEFERRALS_HEADER = "redlock_deferrals"

#: Header of a copy sent with a send-time claim (``lock_unique``, debounce, throttle);
#: its retries and copies put back keep it (:mod:`celery_redlock.integration.unique`).
CLAIMED_HEADER = "redlock_claimed"

#: Called with the running delivery and how long its run may wait parked, before it is
#: parked (the Celery layer registers what it must keep over the wait: a send-time claim).
PARK_HOOKS: list[Callable[[Task, float], None]] = []

#: Header of a copy put back because its key was busy: the lock key whose release may
#: start it before its countdown (None: only the countdown).
WAKE_HEADER = "redlock_wake"

#: Header of a run put back because its lock nodes did not answer when it started:
#: when that first happened (seconds since the epoch, the worker's clock).
UNAVAILABLE_HEADER = "redlock_unavailable_since"

#: Seconds a run whose lock nodes do not answer when it starts is put back for, in
#: all, before it fails with NodeUnavailable: a node that answers late (a loaded
#: machine) or restarts costs a delay, not the run.
UNAVAILABLE_BUDGET = 30.0


def apply_on_busy(
    task: Task,
    task_id: str,
    busy: LockBusy,
    options: TaskLockOptions,
    nodeset: NodeSet | None = None,
) -> None:
    """Apply ``lock_on_busy``; always raises.

    ``nodeset``: the busy lock's nodes, where a run put back is recorded as waiting.
    """
    follows = options.unique == "until_started" or options.debounce or options.throttle
    follows = follows or (options.unique == "until_finished" and bool(busy.holder))
    if nodeset is not None and busy.key:
        then = "redelivered" if busy.holder == task_id else options.on_busy
        then = "follows" if follows and then != "redelivered" else then
        if then == "requeue" and getattr(task.request, "is_eager", False):
            then = "raise"
        # As of the refused request: the holder's release may be logged before this
        # process, slowed, gets here, and the story must not show it refused after it.
        earlier = 0.0 if busy.asked_at is None else max(0.0, clock() - busy.asked_at)
        events.record(task.app, nodeset, "busy", (busy.key,), task.name, task_id,
                      earlier=earlier, holder=busy.holder, then=then)  # fmt: skip
    if busy.holder == task_id:
        why = "is held by an earlier delivery of itself"
        requeue_duplicate(task, task_id, busy, why, nodeset, options)
    if follows:
        # The follow-up of a running copy (queued while it ran; or, until_finished, a
        # second copy whose claim a lock node lost in a restart, or a copy of another
        # task on the resource): it must run after that task, so it waits on the queue,
        # whatever lock_on_busy says. A holder that is no task (a Redlock in a web
        # request) gets lock_on_busy.
        requeue_duplicate(task, task_id, busy, "follows the running copy", nodeset, options)
    policy = options.on_busy
    if policy == "requeue" and not getattr(task.request, "is_eager", False):
        # An eager run has no queue to go back to: it gets LockBusy (as "raise").
        count = deferrals(task.request)
        backoff = 0.25 * 2 ** min(count, 8) * random.uniform(0.5, 1.5)
        if metrics.enabled:
            metrics.deferred(task.name, "busy")
        countdown = min(busy.ttl or 1.0, backoff)
        # The worker holding the copy in its timer starts it early when the key is
        # released (celery_redlock.integration.wakeups); the countdown is the fallback.
        why = f"waits for its key: {busy}"
        spot = None
        if nodeset is not None and busy.key:
            # A run with a budget too is parked for both: taken when the key is free and
            # admitted in its budget then, so it goes through the broker once, not once
            # for its key and again for its slot.
            kind = "busy" if options.rate is None else "rate"
            spot = parking.spot(nodeset, kind, busy.key, options, budget=options.rate)
        defer(task, task_id, countdown, why, reason="busy", wake=busy.key, nodeset=nodeset,
              spot=spot)  # fmt: skip
    if policy == "retry":
        logger.info(
            "Task %s[%s] retries in %ss: %s", task.name, task_id, options.retry_countdown, busy
        )
        raise task.retry(exc=busy, countdown=options.retry_countdown)
    if policy == "skip":
        logger.info("Task %s[%s] skipped: %s", task.name, task_id, busy)
        if _stores_result(task):
            task.backend.mark_as_failure(task_id, busy, request=task.request, call_errbacks=False)
        raise Skipped(busy)
    raise busy


def _stores_result(task: Task) -> bool:
    """Whether a run of ``task`` stores its result in the result backend, as Celery does.

    Not an eager run (``apply()``, ``task_always_eager``) unless the task asks for it
    (``task_store_eager_result``): its caller reads the ``EagerResult`` that ``apply()``
    returns, and a test app's result backend is often not running (a skip there used
    to fail with that backend's ``ConnectionError`` instead of ``LockBusy``).
    """
    if task.ignore_result:
        return False
    if getattr(task.request, "is_eager", False):
        return bool(task.store_eager_result)
    return True


class Skipped(Ignore):
    """The Ignore a skipped run ends with; carries the LockBusy for an eager result."""

    def __init__(self, busy: LockBusy) -> None:
        super().__init__(str(busy))
        self.busy = busy


def requeue_duplicate(
    task: Task,
    task_id: str,
    busy: LockBusy,
    why: str,
    nodeset: NodeSet | None = None,
    options: TaskLockOptions | None = None,
) -> NoReturn:
    """The lock is held under this very task id: put this delivery back for later.

    This is a second delivery of a message whose first delivery holds the lock: an
    acks_late redelivery while it runs, a ``retry(countdown=0)`` picked up before the
    first attempt released, or a redelivery after the first delivery's worker died
    and before its lock expired. Running now would overlap; dropping the message
    would lose the task in the last two cases. So the run is parked until the key is
    free (on ``nodeset``, as a busy run of ``options``: a worker's death does not strand
    it), or, where no node takes it, its message is published again with a growing
    delay (never beyond the holder's lease; started earlier by the key's release,
    :mod:`celery_redlock.integration.wakeups`), and this delivery ends as ignored,
    storing nothing. When the copy runs and the task id already has a final
    result from the first delivery, it does not run again (see
    :func:`celery_redlock.integration.task.acquire_for`).

    The same holds for the follow-up copy of a ``lock_unique="until_started"`` task,
    queued while another copy of its key runs: it is put back until that one ends,
    keeping its send-time claim, so at most one follow-up waits.
    """
    count = requeues(task.request) + 1
    countdown = min(busy.ttl or 1.0, 0.25 * 2 ** min(count, 8))
    if nodeset is not None and options is not None and busy.key:
        spot = parking.spot(nodeset, "busy", busy.key, options)
        defer(task, task_id, countdown, why, reason="follows", wake=busy.key, spot=spot,
              headers={REQUEUES_HEADER: count})  # fmt: skip
    put_back(task, countdown, headers={REQUEUES_HEADER: count, WAKE_HEADER: busy.key})
    logger.info(
        "Task %s[%s] %s; trying again in %.2fs: %s",
        task.name,
        task_id,
        why,
        countdown,
        busy,
    )
    raise Requeued(str(busy))


def defer(
    task: Task,
    task_id: str,
    countdown: float,
    why: str,
    *,
    reason: str,
    wake: str | None = None,
    nodeset: NodeSet | None = None,
    spot: parking.Spot | None = None,
    headers: dict[str, Any] | None = None,
    args: Any = None,
    kwargs: Any = None,
    detail: dict[str, Any] | None = None,
) -> NoReturn:
    """Park this run (``spot``) or put it back on the queue, and end this delivery.

    Parked (:mod:`celery_redlock.integration.parking`): the run waits on a lock node, due in
    ``countdown`` seconds (or when ``spot`` says), and a live worker publishes its copy
    once then; this delivery is acknowledged. Without a ``spot``, or when no node takes
    it, the copy goes back on the queue with a countdown: published before this delivery
    ends, so before an ``acks_late`` message is acknowledged, it waits in the broker and
    a worker's timer. Either way it holds no pool process, and it is the same task id
    with its arguments and options (headers, links, ``retries`` as they were: it is not
    a retry), counted in :data:`DEFERRALS_HEADER`, with ``headers`` added
    (``args``/``kwargs``: other arguments, as :func:`put_back` takes them). Before a run
    is parked, :data:`PARK_HOOKS` are called with how long it may wait parked (a copy
    holding a send-time claim keeps it that long: its countdown, or, waiting for a key's
    release, as long as a parked run is kept; its publication takes the claim again for
    ``lock_unique_ttl``).
    ``wake``: the lock key whose release may start the copy before its countdown
    (:data:`WAKE_HEADER`, read by :mod:`celery_redlock.integration.wakeups` in the worker); the
    copy is recorded on ``nodeset`` among the runs waiting for it (``ls``: QUEUED), with
    one call, before it is published: its start, which removes the entry, cannot come
    first. (A copy refused by its rate budget was recorded by its admission.)

    ``reason``: why it waits, as its ``deferred`` event says
    (:mod:`~celery_redlock.integration.events`), with ``detail``'s fields.

    Raises:
        Requeued: always; the body must not run.
    """
    added: dict[str, Any] = {**(headers or {}), DEFERRALS_HEADER: deferrals(task.request) + 1}
    # Always set: a copy deferred again by its rate must not keep an old key's wake.
    added[WAKE_HEADER] = wake
    if wake is not None and nodeset is not None:
        note_queued(nodeset, keys_of(wake), task_id, countdown)
    token = None
    if spot is not None:
        try:
            # A run waiting for a key's release waits as long as the key is held: its
            # claim (a follow-up's) must outlive that, up to the parked run's lifetime.
            waits = parking.LIFETIME if spot.kind == "busy" else countdown
            for hook in PARK_HOOKS:
                hook(task, waits)
            delay = 0.0 if spot.kind == "busy" else countdown
            token = parking.park(task, delay, added, spot, args=args, kwargs=kwargs)
        except Exception:  # the queue still takes it
            logger.exception("Task %s[%s]: parking failed", task.name, task_id)
    parked = token is not None and token.parked
    where = spot.nodeset if spot is not None else nodeset
    lock = spot.lock if spot is not None else wake
    if where is not None and lock is not None:
        events.record(task.app, where, "deferred", (lock,), task.name, task_id,
                      reason=reason, in_ms=round(countdown * 1000), parked=parked,
                      **(detail or {}))  # fmt: skip
    if parked:
        logger.info("Task %s[%s] %s; parked, due in %.3fs", task.name, task_id, why, countdown)
        raise Requeued(why)
    if request_header(task.request, parking.PARKED_HEADER):
        # A parked run's copy: its record is still parked (its copy's start removes it),
        # due again when its take's lease ends; a copy on the queue as well would run
        # it twice.
        logger.info("Task %s[%s] %s; its parked record brings it back", task.name, task_id, why)
        raise Requeued(why)
    # No node took it. If one may have (no reply), the copy carries that parking's
    # token: of it and the parked one, the first to start runs (parking.claim_start).
    maybe = token.value if token is not None and token.maybe else None
    headers = {**added, parking.PARKED_HEADER: None, parking.MAYBE_HEADER: maybe}
    put_back(task, countdown, headers=headers, args=args, kwargs=kwargs)
    logger.info("Task %s[%s] %s; runs again in %.3fs", task.name, task_id, why, countdown)
    raise Requeued(why)


def defer_unavailable(
    task: Task, task_id: str, exc: BaseException, spot: parking.Spot | None
) -> None:
    """Put back a run whose lock nodes did not answer as it started (for a while).

    Returns (the caller raises ``exc``) once they have not answered for
    :data:`UNAVAILABLE_BUDGET` seconds since it first happened.

    A reply that comes late (an overloaded machine, a failover) is no reason to fail
    the run: it goes back like a busy one, with a backoff doubling from 0.5 s up to 5 s
    (parked if a node takes it, else on the queue), counted in :data:`DEFERRALS_HEADER`.
    An eager run has no queue: it raises at once.
    """
    if getattr(task.request, "is_eager", False):
        return
    try:
        since = float(request_header(task.request, UNAVAILABLE_HEADER) or 0.0)
    except (TypeError, ValueError):
        since = 0.0
    now = time.time()
    since = since or now
    if now - since >= UNAVAILABLE_BUDGET:
        return
    countdown = min(5.0, 0.5 * 2 ** min(deferrals(task.request), 4))
    if metrics.enabled:
        metrics.deferred(task.name, "unavailable")
    why = f"found its lock nodes unavailable ({exc})"
    defer(task, task_id, countdown, why, reason="unavailable", spot=spot,
          headers={UNAVAILABLE_HEADER: since})  # fmt: skip


def put_back(
    task: Task,
    countdown: float,
    *,
    headers: dict[str, Any] | None = None,
    args: Any = None,
    kwargs: Any = None,
) -> None:
    """Publish the running delivery's copy again: same task id, options and retries.

    ``headers`` are merged into the copy's own (its claim's, the user's go on with it);
    ``args``/``kwargs`` replace its arguments when given (a debounced copy runs with the
    last call's). The copy is not a child of this delivery: nothing of it is kept on
    the request (whose children list outlives it, with an AsyncResult each).
    """
    signature = task.signature_from_request(
        task.request, args=args, kwargs=kwargs, countdown=countdown
    )
    if headers:
        signature.set(headers={**(signature.options.get("headers") or {}), **headers})
    signature.apply_async(add_to_parent=False)


def deferrals(request: Any) -> int:
    """How often this run was put back to wait for its turn (0 for none, or unreadable)."""
    return _counted(request, DEFERRALS_HEADER)


class Requeued(Ignore):
    """The Ignore a delivery put back as a duplicate of itself ends with.

    The copy goes on (it is queued again under the same task id), so its send-time
    claim stays (:func:`celery_redlock.integration.unique.ended`).
    """


def requeues(request: Any) -> int:
    """How often this delivery was put back as a duplicate (0 for none, or unreadable)."""
    return _counted(request, REQUEUES_HEADER)


def _counted(request: Any, header: str) -> int:
    """A counter header of the delivery (0 when absent or unreadable)."""
    try:
        return int(request_header(request, header) or 0)
    except (TypeError, ValueError):
        return 0


def request_header(request: Any, name: str) -> Any:
    """A custom message header of the delivery ``request`` is for (None if absent).

    Celery puts a message's custom headers on the request, or (eager, some
    versions) in its ``headers``.
    """
    value = getattr(request, name, None)
    if value is None:
        value = (getattr(request, "headers", None) or {}).get(name)
    return value


def already_done(task: Task, task_id: str) -> bool:
    """Whether an earlier delivery of ``task_id`` stored a final result."""
    if task.ignore_result:
        return False
    try:
        state = task.backend.get_task_meta(task_id).get("status")
    except Exception:  # no usable backend: run (at least once beats at most once)
        return False
    return state in states.READY_STATES


def apply_on_lost(task: Task, task_id: str, policy: str, lock: Redlock, exc: LockLost) -> None:
    """Apply ``lock_on_lost``: called by the renewer when a running task's lease is lost."""
    then = "abort" if policy == "revoke" and not reaper.in_pool_child() else policy
    nodeset = getattr(lock, "nodeset", None)
    events.record(task.app, nodeset, "lost", (exc.key,), task.name, task_id, then=then)
    if policy == "ignore":
        logger.error("Task %s[%s] lost its lock (%s); it keeps running", task.name, task_id, exc)
        return
    if policy == "revoke" and reaper.in_pool_child():
        logger.error("Task %s[%s] lost its lock (%s); revoking it", task.name, task_id, exc)
        try:
            task.app.control.revoke(task_id, terminate=True, signal="SIGTERM")
            return
        except Exception:  # broker unreachable: stopping the body must not depend on it
            logger.exception("Task %s[%s]: revoke failed; aborting instead", task.name, task_id)
    logger.error("Task %s[%s] lost its lock (%s); aborting it", task.name, task_id, exc)
    if not abort.abort(lock.lease, exc):
        logger.debug("Task %s[%s] had already ended", task.name, task_id)
