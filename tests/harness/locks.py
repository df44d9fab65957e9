"""Looking at (and tampering with) celery_redlock's keys on a test server."""

from __future__ import annotations

from typing import Any

from celery_redlock.engine.keys import parse_key

#: Keys beside a lock that are not a hold: fence counters, the send-time claims and
#: throttle windows of ``lock_unique`` tasks (a claim is a queued copy, not a lock), and
#: the logs of starts of rate budgets (``lock_rate``), the event logs (a lock's, and the
#: feed ``redlock:log``).
NOT_HOLDS = (":fence", ":claim", ":throttle", ":rate", ":log")


def lock_keys(server: Any) -> list[str]:
    """The lock keys present on ``server``: what holders hold (not counters or claims)."""
    return sorted(
        k
        for k in server.client().scan_iter("redlock:*")
        if not k.endswith(NOT_HOLDS) and (parse_key(k) or (None, ""))[1] != "claim"
    )


def holder_pid(server: Any) -> int | None:
    """The pid recorded by the holder of the (first) lock on ``server``."""
    keys = lock_keys(server)
    pid = server.client().hget(keys[0], "pid") if keys else None
    return int(pid) if pid else None


def steal_locks(server: Any) -> None:
    """Delete every lock behind its holder's back, as an operator or a bug would."""
    for key in lock_keys(server):
        server.client().delete(key)


__all__ = ["holder_pid", "lock_keys", "steal_locks"]
