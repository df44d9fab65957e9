"""Rate budgets of tasks (``lock_rate``): a run starts only when its key's budget has room.

``lock_rate="N/s"`` (or ``"N/m"``, ``"N/h"``) lets at most N runs of one key start in
any sliding window of that length, across every worker, pool process and host: the
budget is ``redlock:{NAME}:rate`` on the lock nodes (:mod:`celery_redlock.engine.rate`),
``NAME`` the task's lock name, so ``lock_key="api:{tenant}"`` gives each tenant a budget
and a :class:`~celery_redlock.RateLimit` of the same name draws on it too.

The admission is the last step before the body, after the execution lock (or shared
slot) is taken: the start logged is the body's. A run that comes early holds nothing
while it waits: it is parked on the lock node (:mod:`celery_redlock.integration.parking`: same task
id, arguments and options, not a retry; this delivery is acknowledged) until its place
in line: the node serves the runs waiting for the key in the order they were refused, N
per window (``rate.lua``). Shortly before its place comes, a live worker reserves its
start in the budget at its slot and publishes its copy, once, with a countdown to it;
the copy's admission moves that start to the body's moment (``owned``; a copy that
comes a little early, its countdown having run on another clock, waits for its slot in
place, up to :data:`IN_PLACE`), so a backlog of B runs goes through the broker about B
times more, whoever dies meanwhile. Its lock is released as the delivery ends.

Where no node takes the run (a Redis Cluster), it goes back on the queue with a
countdown to its place, held by a worker unacknowledged until due; the Redis and SQS
brokers give a message held longer than their ``visibility_timeout`` to another worker,
so no countdown is longer than half that timeout (:func:`broker_visibility`,
:data:`MAX_HOLD` for a broker without one), and a small random margin (at most
:data:`MAX_MARGIN`, and a tenth of a slot) keeps such a copy from arriving a hair
before its slot.

An eager run (``apply()``) has no queue: it sleeps until its slot, in its caller.
Redis unreachable or late: as for the lock (the run is put back for a while, then
fails with ``NodeUnavailable``, :func:`~celery_redlock.integration.policies.defer_unavailable`;
retries with ``lock_on_busy="retry"``; runs without its budget with
``redlock_fail_open``).
"""

from __future__ import annotations

import logging
import math
import random
import secrets
import time
from dataclasses import dataclass
from typing import Any

from celery import Task

from ..base import metrics
from ..engine.lock import Redlock
from ..engine.rate import judge, rate_calls, return_calls
from ..exceptions import LockKeyError, NodeUnavailable
from . import parking
from .policies import defer, defer_unavailable, request_header
from .settings import Settings, TaskLockOptions

__all__ = ["Stamp", "admit", "broker_visibility", "keep_on_time", "longest_hold"]

#: Longest random margin after its slot a run is put back with, in seconds.
MAX_MARGIN = 0.02

#: Longest wait in place (holding its lock) of a parked run's copy that came before the
#: start reserved for it, in seconds; one earlier than that is parked again.
IN_PLACE = 0.25

#: How late a body may start against its logged start, beyond its usual round trips,
#: in seconds: the guard every logged start keeps past its window (``window.lua``; half
#: a slot for budgets faster than 50/s, whose bodies are kept to N per window within
#: this much).
LATE = 0.010

#: Most times a run's start is logged again because its body would come late
#: (:func:`keep_on_time`).
RESTAMPS = 8

#: Longest countdown of a run put back, for a broker without a visibility timeout
#: (RabbitMQ closes a channel whose delivery stays unacknowledged past its
#: ``consumer_timeout``, 30 minutes by default).
MAX_HOLD = 600.0

#: Seconds kombu's transports give a delivered message before another consumer gets it
#: (``visibility_timeout``), for the brokers that have one, by transport alias.
VISIBILITY_DEFAULTS = {"redis": 3600.0, "rediss": 3600.0, "sentinel": 3600.0, "sqs": 1800.0}

logger = logging.getLogger("celery_redlock.task")


@dataclass(frozen=True)
class Stamp:
    """A start logged for this run: its member, and when the call that logged it left.

    The node logged the start at some moment after ``sent`` (``time.monotonic()``): a
    body that starts no later than :data:`LATE` after ``sent`` starts within that of
    its logged start (:func:`keep_on_time`).
    """

    member: str
    sent: float


