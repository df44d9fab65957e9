"""One acquisition's steps, without I/O: the state machine both lock drivers run.

:class:`~celery_redlock.Redlock` (threads) and :class:`~celery_redlock.AsyncRedlock`
(asyncio) take a lock by the same steps: vote on every node, store back disagreeing
fences, record the hold or undo what the attempt was granted, and after a lost attempt
decide whether to wait, retry or report the nodes down. Those steps live here once, as
generators that yield each fan-out they need (:class:`Send`) and receive its replies;
a driver runs them with its own I/O (``NodeSet.call`` in the calling thread, or
``await AsyncNodeSet.call``) and its own way of waiting for a release. The drivers
differ only in what their fan-out reports (:class:`Fanout`): whether a request left
unanswered keeps its connection, so that a later request to that node queues behind it,
and which nodes lag.

:class:`Core` is a lock's state that the steps read and write: its kind, keys and
timing, its nodes and quorum, and the holds it keeps.
"""

from __future__ import annotations

import enum
import logging
import random
import time
import weakref
from collections.abc import Callable, Generator, Sequence
from typing import Any, NamedTuple, Protocol, TypeVar

from redis.exceptions import ResponseError

from ..base import forksafe, metrics
from ..exceptions import LockBusy, LockLost, LockNotOwned, NodeUnavailable
from ..nodes import ALIVE_GRACE, Call, NodeSet, Reply
from .handoff import Grant
from .holds import Holds, finalize
from .kinds import Holder, Kind, Waiter
from .lease import Lease, clock
from .renewal import get_renewer
from .scripts import ReleaseStatus
from .timing import Timing
from .vote import (
    Attempt,
    budget,
    fence_requests,
    fences_stored,
    release_decided,
    tally,
    undone_on,
    vote_calls,
    vote_decided,
)
from .waiting import HOST, Granted, grant_ms, grant_window

__all__ = [
    "RETRY_DELAY",
    "SPLIT_BACKOFF",
    "Core",
    "Fanout",
    "Send",
    "Step",
    "Steps",
    "agreeing",
    "bounded",
    "node_view",
    "report_release",
]

logger = logging.getLogger("celery_redlock.lock")  # the lock's messages, one logger

T = TypeVar("T")

#: Upper bound of the random pause (seconds) before retrying an attempt that found no
#: holder to wait for (split votes, unreachable nodes), as Redlock prescribes.
RETRY_DELAY = 0.2

#: Upper bound of the random pause after a split vote, per node: 10 ms x N.
SPLIT_BACKOFF = 0.002


class Send(NamedTuple):
    """A fan-out a step needs: the arguments of ``NodeSet.call`` / ``AsyncNodeSet.call``."""

    calls: Sequence[Call] | Sequence[Sequence[Call] | None]
    per_node: bool = False
    timeout: float | None = None
    decided: Callable[[list[Reply | None]], bool] | None = None
    #: A vote: a late reply only shortens the validity (threaded fan-out only).
    patient: bool = False


#: A step: yields the fan-outs it needs, receives each one's replies, returns ``T``.
Steps = Generator[Send, list["Reply | None"], T]


class Fanout(Protocol):
    """What a driver's fan-out tells the steps (``NodeSet``, ``AsyncNodeSet``)."""

    #: A request left unanswered keeps its connection, and the next request to that
    #: node goes out behind it: an undo can never overtake the request it undoes.
    queues_behind: bool

    def lagging(self) -> frozenset[int]:
        """The nodes (by index) not to wait for once a quorum answered."""


class Step(enum.Enum):
    """What a blocking acquisition does after an attempt that did not win."""

    UNAVAILABLE = "too many nodes failed for any quorum: raise NodeUnavailable"
    GIVE_UP = "not blocking, or the timeout passed: return False"
    SPLIT = "a split vote: step back a random moment"
    WAIT = "held: wait for its release notification, or its lease's end"
    RETRY = "no holder to wait for: retry after a random pause"


