"""The kinds of lock: what each one sends to the nodes and how it reads their answers.

A :class:`~celery_redlock.Redlock` is of one kind, picked once from its arguments by
:func:`kind_of`:

* :class:`Exclusive`: one holder at a time, on one resource or on several taken
  together (every exclusive script takes a list of resources; one resource is a list
  of one, so several resources need no kind of their own). On one resource, the
  nodes keep a record of the blocked waiters, and a release grants the lock to the
  oldest of them, told on its process's channel (:mod:`.waiting`);
* :class:`Fair`: exclusive on one resource, and blocking waiters are served in
  arrival order through the same record, read as a queue: only its head may take the
  lock;
* :class:`Shared`: any number of holders, or at most ``limit``, never beside an
  exclusive holder (``mode="shared"``, or ``limit=``).

A kind builds the script calls of each step (acquire, release, leave the queue,
store fences back), names the keys a renewal extends, reads the nodes' answers to
``owned`` and ``locked``, and says how many nodes make a quorum. It keeps no state
beyond the lock's keys and shape, and makes no network call: the lock sends what
the kind builds, and keeps the vote, the lease and the per-thread holds, which are
the same for every kind.
"""

from __future__ import annotations

import abc
import secrets
import time
from collections.abc import Sequence
from typing import Any, ClassVar, NamedTuple

from ..nodes import Call
from ..nodes.calls import bulk
from . import timing
from .keys import LockKeys, lock_keys, release_keys
from .scripts import (
    ABANDON,
    ACQUIRE,
    ACQUIRE_FAIR,
    ACQUIRE_SHARED,
    ACQUIRE_WAKE,
    FAIR_LEAVE,
    FENCE_SYNC,
    FENCE_SYNC_SHARED,
    RELEASE,
    RELEASE_FAIR,
    RELEASE_SHARED,
    RELEASE_WAKE,
    WAKE_LEAVE,
    Script,
)
from .timing import check_kind
from .waiting import Named, named_reserve_ms, process_channel

__all__ = ["Exclusive", "Fair", "Holder", "Kind", "Shared", "Waiter", "kind_of", "majority"]


class Holder(NamedTuple):
    """Who acquires, as the acquire scripts record it (``celery redlock ls`` shows it)."""

    task_id: str
    host: str
    pid: int
    acquired_at: str  #: unix seconds on this host's clock, for display only
    task_name: str


class Waiter:
    """One acquire call's identity across its attempts (a fair waiter keeps its place)."""

    __slots__ = ("arrival", "attempt", "blocking", "in_doubt", "sent", "sent_at", "token")

    def __init__(self, blocking: bool, arrival: str = "") -> None:
        self.token = secrets.token_hex(16)
        self.blocking = blocking
        self.sent = False  # a request with this token went out
        #: The number of the last attempt built (:meth:`next_attempt`): the attempts of
        #: one acquisition share its token, and an attempt's undo names its number, so
        #: that it can remove only what that attempt (or an earlier one) wrote.
        self.attempt = 0
        #: When the last attempt was sent (:data:`.lease.clock`): a grant to it by a
        #: release came later, so a lease counted from then is never too long.
        self.sent_at = 0.0
        #: A request with this token got no reply (a node failed or timed out): it may
        #: still be on its way, and may reach its node after any undo sent since.
        self.in_doubt = False
        self.arrival = arrival

    def next_attempt(self) -> int:
        """Number a new attempt of this acquisition (1, 2, ...)."""
        self.attempt += 1
        return self.attempt


def majority(nodes: int) -> int:
    """Nodes that must grant an exclusive hold: two majorities always intersect."""
    return nodes // 2 + 1


