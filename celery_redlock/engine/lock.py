"""``Redlock``: a lease on one Redis node, or on a majority of N independent masters.

One acquisition, step by step::

    t0 = monotonic()                  the clock starts when the requests are *sent*
    acquire.lua on every node         concurrently; return once a quorum is decided
    validity = ttl - (now - t0) - (ttl * drift_factor + 2 ms)
    granted on >= N//2+1 nodes and validity > 0 ?
        yes: fence = largest counter among the granting nodes (stored back on them
             when they disagree), lease deadline = t0 + ttl - drift, watchdog on
        no:  release.lua on every node (even those that did not answer), then
             retry after a random delay, or wait for a release notification

Why the clock starts at send time: a reply can be delayed arbitrarily, but Redis
cannot have set the key before the request left. Counting from then, the local
deadline is never later than the real expiry on any granting node, up to the
drift allowance.

Why tokens are random per acquisition, not the task id: with ``acks_late`` a task
message can be delivered twice while the first run is still going. Both runs have
the same task id, and must not be able to renew or release each other's lock::

    worker A: acquire(token=a)  ... body runs ...              release(a): -1, left alone
    worker B:         (redelivered, same task id) acquire(b): busy

Ownership: a hold belongs to the thread (greenlet, under gevent) that acquired it
(see :mod:`.holds`, which keeps them). Each thread using one ``Redlock`` object has
its own acquisition, token and fence; another thread using the same object contends
like any other owner, and can never release, extend or renew a hold that is not its
own.

Reentrancy is counted per thread on a lease that is still valid by the local
deadline: the holding thread acquiring again increments a counter, and only the
matching number of releases frees the lock. A hold whose lease has run out (not
renewed, or lost) is not re-entered: acquiring again is a new acquisition with a new
token and a larger fence, and releases of the old hold raise
:class:`~celery_redlock.LockNotOwned`.

Asynchronous exceptions (a soft time limit, ``KeyboardInterrupt``, this library's
own abort) can land anywhere in ``acquire``. Whatever the nodes granted to an
acquisition that does not return ``True`` is released on the way out, and the
renewer never shares a lock with the threads that call into the lock.

A held ``Redlock`` that is garbage-collected (the program dropped the last
reference without releasing) is released with a ``ResourceWarning`` when it
renews automatically; with ``auto_renew=False`` its lease just runs out.

Where the parts are: :mod:`.kinds` builds what each kind of lock (exclusive, fair,
shared) sends and reads; :mod:`.vote` sends one attempt and tallies it; :mod:`.holds`
keeps the holds per thread; :mod:`.lease` is a lease and its deadline; :mod:`.renewal`
the watchdog; :mod:`.waiting` the release notifications. This module keeps the
sequence that ties them: attempts and waits, the hold, the release, and the undo.

Why this module is larger than the project's ~400-line guide (and ``Redlock`` than ~250):
what is left is the public API users read (the argument reference, fifteen methods
and properties, most of them a few lines over :mod:`.kinds` and :mod:`.holds`) and
the two exception-safe sequences. ``acquire`` and ``release`` stay whole, each with
the ``try``/``finally`` that undoes what an exception (maybe asynchronous) interrupted,
beside the undo helpers they call (``_abandon``, ``_end_interrupted_release``):
split across modules, a gap between a call and its ``try`` is a place where an
exception leaves a hold behind (``tests/unit/engine/test_lock_handles.py`` injects
exceptions at random points to find one).
"""

from __future__ import annotations

import enum
import logging
import random
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from redis.exceptions import ResponseError

from .. import forksafe, metrics
from ..exceptions import ConfigurationError, LockBusy, LockLost, LockNotOwned, NodeUnavailable
from ..nodes import ALIVE_GRACE, NodeSet, Reply
from ..nodes.cluster import is_cluster_url
from . import handoff
from .handoff import Grant
from .holds import Hold, Holds, finalize
from .keys import DEFAULT_PREFIX
from .kinds import Holder, Waiter, kind_of
from .lease import Lease, clock, renew_call
from .renewal import get_renewer
from .scripts import INSPECT, ReleaseStatus
from .timing import Timing
from .vote import Attempt, budget, release_decided, sent_only, sync_fences, undone_on, vote
from .waiting import HOST, Subscription, subscribed

