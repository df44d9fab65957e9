"""``LockedTask``: a task base class that runs its body only while holding its lock.

::

    @app.task(base=LockedTask, bind=True, lock_ttl=60, lock_args=("account_id",))
    def sync_account(self, account_id, full=False):
        self.lock.check()
        ...

The lock is taken in :meth:`LockedTask.before_start`, which Celery (>= 5.2) runs
inside the traced ``try``: raising there decides the task's state, and the body
never starts (a ``task_prerun`` receiver could not do this: Celery logs and swallows
its exceptions). It is released as the body returns or raises, in
:meth:`LockedTask.__call__`, before Celery sends the chain's next step and ``link``
callbacks and stores the result (which starts a chord's body and wakes a caller in
``get()``): a run never finds its key held by the run that caused it. ``task_postrun``
(see :mod:`celery_redlock.integration.worker`), which fires for every outcome, releases what is
left: the lock of a run whose body never started (``before_start`` failed after taking
it), or whose release an exception cut short. A pool child that dies has its locks
released by the worker's main process (:mod:`celery_redlock.integration.reaper`).

Everything about one execution lives in thread-local (greenlet-local under gevent)
storage keyed by the execution's task id, never on the task object, which the threads
pool shares between runs.

What a busy lock (``lock_on_busy``), a second delivery of a task id that holds its
lock, and a lost lock (``lock_on_lost``) do is told, and applied, in
:mod:`celery_redlock.integration.policies`.

Redis unreachable: the body does not run and the task fails with
:class:`~celery_redlock.NodeUnavailable` (or retries, with ``lock_on_busy="retry"``),
unless ``redlock_fail_open`` is set, in which case it runs unlocked with a warning.
"""

from __future__ import annotations

import inspect
import logging
import threading
import time
from collections.abc import Mapping, Sequence
from datetime import datetime, timezone
from functools import partial
from typing import Any

from celery import Celery, Task, states
from celery.exceptions import Ignore
from celery.result import EagerResult
from celery.utils.time import maybe_iso8601

from ..engine.lock import Redlock
from ..exceptions import ConfigurationError, LockBusy, LockLost, LockNotOwned, NodeUnavailable
from . import abort, budgets, events, policies, reaper, unique
from .names import call_lock_name, signature
from .parking import MAYBE_HEADER, PARKED_HEADER, Spot, can_park, claim_start
from .policies import (
    Skipped,
    already_done,
    apply_on_busy,
    apply_on_lost,
    defer_unavailable,
    deferrals,
    request_header,
    requeues,
)
from .queued import note_started
from .settings import (
    TASK_OPTIONS,
    Settings,
    TaskLockOptions,
    app_settings,
    forget_app_settings,
    parse_entry,
    resolve_task_options,
)

__all__ = [
    "LockedTask",
    "acquire_for",
    "announce_lock",
    "app_settings",
    "call_lock",
    "config_overrides",
    "forget_options",
    "forget_settings",
    "held_lock",
    "lock_for",
    "lock_options",
    "pop_lock",
    "push_lock",
    "release_lock",
    "task_options",
]

logger = logging.getLogger("celery_redlock.task")

#: ``EagerResult`` takes the task's name from Celery 5.4 on.
_EAGER_RESULT_NAMED = "name" in inspect.signature(EagerResult).parameters

# The locks of the executions running in this thread (greenlet, under gevent), as a
# stack, innermost last. A stack, because one thread can run several locked executions
# nested in each other: a body calling ``other.apply()``, errbacks and callbacks Celery
# runs inline for an eager task, ``task_always_eager`` canvases. Each keeps and
# releases its own lock. Not an attribute of ``task.request``: Celery copies unknown
# request attributes into the custom headers of retried messages, and a Redlock is not
# serialisable.
_running = threading.local()


class _Execution:
    """One locked execution in this thread: its task id, its lock, whether its body runs."""

    __slots__ = ("in_body", "lock", "since", "task_id")

    def __init__(self, task_id: str, lock: Redlock) -> None:
        self.task_id = task_id
        self.lock = lock
        self.since = time.monotonic()  # taken (about): the released event's held_ms
        # Set by the traced call of the body (LockedTask.__call__): a call of the task
        # from inside its own body (``self(...)``) sees it, and neither checks nor
        # releases the lock, which belongs to the outer run.
        self.in_body = False


