"""Redis key names: the only module that builds them.

A lock named ``NAME`` under the prefix ``redlock:`` uses::

    redlock:{NAME}            hash: token, fence, task_id, host, pid, acquired_at, ttl
    redlock:{NAME}:fence      fence counter (an integer that only grows; no TTL)
    redlock:{NAME}:released   pub/sub channel: one message per release

The braces are a Redis Cluster hash tag, so a lock's keys always share one slot
and one script can touch them all.
"""

from __future__ import annotations

from typing import NamedTuple

from .exceptions import ConfigurationError

__all__ = ["DEFAULT_PREFIX", "MAX_NAME_LENGTH", "LockKeys", "lock_keys", "validate_prefix"]

DEFAULT_PREFIX = "redlock:"

#: Longest lock name accepted, in characters. Task locks hash their arguments, so
#: their names stay short whatever the arguments are; this only guards hand-made
#: names from growing keys without bound.
MAX_NAME_LENGTH = 512


class LockKeys(NamedTuple):
    """The Redis names one lock uses."""

    lock: str
    fence: str
    channel: str


def validate_prefix(prefix: str) -> str:
    """Return ``prefix`` if it can prefix lock keys, else raise ConfigurationError."""
    if not isinstance(prefix, str) or "{" in prefix or "}" in prefix:
        raise ConfigurationError(
            f"redlock_key_prefix must be a string without '{{' or '}}' (they would change "
            f"the cluster hash tag), got {prefix!r}"
        )
    return prefix


def lock_keys(name: str, prefix: str = DEFAULT_PREFIX) -> LockKeys:
    """The keys of the lock called ``name``."""
    if not isinstance(name, str) or not name:
        raise ConfigurationError(f"a lock name must be a non-empty string, got {name!r}")
    if len(name) > MAX_NAME_LENGTH:
        raise ConfigurationError(
            f"lock name is {len(name)} characters long, the limit is {MAX_NAME_LENGTH}: "
            "hash long names before using them"
        )
    lock = f"{prefix}{{{name}}}"
    return LockKeys(lock, f"{lock}:fence", f"{lock}:released")
