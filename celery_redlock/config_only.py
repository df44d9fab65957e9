"""Configuration-only enablement: lock tasks named in ``redlock_tasks``.

::

    imports = ["celery_redlock", "proj.tasks"]
    redlock_tasks = {
        "proj.tasks.sync_*": {"ttl": 60, "args": ["account_id"]},
        "proj.tasks.nightly_report": {},
    }

Each registered task whose name matches a key (exact name or :mod:`fnmatch` glob)
becomes a :class:`~celery_redlock.LockedTask`, with the option dict's entries as
its ``lock_*`` options; the first matching pattern wins, in the dict's order. This
runs in the worker (and beat) before any task executes; the task code and the app
module stay untouched.

How: the task's class is replaced by a subclass of ``LockedTask`` and the original
class, so the task keeps every attribute and method of its own and gains the
lock. Celery builds its tracer after this, and sees the overridden
``before_start`` and ``__call__`` as it would for ``base=LockedTask``.
"""

from __future__ import annotations

import fnmatch
import logging
from typing import Any

from .exceptions import ConfigurationError
from .settings import Settings
from .task import LockedTask

__all__ = ["OPTION_NAMES", "apply", "lockify"]

logger = logging.getLogger("celery_redlock.config_only")

#: Keys accepted in a ``redlock_tasks`` entry; each sets ``lock_<key>``.
OPTION_NAMES = (
    "ttl",
    "args",
    "key",
    "on_busy",
    "on_lost",
    "retry_countdown",
    "wait_timeout",
    "renew_interval",
    "mode",
    "limit",
    "fair",
)


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


def lockify(task: Any, options: dict[str, Any], *, source: str = "options") -> None:
    """Make ``task`` a LockedTask with ``options`` (idempotent)."""
    unknown = set(options) - set(OPTION_NAMES)
    if unknown:
        raise ConfigurationError(
            f"{source}: unknown option(s) {', '.join(sorted(map(repr, unknown)))}; "
            f"allowed: {', '.join(OPTION_NAMES)}"
        )
    attributes = {f"lock_{key}": value for key, value in options.items()}
    if "args" in options and options["args"] is not None:
        attributes["lock_args"] = tuple(options["args"])
    cls = type(task)
    if isinstance(task, LockedTask):
        if getattr(cls, "_redlock_configured", None) == attributes:
            return
        for key, value in attributes.items():
            setattr(cls, key, value)
        cls._redlock_options = None
        cls._redlock_configured = attributes
        return
    locked_cls = type(
        cls.__name__,
        (LockedTask, cls),
        {
            **attributes,
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
            "_redlock_configured": attributes,
        },
    )
    task.__class__ = locked_cls
