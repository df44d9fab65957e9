"""Fences as the scripts grant them (``celery_redlock/engine/scripts/fence.lua``).

A key's first fence, and its first after its counter expired, is the node's clock in
microseconds (about 1.8e15); later fences within the fence horizon are the counter + 1.
With several nodes, each seeds its counter at its own microsecond, so consecutive
fences across quorums are strictly larger but not necessarily one apart.
"""

from __future__ import annotations

import time
from typing import Any

from celery_redlock.engine.keys import FENCE_HORIZON_LEASES, FENCE_HORIZON_MIN

#: Smallest fence seeded from a clock (2001-09-09 in microseconds): far above any
#: count of acquisitions, so a small fence means the counter was not seeded.
CLOCK_FENCE_MIN = 10**15

#: How long before the test reads a server's clock a fence seeded from it may be.
CLOCK_SLACK = 5.0


def server_clock_us(client: Any) -> int:
    """The server's clock (``TIME``) in microseconds."""
    seconds, micros = client.time()
    return int(seconds) * 1_000_000 + int(micros)


def assert_clock_fence(fence: int, client: Any = None, slack: float = CLOCK_SLACK) -> None:
    """``fence`` was seeded from the clock of ``client``'s server, at most ``slack``
    seconds ago (and, as a Python int, with all its digits). Without a client: from
    this machine's clock, which the test servers share (they run here)."""
    now = time.time_ns() // 1000 if client is None else server_clock_us(client)
    assert isinstance(fence, int), fence
    assert CLOCK_FENCE_MIN < fence <= now, (fence, now)
    assert now - fence <= slack * 1_000_000, f"fence {fence} is {now - fence} µs old"


def horizon_ms(lease_ms: int) -> int:
    """How long a fence counter lives after an acquisition with a lease of ``lease_ms``."""
    return max(FENCE_HORIZON_LEASES * lease_ms, round(FENCE_HORIZON_MIN * 1000))


def assert_counter_expires(client: Any, key: str, lease_ms: int) -> int:
    """The fence counter ``key`` has a TTL within the horizon of ``lease_ms``; its PTTL."""
    pttl = client.pttl(key)
    assert 0 < pttl <= horizon_ms(lease_ms), (key, pttl, horizon_ms(lease_ms))
    return pttl


__all__ = [
    "CLOCK_FENCE_MIN",
    "assert_clock_fence",
    "assert_counter_expires",
    "horizon_ms",
    "server_clock_us",
]