def admit(
    task: Task,
    options: TaskLockOptions,
    settings: Settings,
    lock: Redlock,
    member: str | None = None,
) -> Stamp | None:
    """Log this run's start in its key's budget, or put the run back on the queue.

    ``lock`` is the run's lock (held): the budget is its name's. ``member``: a start
    logged for this run earlier, moved to now (:func:`keep_on_time`). Returns the start
    logged (None: the run goes without its budget, ``redlock_fail_open``).

    Raises:
        Requeued: the run came early; it waits on the queue for its slot.
        NodeUnavailable: too few lock nodes answered (unless ``redlock_fail_open``).
    """
    budget = options.rate
    assert budget is not None
    if len(lock.resources) > 1:
        raise LockKeyError(task.name, "lock_key", "lock_rate needs one resource, got several")
    keys, nodeset = lock.keys, lock.nodeset
    eager = bool(getattr(task.request, "is_eager", False))
    # A run on the queue is seen waiting (ls: QUEUED) from its refusal to its start,
    # both recorded by the admission's own call; an eager run waits in its caller.
    waiting = None if eager else task.request.id
    # A parked run's copy: its publisher reserved its start (it owns its slot).
    logged = member or (None if eager else request_header(task.request, parking.MEMBER_HEADER))
    in_place = IN_PLACE
    while True:
        owned = isinstance(logged, str) and bool(logged)
        member = str(logged) if owned else secrets.token_hex(8)
        logged = None
        # Arrive just after the slot frees, not a hair before it (clocks, rounding).
        jitter = random.uniform(0, min(MAX_MARGIN, budget.window / budget.limit / 10))
        call = rate_calls(keys, budget, member, task_id=waiting, jitter=jitter, owned=owned)
        sent = time.monotonic()
        try:
            replies = nodeset.call([call])
            round_trips.add(time.monotonic() - sent)
            verdict = judge(replies, nodeset.quorum)
            if not verdict.admitted and any(verdict.undo):
                nodeset.call(return_calls(keys, member, verdict.undo), per_node=True)
            wait = verdict.wait_or_raise(keys.rate)
        except NodeUnavailable as exc:
            if settings.fail_open:
                logger.warning(
                    "Task %s[%s] runs WITHOUT its rate budget (redlock_fail_open): %s",
                    task.name,
                    task.request.id,
                    exc,
                )
                return None
            if options.on_busy == "retry":
                raise task.retry(exc=exc, countdown=options.retry_countdown) from exc
            defer_unavailable(task, task.request.id, exc, parking.Spot(nodeset, "later", lock.key))
            raise
        if not wait:
            return Stamp(member, sent)
        if owned and wait <= in_place:
            # Early for the start reserved for it (clocks): still its own slot.
            logged, in_place = member, in_place - wait
            time.sleep(wait)
            continue
        if metrics.enabled:
            metrics.deferred(task.name, "rate")
        if not eager:
            why = f"waits for its slot in {budget} of {lock.name}"
            # Parked until its place in line comes; on the queue (for at most half the
            # broker's visibility timeout) if no node takes it.
            spot = parking.spot(nodeset, "rate", lock.key, options, budget=budget)
            countdown = min(wait + jitter, longest_hold(task.app))
            place = max(1, math.ceil(wait * budget.limit / budget.window))
            defer(task, task.request.id, countdown, why, reason="rate", spot=spot,
                  detail={"rate": str(budget), "place": place})  # fmt: skip
        time.sleep(wait + jitter)


def keep_on_time(
    task: Task, options: TaskLockOptions, settings: Settings, lock: Redlock, stamp: Stamp | None
) -> None:
    """Just before the body: move its logged start to now if the body would come late.

    A start is logged on the node, then the reply travels back and the run takes its
    last steps (a parked copy's check that it is the one to run): a process descheduled
    meanwhile (measured: replies 37-68 ms late for 150 ms on two cores with eight pool
    processes) starts its body that much after its logged start, and N + 1 bodies could
    start within one window although the node admitted N. A body about to start more
    than :data:`LATE` plus two of this process's usual round trips (:class:`RoundTrips`:
    a path that is always slow delays every body alike) after its admission was sent
    has its start logged again at now (``owned``: when the windows after it have room;
    else the run waits for its place like any refused run), at most :data:`RESTAMPS`
    times; then the body goes.

    Raises:
        Requeued: no room at now; the run waits for its place (as in :func:`admit`).
    """
    for _ in range(RESTAMPS):
        if stamp is None or time.monotonic() - stamp.sent <= LATE + 2 * round_trips.usual:
            return
        logger.debug("Task %s[%s] late for its start: logged again", task.name, task.request.id)
        stamp = admit(task, options, settings, lock, member=stamp.member)


class RoundTrips:
    """The usual admission round trip of this process, in seconds: about its fastest recent.

    Falls at once to a faster round trip and rises by a sixteenth of the difference
    with each slower one, so a stall of a few calls barely moves it and a path that
    stays slower is followed within some tens of calls. One float, written whole: the
    threads of a pool share it without a lock.
    """

    def __init__(self) -> None:
        # Infinite until the first admission (which always comes before keep_on_time).
        self.usual = math.inf

    def add(self, seconds: float) -> None:
        """One admission's round trip."""
        if seconds < self.usual:
            self.usual = seconds
        else:
            self.usual += (seconds - self.usual) / 16


#: The round trips of this process's admissions (:func:`keep_on_time`).
round_trips = RoundTrips()


def longest_hold(app: Any) -> float:
    """The longest countdown a run may be put back with on ``app``'s broker.

    Half the broker's visibility timeout (so a worker never holds the copy long enough
    for the broker to deliver it again), or :data:`MAX_HOLD` without one.
    """
    visibility = broker_visibility(app)
    return MAX_HOLD if visibility is None else visibility[1] / 2


def broker_visibility(app: Any) -> tuple[str, float] | None:
    """How long the broker lets a worker hold a message unacknowledged, and the setting.

    ``(source, seconds)`` for the Redis and SQS transports (``broker_transport_options
    ['visibility_timeout']`` or the transport's default); None for a broker without
    one (AMQP, memory). Read from the URL, as kombu picks the transport: building a
    connection would import the transport (SQS needs boto3).
    """
    conf = app.conf
    url = conf.get("broker_write_url") or conf.get("broker_url") or ""
    first = (url if isinstance(url, str) else next(iter(url), "")).split(";")[0]
    scheme = first.split("://")[0] if "://" in first else conf.get("broker_transport")
    transport = str(scheme or "amqp").split("+")[0].lower()
    default = VISIBILITY_DEFAULTS.get(transport)
    if default is None:
        return None
    options = conf.get("broker_transport_options") or {}
    given = options.get("visibility_timeout") if isinstance(options, dict) else None
    try:
        seconds = float(given) if given is not None else default
    except (TypeError, ValueError):
        return None
    if given is None:
        return f"the {transport} broker's default visibility_timeout", seconds
    return "broker_transport_options['visibility_timeout']", seconds
