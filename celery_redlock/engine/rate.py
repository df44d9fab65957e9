"""Rate budgets: at most N starts of a key in any sliding window, on the lock nodes.

::

    limit = RateLimit("api:stripe", rate="100/m", nodes=["redis://redis:6379/0"])
    wait = limit.try_acquire()      # 0.0: go; else seconds until a start fits
    if limit.acquire(timeout=5):    # or wait (up to 5 s) for a start
        call_stripe()

A budget is a log of the starts of the last window in ``redlock:{NAME}:rate`` (a
sorted set: member -> start time in ms on the node's clock), kept by one script,
``rate.lua``: it drops the starts older than one window, and admits a start (logging
it) when fewer than N remain, else says how long until the oldest leaves. Each
admission also writes the budget itself beside the log (``redlock:{NAME}:budget``,
``N/WINDOW_MS``, expiring with the log) for ``celery redlock ls`` to show used/limit,
and a task's run refused is recorded among the runs waiting on the queue for the key
(``redlock:{NAME}:queued``), all in the same script call. Exact, not
a token bucket's approximation: in any window of that length (judged on the node's
clock) at most N starts are admitted, by every process, worker and host together. The
key expires one window after its last start.

Tasks with ``lock_rate="N/s"`` draw on the same budget as a :class:`RateLimit` of the
same name (the task's lock name): a web request and a task that call one API share its
limit.

Several nodes (Redlock). A start is admitted when a majority of the nodes admits it;
a node that admitted a start the majority refused gives it back (``rate_return.lua``).
What that bounds, exactly:

* Each node admits at most N starts per window, and each admitted start is logged on a
  majority (q of n nodes). So at most ``floor(n * N / q)`` starts are admitted in any
  window: 1.5 N with 3 nodes, 5N/3 with 5, never more. Not N: three concurrent
  starts with N=2 can reach the three nodes in different orders and each be admitted by
  a different pair ({a, b}, {b, c}, {a, c}); a node unreachable for one start and
  another for the next does the same. One node alone (the default) admits exactly N.
* A node restarted without persistence forgets its log: up to ``floor(n * N / q)``
  more in that window (as a restarted node forgets a lock).
* Windows are judged on each node's clock: a node whose clock jumps moves its window.
* Racing starts can also be admitted *fewer* than N times: each refused by a majority
  (every one reached a different node first) until their give-backs are done.
* A timeout never admits more: a node whose reply did not come back in time counts as
  refusing, and is sent the give-back; should the give-back overtake the start on its
  way, that start stays logged until it leaves the window (fewer starts, never more).

A budget counts *starts*, not runs in flight: with ``lock_limit`` (or the exclusive
lock) beside it a task has both bounds.
"""

from __future__ import annotations

import asyncio
import math
import random
import re
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from redis.exceptions import ResponseError

from ..exceptions import ConfigurationError, NodeUnavailable
from ..nodes import Call, NodeSet, Reply
from ..nodes.aio import AsyncNodeSet
from .keys import DEFAULT_PREFIX, QUEUED_GRACE, LockKeys, lock_keys
from .lock import DEFAULT_URL
from .scripts import RATE, RATE_OWNED, RATE_PEEK, RATE_RETURN, RateStatus
from .timing import DEFAULT_NODE_TIMEOUT, MIN_NODE_TIMEOUT, seconds

__all__ = [
    "AsyncRateLimit",
    "Budget",
    "RateLimit",
    "Verdict",
    "judge",
    "parse_rate",
    "rate_calls",
    "return_calls",
]

#: The units of a rate, as Celery's ``rate_limit`` writes them: seconds per window.
UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0}
#: Most starts per window a budget may allow (``rate.lua`` refuses more).
MAX_LIMIT = 1_000_000
_RATE = re.compile(r"([0-9]+)/([smh])")


