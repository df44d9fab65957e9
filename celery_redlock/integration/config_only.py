"""Configuration-only enablement: lock tasks named in ``redlock_tasks``.

::

    imports = ["celery_redlock", "proj.tasks"]
    redlock_tasks = {
        "proj.tasks.sync_*": {"ttl": 60, "args": ["account_id"]},
        "proj.tasks.nightly_report": {},
    }

Each registered task whose name matches a key (exact name or :mod:`fnmatch` glob)
becomes a :class:`~celery_redlock.LockedTask`, with the option dict's entries (the
names :data:`celery_redlock.integration.settings.TASK_OPTIONS` lists) as its ``lock_*`` options;
the first matching pattern wins, in the dict's order. This runs in the worker (and
beat) before any task executes; the task code and the app module stay untouched.

How: the task's class is replaced by a subclass of ``LockedTask`` and the original
class. Celery builds its tracer after this, and sees the overridden
``before_start`` and ``__call__`` as it would for ``base=LockedTask``; they call the
task class's own ``before_start``, ``__call__`` and ``push_request`` (through
``super()``), so those still run, as do its ``on_failure`` and every other hook.

No change to task code: an attribute the task class already has is never
shadowed. A project base class with its own ``lock`` method or ``lock_key``
attribute keeps them (``self.lock`` is then the project's; the task's lock is
:func:`celery_redlock.integration.task.held_lock`), and the lock options of such a task come
from its ``redlock_tasks`` entry (and the ``redlock_*`` settings) only, never from
``lock_*`` attributes of the project's class. A task class that already is a
``LockedTask`` keeps its ``lock_*`` options; the entry overrides them.

``args`` must be a list of argument names: a string is refused at worker start
(naming the task and the entry), not split into letters.

A process that only sends (a web app) starts no worker or beat, yet its sends must be
deduplicated (``unique``, ``debounce``, ``throttle`` are decided at send time). So,
once :mod:`celery_redlock` is imported there (``imports`` is read by workers and beat
only: the process imports it itself, or a module it imports does). Celery finalizes an
app at its first ``app.tasks``, not for ``delay()`` on a task imported from its module:
a web process calls :func:`lock_configured_tasks`, which finalizes it, or is warned.

==========================  ===================================================
app finalized               ``redlock_tasks`` is applied to the tasks it made
                            (``app.on_after_finalize``, connected for every app
                            through Celery's ``connect_on_app_finalize``, as
                            ``shared_task`` is); invalid settings are logged at
                            ERROR here, and refused by the worker at its start
``before_task_publish``     a task that ``redlock_tasks`` makes unique, sent
                            while it is not locked in this process (its app
                            not finalized, the task registered after, or sent
                            by name with ``send_task``), is published
                            undeduplicated: a
                            WARNING, once per task name, says so and what to do
==========================  ===================================================
"""

from __future__ import annotations

import fnmatch
import logging
from typing import Any

from celery import Task, signals
from celery._state import _get_active_apps, connect_on_app_finalize

from ..exceptions import ConfigurationError
from .settings import Settings, parse_entry
from .task import LockedTask, app_settings, forget_options

__all__ = ["apply", "lock_configured_tasks", "lockify"]

logger = logging.getLogger("celery_redlock.config_only")


#: The options decided at send time: a task with one of them is deduplicated by
#: ``apply_async()``, which only a locked task class does.
SEND_TIME_OPTIONS = ("unique", "debounce", "throttle")

#: Task names already warned about in this process (:func:`_warn_unlocked_send`).
_warned: set[str] = set()


def apply(app: Any, settings: Settings, *, quiet: bool = False) -> list[str]:
    """Lock every task of ``app`` that ``redlock_tasks`` names; return their names.

    ``quiet``: what was locked, and patterns that matched nothing, are logged at DEBUG
    (at finalize, before a worker has imported its task modules), else INFO and WARNING.
    """
    if not settings.tasks:
        return []
    locked = []
    matched: set[str] = set()
    for name in sorted(app.tasks):
        found = _entry(settings, name)
        if found is not None:
            pattern, options = found
            matched.add(pattern)
            lockify(app.tasks[name], options, source=f"redlock_tasks[{pattern!r}]")
            locked.append(name)
    for pattern in settings.tasks.keys() - matched:
        logger.log(
            logging.DEBUG if quiet else logging.WARNING,
            "redlock_tasks: %r matches no registered task",
            pattern,
        )
    logger.log(
        logging.DEBUG if quiet else logging.INFO,
        "celery_redlock: locking by configuration: %s",
        ", ".join(locked) or "none",
    )
    return locked


def _entry(settings: Settings, name: str) -> tuple[str, dict[str, Any]] | None:
    """The first ``redlock_tasks`` (pattern, options) naming the task ``name``, if any."""
    for pattern, options in settings.tasks.items():
        if name == pattern or fnmatch.fnmatchcase(name, pattern):
            return pattern, options
    return None


def _on_app_finalize(app: Any) -> None:
    # Called inside app.finalize(), before its pending task decorators have made their
    # tasks: lock them once they have. Nothing here may raise (finalize would).
    app.on_after_finalize.connect(_lock_at_finalize, weak=False, dispatch_uid=__name__)


