"""Correct distributed locks for Celery tasks on Redis.

Everything users import comes from here; the submodules are internal.
"""

from importlib.metadata import PackageNotFoundError, version

from .exceptions import (
    ConfigurationError,
    LockBusy,
    LockLost,
    LockNotOwned,
    NodeUnavailable,
    RedlockError,
)
from .lock import Redlock

try:
    __version__ = version("celery_redlock")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0"

__all__ = [
    "ConfigurationError",
    "LockBusy",
    "LockLost",
    "LockNotOwned",
    "NodeUnavailable",
    "Redlock",
    "RedlockError",
    "__version__",
]