@dataclass(frozen=True)
class Budget:
    """A rate: at most ``limit`` starts in any window of ``window`` seconds."""

    limit: int
    window: float

    @property
    def window_ms(self) -> int:
        """The window in milliseconds, as ``rate.lua`` takes it."""
        return round(self.window * 1000)

    def __str__(self) -> str:
        unit = next(u for u, s in UNITS.items() if s == self.window)
        return f"{self.limit}/{unit}"


def parse_rate(name: str, value: Any) -> Budget:
    """``"N/s"``, ``"N/m"`` or ``"N/h"`` (N a whole number >= 1) as a :class:`Budget`.

    The syntax of Celery's ``rate_limit``, without its plain numbers: a rate always
    says its window.

    Raises:
        ConfigurationError: naming ``name`` and the allowed form.
    """
    match = _RATE.fullmatch(value) if isinstance(value, str) else None
    limit = int(match.group(1)) if match else 0
    if match is None or not 1 <= limit <= MAX_LIMIT:
        raise ConfigurationError(
            f'{name} must be a rate "N/s", "N/m" or "N/h" (at most N starts per second, '
            f"minute or hour; N a whole number from 1 to {MAX_LIMIT}), got {value!r}"
        )
    return Budget(limit, UNITS[match.group(2)])


@dataclass(frozen=True)
class Verdict:
    """What the nodes said of one start: admitted, or refused for ``wait`` seconds.

    ``used``: starts in the window, as the majority's busiest node counted them.
    ``undo``: for each node, whether it must be sent ``rate_return`` (it admitted a
    start that the majority refused, or may have: its reply was not read). ``wait`` is
    infinite when too few nodes answered for a majority ever to admit (``errors``).
    """

    admitted: bool
    wait: float
    used: int
    undo: tuple[bool, ...] = ()
    errors: tuple[str, ...] = ()
    #: Admitted: seconds from now to the start logged (0.0 but for a start reserved
    #: ahead: the latest of the admitting nodes').
    start: float = 0.0

    def wait_or_raise(self, key: str) -> float:
        """0.0 if admitted, else the wait; NodeUnavailable if too few nodes answered."""
        if self.wait == math.inf:
            raise NodeUnavailable(key, list(self.errors))
        return self.wait


def rate_calls(
    keys: LockKeys,
    budget: Budget,
    member: str,
    *,
    peek: bool = False,
    task_id: str | None = None,
    jitter: float = 0.0,
    owned: bool = False,
    at: float = 0.0,
    ahead: float = 0.0,
) -> Call:
    """The ``rate.lua`` call admitting (or, ``peek``, counting) one start of ``keys``.

    It records the budget beside the log. With ``task_id`` (a run that goes back on
    the queue when refused) a refusal also records the run in ``keys.queued``, due
    at the end of its wait plus ``jitter`` seconds, and an admission removes it: in
    the same call, so a run pays no round trip for being seen waiting.

    ``at``, ``ahead``: reserve the start ahead, at the first slot at least ``at`` (at
    most one window) and at most ``ahead`` (two) seconds from now (:attr:`Verdict.start`
    says when): a parked run's publisher reserves its slot before publishing its copy
    with a countdown to it.

    ``owned``: ``member`` was reserved for this run earlier (by its publisher): the copy
    is told to wait if it came early; else its start moves to now if the windows after
    the reservation have room for it there, or the run is judged as any other.
    """
    queued = (round(jitter * 1000), round(QUEUED_GRACE * 1000)) if task_id else ("", "")
    return (RATE_PEEK if peek else RATE_OWNED if owned else RATE).on(
        keys, limit=budget.limit, window_ms=budget.window_ms, member=member,
        task_id=task_id or "", jitter_ms=queued[0], grace_ms=queued[1],
        at_ms=round(at * 1000), ahead_ms=round(max(at, ahead) * 1000),
    )  # fmt: skip