def _lock_at_finalize(sender: Any = None, **kwargs: Any) -> None:
    """Apply ``redlock_tasks`` to the tasks the app ``sender`` made as it finalized."""
    app = sender
    if not app.conf.get("redlock_tasks"):
        return  # cheap for every app that locks nothing by configuration
    try:
        apply(app, app_settings(app), quiet=True)
    except ConfigurationError as exc:
        # Celery ignores a receiver's exception; a worker refuses the same error at its
        # start (RedlockStep), and lock_configured_tasks(app) raises it.
        logger.error("celery_redlock: redlock_tasks not applied in this process: %s", exc)


def _warn_unlocked_send(sender: Any = None, **kwargs: Any) -> None:
    """Warn, once per task name, of a send ``redlock_tasks`` would deduplicate but cannot."""
    name = sender
    if not isinstance(name, str) or name in _warned:
        return
    for app in list(_get_active_apps()):
        if not app.configured or not app.conf.get("redlock_tasks"):
            continue
        try:
            settings = app_settings(app)
        except ConfigurationError:
            continue  # said at finalize, and refused by the worker
        found = _entry(settings, name)
        if found is None or isinstance(app._tasks.get(name), LockedTask):
            continue
        pattern, options = found
        if all(options.get(o, getattr(settings, o, None)) is None for o in SEND_TIME_OPTIONS):
            continue
        _warned.add(name)
        if name not in app._tasks:
            why = "not registered here; send it through its task object, not send_task()"
        elif not app.finalized:
            why = "its app is not finalized: Celery does it at app.tasks, not for delay()"
        else:
            why = "registered after its app finalized"
        logger.warning(
            "celery_redlock: task %s is sent from this process without its lock, so "
            "redlock_tasks[%r] cannot deduplicate its sends (%s). Call "
            "celery_redlock.lock_configured_tasks(app) once the task's module is imported",
            name,
            pattern,
            why,
        )
        return


def lock_configured_tasks(app: Any) -> list[str]:
    """Lock ``app``'s ``redlock_tasks`` in this process; the names of the tasks locked.

    Workers and beat do this when they start, and any process that imported
    :mod:`celery_redlock` when its app finalizes. A process that only sends tasks (a web
    app) starts neither, and Celery does not finalize an app for ``delay()`` on a task
    imported from its module, so its sends of a configuration-locked task would not be
    deduplicated (``lock_unique``; they are warned about): call this there, once its
    task modules are imported (Django: in an ``AppConfig.ready()``). The app is
    finalized first, so that its pending task decorators have made their tasks. A task
    registered later is not locked: call this again after importing it.

    Raises:
        ConfigurationError: invalid ``redlock_*`` settings or ``redlock_tasks`` entries,
            naming the setting, as a worker would refuse them.
    """
    settings = app_settings(app)
    app.finalize(auto=True)
    return apply(app, settings)


def lockify(task: Any, options: dict[str, Any], *, source: str = "options") -> None:
    """Make ``task`` a LockedTask with ``options`` (idempotent).

    Raises:
        ConfigurationError: an unknown option, or ``args`` that is not a list of
            argument names; naming the task and ``source`` (the setting's entry).
    """
    configured = parse_entry(task.name, options, source)
    cls = type(task)
    if getattr(cls, "_redlock_configured", None) == configured:
        return
    if isinstance(task, LockedTask):
        # Written for celery_redlock: its lock_* attributes are our options, and the
        # redlock_tasks entry overrides them.
        forget_options(task)
        cls._redlock_configured = configured
        cls._redlock_source = source
        return
    task.__class__ = type(
        cls.__name__,
        (LockedTask, cls),
        {
            **_kept_attributes(cls),
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
            "_redlock_configured": configured,
            "_redlock_source": source,
            # The class's own lock_* attributes (if any) are the project's, not options.
            "_redlock_read_attributes": False,
        },
    )


#: LockedTask members that call the task class's own version (through super()), so
#: both run: they are not taken from the task class.
_COOPERATIVE = frozenset({"before_start", "__call__", "apply", "apply_async", "push_request"})


def _kept_attributes(cls: type) -> dict[str, Any]:
    """The attributes of ``cls`` that LockedTask, placed in front of it, would hide.

    A project's base class may already have a ``lock`` method, or a ``lock_key``
    attribute of its own meaning: configuration-only enablement must not change
    what the task code sees, so these are put back in front of LockedTask's. The
    task's lock then stays reachable as :func:`celery_redlock.integration.task.held_lock`.
    """
    kept = {}
    for name in vars(LockedTask):
        if name in _COOPERATIVE or (name.startswith("__") and name.endswith("__")):
            continue
        owner = next((klass for klass in cls.__mro__ if name in vars(klass)), None)
        if owner is not None and owner not in Task.__mro__:
            kept[name] = vars(owner)[name]
    return kept


connect_on_app_finalize(_on_app_finalize)
signals.before_task_publish.connect(
    _warn_unlocked_send, weak=False, dispatch_uid="celery_redlock.config_only.before_publish"
)
