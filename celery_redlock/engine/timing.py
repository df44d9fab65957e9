"""Lease timing and lock shapes: the durations and kinds the engine works with.

A lower layer than :mod:`celery_redlock.integration.settings` (which reads Celery's
configuration through a table and falls back on these): the lock engine validates a
``Redlock``'s own arguments here, with no knowledge of Celery.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Any, NamedTuple

from ..exceptions import ConfigurationError

__all__ = [
    "DEFAULT_NODE_TIMEOUT",
    "MAX_SECONDS",
    "MIN_NODE_TIMEOUT",
    "MIN_RENEW_INTERVAL",
    "MIN_TTL",
    "MODES",
    "TURN",
    "Timing",
    "Turn",
    "check_kind",
    "default_node_timeout",
    "drift_allowance",
    "fraction",
    "lease_seconds",
    "seconds",
]

#: Lock modes: one exclusive holder, or any number of shared holders (at most
#: ``limit``) and never both at once.
MODES = ("exclusive", "shared")

#: Per-node budget of one call when ``redlock_node_timeout`` is not set: at most
#: this, at most a tenth of the lease (Redlock asks for a budget small against it),
#: and at most half the renewal interval (a failed renewal leaves time for another).
DEFAULT_NODE_TIMEOUT = 0.25

#: Longest duration of any setting, in seconds (30 days). A lease is renewed, so a long
#: task needs no long ttl; and the scripts compute deadlines with Lua numbers, which
#: Redis reads back as integers only below 1e14 ms (``1e+18`` is "not an integer").
MAX_SECONDS = 30 * 86400.0
#: Shortest lease: 10 ms, ten of the scripts' millisecond steps, which leaves room
#: for the default renewal (ttl/3), node timeout (ttl/10), drift and loss margin.
MIN_TTL = 0.01
#: Shortest node timeout (1 ms, the scripts' resolution) and renewal interval (room
#: for a node timeout of half of it).
MIN_NODE_TIMEOUT = 0.001
MIN_RENEW_INTERVAL = 2 * MIN_NODE_TIMEOUT


def seconds(name: str, value: Any, *, minimum: float = 0.0) -> float:
    """A duration in ``[minimum, MAX_SECONDS]`` (``(0, MAX_SECONDS]`` for minimum 0)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise ConfigurationError(
            f"{name} must be a number of seconds, got {value!r} ({type(value).__name__})"
        )
    if value <= 0 or value < minimum or value > MAX_SECONDS:
        top = f"{MAX_SECONDS:.0f} seconds ({MAX_SECONDS / 86400:g} days)"
        allowed = f"from {minimum:g} to {top}" if minimum else f"at most {top}"
        rule = f"> 0 ({allowed})" if value <= 0 else allowed
        raise ConfigurationError(f"{name} must be {rule}, got {value!r}")
    return float(value)


def lease_seconds(name: str, value: Any) -> float:
    """A lease: a duration of at least :data:`MIN_TTL`."""
    return seconds(name, value, minimum=MIN_TTL)