class Kind(abc.ABC):
    """What one kind of lock sends to the nodes, and how it reads their answers.

    ``Redlock`` asks its kind these questions instead of testing its mode.
    """

    #: ``Redlock.mode``: ``exclusive`` or ``shared``.
    mode: ClassVar[str]
    #: ``Redlock.fair``: blocking waiters are served in arrival order.
    fair: ClassVar[bool] = False
    #: A hold leaves room for others (a share): when one waiter of this process gets
    #: in, the next one is woken too, not only by the next release.
    admits_others: ClassVar[bool] = False
    #: A blocked attempt leaves a mark on the nodes that lapses after one ttl (a
    #: writer waiting for shared holders, a place in the fair queue): the waiter
    #: comes back within a renewal interval to refresh it, even if the holder's
    #: lease is longer.
    refreshes_while_waiting: ClassVar[bool] = False
    #: A releasing holder can hand the lock straight to a waiter of its process
    #: (:mod:`.handoff`): one holder at a time, taken over in place.
    hands_over: ClassVar[bool] = False

    #: ``Redlock.limit``: at most this many shared holders (None: no limit).
    limit: int | None = None

    def __init__(self, resources: Sequence[LockKeys]) -> None:
        self.resources = tuple(resources)
        #: The first (for most kinds, the only) resource's keys.
        self.keys = self.resources[0]
        #: RESP of a script call up to its arguments, per (script, key count, argument
        #: count): see :meth:`encoded`.
        self._heads: dict[tuple[str, int, int], bytes] = {}

    def encoded(self, script: Script, keys: tuple[str, ...], args: tuple[str | int, ...]) -> Call:
        """``script`` on ``keys`` with ``args``, its RESP built from the keys' encoded once.

        A lock's keys do not change, and they are most of what its acquire and release
        calls send (10 and 8 of 22 and 12 arguments): encoded once per lock, an
        acquire + release packs in about half the time.
        ``keys`` must be the same for one ``script`` and key count, as a lock's are;
        both come from the script's signature (:attr:`Script.build_keys`,
        :attr:`Script.build_argv`), which alone knows their positions.
        """
        shape = (script.name, len(keys), len(args))
        head = self._heads.get(shape)
        if head is None:
            head = self._heads[shape] = script.evalsha_resp(len(keys), len(args)) + bulk(*keys)
        return Call(script, keys, args, resp=head + bulk(*args))

    def describe(self) -> str:
        """The kind as ``repr`` shows it (nothing for an exclusive lock, fair or not)."""
        return ""

    def quorum(self, nodes: int) -> int:
        """Nodes of ``nodes`` that must grant (and renew) a hold."""
        return majority(nodes)

    def new_waiter(self, blocking: bool, nodes: int) -> Waiter:
        """The identity of one acquire call on ``nodes`` nodes."""
        return Waiter(blocking)

    def wake_token(self, waiter: Waiter) -> Named | None:
        """What a release announcement names to wake ``waiter`` (None: it names nobody)."""
        return None

    def leave_call(self, token: str) -> Call | None:
        """The call that gives up a waiter's place in a queue, if the kind queues."""
        return None

    def abandon_calls(self, token: str, ttl_ms: int) -> list[Call]:
        """The undo of an acquisition given up with requests maybe still on the way.

        ``abandon.lua`` first: from then on the acquire scripts refuse ``token`` (for
        ``ttl_ms``), so a request that arrives later grants nothing; then the release,
        behind it on the same connection, frees what an earlier arrival granted.
        """
        return [ABANDON.on(self.keys, token=token, ttl_ms=ttl_ms), self.release_call(token)]

    @abc.abstractmethod
    def acquire_call(
        self, waiter: Waiter, ttl_ms: int, holder: Holder, predecessor: str = "", grant_ms: int = 0
    ) -> Call:
        """A new attempt of ``waiter`` to take a ``ttl_ms`` lease (numbered by the waiter).

        ``predecessor``: the token of a holder handing the lock over (kinds that
        :attr:`hands_over` only), whose hold counts as free within its process's
        turn (:data:`.timing.TURN`). ``grant_ms``: the lease of a grant to this waiter
        by a release (kinds that record waiters; :func:`.waiting.grant_ms`).
        """

    @abc.abstractmethod
    def release_call(self, token: str) -> Call:
        """The call that releases ``token``'s hold.

        A lock's finalizer keeps this bound method, so a kind never refers to its lock
        object (the lock could then never be garbage-collected).
        """

    @abc.abstractmethod
    def undo_call(self, token: str, attempt: int) -> Call:
        """The call that frees what attempt number ``attempt`` of ``token`` was granted.

        It frees nothing that a later attempt of the token wrote or found held (an
        undo can arrive after the next attempt, on another connection), and the waiter
        keeps its place among the recorded waiters: it tries again in a moment.
        """

    @abc.abstractmethod
    def fence_sync_calls(self, token: str, fences: tuple[int, ...]) -> list[Call]:
        """Store ``fences`` (one per resource) back on a granting node."""

    @abc.abstractmethod
    def renew_entries(self) -> tuple[tuple[str, str], ...]:
        """What a renewal extends: (key, kind) pairs, as ``renew_many.lua`` takes them."""

    @abc.abstractmethod
    def owned_calls(self, token: str) -> list[Call]:
        """The query whose answer :meth:`owns` reads."""

    @abc.abstractmethod
    def owns(self, values: list[Any], token: str) -> bool:
        """Whether one node's answer to :meth:`owned_calls` says ``token`` holds the lock."""

    @abc.abstractmethod
    def locked_calls(self) -> list[Call]:
        """The query whose answer :meth:`held` reads."""

    @abc.abstractmethod
    def held(self, values: list[Any]) -> bool:
        """Whether one node's answer to :meth:`locked_calls` would make ``acquire`` wait."""