def return_calls(keys: LockKeys, member: str, undo: Sequence[bool]) -> list[list[Call] | None]:
    """Per node, the ``rate_return.lua`` call giving ``member``'s start back (or nothing)."""
    call = RATE_RETURN.on(keys, member=member)
    return [[call] if u else None for u in undo]


def judge(replies: Sequence[Reply | None], quorum: int) -> Verdict:
    """Admitted when ``quorum`` nodes admitted; else refused until a quorum would admit.

    The wait is the ``quorum``-th shortest of the nodes' (0 for a node that admitted):
    when that many nodes have a start leave their window. Nodes that did not answer
    count as never.

    Too few nodes answering for a quorum ever to admit gives an infinite wait (see
    :meth:`Verdict.wait_or_raise`), after the give-back like any refusal.
    """
    waits: list[float] = []
    starts: list[float] = []
    used: list[int] = []
    admitted_on: list[bool] = []
    errors: list[str] = []
    for reply in replies:
        value = None
        if reply is None:
            pass
        elif not reply.ok:
            errors.append(reply.describe_error())
        elif isinstance(reply.values[0], ResponseError):
            errors.append(f"{reply.node.safe_url}: {reply.values[0]}")
        else:
            value = reply.values[0]
        if value is None:
            waits.append(math.inf)
            admitted_on.append(True)  # it may have logged the start: give it back if refused
            continue
        status, count, wait_ms = (int(v) for v in value)
        used.append(count)
        admitted = status == RateStatus.ADMITTED or (status == RateStatus.PEEKED and not wait_ms)
        waits.append(0.0 if admitted else max(wait_ms, 1) / 1000)
        admitted_on.append(status == RateStatus.ADMITTED)
        if status == RateStatus.ADMITTED:
            starts.append(wait_ms / 1000)
    ranked = sorted(waits)
    wait = ranked[quorum - 1] if len(ranked) >= quorum else math.inf
    top = sorted(used, reverse=True)
    count = top[min(quorum, len(top)) - 1] if top else 0
    if wait == 0.0:
        return Verdict(True, 0.0, count, start=max(starts, default=0.0))
    return Verdict(False, wait, count, tuple(admitted_on), tuple(errors) or ("no reply",))


def _member() -> str:
    return secrets.token_hex(8)


class _Budgeted:
    """What both kinds of rate limit share: the budget, its key and its nodes."""

    def __init__(
        self,
        name: str,
        *,
        rate: str,
        nodes: Sequence[str] | str | None = None,
        key_prefix: str = DEFAULT_PREFIX,
        node_timeout: float | None = None,
    ) -> None:
        self.budget = parse_rate("rate", rate)
        self.name = name
        self.keys = lock_keys(name, key_prefix)
        timeout = (
            DEFAULT_NODE_TIMEOUT
            if node_timeout is None
            else seconds("node_timeout", node_timeout, minimum=MIN_NODE_TIMEOUT)
        )
        self._attach(NodeSet.get([DEFAULT_URL] if nodes is None else nodes, timeout=timeout))

    def _attach(self, nodeset: NodeSet) -> None:
        """Keep the nodes, as this kind of rate limit calls them."""
        raise NotImplementedError

    def _pause(self, wait: float, left: float | None) -> float | None:
        """How long to sleep before trying again (None: ``left`` is too short to wait).

        The wait plus a random share of one slot (window / N), so that waiters woken
        together do not all come back at the same instant.
        """
        if left is not None and left < wait:
            return None
        pause = wait + random.uniform(0, self.window / self.limit)
        return pause if left is None else min(pause, left)

    @property
    def key(self) -> str:
        """The Redis key of the budget's log of starts."""
        return self.keys.rate

    @property
    def limit(self) -> int:
        """N: the starts allowed per window."""
        return self.budget.limit

    @property
    def window(self) -> float:
        """The window, in seconds."""
        return self.budget.window