def _stack() -> list[_Execution]:
    stack = getattr(_running, "stack", None)
    if stack is None:
        stack = _running.stack = []
    return stack


def _execution(task_id: str | None) -> _Execution | None:
    """The innermost locked execution of ``task_id`` in this thread, if any."""
    for execution in reversed(_stack()):
        if execution.task_id == task_id:
            return execution
    return None


def held_lock(task: Task) -> Redlock | None:
    """The lock held by the execution of ``task`` running in this thread, if any."""
    execution = _execution(task.request.id)
    return None if execution is None else execution.lock


def push_lock(task_id: str, lock: Redlock) -> None:
    """Record that this thread's execution of ``task_id`` now holds ``lock``."""
    _stack().append(_Execution(task_id, lock))


def pop_lock(task_id: str | None) -> Redlock | None:
    """Detach and return this thread's lock for ``task_id`` (at the end of a run)."""
    stack = _stack()
    for index in range(len(stack) - 1, -1, -1):
        if stack[index].task_id == task_id:
            return stack.pop(index).lock
    return None


#: Task ids whose body ended in this process and whose run has not reached
#: ``task_postrun``: the lock is released as the body ends, before Celery stores the
#: result, so another delivery of the same task id that was waiting for the key can
#: take it in between and find no result yet. It must not run the body again.
_ended_bodies: set[str] = set()


def body_ended(task_id: str) -> None:
    """The body of ``task_id``'s run ended here; its result is not stored yet."""
    _ended_bodies.add(task_id)


def run_ended(task_id: str | None) -> None:
    """``task_id``'s run reached ``task_postrun``: its result, if any, is stored."""
    _ended_bodies.discard(task_id or "")


def release_lock(task: Task, task_id: str | None) -> None:
    """Release the lock of ``task_id``'s execution in this thread, if it holds one.

    Called as the body returns (:meth:`LockedTask.__call__`), and again in
    ``task_postrun`` for a run whose body never started (``before_start`` failed after
    the lock was taken) or whose release an exception cut short. The lock leaves this
    thread's records only once its release has run: an exception (a soft time limit)
    landing before that leaves it to the second call, instead of to a lease renewed
    with nobody left to release it. A release that fails is logged: the lease ends by
    itself within one TTL, and the run's outcome is its body's.
    """
    execution = _execution(task_id)
    if execution is None:
        return
    lock = execution.lock
    abort.untrack(lock.lease)  # a loss noticed from now on is no longer the body's
    try:
        lock.release()
    except LockNotOwned:
        # An earlier release of this run was interrupted: the engine ended the hold.
        logger.debug("Task %s[%s]: %s was released already", task.name, task_id, lock.key)
    except Exception:
        logger.exception("Task %s[%s]: releasing %s failed", task.name, task_id, lock.key)
    pop_lock(task_id)
    announce_lock(reaper.forget, lock, task_id or "")
    held_ms = round((time.monotonic() - execution.since) * 1000)
    record(task, lock, "released", task_id, held_ms=held_ms)


def record(task: Task, lock: Redlock, event: str, task_id: str | None, **fields: Any) -> None:
    """Log ``event`` of this run of ``task`` on each key of ``lock`` (the event log)."""
    keys = [resource.lock for resource in lock.resources]
    events.record(task.app, lock.nodeset, event, keys, task.name, task_id, **fields)


def forget_settings(app: Celery) -> None:
    """Read ``app``'s ``redlock_*`` settings again at their next use (they changed).

    The lock options of its tasks, which the settings' defaults fill in, too.
    """
    forget_app_settings(app)
    for task in list(getattr(app, "_tasks", {}).values()):  # app.tasks would finalize it
        if isinstance(task, LockedTask):
            forget_options(task)


def lock_options(task: Task) -> TaskLockOptions:
    """Resolve and validate ``task``'s ``lock_*`` options (cached on the task class).

    Options set by ``redlock_tasks`` (:func:`celery_redlock.integration.config_only.lockify`)
    come first. A task class made lockable by configuration from a project's own
    base class has no ``lock_*`` options of ours besides those: its attributes of
    that name, if any, are the project's. The work is
    :func:`celery_redlock.integration.settings.resolve_task_options`'s, which ``doctor`` calls too.

    Raises:
        ConfigurationError: naming the task, the option and the accepted values (and
            the ``redlock_tasks`` entry, for options set there).
    """
    cls = type(task)
    cached: TaskLockOptions | None = cls.__dict__.get("_redlock_options")
    if cached is not None:
        return cached
    options = task_options(
        task,
        getattr(cls, "_redlock_configured", None),
        source=getattr(cls, "_redlock_source", None),
        read_attributes=getattr(cls, "_redlock_read_attributes", True),
    )
    cls._redlock_options = options
    return options