class Core:
    """A lock's state shared by its drivers, and the steps of its acquisitions.

    Arguments:
        kind: what the lock's scripts are and how their replies read (:mod:`.kinds`).
        timing: ttl, renewal interval, node timeout, drift.
        nodeset: the process's nodes for the lock (their health, for :meth:`next_step`).
        min_replicas: replicas each granting node must confirm (``WAIT``), or 0.
        holds: the holds, kept per thread or per asyncio task.
        task_id, task_name: who acquires, recorded with each hold.
        auto_renew: whether the watchdog renews the holds.
    """

    def __init__(
        self,
        kind: Kind,
        timing: Timing,
        nodeset: NodeSet,
        *,
        min_replicas: int,
        holds: Holds,
        task_id: str | None,
        task_name: str | None,
        auto_renew: bool,
    ) -> None:
        self.kind = kind
        self.keys = kind.keys
        self.timing = timing
        self.nodeset = nodeset
        self.nodes = len(nodeset)
        self.quorum = kind.quorum(len(nodeset))
        self.min_replicas = min_replicas
        self.holds = holds
        self.task_id = task_id
        self.task_name = task_name
        self.auto_renew = auto_renew
        #: The lease of a grant to a waiter of this lock by a release (ms), and how
        #: long after its attempt the waiter may count it (seconds).
        self.grant_ms = grant_ms(timing)
        self.grant_window = grant_window(timing)
        self._finalizer: weakref.finalize[..., object] | None = None

    @property
    def owner(self) -> str:
        """Who holds this lock's acquisitions, for logs: ``task[task id]`` or ``-``."""
        if self.task_id:
            return f"{self.task_name or 'task'}[{self.task_id}]"
        return self.task_name or "-"

    # -- one attempt -------------------------------------------------------------

    def vote(
        self,
        waiter: Waiter,
        fanout: Fanout,
        predecessor: str = "",
    ) -> Steps[Grant | Attempt]:
        """Ask the nodes for ``waiter``'s lock: a Grant, or the Attempt that lost.

        A Grant is a quorum's, with agreeing fences, not recorded yet; a losing
        Attempt's grants are undone already. ``predecessor``: a takeover by a releasing
        thread of this process (:mod:`.handoff`). A takeover also reads the replies of
        the nodes that keep pace (not :meth:`~Fanout.lagging`), a moment's wait: on
        each node it leaves unanswered, the predecessor's token must then be released
        by a request of its own.
        """
        holder = Holder(
            self.task_id or "", HOST, forksafe.pid(), f"{time.time():.3f}", self.task_name or ""
        )
        acquire = self.kind.acquire_call(
            waiter, self.timing.ttl_ms, holder, predecessor, self.grant_ms
        )
        wait_for = frozenset(range(self.nodes)) - fanout.lagging() if predecessor else frozenset()
        waiter.sent = True
        waiter.sent_at = sent_at = clock()
        replies = yield Send(
            vote_calls(acquire, self.min_replicas, self.timing.node_timeout),
            timeout=budget(self.timing.node_timeout, self.min_replicas),
            decided=vote_decided(self.quorum, self.nodes, self.min_replicas, wait_for),
            patient=True,
        )
        attempt = tally(replies, clock() - sent_at, self.min_replicas)
        attempt.number = waiter.attempt
        if attempt.failed() or (None in replies and not fanout.queues_behind):
            # A request that failed, or runs on on a connection of its own, may arrive
            # after an undo sent later on another connection: the undo must then make
            # the nodes refuse the token (abandon.lua).
            waiter.in_doubt = True
        validity = self.timing.ttl - attempt.elapsed - self.timing.drift
        if len(attempt.granted) >= self.quorum and validity > 0:
            fences = attempt.top_fences()
            if attempt.agreeing(fences) >= self.quorum or (
                yield from self._sync_fence(waiter.token, fences, attempt)
            ):
                return Grant(waiter.token, fences, sent_at, attempt)
        return (yield from self.undo(waiter.token, attempt, fanout))

    def _sync_fence(self, token: str, fences: tuple[int, ...], attempt: Attempt) -> Steps[bool]:
        """Store the fences back on the granting nodes; True if a quorum holds them."""
        calls = self.kind.fence_sync_calls(token, fences)
        replies = yield Send(fence_requests(self.nodes, calls, attempt.granted), per_node=True)
        synced = fences_stored(replies)
        if synced < self.quorum:
            attempt.errors.append(f"fence stored on {synced} nodes only")
            return False
        return True

    def undo(self, token: str, attempt: Attempt, fanout: Fanout) -> Steps[Attempt]:
        """Undo what a losing (or spent) attempt was granted; the attempt, for the caller.

        Everywhere, including nodes that did not answer (they may have granted it after
        all); waiting only for the nodes that may hold it and keep pace
        (:func:`.vote.undone_on`). The undo names the attempt, so it removes nothing a
        later attempt of this token wrote, whenever it arrives; the waiter keeps its
        place among the recorded waiters.
        """
        if not attempt.all_busy():
            call = self.kind.undo_call(token, attempt.number)
            yield Send([call], decided=undone_on(attempt, fanout.lagging()))
        if len(attempt.granted) >= self.quorum:
            attempt.errors.append(f"lease spent while acquiring ({attempt.elapsed:.3f}s)")
        return attempt

    def hold_granted(
        self,
        waiter: Waiter,
        grants: Sequence[Granted],
        on_lost: Callable[[LockLost], object] | None,
        lock: object,
    ) -> Lease | None:
        """Hold the lock that releases granted to ``waiter``'s last attempt: its lease.

        ``grants``: each granting node's announcement (:meth:`.waiting.Subscription.granted`).
        It may be held without asking the nodes again when a quorum granted it with one
        fence (a Redlock's nodes number their fences apart: the waiter asks, and its
        attempt stores one fence on them) and no replica has to confirm it.

        The grant's lease (:func:`.waiting.grant_ms`) began on the node when it was
        made; the waiter counts it from when it sent the attempt the node recorded, plus
        what the node counted from recording that attempt to the grant, less the drift
        factor of it: the node recorded the attempt after it was sent, so the waiter's
        count ends first. It holds only in the first half of
        :func:`.waiting.grant_window` from there, so that the renewer has the other half
        to extend the short lease. Else None: the waiter asks the nodes, whose answer
        counts the grants held by its token.
        """
        fences = [grant.fence for grant in grants]
        if self.min_replicas or len(fences) < self.quorum or len(set(fences)) != 1:
            return None
        elapsed = min(grant.elapsed_ms for grant in grants) / 1000
        granted_at = waiter.sent_at + elapsed * (1 - self.timing.drift_factor)
        if clock() - granted_at > self.grant_window / 2:
            return None
        attempt = Attempt([], clock() - waiter.sent_at)
        attempt.granted = list(range(len(fences)))
        attempt.fences = [(fence,) for fence in fences]
        attempt.number = waiter.attempt
        grant = Grant(waiter.token, (fences[0],), granted_at, attempt)
        return self.record(grant, on_lost, lock, self.grant_ms / 1000)

    def release(self, token: str, fanout: Fanout) -> Send:
        """The fan-out that releases ``token``: done once a quorum confirmed it."""
        decided = release_decided(self.quorum, fanout.lagging())
        return Send([self.kind.release_call(token)], decided=decided)

    def record(
        self,
        grant: Grant,
        on_lost: Callable[[LockLost], object] | None,
        lock: object,
        length: float | None = None,
    ) -> Lease | None:
        """Record a grant as the caller's hold: its lease; None if it ran out first.

        ``lock``: the driver object, whose collection releases its holds. ``length``:
        the lease the nodes granted, if not the ttl (a grant by a release).
        """
        lease = Lease(
            self.keys,
            grant.token,
            grant.fences[0],
            self.nodeset,
            self.timing,
            grant.sent_at,
            [on_lost] if on_lost is not None else [],
            owner=self.owner,
            task_name=self.task_name,
            entries=self.kind.renew_entries(),
            fences=grant.fences,
            quorum=self.quorum,
            length=length,
        )
        if clock() >= lease.give_up_at:
            # Paused (or slowed) between the vote and here, e.g. by the fence sync:
            # a lease that is over by the local clock is not a hold.
            return None
        self.holds.add(lease)
        if self.auto_renew:
            if self._finalizer is None:
                self._finalizer = weakref.finalize(
                    lock, finalize, self.holds, self.keys.lock, self.kind.release_call
                )
            get_renewer().add(lease)
        logger.debug(
            "Lock(%r) acquired by %s: fence %s, %d of %d nodes",
            self.keys.lock,
            self.owner,
            grant.fences[0] if len(grant.fences) == 1 else grant.fences,
            len(grant.attempt.granted),
            self.nodes,
        )
        return lease

    # -- between attempts ----------------------------------------------------------

    def next_step(
        self, attempt: Attempt, blocking: bool, give_up: float | None, started: float
    ) -> tuple[Step, float]:
        """What a blocking acquisition does after a failed attempt, and for how long."""
        if len(attempt.errors) > self.nodes - self.quorum and not (
            blocking and self._not_yet_down(started)
        ):
            # Too many nodes failed for any quorum: waiting would hide a Redis outage
            # behind a lock that looks busy.
            return Step.UNAVAILABLE, 0.0
        if not blocking or (give_up is not None and clock() >= give_up):
            if metrics.enabled:
                metrics.busy(self.task_name)
            return Step.GIVE_UP, 0.0
        if attempt.granted:
            # A split vote: nobody won and every contender is undoing its part, which
            # announces releases that would wake us all again at once. Step back a
            # random moment, as Redlock prescribes, and ignore the wake-ups our own
            # undo caused.
            step, pause = Step.SPLIT, random.uniform(0, SPLIT_BACKOFF * self.nodes)
        elif attempt.busy_ttl:
            # TTL fallback: an expiry publishes nothing. A waiter whose mark on the
            # nodes lapses (a queue place, a waiting writer) comes back in time to
            # renew it.
            step, pause = Step.WAIT, min(attempt.busy_ttl) + random.uniform(0, 0.01)
            if self.kind.refreshes_while_waiting:
                pause = min(pause, self.timing.renew_interval)
        else:
            step, pause = Step.RETRY, random.uniform(0, RETRY_DELAY)
        return step, bounded(pause, give_up)

    def _not_yet_down(self, started: float) -> bool:
        """Whether a blocking acquisition begun at ``started`` retries failed nodes.

        A node is down once it has had :data:`ALIVE_GRACE` to answer this process and
        answered nothing: before that, or while a quorum of nodes answers other
        requests of this process, a failed attempt means this thread (or the machine)
        was starved of CPU, not that Redis is out. A process whose hundreds of threads
        all ask at once reads its first replies late; a cold start is not an outage.
        """
        return clock() - started < ALIVE_GRACE or (
            self.nodeset.answering(since=time.monotonic() - ALIVE_GRACE) >= self.quorum
        )

    def tried(self, attempt: Attempt | None, started: float) -> None:
        """Count ``try_acquire``'s attempt; raise :class:`LockBusy` or why not held."""
        if attempt is None:
            if metrics.enabled:
                metrics.acquired(self.task_name, clock() - started)
            return
        if attempt.busy_ttl:
            if metrics.enabled:
                metrics.busy(self.task_name)
            busy = LockBusy(self.keys.lock, attempt.holder, min(attempt.busy_ttl))
            busy.asked_at = started
            raise busy
        raise NodeUnavailable(self.keys.lock, attempt.errors)

    # -- the caller's hold ---------------------------------------------------------------

    def check(self) -> None:
        """Raise :class:`LockLost` unless the caller holds the lock and the lease is sure."""
        lease = self.holds.lease()
        if lease is None:
            raise LockLost(self.keys.lock, "never acquired", None)
        lease.check()

    def fence(self) -> int:
        """The fencing token of the caller's current (or last) acquisition."""
        lease = self.holds.lease()
        if lease is None:
            raise LockNotOwned(self.keys.lock, "no fence: no acquisition of this caller's")
        return lease.fence

    def remaining(self) -> float:
        """Seconds of the caller's lease left by the local deadline; 0 when not held."""
        hold = self.holds.live()
        return 0.0 if hold is None else hold.lease.remaining()

    # -- interrupted acquisitions and stale holds ---------------------------------------

    def end_abandoned(self, waiter: Waiter) -> bool:
        """End the hold an interrupted acquisition recorded; whether it sent anything."""
        hold = self.holds.entry()
        if hold is not None and hold.lease.token == waiter.token:
            hold.lease.released = True  # first: the renewer must stop renewing it
            hold.count = 0
        return waiter.sent

    def abandon_calls(self, waiter: Waiter) -> list[Call]:
        """What undoes an interrupted acquisition: refuse the token, then release it.

        The undo may overtake a request still on its way (on a connection the
        interruption closed, or one that timed out), so it first makes the nodes refuse
        the token (``abandon.lua``), then releases what they granted.
        """
        return self.kind.abandon_calls(waiter.token, self.timing.ttl_ms)

    def undo_failed(self) -> None:
        """Log an undo that could not reach the nodes (call from an ``except`` block)."""
        logger.warning(
            "Lock(%r): could not undo an interrupted acquisition; it expires within %.1fs",
            self.keys.lock,
            self.timing.ttl,
            exc_info=True,
        )

    def reenter_or_end(self) -> bool | str:
        """Count one more hold on a lease still valid (True); False: no hold.

        Else the token of a hold whose lease has run out, ended here: the caller
        frees whatever may be left of it on the nodes (within the drift allowance it
        can still be there) before a real acquisition.
        """
        hold = self.holds.live()
        if hold is None:
            return False
        lease = hold.lease
        if lease.lost is None and clock() < lease.give_up_at:
            hold.count += 1
            return True
        lease.released = True  # stop renewing it
        hold.count = 0
        return lease.token