def fraction(name: str, value: Any) -> float:
    """A drift factor: a number from 0 to 0.5."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or math.isnan(value)
        or not 0 <= value <= 0.5
    ):
        raise ConfigurationError(f"{name} must be >= 0.0 and <= 0.5, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class Timing:
    """The validated timing of one lock: every duration the engine works with.

    Built once by :meth:`of` (which validates), then passed on: to
    :class:`~celery_redlock.Redlock`, the renewer's leases and ``doctor``.
    """

    ttl: float
    renew_interval: float
    node_timeout: float
    drift_factor: float

    # Cached: the renewer reads these for every lease it renews (100,000 locks: 10,000
    # times a second), and a Timing never changes.
    @cached_property
    def ttl_ms(self) -> int:
        """The lease as the scripts take it: whole milliseconds, at least 1."""
        return max(1, round(self.ttl * 1000))

    @cached_property
    def drift(self) -> float:
        """Seconds subtracted from every lease for clock drift (Redlock's formula)."""
        return drift_allowance(self.ttl, self.drift_factor)

    @cached_property
    def margin(self) -> float:
        """How long before the local lease deadline an unconfirmed lease counts as lost.

        Two call budgets, so the abort lands while the lease is still valid, but at
        most half a renewal interval, so short leases keep room for retries.
        """
        return min(2 * self.node_timeout, self.renew_interval / 2)

    @classmethod
    def of(
        cls,
        ttl: Any,
        renew_interval: Any = None,
        node_timeout: Any = None,
        drift_factor: Any = 0.01,
        *,
        source: str = "redlock_",
        ttl_name: str | None = None,
    ) -> Timing:
        """Validate lease timing; ``source`` prefixes the names used in error messages.

        Every error names a value the caller gave: a default derived from the ttl
        (``renew_interval`` ttl/3, ``node_timeout``) always fits it. ``ttl_name``
        overrides the ttl's name (``redlock_beat_ttl``).

        Raises:
            ConfigurationError: naming the value and its allowed range (see
                :data:`MIN_TTL`, :data:`MIN_RENEW_INTERVAL`, :data:`MIN_NODE_TIMEOUT`,
                :data:`MAX_SECONDS`).
        """
        ttl_name = ttl_name or f"{source}ttl"
        renew_name, timeout_name = f"{source}renew_interval", f"{source}node_timeout"
        lease = lease_seconds(ttl_name, ttl)
        renew_shown = f"{renew_name} ({renew_interval}s)"
        if renew_interval is None:
            renew = lease / 3
            renew_shown = f"{renew_name} (default {ttl_name}/3: {renew:.4g}s)"
        else:
            renew = seconds(renew_name, renew_interval, minimum=MIN_RENEW_INTERVAL)
            if renew >= lease:
                raise ConfigurationError(
                    f"{renew_name} must be shorter than {ttl_name} ({lease}s), got "
                    f"{renew}s: the lease would expire between renewals"
                )
        if node_timeout is None:
            timeout = default_node_timeout(lease, renew)
        else:
            timeout = seconds(timeout_name, node_timeout, minimum=MIN_NODE_TIMEOUT)
            if timeout >= renew:
                raise ConfigurationError(
                    f"{timeout_name} ({timeout}s) must be shorter than {renew_shown}: "
                    "a renewal must be able to fail and be retried before the lease ends"
                )
        drift = fraction(f"{source}drift_factor", drift_factor)
        t = cls(lease, renew, timeout, drift)
        if t.drift + t.margin >= lease:
            raise ConfigurationError(
                f"{ttl_name} ({lease}s) is too short for the drift allowance ({t.drift:.3f}s, "
                f"{source}drift_factor {drift}) and the loss margin ({t.margin:.3f}s, "
                f"from {timeout_name} {timeout}s): lengthen it or lower those"
            )
        return t


def drift_allowance(ttl: float, drift_factor: float) -> float:
    """Seconds of a ``ttl`` lease assumed lost to clock drift (Redlock's formula)."""
    return ttl * drift_factor + 0.002


def default_node_timeout(ttl: float, renew_interval: float) -> float:
    """The node timeout when none is set (see :data:`DEFAULT_NODE_TIMEOUT`)."""
    return min(DEFAULT_NODE_TIMEOUT, ttl / 10, renew_interval / 2)


def check_kind(
    resources: int, mode: str | None, limit: int | None, fair: bool
) -> tuple[str, int | None, bool]:
    """Validate the shape of a lock on ``resources`` resources; (mode, limit, fair)."""
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ConfigurationError(f"limit must be an integer >= 1 (or None), got {limit!r}")
    if mode is None:
        mode = "shared" if limit is not None else "exclusive"
    if mode not in MODES:
        raise ConfigurationError(f"mode must be one of {MODES!r}, got {mode!r}")
    if limit is not None and mode != "shared":
        raise ConfigurationError("limit applies to shared holders: use mode='shared' or no mode")
    if mode == "shared" and resources > 1:
        raise ConfigurationError(f"a shared lock (or a limit) covers one resource, got {resources}")
    if fair and (mode != "exclusive" or resources > 1):
        raise ConfigurationError("fair waiting applies to an exclusive lock on one resource")
    return mode, limit, bool(fair)


class Turn(NamedTuple):
    """A process's turn on a lock while a blocking waiter of another process waits.

    The bound of the *service across processes* invariant: a waiter of another process
    is served within ``handoffs + 1`` holds of the process that has the lock, or
    ``ms`` plus the hold under way (see :mod:`.handoff`). Sent with every takeover
    (``acquire.lua``'s handoff arguments).
    """

    #: Takeovers at most, counted from the other process's first refused attempt.
    handoffs: int
    #: Milliseconds (node clock) from that attempt after which no takeover is granted.
    ms: int
    #: Milliseconds the yielded lock is refused to this process (unless taken before).
    reserve_ms: int


TURN = Turn(handoffs=8, ms=100, reserve_ms=100)