def task_options(
    task: Task,
    entry: Mapping[str, Any] | None,
    *,
    source: str | None,
    read_attributes: bool,
) -> TaskLockOptions:
    """``task``'s lock options from a ``redlock_tasks`` entry and its attributes (uncached).

    With ``read_attributes``, the task's ``lock_*`` attributes are options of ours
    (a :class:`LockedTask` written for celery_redlock); the entry overrides them.
    """

    def attribute(name: str) -> Any:
        return getattr(task, TASK_OPTIONS[name].attribute, None)

    return resolve_task_options(
        app_settings(task.app),
        task.name,
        task.run,
        entry,
        attribute if read_attributes else None,
        source=source,
    )


def config_overrides(task: Task) -> dict[str, tuple[Any, Any]]:
    """The options a ``redlock_tasks`` entry sets over ``task``'s own code.

    ``{name: (code value, entry value)}``: the entry wins (the configuration is what
    operators change without a deploy), and the worker says so at start.
    """
    cls = type(task)
    entry = getattr(cls, "_redlock_configured", None)
    if entry is None or not getattr(cls, "_redlock_read_attributes", True):
        return {}  # no entry, or attributes that are the project's, not options of ours
    given = parse_entry(task.name, entry, getattr(cls, "_redlock_source", None) or "options")
    found = {}
    for name, value in given.items():
        code = getattr(task, TASK_OPTIONS[name].attribute, None)
        if code is not None and code != value:
            found[name] = (code, value)
    return found


def forget_options(task: Task) -> None:
    """Drop the cached options of ``task``'s class (its configuration changed)."""
    type(task)._redlock_options = None