class Exclusive(Kind):
    """One holder at a time, on one resource or on several taken together (all or none).

    On one resource, a refused blocking waiter is recorded on the nodes (refreshed
    with its place while it waits), and a release grants the lock to the oldest
    recorded one, told on its process channel (:mod:`.waiting`). A lock on
    several resources keeps no record: its release wakes one waiter per process.
    """

    mode = "exclusive"
    # A blocking writer kept out by shared holders marks itself waiting on the nodes,
    # and a recorded waiter's place lapses unless refreshed.
    refreshes_while_waiting = True
    hands_over = True
    #: The scripts (acquire, release, leave) of a lock with a record of waiters: any
    #: waiter may take a free lock, and a release grants it to the oldest recorded one.
    scripts: ClassVar[tuple[Script, Script, Script]] = (ACQUIRE_WAKE, RELEASE_WAKE, WAKE_LEAVE)

    def __init__(self, resources: Sequence[LockKeys]) -> None:
        super().__init__(resources)
        #: The nodes keep a record of the blocked waiters (one resource only).
        self.records = len(self.resources) == 1
        #: The scripts that acquire, release and leave the record (None: no record).
        self._acquire, self._release = self.scripts[:2] if self.records else (ACQUIRE, RELEASE)
        self._leave: Script | None = self.scripts[2] if self.records else None
        # The keys of every acquire and release call: fixed for the lock, built once.
        record = self.keys.record if self.records else ()
        self._acquire_keys = self._acquire.build_keys(
            resources=[key for resource in self.resources for key in resource.resource],
            record=record,
            abandoned=self.keys.abandoned,
        )
        self._release_keys = self._release.build_keys(
            locks=release_keys(self.resources),
            record=record,
            fence=(self.keys.fence,) if self.records else (),
        )

    def new_waiter(self, blocking: bool, nodes: int) -> Waiter:
        """A waiter with its arrival stamped, when several nodes must agree on the order.

        One node numbers arrivals itself; several cannot, so the waiter stamps its
        arrival (clocks of different hosts order it roughly): each node names its own
        oldest waiter, and with one order they name the same one.
        """
        stamped = self.records and nodes > 1
        arrival = f"{time.time() * 1000:.3f}" if stamped else ""
        return Waiter(blocking, arrival)

    def acquire_call(
        self, waiter: Waiter, ttl_ms: int, holder: Holder, predecessor: str = "", grant_ms: int = 0
    ) -> Call:
        """``acquire.lua`` on every resource at once."""
        if self.records:
            # A blocking waiter keeps its place one lease unless refreshed (it comes
            # back every renewal interval); a try is never recorded.
            waiter_ms = str(ttl_ms if waiter.blocking else 0)
            channel = process_channel(self.keys.channel)
        else:
            waiter_ms, channel = "", ""
        args = self._acquire.build_argv(
            token=waiter.token, ttl_ms=ttl_ms, task_id=holder.task_id, host=holder.host,
            pid=holder.pid, acquired_at=holder.acquired_at, task_name=holder.task_name,
            blocking="1" if waiter.blocking else "", waiter_ms=waiter_ms, arrival=waiter.arrival,
            channel=channel, attempt=waiter.next_attempt(), grant_ms=grant_ms or 1,
            handoff=(predecessor, *timing.TURN) if predecessor else (),
        )  # fmt: skip
        return self.encoded(self._acquire, self._acquire_keys, args)

    def release_call(self, token: str) -> Call:
        """``release.lua`` on every resource; on one, it names a recorded waiter.

        ``token`` also leaves the record: a Redlock holder stays recorded on a node that
        refused it (still held there by its predecessor) while the others granted it.
        """
        return self.encoded(self._release, self._release_keys, self._release_args(token, ""))

    def _release_args(self, token: str, attempt: int | str) -> tuple[str | int, ...]:
        if not self.records:
            return self._release.build_argv(token=token, reserve_ms="", channel="", attempt=attempt)
        return self._release.build_argv(
            token=token,
            reserve_ms=named_reserve_ms(),
            channel=process_channel(self.keys.channel),
            attempt=attempt,
        )

    def undo_call(self, token: str, attempt: int) -> Call:
        """As :meth:`release_call`, but only up to ``attempt``, and ``token`` keeps its place.

        A split vote's loser dropping out of the record on every node would leave the
        nodes nobody to name for a moment, and each would wake one waiter per process
        (measured with 6 processes on 3 nodes: the split votes then fed themselves).
        """
        return self.encoded(self._release, self._release_keys, self._release_args(token, attempt))

    def wake_token(self, waiter: Waiter) -> Named | None:
        """A recorded waiter is woken by the release that names it (or by ``''``)."""
        return waiter if self.records else None

    def leave_call(self, token: str) -> Call | None:
        """A recorded waiter that gives up leaves the record, passing on a grant made to it.

        Else a fair waiter would hold the queue up for a ttl, and a granted one keep the
        lock idle for the grant's lease.
        """
        if self._leave is None:
            return None
        return self._leave.on(self.keys, token=token, reserve_ms=named_reserve_ms())

    def fence_sync_calls(self, token: str, fences: tuple[int, ...]) -> list[Call]:
        """One ``fence_sync.lua`` call per resource."""
        return [
            FENCE_SYNC.on(resource, token=token, granted=fence)
            for resource, fence in zip(self.resources, fences, strict=True)
        ]

    def renew_entries(self) -> tuple[tuple[str, str], ...]:
        """Each resource's lock hash."""
        return tuple((resource.lock, "x") for resource in self.resources)

    def owned_calls(self, token: str) -> list[Call]:
        """Each resource's holder token."""
        return [Call.command("HGET", resource.lock, "token") for resource in self.resources]

    def owns(self, values: list[Any], token: str) -> bool:
        """``token`` holds every resource on the node."""
        return all(value == token for value in values)

    def locked_calls(self) -> list[Call]:
        """How many of the resources are held exclusively."""
        return [Call.command("EXISTS", *(resource.lock for resource in self.resources))]

    def held(self, values: list[Any]) -> bool:
        """Any of the resources is held exclusively."""
        return bool(values[0] > 0)


