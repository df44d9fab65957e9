"""Rate budgets of tasks (``lock_rate``): a run starts only when its key's budget has room.

``lock_rate="N/s"`` (or ``"N/m"``, ``"N/h"``) lets at most N runs of one key start in
any sliding window of that length, across every worker, pool process and host: the
budget is ``redlock:{NAME}:rate`` on the lock nodes (:mod:`celery_redlock.engine.rate`),
``NAME`` the task's lock name, so ``lock_key="api:{tenant}"`` gives each tenant a budget
and a :class:`~celery_redlock.RateLimit` of the same name draws on it too.

The admission is the last step before the body, after the execution lock (or shared
slot) is taken: the start logged is the body's. A run that comes early holds nothing
while it waits: it goes back on the queue (:func:`celery_redlock.policies.defer`: same
task id, arguments and options, not a retry, published before this delivery is
acknowledged) with a countdown of when its key's oldest start leaves the window, plus
a random share of one slot (window / N), so that the runs refused together do not all
come back at the same instant; its lock is released as the delivery ends.

An eager run (``apply()``) has no queue: it sleeps until its slot, in its caller.
Redis unreachable: as for the lock (the task fails with ``NodeUnavailable``, retries
with ``lock_on_busy="retry"``, or runs without its budget with ``redlock_fail_open``).
"""

from __future__ import annotations

import logging
import random
import secrets
import time

from celery import Task

from . import metrics
from .engine.lock import Redlock
from .engine.rate import judge, rate_calls, return_calls
from .exceptions import LockKeyError, NodeUnavailable
from .options import TaskLockOptions
from .policies import defer
from .settings import Settings

__all__ = ["admit"]

logger = logging.getLogger("celery_redlock.task")


def admit(task: Task, options: TaskLockOptions, settings: Settings, lock: Redlock) -> None:
    """Log this run's start in its key's budget, or put the run back on the queue.

    ``lock`` is the run's lock (held): the budget is its name's.

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
    while True:
        member = secrets.token_hex(8)
        # A random share of one slot: runs refused together come back spread out.
        jitter = random.uniform(0, budget.window / budget.limit)
        call = rate_calls(keys, budget, member, task_id=waiting, jitter=jitter)
        try:
            verdict = judge(nodeset.call([call]), nodeset.quorum)
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
                return
            if options.on_busy == "retry":
                raise task.retry(exc=exc, countdown=options.retry_countdown) from exc
            raise
        if not wait:
            return
        countdown = wait + jitter
        if metrics.enabled:
            metrics.deferred(task.name, "rate")
        if not eager:
            why = f"waits for its slot in {budget} of {lock.name}"
            defer(task, task.request.id, countdown, why)
        time.sleep(countdown)