class RateLimit(_Budgeted):
    """A budget of ``rate`` starts per window for the name ``name``, on Redis.

    ``rate`` is ``"N/s"``, ``"N/m"`` or ``"N/h"``. The same budget as a task's
    ``lock_rate`` whose lock name is ``name`` (and ``key_prefix``): both draw on it.
    Several ``nodes`` make it a Redlock budget (see the module docs for what a majority
    bounds).

    .. versionadded:: 0.2
    """

    def _attach(self, nodeset: NodeSet) -> None:
        self.nodeset = nodeset

    def __repr__(self) -> str:
        return f"<RateLimit {self.name!r} {self.budget} on {len(self.nodeset)} node(s)>"

    def try_acquire(self) -> float:
        """Take one start if the budget has one: 0.0; else the seconds until one fits.

        Never blocks beyond the node timeout.

        Raises:
            NodeUnavailable: too few nodes answered to decide.
        """
        member = _member()
        replies = self.nodeset.call([rate_calls(self.keys, self.budget, member)])
        verdict = judge(replies, self.nodeset.quorum)
        if not verdict.admitted and any(verdict.undo):
            self.nodeset.call(return_calls(self.keys, member, verdict.undo), per_node=True)
        return verdict.wait_or_raise(self.key)

    def acquire(self, blocking: bool = True, timeout: float | None = None) -> bool:
        """Take one start: True once taken, False if ``timeout`` passed first.

        Sleeps until the budget has room (plus a little jitter, so that waiters woken
        together do not all come back at once); never polls at a fixed interval.
        """
        deadline = None if timeout is None else time.monotonic() + max(0.0, timeout)
        while (wait := self.try_acquire()) and blocking:
            pause = self._pause(wait, None if deadline is None else deadline - time.monotonic())
            if pause is None:
                return False
            time.sleep(pause)
        return not wait

    def used(self) -> tuple[int, float]:
        """Starts in the current window, and seconds until a start would fit (0: now)."""
        replies = self.nodeset.call([rate_calls(self.keys, self.budget, "-", peek=True)])
        verdict = judge(replies, self.nodeset.quorum)
        return verdict.used, verdict.wait_or_raise(self.key)


class AsyncRateLimit(_Budgeted):
    """:class:`RateLimit` for asyncio: the same budget, awaited.

    Plain masters only (``redis://``, ``rediss://``, ``unix://``), as
    :class:`~celery_redlock.AsyncRedlock`.

    .. versionadded:: 0.2
    """

    def _attach(self, nodeset: NodeSet) -> None:
        self.nodeset = AsyncNodeSet(nodeset)

    def __repr__(self) -> str:
        return f"<AsyncRateLimit {self.name!r} {self.budget} on {len(self.nodeset)} node(s)>"

    async def try_acquire(self) -> float:
        """Take one start if the budget has one: 0.0; else the seconds until one fits."""
        member = _member()
        replies = await self.nodeset.call([rate_calls(self.keys, self.budget, member)])
        verdict = judge(replies, self.nodeset.quorum)
        if not verdict.admitted and any(verdict.undo):
            await self.nodeset.call(return_calls(self.keys, member, verdict.undo), per_node=True)
        return verdict.wait_or_raise(self.key)

    async def acquire(self, blocking: bool = True, timeout: float | None = None) -> bool:
        """Take one start: True once taken, False if ``timeout`` passed first."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + max(0.0, timeout)
        while (wait := await self.try_acquire()) and blocking:
            pause = self._pause(wait, None if deadline is None else deadline - loop.time())
            if pause is None:
                return False
            await asyncio.sleep(pause)
        return not wait

    async def used(self) -> tuple[int, float]:
        """Starts in the current window, and seconds until a start would fit (0: now)."""
        call = rate_calls(self.keys, self.budget, "-", peek=True)
        verdict = judge(await self.nodeset.call([call]), self.nodeset.quorum)
        return verdict.used, verdict.wait_or_raise(self.key)