def bounded(pause: float, give_up: float | None) -> float:
    """``pause``, cut short at ``give_up`` (a ``clock()`` time, or None: never)."""
    return pause if give_up is None else max(0.0, min(pause, give_up - clock()))


def agreeing(replies: list[Reply | None], says: Callable[[list[Any]], bool]) -> int:
    """Nodes whose answer ``says`` yes to."""
    return sum(1 for reply in replies if reply is not None and reply.ok and says(reply.values))


def node_view(reply: Reply | None) -> dict[str, Any]:
    """One node's ``inspect.lua`` answer as ``Redlock.inspect`` gives it."""
    if reply is None or not reply.ok or isinstance(reply.values[0], ResponseError):
        error = reply.describe_error() if reply is not None and reply.error else "no reply"
        return {"node": reply.node.safe_url if reply else None, "error": error}
    value = reply.values[0]
    fields = value[2:]
    return {
        "node": reply.node.safe_url,
        "pttl": value[0],
        "fence_counter": value[1],
        **dict(zip(fields[::2], fields[1::2], strict=True)),
    }


def report_release(lock: Core, lease: Lease, replies: list[Reply | None]) -> None:
    """Count a release in the metrics and the log; say why if a quorum did not confirm it."""
    if metrics.enabled and lease.lost is None:
        metrics.released(lock.task_name, clock() - lease.sent_at)
    codes = [r.values[0] for r in replies if r is not None and r.ok]
    released = codes.count(ReleaseStatus.RELEASED)
    if lease.lost is None and released < lock.quorum:
        _warn_release(lock, lease, codes)
    logger.debug(
        "Lock(%r) released by %s: fence %s, %d of %d nodes",
        lock.keys.lock,
        lock.owner,
        lease.fence,
        released,
        lock.nodes,
    )


def _warn_release(lock: Core, lease: Lease, codes: list[Any]) -> None:
    """Say why a release was not confirmed by a quorum, and what follows."""
    left = max(0.0, lease.deadline - clock())
    unanswered = lock.nodes - len(codes)
    if codes.count(ReleaseStatus.TAKEN) or codes.count(ReleaseStatus.GONE):
        if left <= 0:
            return  # the lease had simply run out
        logger.error(
            "Lock(%r) was no longer held by %s at release (fence %s): gone on %d and "
            "held by another owner on %d of %d nodes, %.1fs before its local deadline; "
            "the other owner's lock was left alone",
            lock.keys.lock,
            lock.owner,
            lease.fence,
            codes.count(ReleaseStatus.GONE),
            codes.count(ReleaseStatus.TAKEN),
            lock.nodes,
            left,
        )
    if unanswered and left > 0:
        logger.warning(
            "Lock(%r) release not confirmed by %d of %d nodes; there it expires within %.1fs",
            lock.keys.lock,
            unanswered,
            lock.nodes,
            left,
        )
