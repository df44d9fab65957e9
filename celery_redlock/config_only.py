"""Configuration-only enablement: lock tasks named in ``redlock_tasks``.

::

    imports = ["celery_redlock", "proj.tasks"]
    redlock_tasks = {
        "proj.tasks.sync_*": {"ttl": 60, "args": ["account_id"]},
        "proj.tasks.nightly_report": {},
    }

Each registered task whose name matches a key (exact name or :mod:`fnmatch` glob)
becomes a :class:`~celery_redlock.LockedTask`, with the option dict's entries (the
names :data:`celery_redlock.options.TASK_OPTIONS` lists) as its ``lock_*`` options;
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
:func:`celery_redlock.task.held_lock`), and the lock options of such a task come
from its ``redlock_tasks`` entry (and the ``redlock_*`` settings) only, never from
``lock_*`` attributes of the project's class. A task class that already is a
``LockedTask`` keeps its ``lock_*`` options; the entry overrides them.

``args`` must be a list of argument names: a string is refused at worker start
(naming the task and the entry), not split into letters.
"""

from __future__ import annotations

import fnmatch
import logging
from typing import Any

from celery import Task

from .options import parse_entry
from .settings import Settings
from .task import LockedTask, app_settings, forget_options

__all__ = ["apply", "lock_configured_tasks", "lockify"]

logger = logging.getLogger("celery_redlock.config_only")


def apply(app: Any, settings: Settings) -> list[str]:
    """Lock every task of ``app`` that ``redlock_tasks`` names; return their names."""
    if not settings.tasks:
        return []
    locked = []
    matched: set[str] = set()
    for name in sorted(app.tasks):
        for pattern, options in settings.tasks.items():
            if name == pattern or fnmatch.fnmatchcase(name, pattern):
                matched.add(pattern)
                lockify(app.tasks[name], options, source=f"redlock_tasks[{pattern!r}]")
                locked.append(name)
                break
    for pattern in settings.tasks.keys() - matched:
        logger.warning("redlock_tasks: %r matches no registered task", pattern)
    logger.info("celery_redlock: locking by configuration: %s", ", ".join(locked) or "none")
    return locked


def lock_configured_tasks(app: Any) -> list[str]:
    """Lock ``app``'s ``redlock_tasks`` in this process; the names of the tasks locked.

    Workers and beat do this when they start. A process that only sends tasks (a web
    app) does not start either, so its sends of a configuration-locked task would not
    be deduplicated (``lock_unique``): call this there, once its task modules are
    imported (Django: in an ``AppConfig.ready()``). The app is finalized first, so
    that its pending task decorators have made their tasks. A task registered later
    is not locked: call this again after importing it.

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
    task's lock then stays reachable as :func:`celery_redlock.task.held_lock`.
    """
    kept = {}
    for name in vars(LockedTask):
        if name in _COOPERATIVE or (name.startswith("__") and name.endswith("__")):
            continue
        owner = next((klass for klass in cls.__mro__ if name in vars(klass)), None)
        if owner is not None and owner not in Task.__mro__:
            kept[name] = vars(owner)[name]
    return kept
