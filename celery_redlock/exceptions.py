"""Exceptions raised by celery_redlock.

This module imports nothing from the package, so anything may import it without
creating a cycle.

Hierarchy::

    RedlockError
    ├── ConfigurationError        (also celery.exceptions.ImproperlyConfigured)
    ├── LockBusy                  the lock is held by someone else
    ├── LockLost                  the lease is gone, or can no longer be trusted
    ├── LockNotOwned              release/extend of a lock this object does not hold
    ├── LockKeyError              a task's arguments cannot form a lock key (also TypeError)
    └── NodeUnavailable           not enough Redis nodes answered in time

Every exception keeps what it knows (key, holder, fence...) in ``args``: Celery's
result backends rebuild exceptions from ``args`` alone, so anything kept only in
attributes would be lost on the way to ``AsyncResult.get()``.
"""

from __future__ import annotations

from celery.exceptions import ImproperlyConfigured

__all__ = [
    "ConfigurationError",
    "LockBusy",
    "LockKeyError",
    "LockLost",
    "LockNotOwned",
    "NodeUnavailable",
    "RedlockError",
]


class RedlockError(Exception):
    """Base class of every error raised by celery_redlock."""


class ConfigurationError(RedlockError, ImproperlyConfigured):
    """A setting or option has a value the library cannot work with.

    The message names the setting and the values it accepts.
    """


class LockBusy(RedlockError):
    """The lock is held by someone else.

    Arguments:
        key: the Redis key of the lock.
        holder: the holder's task id, or ``None`` when the holder is not a task.
        ttl: the holder's remaining lease in seconds, when known.
    """

    #: When this process sent the request that was refused (the engine's clock,
    #: :data:`celery_redlock.engine.lease.clock`); None where unknown. The refusal came
    #: between then and the reply, so a record of it stamped with this time is never
    #: later than the holder's release, however late the refused caller gets to it.
    #: Not part of ``args``: it means nothing in another process.
    asked_at: float | None = None

    def __init__(self, key: str, holder: str | None = None, ttl: float | None = None) -> None:
        super().__init__(key, holder, ttl)

    @property
    def key(self) -> str:
        """The Redis key of the lock."""
        value: str = self.args[0]
        return value

    @property
    def holder(self) -> str | None:
        """The holder's task id, if it is a task."""
        value: str | None = self.args[1]
        return value

    @property
    def ttl(self) -> float | None:
        """The holder's remaining lease in seconds, when known."""
        value: float | None = self.args[2]
        return value

    def __str__(self) -> str:
        who = f"task {self.holder}" if self.holder else "another owner"
        left = f", lease ends in {self.ttl:.3f}s" if self.ttl is not None else ""
        return f"lock {self.key!r} is held by {who}{left}"


class LockLost(RedlockError):
    """The lease is gone or in doubt: the critical section is no longer protected.

    Raised by ``check()`` after the watchdog failed to renew before the local lease
    deadline, after the key was found deleted or taken over, and injected into a
    running task when its ``lock_on_lost`` policy is ``abort``.

    Arguments:
        key: the Redis key of the lock.
        reason: why the lease is considered lost.
        fence: the fencing token of the lost acquisition.
    """

    def __init__(self, key: str, reason: str = "lost", fence: int | None = None) -> None:
        super().__init__(key, reason, fence)

    @property
    def key(self) -> str:
        """The Redis key of the lock."""
        value: str = self.args[0]
        return value

    @property
    def reason(self) -> str:
        """Why the lease is considered lost."""
        value: str = self.args[1]
        return value

    @property
    def fence(self) -> int | None:
        """The fencing token of the acquisition that was lost."""
        value: int | None = self.args[2]
        return value

    def __str__(self) -> str:
        return f"lock {self.key!r} (fence {self.fence}) lost: {self.reason}"


class LockNotOwned(RedlockError):
    """``release()``, ``extend()`` or ``fence`` of a lock this thread does not hold.

    Also raised in a forked child for a lock its parent acquired: only the process
    that acquired a lock may renew or release it.
    """

    def __init__(self, key: str, reason: str = "not owned") -> None:
        super().__init__(key, reason)

    def __str__(self) -> str:
        return f"lock {self.args[0]!r}: {self.args[1]}"


class LockKeyError(RedlockError, TypeError):
    """A task's arguments cannot be turned into a lock key.

    Arguments:
        task: the task name.
        argument: the argument (and the path inside it) that cannot be keyed.
        reason: what is wrong with it.
    """

    def __init__(self, task: str, argument: str, reason: str) -> None:
        super().__init__(task, argument, reason)

    def __str__(self) -> str:
        task, argument, reason = self.args
        return f"task {task}: argument {argument!r} cannot be part of a lock key: {reason}"


class NodeUnavailable(RedlockError):
    """Too few Redis nodes answered within the time budget to decide.

    Arguments:
        key: the lock's key (or the operation's subject).
        errors: one line per failing node, ``"url: error"``.
    """

    def __init__(self, key: str, errors: tuple[str, ...] | list[str] = ()) -> None:
        super().__init__(key, tuple(errors))

    def __str__(self) -> str:
        detail = "; ".join(self.args[1]) or "no node answered"
        return f"lock {self.args[0]!r}: Redis unavailable ({detail})"