__all__ = ["DEFAULT_URL", "Redlock", "Step"]

logger = logging.getLogger("celery_redlock.lock")

DEFAULT_URL = "redis://localhost:6379/0"

#: Upper bound of the random pause between two attempts that failed without a
#: holder to wait for (split votes, unreachable nodes), as Redlock prescribes.
RETRY_DELAY = 0.2

#: Upper bound of the random pause after a split vote, per node: 10 ms x N.
SPLIT_BACKOFF = 0.002


_HOST = HOST  # the host the scripts record for a holder and a waiter


class Step(enum.Enum):
    """What a blocking acquisition does after an attempt that did not win."""

    UNAVAILABLE = "too many nodes failed for any quorum: raise NodeUnavailable"
    GIVE_UP = "not blocking, or the timeout passed: return False"
    SPLIT = "a split vote: step back a random moment"
    WAIT = "held: wait for its release notification, or its lease's end"
    RETRY = "no holder to wait for: retry after a random pause"


class Redlock:
    """A distributed lock with a watchdog, fencing tokens and Redlock quorum.

    Arguments:
        name: what the lock protects; the Redis keys derive from it.
        nodes: Redis URLs. One URL (or ``None``: ``redis://localhost:6379/0``) for a
            single node; 3, 5 or 7 independent masters for Redlock.
        ttl: lease in seconds. The watchdog renews it every ``renew_interval``
            while the lock is held, so ``ttl`` bounds how long a crashed holder
            blocks others, not how long the work may take.
        auto_renew: renew in the background while held. Without it the lease
            simply ends after ``ttl`` (call :meth:`extend` yourself).
        on_lost: called with the :class:`LockLost` when the lease is lost while
            held (from the renewer thread: keep it short).
        renew_interval: seconds between renewals; default ``ttl / 3``.
        node_timeout: budget of one call to the nodes; default min(0.25, ttl/10).
        drift_factor: share of the lease assumed lost to clock drift.
        key_prefix: prefix of the Redis keys.
        min_replicas: replicas that must acknowledge an acquisition (``WAIT``)
            before a node's vote counts.
        task_id: recorded as the holder, so others can name who holds the lock and
            a worker can release the lock of a task whose process died.
        task_name: recorded beside the task id, for ``celery redlock ls``.
        mode: ``exclusive`` (default) or ``shared``.
        limit: at most this many shared holders (implies ``mode="shared"``).
        fair: blocking waiters are served in arrival order.
        timing: a validated :class:`~celery_redlock.settings.Timing`, in place of
            ``ttl``, ``renew_interval``, ``node_timeout`` and ``drift_factor``
            (which are then ignored): what the task base and beat pass on.

    The validated ``mode``, ``limit`` and ``fair`` are attributes of the same names;
    ``kind`` is the :class:`~celery_redlock.engine.kinds.Kind` they select.

    Example::

        with Redlock("reports:daily", nodes=["redis://a", "redis://b", "redis://c"]) as lock:
            write_report(fence=lock.fence)
    """

    def __init__(
        self,
        name: str | Sequence[str],
        *,
        nodes: Sequence[str] | str | None = None,
        ttl: float = 30.0,
        auto_renew: bool = True,
        on_lost: Callable[[LockLost], object] | None = None,
        renew_interval: float | None = None,
        node_timeout: float | None = None,
        drift_factor: float = 0.01,
        key_prefix: str = DEFAULT_PREFIX,
        min_replicas: int = 0,
        task_id: str | None = None,
        task_name: str | None = None,
        mode: str | None = None,
        limit: int | None = None,
        fair: bool = False,
        timing: Timing | None = None,
    ) -> None:
        names = [name] if isinstance(name, str) else list(dict.fromkeys(name))
        if not names or not all(isinstance(n, str) for n in names):
            raise ConfigurationError(
                f"a lock name must be a non-empty string or a sequence of them, got {name!r}"
            )
        self.kind = kind_of(names, key_prefix, mode, limit, fair)
        self.mode, self.limit, self.fair = self.kind.mode, self.kind.limit, self.kind.fair
        self.names = tuple(names)
        self.name = names[0]
        self.resources = self.kind.resources
        self.keys = self.kind.keys
        self.timing = timing or Timing.of(
            ttl, renew_interval, node_timeout, drift_factor, source=""
        )
        self.nodeset = NodeSet.get(
            [DEFAULT_URL] if nodes is None else nodes, timeout=self.timing.node_timeout
        )
        if len(self.resources) > 1 and any(is_cluster_url(n.url) for n in self.nodeset.nodes):
            raise ConfigurationError(
                f"a lock on several resources ({list(self.names)!r}) cannot use a Redis Cluster "
                "node: each resource's keys hash to a slot of their own, and one script "
                "cannot take keys in several slots; use independent nodes, or one resource"
            )
        self.quorum = self.kind.quorum(len(self.nodeset))
        #: This lock as :mod:`.handoff` finds it among the process's holds and waiters.
        self.local_key = (
            tuple(node.url for node in self.nodeset.nodes),
            tuple(resource.lock for resource in self.resources),
        )
        self.auto_renew = auto_renew
        self.on_lost = on_lost
        self.min_replicas = min_replicas
        self.task_id = task_id
        self.task_name = task_name
        self._holds = Holds()
        self._finalizer: weakref.finalize[..., Redlock] | None = None

    def __repr__(self) -> str:
        names = self.keys.lock if len(self.resources) == 1 else [k.lock for k in self.resources]
        lease = self.lease
        return (
            f"<Redlock{self.kind.describe()} {names!r} on {len(self.nodeset)} node(s) "
            f"fence={None if lease is None else lease.fence}>"
        )

    # -- acquisition -----------------------------------------------------------

    def acquire(self, blocking: bool = True, timeout: float | None = None) -> bool:
        """Take the lock; True once held, False if ``timeout`` passed (or not blocking).

        A blocking call waits for the holder's release notification (or the end of
        its lease) between attempts; it never polls at a fixed interval. Raises
        :class:`NodeUnavailable` when so many nodes fail that no quorum is possible
        (blocking or not: an outage is not a busy lock).

        With ``fair=True`` a blocking call queues up on the nodes and is served in
        arrival order; it refreshes its place while it waits, so a waiter that dies
        leaves the queue within one ``ttl``.
        """
        if self._reenter():
            return True
        started = clock()
        give_up = None if timeout is None or not blocking else started + timeout
        waiter = self.kind.new_waiter(blocking, len(self.nodeset))
        subscription: Subscription | None = None
        offer: handoff.Offer | None = None
        handed: Grant | Attempt | None = None
        acquired = settled = undone = False
        try:
            try:
                if blocking and handoff.held_here(self):
                    # Another thread of this process holds it, so Redis could only say
                    # "busy": queue up for its handoff without asking.
                    subscription = self._subscribe(waiter)
                    held = handoff.held_here(self)
                    if held:
                        offer = handoff.offer(self, waiter, subscription.event)
                        subscription.wait(
                            self._bounded(min(held, self.timing.renew_interval), give_up)
                        )
                if (
                    blocking
                    and subscription is None
                    and subscribed(self.nodeset.nodes, self.keys.channel)
                ):
                    # This process still listens to the lock's channel (it waited for it
                    # a moment ago): register first, and a refusal waits at once, with
                    # no retry once subscribed.
                    subscription = self._subscribe(waiter)
                while True:
                    handed = None
                    if offer is not None:
                        handed = offer.withdraw(self._patience())
                        offer = None
                    if isinstance(handed, Grant):
                        attempt = self._record(handed)  # handed over by a releasing thread
                    else:
                        # Nobody handed it over, or a takeover lost (the lock held by a
                        # third party, or the process's turn over): ask the nodes
                        # ourselves. The takeover's wake-up may have merged with a
                        # release's announcement to this waiter, which waiting on its
                        # busy answer would then wait out, up to the fallback.
                        attempt = self._attempt(waiter)
                    if attempt is None:
                        acquired = settled = True
                        if metrics.enabled:
                            metrics.acquired(self.task_name, clock() - started)
                        if subscription is not None and self.kind.admits_others:
                            subscription.pass_on()  # a share does not exclude the next waiter
                        return True
                    step, pause = self._next_step(attempt, blocking, give_up, started)
                    if step is Step.UNAVAILABLE:
                        # The attempt undid its part; unanswered requests still need
                        # the abandon (below).
                        settled = not waiter.in_doubt
                        raise NodeUnavailable(self.keys.lock, attempt.errors)
                    if step is Step.GIVE_UP:
                        settled = not waiter.in_doubt
                        return False
                    if step is Step.SPLIT:
                        time.sleep(pause)
                        if subscription is not None:
                            subscription.clear()
                    elif step is Step.WAIT:
                        if subscription is None:
                            subscription = self._subscribe(waiter)
                            continue  # retry once subscribed, so no release is missed
                        offer = handoff.offer(self, waiter, subscription.event)
                        subscription.wait(pause)
                    else:
                        time.sleep(pause)
            finally:
                if offer is not None:
                    offer.abandon()
                if isinstance(handed, Grant) and not acquired:
                    handoff.forget(self, handed)
                if not settled:
                    # Left by an exception (maybe asynchronous: a soft time limit, our own
                    # abort) at any point after the first request went out, or given up
                    # with a request unanswered: whatever the nodes granted, or will
                    # grant when a request still on the way arrives, must not outlive
                    # this call.
                    self._abandon(waiter)
                    undone = True
                if subscription is not None:
                    subscription.close()
                if blocking and not acquired:
                    leave = self.kind.leave_call(waiter.token)
                    if leave is not None:  # else a queued place holds others up for a ttl
                        self.nodeset.call([leave])
        except BaseException:
            if acquired or not (settled or undone):
                # Landed after the hold was recorded (in the clean-up above, say):
                # acquire() raises, so the caller will never release it. Or a second
                # exception landed before the undo above was done. End it here.
                self._abandon(waiter)
            raise

    def _subscribe(self, waiter: Waiter) -> Subscription:
        """Listen for this lock's release announcements (and those naming ``waiter``).

        A named waiter of a Redlock tries once a quorum of nodes announced a release
        to it (:meth:`.waiting.Subscription.wait`).
        """
        named = self.kind.wake_token(waiter)
        return Subscription(
            self.nodeset.nodes,
            self.keys.channel,
            confirm_timeout=self.timing.node_timeout,
            named=named,
            quorum=1 if named is None else self.quorum,
        )

    @staticmethod
    def _bounded(pause: float, give_up: float | None) -> float:
        return pause if give_up is None else max(0.0, min(pause, give_up - clock()))

    def _patience(self) -> float:
        """How long a waiter claimed by a releasing thread waits for its takeover."""
        return handoff.PATIENCE_BUDGETS * budget(self.timing.node_timeout, self.min_replicas)

    def _next_step(
        self, attempt: Attempt, blocking: bool, give_up: float | None, started: float
    ) -> tuple[Step, float]:
        """What a blocking ``acquire`` does after a failed attempt, and for how long."""
        if len(attempt.errors) > len(self.nodeset) - self.quorum and not (
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
            step, pause = Step.SPLIT, random.uniform(0, SPLIT_BACKOFF * len(self.nodeset))
        elif attempt.busy_ttl:
            # TTL fallback: an expiry publishes nothing. A waiter whose mark on the
            # nodes lapses (a queue place, a waiting writer) comes back in time to
            # renew it.
            step, pause = Step.WAIT, min(attempt.busy_ttl) + random.uniform(0, 0.01)
            if self.kind.refreshes_while_waiting:
                pause = min(pause, self.timing.renew_interval)
        else:
            step, pause = Step.RETRY, random.uniform(0, RETRY_DELAY)
        return step, self._bounded(pause, give_up)

    def _not_yet_down(self, started: float) -> bool:
        """Whether a blocking acquisition begun at ``started`` retries failed nodes.

        A node is down once it has had :data:`ALIVE_GRACE` to answer this process and
        answered nothing: before that, or while a quorum of nodes answers other
        requests of this process, a failed attempt means this thread (or the machine)
        was starved of CPU, not that Redis is out. A process whose hundreds of threads
        all ask at once reads its first replies late; a cold start is not an outage.
        """
        now = clock()
        return now - started < ALIVE_GRACE or (
            self.nodeset.answering(since=time.monotonic() - ALIVE_GRACE) >= self.quorum
        )

    def try_acquire(self) -> None:
        """Take the lock now or raise :class:`LockBusy` naming the holder."""
        if self._reenter():
            return
        started = clock()
        waiter = self.kind.new_waiter(False, len(self.nodeset))
        settled = undone = False
        try:
            try:
                attempt = self._attempt(waiter)
                settled = attempt is None or not waiter.in_doubt
            finally:
                if not settled:
                    self._abandon(waiter)
                    undone = True
        except BaseException:
            if not (settled or undone):  # a second exception landed before the undo
                self._abandon(waiter)
            raise
        self._tried(attempt, started)

    def _tried(self, attempt: Attempt | None, started: float) -> None:
        """Count ``try_acquire``'s attempt; raise :class:`LockBusy` or why not held."""
        if attempt is None:
            if metrics.enabled:
                metrics.acquired(self.task_name, clock() - started)
            return
        if attempt.busy_ttl:
            if metrics.enabled:
                metrics.busy(self.task_name)
            raise LockBusy(self.keys.lock, attempt.holder, min(attempt.busy_ttl))
        raise NodeUnavailable(self.keys.lock, attempt.errors)

    def _abandon(self, waiter: Waiter) -> None:
        """Undo an acquisition interrupted by an exception, wherever it stopped.

        The undo may overtake a request still on its way (on a connection the
        interruption closed, or one that timed out), so it first makes the nodes refuse
        the token (``abandon.lua``), then releases what they granted.
        """
        if not self._end_abandoned(waiter):
            return
        calls = self.kind.abandon_calls(waiter.token, self.timing.ttl_ms)
        _undo_surely(lambda: self.nodeset.call(calls), self._undo_failed)

    def _end_abandoned(self, waiter: Waiter) -> bool:
        """End the hold an interrupted acquisition recorded; whether it sent anything."""
        hold = self._holds.entry()
        if hold is not None and hold.lease.token == waiter.token:
            hold.lease.released = True  # first: the renewer must stop renewing it
            hold.count = 0
        return waiter.sent

    def _undo_failed(self) -> None:
        logger.warning(
            "Lock(%r): could not undo an interrupted acquisition; it expires within %.1fs",
            self.keys.lock,
            self.timing.ttl,
            exc_info=True,
        )

    def _attempt(self, waiter: Waiter) -> Attempt | None:
        """One acquisition attempt; None when it succeeded (and the hold is recorded)."""
        outcome = self._vote(waiter)
        if isinstance(outcome, Attempt):
            return outcome
        return self._record(outcome)

    def _record(self, grant: Grant) -> Attempt | None:
        """Record a granted acquisition as this thread's hold; None once recorded."""
        if self._won(grant.token, grant.fences, grant.sent_at, len(grant.attempt.granted)):
            return None
        handoff.forget(self, grant)  # if it was a takeover: it will not be held
        return self._undo(grant.token, grant.attempt)

    def _vote(
        self, waiter: Waiter, predecessor: str = "", wait_all: bool = False
    ) -> Grant | Attempt:
        """Ask the nodes for ``waiter``'s lock: a Grant, or the Attempt that lost.

        A Grant is a quorum's, with agreeing fences, not recorded yet; a losing
        Attempt's grants are undone already.

        ``predecessor``: a takeover by a releasing thread of this process
        (:mod:`.handoff`), which may run in that thread.
        """
        token, quorum = waiter.token, self.quorum
        holder = Holder(
            self.task_id or "", _HOST, forksafe.pid(), f"{time.time():.3f}", self.task_name or ""
        )
        acquire = self.kind.acquire_call(waiter, self.timing.ttl_ms, holder, predecessor)
        waiter.sent = True
        attempt, sent_at = vote(
            self.nodeset, acquire, quorum, self.min_replicas, self.timing.node_timeout, wait_all
        )
        attempt.number = waiter.attempt
        if attempt.failed():
            # Those connections are closed: an undo goes out on others, and may
            # arrive first. (A reply not waited for is read, and an undo sent, on the
            # same connection, behind the request.)
            waiter.in_doubt = True
        validity = self.timing.ttl - attempt.elapsed - self.timing.drift
        if len(attempt.granted) >= quorum and validity > 0:
            fences = attempt.top_fences()
            if attempt.agreeing(fences) >= quorum or self._sync_fence(token, fences, attempt):
                return Grant(token, fences, sent_at, attempt)
        return self._undo(token, attempt)

    def _undo(self, token: str, attempt: Attempt) -> Attempt:
        """Undo what a losing (or spent) attempt was granted; the attempt, for the caller."""
        if not attempt.all_busy():
            # Undo everywhere, including nodes that did not answer (they may have
            # granted it after all) and nodes whose replicas did not confirm; wait only
            # for the nodes that granted it. The undo names the attempt, so it removes
            # nothing a later attempt of this token wrote, whenever it arrives.
            self._unlock(token, undo=attempt)
        if len(attempt.granted) >= self.quorum:
            attempt.errors.append(f"lease spent while acquiring ({attempt.elapsed:.3f}s)")
        return attempt

    def _sync_fence(self, token: str, fences: tuple[int, ...], attempt: Attempt) -> bool:
        """Store the fences back on the granting nodes; True if a quorum holds them."""
        calls = self.kind.fence_sync_calls(token, fences)
        synced = sync_fences(self.nodeset, calls, attempt.granted)
        if synced < self.quorum:
            attempt.errors.append(f"fence stored on {synced} nodes only")
            return False
        return True

    @property
    def owner(self) -> str:
        """Who holds this object's acquisitions, for logs: ``task[task id]`` or ``-``."""
        if self.task_id:
            return f"{self.task_name or 'task'}[{self.task_id}]"
        return self.task_name or "-"

    def _won(
        self,
        token: str,
        fences: tuple[int, ...],
        sent_at: float,
        granted: int,
        on_lost: Callable[[LockLost], object] | None = None,
    ) -> bool:
        """Record the hold; False if the lease ran out before it could be recorded.

        ``on_lost`` replaces :attr:`on_lost` for this hold (AsyncRedlock's delivers the
        loss to the holder's event loop).
        """
        report = on_lost or self.on_lost
        callbacks = [report] if report is not None else []
        lease = Lease(
            self.keys,
            token,
            fences[0],
            self.nodeset,
            self.timing,
            sent_at,
            callbacks,
            owner=self.owner,
            task_name=self.task_name,
            entries=self.kind.renew_entries(),
            fences=fences,
            quorum=self.quorum,
        )
        if clock() >= lease.give_up_at:
            # Paused (or slowed) between the vote and here, e.g. by the fence sync:
            # a lease that is over by the local clock is not a hold.
            return False
        self._holds.add(lease)
        handoff.holding(self, lease)
        if self.auto_renew:
            if self._finalizer is None:
                self._finalizer = weakref.finalize(
                    self, finalize, self._holds, self.keys.lock, self.kind.release_call
                )
            get_renewer().add(lease)
        logger.debug(
            "Lock(%r) acquired by %s: fence %s, %d of %d nodes",
            self.keys.lock,
            self.owner,
            fences[0] if len(fences) == 1 else fences,
            granted,
            len(self.nodeset),
        )
        return True

    def _unlock(self, token: str, *, undo: Attempt | None = None) -> list[Reply | None]:
        """Release ``token`` on every node, waiting for a quorum's confirmation at most.

        ``undo``: only what that attempt (or an earlier one) was granted, for an attempt
        that lost the vote (it tries again, so it keeps its place among the recorded
        waiters), waiting for the nodes that may hold it (:func:`.vote.undone_on`).
        """
        if undo is not None:
            call = self.kind.undo_call(token, undo.number)
            return self.nodeset.call([call], decided=undone_on(undo, self.nodeset.lagging()))
        decided = release_decided(self.quorum, self.nodeset.lagging())
        return self.nodeset.call([self.kind.release_call(token)], decided=decided)

    # -- holding -----------------------------------------------------------------

    def _reenter(self) -> bool:
        """Count one more hold if this thread holds the lock on a lease still valid.

        A hold whose lease has run out by the local deadline (not renewed, or lost)
        is dropped instead: the caller then makes a real acquisition.
        """
        token = self._reenter_or_end()
        if token is True or token is False:
            return token
        self._unlock(token)
        return False

    def _reenter_or_end(self) -> bool | str:
        """Count one more hold on a lease still valid (True); False: no hold.

        Else the token of a hold whose lease has run out, ended here: the caller
        frees whatever may be left of it on the nodes (within the drift allowance it
        can still be there) before a real acquisition.
        """
        hold = self._holds.live()
        if hold is None:
            return False
        lease = hold.lease
        if lease.lost is None and clock() < lease.give_up_at:
            hold.count += 1
            return True
        lease.released = True  # stop renewing it
        hold.count = 0
        return lease.token

    @property
    def lease(self) -> Lease | None:
        """The calling thread's current (or last) lease on this lock.

        From a thread that never acquired this object (a callback, a helper thread),
        the lease of the only thread that did; ``None`` if several did.
        """
        return self._holds.lease()

    def release(self) -> None:
        """Release the calling thread's hold (its outermost release frees the lock).

        Only this acquisition's token is deleted; if the lease was lost and someone
        else holds the lock now, their lock is left alone. Raises
        :class:`LockNotOwned` if the calling thread does not hold the lock. A release
        interrupted by an exception (a soft time limit, an abort) still ends the hold:
        the exception propagates, and the lock is not renewed any more.
        """
        hold: Hold | None = None
        counted = done = False
        try:
            hold = self._holds.own(self.keys.lock, "release")
            hold.count -= 1
            counted = True
            if hold.count:
                done = True
                return
            lease = hold.lease
            lease.released = True
            handed = handoff.NOT_HANDED
            if lease.lost is None:
                handed = handoff.hand_over(self, lease.token)
            if handed.handed:
                replies = self._unlock_elsewhere(lease.token, handed.granted)
            else:
                replies = self._unlock(lease.token)
            handoff.released(self, lease)
            done = True
        finally:
            if not done:
                self._end_interrupted_release(hold, counted)
        if handed.handed:
            logger.debug(
                "Lock(%r) handed over by %s: fence %s", self.keys.lock, self.owner, lease.fence
            )
            if metrics.enabled:
                metrics.released(self.task_name, clock() - lease.sent_at)
        elif not handed.touched:  # else the takeover's undo freed it: nothing to report
            _report_release(self, lease, replies)

    def _unlock_elsewhere(self, token: str, granted: Sequence[int]) -> list[Reply | None]:
        """Release ``token`` on the nodes a takeover did not reach (none, usually).

        Waiting for no reply: those nodes are a minority (slow, down, or still held by
        someone else), and on each the release goes out behind the takeover, on the
        same connection.
        """
        requests = [
            None if i in granted else [self.kind.release_call(token)]
            for i in range(len(self.nodeset))
        ]
        if not any(requests):
            return []
        return self.nodeset.call(requests, per_node=True, decided=sent_only)

    def _end_interrupted_release(self, hold: Hold | None, counted: bool) -> None:
        """Finish a release that an exception cut short, wherever it stopped."""
        if hold is None:  # stopped before it found the hold (or there was none)
            hold = self._holds.live()
            if hold is None:
                return
        if not counted:
            hold.count -= 1
        if hold.count > 0:
            return
        lease = hold.lease
        lease.released = True
        handoff.released(self, lease)

        def failed() -> None:
            logger.warning(
                "Lock(%r): an interrupted release could not reach the nodes; "
                "the lock expires within %.1fs",
                self.keys.lock,
                max(0.0, lease.deadline - clock()),
                exc_info=True,
            )

        _undo_surely(lambda: self._unlock(lease.token), failed)

    def extend(self) -> float:
        """Renew the lease now, as the watchdog would.

        Returns the lease left, in seconds. Raises :class:`LockNotOwned` if this
        object does not hold the lock, :class:`LockLost` if Redis says it is gone,
        and :class:`NodeUnavailable` if too few nodes answered.
        """
        lease = self._holds.own(self.keys.lock, "extend").lease
        lease.check()
        sent_at = clock()
        return lease.extended(self.nodeset.call([renew_call([lease])]), sent_at)

    def check(self) -> None:
        """Raise :class:`LockLost` unless this object holds the lock and the lease is sure.

        Local and immediate (no round trip): the lease is in doubt once the local
        deadline minus the safety margin has passed without a confirmed renewal.
        """
        lease = self.lease
        if lease is None:
            raise LockLost(self.keys.lock, "never acquired", None)
        lease.check()

    def owned(self) -> bool:
        """True if this object holds the lock: a quorum of nodes has its token."""
        hold = self._holds.live()
        if hold is None:
            return False
        token = hold.lease.token
        replies = self.nodeset.call(self.kind.owned_calls(token))
        return _agreeing(replies, lambda values: self.kind.owns(values, token)) >= self.quorum

    def locked(self) -> bool:
        """True if a quorum of nodes says the lock is held, so that ``acquire`` would wait.

        Exclusive mode: any of its resources is held exclusively. Shared mode: the
        resource is held exclusively, or ``limit`` shares are taken.
        """
        replies = self.nodeset.call(self.kind.locked_calls())
        return _agreeing(replies, self.kind.held) >= self.quorum

    def inspect(self) -> list[dict[str, Any]]:
        """Each node's view of the lock: holder fields, ``pttl`` and the fence counter."""
        return [_view(reply) for reply in self.nodeset.call([INSPECT.on(self.keys)])]

    @property
    def key(self) -> str:
        """The Redis key of the lock (``<prefix>{<name>}``)."""
        return self.keys.lock

    @property
    def fence(self) -> int:
        """The fencing token of the current acquisition (larger than any before it).

        For a lock on several resources, the fence of the first one; use
        :attr:`fences` to guard writes to the others.

        After a release it is the last acquisition's fence (as :attr:`lease` is its
        lease); from a thread that never acquired, the only holding thread's.

        Raises:
            LockNotOwned: there is no acquisition to take a fence from (never
                acquired, or several threads did and this one is none of them). A
                write guarded by no fence is a bug: there is no ``None`` to pass on.
        """
        lease = self.lease
        if lease is None:
            raise LockNotOwned(self.key, "no fence: no acquisition of this thread's")
        return lease.fence

    @property
    def fences(self) -> dict[str, int]:
        """Each resource's fencing token for the current acquisition, by name."""
        lease = self.lease
        if lease is None:
            return {}
        return dict(zip(self.names, lease.fences, strict=True))

    def remaining(self) -> float:
        """Seconds of lease left by the local deadline; 0 when not held."""
        hold = self._holds.live()
        return 0.0 if hold is None else hold.lease.remaining()

    def __enter__(self) -> Redlock:
        self.acquire()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


def _undo_surely(send: Callable[[], object], failed: Callable[[], None]) -> None:
    """Send an undo; send it once more if a second exception cuts it short.

    The undo runs because of an exception (maybe asynchronous: a soft time limit, an
    abort); another may land while it is on the network. Cut short, the undo would
    leave the lock to its ttl, unrenewed and held by nobody. ``failed`` logs a node
    error: the original exception matters more, and the lease ends by itself.
    """
    try:
        send()
    except Exception:
        failed()
    except BaseException:
        try:
            send()
        except Exception:
            failed()
        raise


def _agreeing(replies: list[Reply | None], says: Callable[[list[Any]], bool]) -> int:
    """Nodes whose answer ``says`` yes to."""
    return sum(1 for reply in replies if reply is not None and reply.ok and says(reply.values))


def _view(reply: Reply | None) -> dict[str, Any]:
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


def _report_release(lock: Redlock, lease: Lease, replies: list[Reply | None]) -> None:
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
        len(lock.nodeset),
    )


def _warn_release(lock: Redlock, lease: Lease, codes: list[Any]) -> None:
    """Say why a release was not confirmed by a quorum, and what follows."""
    left = max(0.0, lease.deadline - clock())
    unanswered = len(lock.nodeset) - len(codes)
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
            len(lock.nodeset),
            left,
        )
    if unanswered and left > 0:
        logger.warning(
            "Lock(%r) release not confirmed by %d of %d nodes; there it expires within %.1fs",
            lock.keys.lock,
            unanswered,
            len(lock.nodeset),
            left,
        )