class LockedTask(Task):
    """A task whose body runs only while it holds a distributed lock.

    Options (class attributes, so also ``@app.task(...)`` keywords; each defaults
    to the ``redlock_*`` setting of the same name):

    * ``lock_ttl``: lease in seconds, renewed while the body runs.
    * ``lock_args``: argument names the key uses; ``None`` all, ``()`` none.
    * ``lock_key``: ``(args, kwargs) -> str`` or a format string over argument
      names, naming the resource instead (tasks with the same key share a lock).
    * ``lock_on_busy``: ``skip`` | ``retry`` | ``raise`` | ``wait`` | ``requeue`` (back
      on the queue until the key is free; not a retry).
    * ``lock_on_lost``: ``abort`` (``LockLost`` raised in the body) | ``revoke``
      (terminate through Celery's revoke; prefork) | ``ignore`` (log only). In
      every case ``self.lock.check()`` raises and the task's result is a failure
      with ``LockLost``.
    * ``lock_mode``: ``exclusive`` (default) | ``shared``: shared runs hold the
      resource together, never alongside an exclusive run of the same key.
    * ``lock_limit``: at most this many runs per key at once (shared slots).
    * ``lock_fair``: waiters (``lock_on_busy="wait"``) are served in arrival order.
    * ``lock_retry_countdown``, ``lock_wait_timeout``, ``lock_renew_interval``.
    * ``lock_unique``: ``None`` | ``"until_started"`` | ``"until_finished"``: at most
      one queued (or running) copy per key, decided at send time
      (:mod:`celery_redlock.integration.unique`); ``lock_on_duplicate``: ``"return"`` (the queued
      copy's ``AsyncResult``) | ``"raise"`` (``LockBusy``); ``lock_unique_ttl``.
    * ``lock_debounce``: seconds; calls within it collapse into one run, started no
      sooner than that after the last call, with its arguments. ``lock_throttle``:
      seconds; at most one run per key starts per window.
    * ``lock_rate``: ``"N/s"`` | ``"N/m"`` | ``"N/h"``: at most N runs per key start in
      any such sliding window, across all workers; a run that comes early goes back on
      the queue for its slot (:mod:`celery_redlock.integration.budgets`). With
      ``lock_mode="shared"`` runs of a key may overlap; with ``lock_limit=N`` at most N
      at once.

    ``lock_key`` may name several resources (a list of format strings, or a callable
    returning a list): all are locked together or none, e.g. both accounts of a
    transfer.

    .. versionadded:: 0.1
    """

    lock_ttl: float | None = None
    lock_renew_interval: float | None = None
    lock_args: tuple[str, ...] | None = None
    lock_key: Any = None
    lock_on_busy: str | None = None
    lock_on_lost: str | None = None
    lock_retry_countdown: float | None = None
    lock_wait_timeout: float | None = None
    lock_mode: str | None = None
    lock_limit: int | None = None
    lock_fair: bool | None = None
    lock_unique: str | None = None
    lock_on_duplicate: str | None = None
    lock_unique_ttl: float | None = None
    lock_debounce: float | None = None
    lock_throttle: float | None = None
    lock_rate: str | None = None

    @property
    def lock(self) -> Redlock:
        """The lock this execution holds: ``fence``, ``key``, ``remaining()``, ``check()``."""
        lock = held_lock(self)
        if lock is None:
            raise RuntimeError(
                f"task {self.name}: self.lock exists only while the task's body runs, in a "
                "worker or with apply() (not in on_success, on_failure or after_return, "
                "which run after the release; not when the task is called directly, nor "
                "with redlock_fail_open after Redis was unreachable: see self.current_lock)"
            )
        return lock

    @property
    def current_lock(self) -> Redlock | None:
        """:attr:`lock`, or None when this execution holds none.

        For a body that must also run without its lock: with ``redlock_fail_open``
        after Redis was unreachable, or called directly (``task(...)``).
        """
        return held_lock(self)

    def before_start(self, task_id: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Take the lock before the body runs (see the module docs for busy locks)."""
        super().before_start(task_id, args, kwargs)
        lock = acquire_for(self, task_id, args, kwargs)
        options, settings = lock_options(self), app_settings(self.app)
        stamp = None
        if lock is not None and options.rate is not None:
            # Last before the body (and the claim's hand-over): the start logged is its.
            stamp = budgets.admit(self, options, settings, lock)
        elif lock is not None and deferrals(self.request):
            # A run put back by lock_on_busy="requeue" starts: it waits no more (ls:
            # QUEUED). Only such runs pay this call; a rated run's admission does it.
            note_started(lock.nodeset, lock.resources, task_id)
        if lock is not None and not _first_copy(self, lock, settings, task_id):
            # Another copy of this parked run started (its first worker died holding
            # this one, or it waited past its take's lease): this one must not run. Its
            # lock is released in task_postrun; a start it logged in its budget goes
            # unused (fewer starts, never more).
            logger.info(
                "Task %s[%s] already started from another copy; not again", self.name, task_id
            )
            record(self, lock, "not_again", task_id, why="another copy")
            raise Ignore("another copy started")
        unique.started(self, options, settings, task_id, args, kwargs)
        if lock is not None and stamp is not None:
            budgets.keep_on_time(self, options, settings, lock, stamp)

    def apply_async(
        self,
        args: Any = None,
        kwargs: Any = None,
        task_id: str | None = None,
        producer: Any = None,
        link: Any = None,
        link_error: Any = None,
        shadow: Any = None,
        **options: Any,
    ) -> Any:
        """Send the task, as Celery does; with ``lock_unique``, only if no copy is queued.

        A duplicate publishes nothing: the queued (or running) copy's ``AsyncResult``
        is returned, or ``LockBusy`` raised (``lock_on_duplicate``). See
        :mod:`celery_redlock.integration.unique`.
        """
        lock = lock_options(self)
        options.update(
            task_id=task_id, producer=producer, link=link, link_error=link_error, shadow=shadow
        )
        if not unique.active(lock):
            return super().apply_async(args, kwargs, **options)
        return unique.send(
            self,
            lock,
            app_settings(self.app),
            tuple(args or ()),
            dict(kwargs or {}),
            options,
            lambda sent: super(LockedTask, self).apply_async(args, kwargs, **sent),
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the body under the lock, and release it as the body returns or raises.

        A lock lost meanwhile makes the result a LockLost failure.

        The release is here, not in ``task_postrun``, because Celery's tracer (5.3 to
        5.7 alike) does everything that starts the runs this one causes after this
        call returns and before ``task_postrun``: it sends the ``link`` callbacks and
        the chain's next step, stores the result (which starts a chord's body, and
        wakes a caller blocked in ``get()``), then calls ``on_success`` or
        ``on_failure``, and ``after_return``. A successor on another pool process, or
        the caller's next call, would find the key still held by this run and be
        refused. Released here, the key is free before any of them is sent, and held
        for the whole body (and the lease check after it). ``task_postrun`` releases
        only what this did not: a run whose body never started, or whose release was
        interrupted.
        """
        execution = _execution(self.request.id)
        if execution is None or execution.in_body:
            # No lock (called directly, or redlock_fail_open), or the task called
            # from inside its own body: the outer call keeps and releases the lock.
            return super().__call__(*args, **kwargs)
        lock, execution.in_body = execution.lock, True
        try:
            try:
                if _calls_run_directly(type(self)):
                    result = self.run(*args, **kwargs)
                else:
                    result = super().__call__(*args, **kwargs)
            except LockLost:
                # The threads pool raises a bare LockLost class: give the result the
                # key, reason and fence.
                lease = lock.lease
                lease_lost = lease.lost if lease is not None else None
                if lease_lost is not None:
                    raise lease_lost from None
                raise
            # A body that returned (or swallowed the abort) still ran unprotected for a
            # while: never report it as a plain success.
            lock.check()
            return result
        finally:
            execution.in_body = False
            body_ended(execution.task_id)
            release_lock(self, execution.task_id)

    def push_request(self, *args: Any, **kwargs: Any) -> None:
        """Push a request for the body that keeps the running execution's fields.

        The tracer calls ``__call__`` rather than ``run`` for a task that overrides
        it, as LockedTask does, and ``Task.__call__`` pushes the body's request
        through this method. Before Celery 5.5 that request held only the arguments
        (celery/celery#9208): the body saw no id, no retries, ``called_directly``,
        so ``self.lock`` found no lock and ``self.retry()`` raised instead of
        retrying. Celery 5.5 merges the current request the same way; explicit
        fields win.
        """
        super().push_request(**{**vars(self.request), **dict(*args, **kwargs)})

    def apply(
        self,
        args: Any = None,
        kwargs: Any = None,
        link: Any = None,
        link_error: Any = None,
        task_id: str | None = None,
        retries: int | None = None,
        throw: bool | None = None,
        **options: Any,
    ) -> EagerResult:
        """Run eagerly, as :meth:`celery.app.task.Task.apply`; a skipped run is a failure.

        A worker stores a run skipped on a busy lock as FAILURE with ``LockBusy``, so
        its ``get()`` raises ``LockBusy``. Celery's eager result would say IGNORED and
        ``get()`` would return None; this gives the eager result the worker's state and
        error instead (and raises ``LockBusy`` at once when ``throw`` /
        ``task_eager_propagates`` asks failures to propagate).
        """
        result = super().apply(args, kwargs, link, link_error, task_id, retries, throw, **options)
        skipped = result.result if result.state == states.IGNORED else None
        if not isinstance(skipped, Skipped):
            return result
        if self.app.conf.task_eager_propagates if throw is None else throw:
            raise skipped.busy
        named = {"name": self.name} if _EAGER_RESULT_NAMED else {}
        return EagerResult(result.id, skipped.busy, states.FAILURE, **named)


_RUN_DIRECTLY: dict[type, bool] = {}


def _calls_run_directly(cls: type) -> bool:
    """Whether a traced run of a ``cls`` task may call its body as the tracer would.

    The tracer calls ``task.run`` for a task that does not override ``__call__``, with
    the request (and the task on the task stack) pushed already; for one that does, as
    every LockedTask, it calls the task. Celery's own ``Task.__call__`` then pushes
    both again, and building that second request cost a lock-taking task about a tenth
    of its CPU (``Context``'s custom headers are sought among all its fields). So the
    body is called as a plain task's is, unless a class between LockedTask and
    ``Task`` in the MRO overrides ``__call__`` (an app context, a tracing wrapper),
    which must run.
    """
    known = _RUN_DIRECTLY.get(cls)
    if known is None:
        mro = cls.__mro__
        callers = [k for k in mro[mro.index(LockedTask) + 1 :] if "__call__" in vars(k)]
        known = _RUN_DIRECTLY[cls] = bool(callers) and callers[0] is Task
    return known


def acquire_for(
    task: Task, task_id: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Redlock | None:
    """Take ``task``'s lock for this execution, or apply the busy/unavailable policy."""
    settings = app_settings(task.app)
    options = lock_options(task)
    lock = call_lock(task, task_id, args, kwargs)
    if lock is None:
        return None
    lock.on_lost = partial(apply_on_lost, task, task_id, options.on_lost, lock)
    announce_lock(reaper.announce, lock, task_id)
    began = time.monotonic()
    try:
        waited = _take(lock, options, task_id)
    except NodeUnavailable as exc:
        announce_lock(reaper.forget, lock, task_id)
        if settings.fail_open:
            logger.warning(
                "Task %s[%s] runs WITHOUT its lock (redlock_fail_open): %s", task.name, task_id, exc
            )
            return None
        if options.on_busy == "retry":
            raise task.retry(exc=exc, countdown=options.retry_countdown) from exc
        defer_unavailable(task, task_id, exc, Spot(lock.nodeset, "later", lock.key))
        raise
    except LockBusy as busy:
        announce_lock(reaper.forget, lock, task_id)
        apply_on_busy(task, task_id, busy, options, lock.nodeset)
    # An eager run (apply(), task_always_eager) is nobody's redelivery: its caller gets
    # only what apply() returns, so it runs even where an earlier run of its task id
    # stored a final result (a frozen canvas applied again, a test reusing an id).
    eager = bool(getattr(task.request, "is_eager", False))
    # A message the broker delivered again (acks_late: its worker died after the body
    # stored a result, before the ack) may be a finished run's, as may any copy that
    # waited or came back.
    redelivered = bool((getattr(task.request, "delivery_info", None) or {}).get("redelivered"))
    maybe_duplicate = not eager and (
        waited
        or redelivered
        or task.request.retries
        or requeues(task.request)
        or deferrals(task.request)
    )
    if maybe_duplicate and (task_id in _ended_bodies or already_done(task, task_id)):
        # Another delivery of this task id finished while this one waited: behind the
        # lock (wait), on the queue (retry, or requeued as a duplicate). Running it again
        # would run the task twice. A parked run's copy takes its run out of the
        # parked runs (else it would come due again at each take's lease end).
        _first_copy(task, lock, app_settings(task.app), task_id)
        lock.release()
        announce_lock(reaper.forget, lock, task_id)
        record(task, lock, "not_again", task_id, why="finished")
        logger.info(
            "Task %s[%s] already finished in an earlier delivery; not running it again",
            task.name,
            task_id,
        )
        raise Ignore("already finished")
    push_lock(task_id, lock)
    abort.track(lock.lease, task_id)
    waited_ms = round((time.monotonic() - began) * 1000) if waited else 0
    record(task, lock, "acquired", task_id, fence=lock.fence, waited_ms=waited_ms)
    late = _late(task.request)
    if late > events.STARTED_LATE:
        record(task, lock, "started_late", task_id, late_ms=round(late * 1000))
    logger.debug("Task %s[%s] holds %s, fence %s", task.name, task_id, lock.key, lock.fence)
    return lock


def call_lock(
    task: Task, task_id: str | None, args: Sequence[Any], kwargs: Mapping[str, Any]
) -> Redlock | None:
    """The lock (not acquired) a call of ``task`` takes; None if the arguments do not bind.

    Raises:
        LockKeyError: an argument that binds cannot be keyed.
    """
    settings = app_settings(task.app)
    options = lock_options(task)
    name = call_lock_name(
        task.name, task.run, args, kwargs, lock_args=options.args, lock_key=options.key
    )
    if name is None:
        return None
    return Redlock(
        name,
        nodes=settings.node_urls(),
        timing=options.timing,
        key_prefix=settings.key_prefix,
        min_replicas=settings.min_replicas,
        task_id=task_id,
        task_name=task.name,
        mode=options.mode,
        limit=options.limit,
        fair=options.fair,
    )


def lock_for(task: Task, /, *args: Any, **kwargs: Any) -> Redlock:
    """The lock that ``task(*args, **kwargs)`` takes when it runs, not acquired.

    The same key, kind (exclusive, shared, limit, several resources), nodes and
    timing as the task's own lock: holding it keeps such a call from running (its
    ``lock_on_busy`` applies), which is how a test or a maintenance script excludes a
    task; ``.key`` is the Redis key. The holder is recorded with no task id.

    Raises:
        ConfigurationError: ``task`` takes no lock (neither a :class:`LockedTask` nor
            named by ``redlock_tasks`` in this process: see
            :func:`~celery_redlock.lock_configured_tasks`), or its options are invalid.
        LockKeyError: an argument cannot be keyed.
        TypeError: the arguments do not bind to the task's signature.
    """
    # `@app.task` returns a proxy until the app is finalized: its options are cached
    # on the task's own class, never on the proxy's, which every such task shares.
    task = getattr(task, "_get_current_object", lambda: task)()
    if not isinstance(task, LockedTask):
        raise ConfigurationError(
            f"task {getattr(task, 'name', task)!r} takes no lock: it is no LockedTask, and "
            "redlock_tasks does not name it in this process (lock_configured_tasks(app) "
            "applies redlock_tasks outside a worker)"
        )
    lock = call_lock(task, None, args, kwargs)
    if lock is None:
        signature(task.run).bind(*args, **kwargs)  # raises Python's own TypeError
        raise TypeError(f"task {task.name}: arguments {args!r}, {kwargs!r} do not bind")
    return lock


def announce_lock(send: Any, lock: Redlock, task_id: str) -> None:
    """Tell the worker's main process (or stop telling it) about each key of ``lock``."""
    for resource in lock.resources:
        send(task_id, resource.lock)


def _first_copy(task: Task, lock: Redlock, settings: Settings, task_id: str) -> bool:
    """Whether this delivery is the one copy of its run to start.

    The last step before the body, so that a parked run stays parked (due again when
    its take's lease ends) until a copy really starts.

    Only a parked run's copy, and a message the broker gave again after its worker
    died (it may have been parked since), pay this call (:func:`parking.claim_start`).
    """
    token = request_header(task.request, PARKED_HEADER) or request_header(
        task.request, MAYBE_HEADER
    )
    redelivered = bool((getattr(task.request, "delivery_info", None) or {}).get("redelivered"))
    if getattr(task.request, "is_eager", False) or not (token or redelivered):
        return True
    if not can_park(lock.nodeset):
        return True  # nothing is parked there
    visibility = budgets.broker_visibility(task.app)
    # The stranded copy of a dead worker comes back after the broker's visibility
    # timeout (Redis, SQS), or as its connection drops (AMQP): kept that long.
    horizon = (visibility[1] if visibility else budgets.MAX_HOLD) + 60.0
    first = lock.resources[0].lock
    return claim_start(lock.nodeset, settings.key_prefix, task_id, str(token or ""), first, horizon)


def _late(request: Any) -> float:
    """Seconds since the delivery's eta (a countdown's end); 0.0 without one."""
    eta = getattr(request, "eta", None)
    if not eta:
        return 0.0
    try:
        moment: datetime = maybe_iso8601(eta)
    except (TypeError, ValueError):
        return 0.0
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return (datetime.now(timezone.utc) - moment).total_seconds()


def _take(lock: Redlock, options: TaskLockOptions, task_id: str) -> bool:
    """Acquire, waiting only with ``on_busy="wait"`` and never for our own task id.

    Returns whether it had to wait (another delivery of this task id may have run
    meanwhile).
    """
    try:
        lock.try_acquire()
    except LockBusy as busy:
        if options.on_busy != "wait" or busy.holder == task_id:
            raise
        if not lock.acquire(timeout=options.wait_timeout):
            lock.try_acquire()
        elif lock.remaining() < lock.timing.renew_interval:
            # Granted by a release, on the grant's short lease, which the watchdog
            # extends within a quarter of a second: a body that holds the GIL from its
            # first line (a long C call) could keep the watchdog from it. Extended here,
            # it starts as a body that did not wait does.
            lock.extend()
        return True
    return False


def _keep_claim(task: Task, countdown: float) -> None:
    """A copy holding a send-time claim keeps it while parked, as one published again does."""
    if not request_header(task.request, policies.CLAIMED_HEADER):
        return
    request = task.request
    unique.carry(
        task,
        lock_options(task),
        app_settings(task.app),
        request.id,
        tuple(request.args or ()),
        dict(request.kwargs or {}),
        {"countdown": countdown},
    )


policies.PARK_HOOKS.append(_keep_claim)
