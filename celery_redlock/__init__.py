"""Correct distributed locks for Celery tasks on Redis.

Everything users import comes from here; the submodules are internal.
"""

from importlib.metadata import PackageNotFoundError, version

from .engine.aio import AsyncRedlock
from .engine.lock import Redlock
from .engine.rate import AsyncRateLimit, RateLimit
from .exceptions import (
    ConfigurationError,
    LockBusy,
    LockKeyError,
    LockLost,
    LockNotOwned,
    NodeUnavailable,
    RedlockError,
)
from .integration import worker as _worker  # noqa: F401 (connects the worker signal receivers)
from .integration.config_only import lock_configured_tasks
from .integration.task import LockedTask, lock_for

try:
    __version__ = version("celery_redlock")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0"

__all__ = [
    "AsyncRateLimit",
    "AsyncRedlock",
    "ConfigurationError",
    "LockBusy",
    "LockKeyError",
    "LockLost",
    "LockNotOwned",
    "LockedTask",
    "NodeUnavailable",
    "RateLimit",
    "Redlock",
    "RedlockError",
    "__version__",
    "lock_configured_tasks",
    "lock_for",
]
