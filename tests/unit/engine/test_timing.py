"""Lease timing (``engine.timing``) as ``Redlock``'s own arguments: bounds named after
the argument, and the extreme leases still ones Redis accepts."""

from __future__ import annotations

import pytest

from celery_redlock import ConfigurationError, NodeUnavailable, Redlock
from celery_redlock.engine.timing import MAX_SECONDS, MIN_TTL
from tests.unit.integration.test_settings import RANGE


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"ttl": 5e-324}, f"ttl must be from 0.01 to {RANGE}, got 5e-324"),
        ({"ttl": float("inf")}, f"ttl must be from 0.01 to {RANGE}, got inf"),
        ({"ttl": 1e15}, f"ttl must be from 0.01 to {RANGE}, got {1e15!r}"),
        ({"ttl": 30, "renew_interval": 1e-9}, "renew_interval must be from 0.002"),
        ({"ttl": 30, "node_timeout": 5e-324}, "node_timeout must be from 0.001"),
        (
            {"ttl": 0.01, "renew_interval": 0.009, "drift_factor": 0.5, "node_timeout": 0.005},
            "ttl (0.01s) is too short for the drift allowance (0.007s, drift_factor 0.5) and "
            "the loss margin (0.004s, from node_timeout 0.005s)",
        ),
    ],
)
def test_redlock_arguments_out_of_range_are_named(kwargs, message):
    """Redlock(ttl=...) names its own arguments, never a setting or an argument not given."""
    with pytest.raises(ConfigurationError) as info:
        Redlock("job", **kwargs)
    assert message in str(info.value)
    assert "redlock_" not in str(info.value)
    assert all(name in kwargs for name in ("ttl", "renew_interval") if name in str(info.value))


@pytest.mark.parametrize("ttl", [MIN_TTL, MAX_SECONDS])
def test_the_bounds_are_leases_redis_accepts(redis_node, ttl):
    """The longest lease is one PEXPIRE (through the scripts' Lua numbers) accepts;
    the shortest is still a whole number of milliseconds."""
    lock = Redlock("bounds", nodes=[redis_node.url], ttl=ttl, auto_renew=False)
    # The shortest lease comes with a 1 ms node budget (ttl/10) and a 10 ms validity,
    # which a loaded machine can miss: a timeout, or a grant whose validity was used up
    # on the way (acquire() returns False), is the budget working, not the script
    # refusing the lease. A refusal would be an error reply, and fails at once.
    for _ in range(50):
        try:
            if lock.acquire(blocking=False):
                break
        except NodeUnavailable as exc:
            if "TimeoutError" not in str(exc):
                raise
    else:
        pytest.fail("50 attempts at the shortest lease all missed their 1 ms / 10 ms budget")
    if ttl == MAX_SECONDS:
        pttl = redis_node.client().pttl(lock.keys.lock)
        assert ttl * 1000 - 60_000 < pttl <= ttl * 1000, pttl
        lock.extend()
    lock.release()
