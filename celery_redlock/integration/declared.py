"""What a worker declares of its locked tasks: the ``redlock_options`` inspect command.

Two workers deployed with different lock options for one task name (a ``redlock_tasks``
entry whose ``args`` changed on one host, a ``lock_ttl`` edited and half rolled out)
lock different keys, or the same key differently, for the same call: two bodies of one
resource can run at once, and nothing in Redis says why. ``celery redlock doctor`` asks
every worker for the options each of its locked tasks resolved to (this inspect command,
answered by the worker from its own app) and reports where they differ
(``settings-drift``).
"""

from __future__ import annotations

from typing import Any

from celery.worker.control import inspect_command

from ..exceptions import ConfigurationError
from .settings import TaskLockOptions
from .task import LockedTask, lock_options

__all__ = ["COMPARED", "declared", "locked_tasks"]

#: The options compared between workers: what decides which key a call locks, how many
#: may hold it, for how long, and how often a run may start or be sent.
COMPARED = ("key", "args", "mode", "limit", "ttl", "rate", "unique", "debounce", "throttle")


def declared(options: TaskLockOptions) -> dict[str, Any]:
    """The compared options of one task, as JSON-ready values (a key function by name)."""
    key = options.key
    if key is not None and not isinstance(key, str):
        key = f"{getattr(key, '__module__', '?')}.{getattr(key, '__qualname__', repr(key))}"
    return {
        "key": key,
        "args": None if options.args is None else list(options.args),
        "mode": options.mode,
        "limit": options.limit,
        "ttl": options.timing.ttl,
        "rate": None if options.rate is None else str(options.rate),
        "unique": options.unique,
        "debounce": options.debounce,
        "throttle": options.throttle,
    }


def locked_tasks(app: Any) -> dict[str, dict[str, Any]]:
    """Each locked task of ``app`` (ours, or locked by ``redlock_tasks``): its options."""
    found: dict[str, dict[str, Any]] = {}
    for name in sorted(app.tasks):
        task = app.tasks[name]
        if not isinstance(task, LockedTask) and not getattr(
            type(task), "_redlock_configured", None
        ):
            continue
        try:
            found[name] = declared(lock_options(task))
        except ConfigurationError as exc:
            found[name] = {"error": str(exc)}
    return found


@inspect_command()  # type: ignore[untyped-decorator]  # Celery's registry is untyped
def redlock_options(state: Any) -> dict[str, dict[str, Any]]:
    """The lock options each locked task of this worker resolved to (``doctor``)."""
    return locked_tasks(state.consumer.app)