class Fair(Exclusive):
    """Exclusive on one resource; blocking waiters queue on the nodes in arrival order.

    A waiter refreshes its place while it waits, so one that dies leaves the queue
    within one ttl; a release names the head of the queue (which keeps its place until
    it gets in), and only that waiter is woken, on its process channel.
    """

    fair = True
    # Only the head of the queue may take the lock, and a releaser cannot tell which
    # local waiter that is: takeovers offered to the others were refused, each at the
    # cost of a round trip (measured: fair throughput with 8 threads fell by a third).
    hands_over = False
    # Only the head of the queue may take a free lock; a release names it.
    scripts = (ACQUIRE_FAIR, RELEASE_FAIR, FAIR_LEAVE)

    def __init__(self, keys: LockKeys) -> None:
        super().__init__((keys,))


class Shared(Kind):
    """Any number of holders of one resource, or at most ``limit``; never a writer too.

    A share's lease is two entries (its place in the shared set and its details),
    and a limit above 1 needs more than a majority of nodes (:meth:`quorum`).
    """

    mode = "shared"
    admits_others = True

    def __init__(self, keys: LockKeys, limit: int | None = None) -> None:
        super().__init__((keys,))
        self.limit = limit

    def describe(self) -> str:
        """`` shared``, and the limit if there is one."""
        return " shared" + (f" limit={self.limit}" if self.limit else "")

    def quorum(self, nodes: int) -> int:
        """A majority keeps two exclusive holders apart, not ``limit + 1`` holders.

        With 3 nodes and 2 slots, three holders can each win 2 nodes while every
        node admits only 2 of them (measured by ``tests/unit/engine/test_kinds.py``).
        ``limit + 1`` holds on ``q`` nodes each need more than the ``limit * N``
        admissions the nodes have, so ``q > limit*N/(limit+1)``.
        """
        if not self.limit or self.limit == 1:
            return majority(nodes)
        return self.limit * nodes // (self.limit + 1) + 1

    def acquire_call(
        self, waiter: Waiter, ttl_ms: int, holder: Holder, predecessor: str = "", grant_ms: int = 0
    ) -> Call:
        """Take one share (``acquire_shared.lua``); a limit of 0 means none."""
        if predecessor:
            raise ValueError("a share is never handed over")
        return ACQUIRE_SHARED.on(
            self.keys,
            token=waiter.token,
            ttl_ms=ttl_ms,
            limit=self.limit or 0,
            task_id=holder.task_id,
            host=holder.host,
            pid=holder.pid,
            acquired_at=holder.acquired_at,
            task_name=holder.task_name,
            attempt=waiter.next_attempt(),
        )

    def release_call(self, token: str) -> Call:
        """Give back the share."""
        return RELEASE_SHARED.on(self.keys, token=token, attempt="")

    def undo_call(self, token: str, attempt: int) -> Call:
        """Give back the share unless a later attempt of ``token`` counted it."""
        return RELEASE_SHARED.on(self.keys, token=token, attempt=attempt)

    def fence_sync_calls(self, token: str, fences: tuple[int, ...]) -> list[Call]:
        """Store the share's fence back (in its details, not the exclusive lock)."""
        return [FENCE_SYNC_SHARED.on(self.keys, token=token, granted=fences[0])]

    def renew_entries(self) -> tuple[tuple[str, str], ...]:
        """The share in the shared set, and its details."""
        return ((self.keys.shared, "s"), (self.keys.holders, "d"))

    def owned_calls(self, token: str) -> list[Call]:
        """Whether ``token`` has a place in the shared set."""
        return [Call.command("ZSCORE", self.keys.shared, token)]

    def owns(self, values: list[Any], token: str) -> bool:
        """``token`` has a share on the node."""
        return values[0] is not None

    def locked_calls(self) -> list[Call]:
        """The exclusive lock, and the number of shares taken."""
        return [
            Call.command("EXISTS", self.keys.lock),
            Call.command("ZCOUNT", self.keys.shared, "-inf", "+inf"),
        ]

    def held(self, values: list[Any]) -> bool:
        """Held exclusively, or every one of ``limit`` shares taken."""
        return values[0] > 0 or bool(self.limit and values[1] >= self.limit)


def kind_of(
    names: Sequence[str], prefix: str, mode: str | None, limit: int | None, fair: bool
) -> Kind:
    """The kind of a lock on ``names`` (keys under ``prefix``), its shape validated first.

    Raises:
        ConfigurationError: naming the impossible combination (a shared lock on
            several resources, a limit on an exclusive lock...) or the bad name.
    """
    mode, limit, fair = check_kind(len(names), mode, limit, fair)
    resources = tuple(lock_keys(name, prefix) for name in names)
    if mode == "shared":
        return Shared(resources[0], limit)
    return Fair(resources[0]) if fair else Exclusive(resources)
