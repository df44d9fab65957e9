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

Where the parts are: :mod:`.acquisition` holds one acquisition's steps without I/O
(vote, fence sync, record, undo, what to do after a lost attempt), which this module
and :mod:`.aio` both drive; :mod:`.kinds` builds what each kind of lock (exclusive,
fair, shared) sends and reads; :mod:`.vote` tallies an attempt; :mod:`.holds` keeps
the holds per thread; :mod:`.lease` is a lease and its deadline; :mod:`.renewal` the
watchdog; :mod:`.waiting` the release notifications; :mod:`.handoff` the handoff
between threads of this process. This module is the threaded driver: its fan-outs,
its waits between attempts (``_Acquiring``), the release, and the undo of a call an
exception interrupted. ``acquire`` and ``release`` each keep the ``try``/``finally``
that undoes what an exception (maybe asynchronous) interrupted beside the undo helpers
they call: split across modules, a gap between a call and its ``try`` is a place where
an exception leaves a hold behind (``tests/unit/engine/test_lock_handles.py`` injects
exceptions at random points to find one).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from ..base import metrics
from ..exceptions import ConfigurationError, LockLost, NodeUnavailable
from ..nodes import NodeSet, Reply
from ..nodes.cluster import is_cluster_url
from . import handoff
from .acquisition import Core, Send, Step, Steps, agreeing, bounded, node_view, report_release
from .handoff import Grant
from .holds import Hold, Holds
from .keys import DEFAULT_PREFIX
from .kinds import Waiter, kind_of
from .lease import Lease, clock, renew_call
from .scripts import INSPECT
from .timing import Timing
from .vote import Attempt, budget, sent_only
from .waiting import Subscription, subscribed

__all__ = ["DEFAULT_URL", "Redlock", "Step"]

logger = logging.getLogger("celery_redlock.lock")

DEFAULT_URL = "redis://localhost:6379/0"

T = TypeVar("T")


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
        timing: a validated :class:`~celery_redlock.engine.timing.Timing`, in place of
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
        names = _names(name)
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
        _check_cluster(self.names, self.nodeset)
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
        self._core = Core(
            self.kind,
            self.timing,
            self.nodeset,
            min_replicas=min_replicas,
            holds=self._holds,
            task_id=task_id,
            task_name=task_name,
            auto_renew=auto_renew,
        )

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

        A waiter that another process's release granted the lock to returns holding a
        short lease (at least half of :func:`~celery_redlock.engine.waiting.grant_window`
        left: 0.25 s with a ttl of 3 s or more), which the watchdog extends to ``ttl``
        halfway; call :meth:`extend` first if the section that follows may keep the
        watchdog thread from the GIL longer than that (``remaining()`` tells).
        """
        if self._reenter():
            return True
        run = _Acquiring(self, blocking, timeout)
        try:
            try:
                run.start()
                while True:
                    attempt = run.attempt()
                    if attempt is None:
                        run.won()
                        return True
                    step, pause = self._core.next_step(attempt, blocking, run.give_up, run.started)
                    if step is Step.UNAVAILABLE:
                        # The attempt undid its part; unanswered requests still need
                        # the abandon (in finish()).
                        run.settled = not run.waiter.in_doubt
                        raise NodeUnavailable(self.keys.lock, attempt.errors)
                    if step is Step.GIVE_UP:
                        run.settled = not run.waiter.in_doubt
                        return False
                    run.pause(step, pause)
            finally:
                run.finish()
        except BaseException:
            if run.acquired or not (run.settled or run.undone):
                # Landed after the hold was recorded (in finish(), say): acquire()
                # raises, so the caller will never release it. Or a second exception
                # landed before finish() was done with the undo. End it here.
                self._abandon(run.waiter)
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

    def _patience(self) -> float:
        """How long a waiter claimed by a releasing thread waits for its takeover."""
        return handoff.PATIENCE_BUDGETS * budget(self.timing.node_timeout, self.min_replicas)

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
        self._core.tried(attempt, started)

    def _abandon(self, waiter: Waiter) -> None:
        """Undo an acquisition interrupted by an exception, wherever it stopped."""
        if not self._core.end_abandoned(waiter):
            return
        calls = self._core.abandon_calls(waiter)
        _undo_surely(lambda: self.nodeset.call(calls), self._core.undo_failed)

    def _drive(self, steps: Steps[T]) -> T:
        """Run an acquisition's steps (:mod:`.acquisition`) with this thread's fan-outs."""
        try:
            send = next(steps)
            while True:
                send = steps.send(self._send(send))
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]

    def _send(self, send: Send) -> list[Reply | None]:
        return self.nodeset.call(
            send.calls,
            per_node=send.per_node,
            timeout=send.timeout,
            decided=send.decided,
            patient=send.patient,
        )

    def _attempt(self, waiter: Waiter) -> Attempt | None:
        """One acquisition attempt; None when it succeeded (and the hold is recorded)."""
        outcome = self._vote(waiter)
        if isinstance(outcome, Attempt):
            return outcome
        return self._record(outcome)

    def _record(self, grant: Grant) -> Attempt | None:
        """Record a granted acquisition as this thread's hold; None once recorded."""
        lease = self._core.record(grant, self.on_lost, self)
        if lease is not None:
            handoff.holding(self, lease)
            return None
        handoff.forget(self, grant)  # if it was a takeover: it will not be held
        return self._drive(self._core.undo(grant.token, grant.attempt, self.nodeset))

    def _vote(self, waiter: Waiter, predecessor: str = "") -> Grant | Attempt:
        """Ask the nodes for ``waiter``'s lock (:meth:`.acquisition.Core.vote`).

        ``predecessor``: a takeover by a releasing thread of this process
        (:mod:`.handoff`), which may run in that thread.
        """
        return self._drive(self._core.vote(waiter, self.nodeset, predecessor))

    @property
    def owner(self) -> str:
        """Who holds this object's acquisitions, for logs: ``task[task id]`` or ``-``."""
        return self._core.owner

    def _unlock(self, token: str) -> list[Reply | None]:
        """Release ``token`` on every node, waiting for a quorum's confirmation at most."""
        return self._send(self._core.release(token, self.nodeset))

    # -- holding -----------------------------------------------------------------

    def _reenter(self) -> bool:
        """Count one more hold if this thread holds the lock on a lease still valid.

        A hold whose lease has run out by the local deadline (not renewed, or lost)
        is dropped instead: the caller then makes a real acquisition.
        """
        token = self._core.reenter_or_end()
        if token is True or token is False:
            return token
        self._unlock(token)
        return False

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
                replies = self._unlock_elsewhere(lease.token, handed.settled)
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
            report_release(self._core, lease, replies)

    def _unlock_elsewhere(self, token: str, settled: Sequence[int]) -> list[Reply | None]:
        """Release ``token`` on the nodes that refused a takeover (none, usually).

        Waiting for no reply: those nodes are a minority (held by someone else there,
        or the process's turn over there). Where the takeover is still on its way, it
        removes the token itself when it lands (:class:`.handoff.Handed`).
        """
        requests = [
            None if i in settled else [self.kind.release_call(token)]
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
        self._core.check()

    def owned(self) -> bool:
        """True if this object holds the lock: a quorum of nodes has its token."""
        hold = self._holds.live()
        if hold is None:
            return False
        token = hold.lease.token
        replies = self.nodeset.call(self.kind.owned_calls(token))
        return agreeing(replies, lambda values: self.kind.owns(values, token)) >= self.quorum

    def locked(self) -> bool:
        """True if a quorum of nodes says the lock is held, so that ``acquire`` would wait.

        Exclusive mode: any of its resources is held exclusively. Shared mode: the
        resource is held exclusively, or ``limit`` shares are taken.
        """
        replies = self.nodeset.call(self.kind.locked_calls())
        return agreeing(replies, self.kind.held) >= self.quorum

    def inspect(self) -> list[dict[str, Any]]:
        """Each node's view of the lock: holder fields, ``pttl`` and the fence counter."""
        return [node_view(reply) for reply in self.nodeset.call([INSPECT.on(self.keys)])]

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
        return self._core.fence()

    @property
    def fences(self) -> dict[str, int]:
        """Each resource's fencing token for the current acquisition, by name."""
        lease = self.lease
        if lease is None:
            return {}
        return dict(zip(self.names, lease.fences, strict=True))

    def remaining(self) -> float:
        """Seconds of lease left by the local deadline; 0 when not held."""
        return self._core.remaining()

    def __enter__(self) -> Redlock:
        self.acquire()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


def _names(name: str | Sequence[str]) -> list[str]:
    """The resources a lock protects, from its ``name`` argument, checked."""
    names = [name] if isinstance(name, str) else list(dict.fromkeys(name))
    if not names or not all(isinstance(n, str) for n in names):
        raise ConfigurationError(
            f"a lock name must be a non-empty string or a sequence of them, got {name!r}"
        )
    return names


def _check_cluster(names: Sequence[str], nodeset: NodeSet) -> None:
    """A lock on several resources cannot use a Redis Cluster node."""
    if len(names) > 1 and any(is_cluster_url(n.url) for n in nodeset.nodes):
        raise ConfigurationError(
            f"a lock on several resources ({list(names)!r}) cannot use a Redis Cluster "
            "node: each resource's keys hash to a slot of their own, and one script "
            "cannot take keys in several slots; use independent nodes, or one resource"
        )


class _Acquiring:
    """One call of :meth:`Redlock.acquire`: its waiter, and how it waits between attempts.

    The attempts themselves are :class:`.acquisition.Core`'s; this is the threaded
    driver's side: the release subscription, and the offer to this process's releasing
    threads (:mod:`.handoff`). The flags say how far it got, for :meth:`finish` and for
    ``acquire``'s last resort against a second exception.
    """

    def __init__(self, lock: Redlock, blocking: bool, timeout: float | None) -> None:
        self.lock = lock
        self.blocking = blocking
        self.started = clock()
        self.give_up = None if timeout is None or not blocking else self.started + timeout
        self.waiter = lock.kind.new_waiter(blocking, len(lock.nodeset))
        self.subscription: Subscription | None = None
        self.offer: handoff.Offer | None = None
        self.handed: Grant | Attempt | None = None
        #: The hold is recorded / nothing is left to undo / the undo was done.
        self.acquired = self.settled = self.undone = False

    def start(self) -> None:
        """Before the first attempt: queue up behind a holder of this process, if any."""
        lock = self.lock
        if not self.blocking:
            return
        if handoff.held_here(lock) or subscribed(lock.nodeset.nodes, lock.keys.channel):
            # Another thread of this process holds it, so Redis could only say "busy":
            # queue up for its handoff without asking (attempt()). Or this process still
            # listens to the lock's channel (it waited for it a moment ago): register
            # first, and a refusal waits at once, with no retry once subscribed.
            self.subscription = lock._subscribe(self.waiter)

    def attempt(self) -> Attempt | None:
        """Take a handoff offered meanwhile, else ask the nodes; None once held.

        While another thread of this process holds the lock, a blocking waiter waits
        for that thread's handoff, whatever woke it: the nodes could only answer
        "busy", and a release announced meanwhile is a minority node's late news, or
        the holder's own release, after which the lock is no longer held here.
        """
        self.handed = self._take_offer()
        while self.handed is None and self._queue_here():
            self.handed = self._take_offer()
        if isinstance(self.handed, Grant):
            return self.lock._record(self.handed)  # handed over by a releasing thread
        if self._granted():
            return None  # granted by a release of another process
        # Nobody handed it over, or a takeover lost (the lock held by a third party, or
        # the process's turn over): ask the nodes ourselves. The takeover's wake-up may
        # have merged with a release's announcement to this waiter, which waiting on
        # its busy answer would then wait out, up to the fallback.
        return self.lock._attempt(self.waiter)

    def _granted(self) -> bool:
        """Hold the lock if releases granted it to this waiter's last attempt; True if held.

        See :meth:`.acquisition.Core.hold_granted`. Else the attempt that follows finds the
        grants held by this waiter's token, and counts them.
        """
        lock, subscription = self.lock, self.subscription
        if subscription is None or not subscription.grants:
            return False
        waiter = self.waiter
        grants = subscription.granted(waiter.token, waiter.attempt)
        lease = lock._core.hold_granted(waiter, grants, lock.on_lost, lock)
        if lease is None:
            return False
        handoff.holding(lock, lease)
        return True

    def _take_offer(self) -> Grant | Attempt | None:
        """Stop offering; what a releasing thread got for this waiter meanwhile, if any."""
        offer, self.offer = self.offer, None
        return None if offer is None else offer.withdraw(self.lock._patience())

    def _queue_here(self) -> bool:
        """Wait for the handoff of a holder of this process; False if none holds it.

        False too once the caller's timeout passed: its attempt then decides.
        """
        lock = self.lock
        if self.subscription is None:  # not blocking, or not waiting yet
            return False
        held = handoff.held_here(lock)
        if not held:
            return False
        pause = bounded(min(held, lock.timing.renew_interval), self.give_up)
        if pause <= 0:
            return False
        self.offer = handoff.offer(lock, self.waiter, self.subscription.event)
        self.subscription.wait(pause)
        return True

    def won(self) -> None:
        """The hold is recorded: count it, and let the next waiter of a share try."""
        self.acquired = self.settled = True
        if metrics.enabled:
            metrics.acquired(self.lock.task_name, clock() - self.started)
        if self.subscription is not None and self.lock.kind.admits_others:
            self.subscription.pass_on()  # a share does not exclude the next waiter

    def pause(self, step: Step, pause: float) -> None:
        """Wait as ``step`` says before the next attempt."""
        if step is Step.SPLIT:
            time.sleep(pause)
            if self.subscription is not None:
                self.subscription.clear()  # the wake-ups our own undo caused
        elif step is Step.WAIT:
            if self.subscription is None:
                # Retry at once once subscribed, so no release is missed.
                self.subscription = self.lock._subscribe(self.waiter)
                return
            self.offer = handoff.offer(self.lock, self.waiter, self.subscription.event)
            self.subscription.wait(pause)
        else:
            time.sleep(pause)

    def finish(self) -> None:
        """Leave, held or not: undo what an interrupted or given-up attempt left."""
        lock = self.lock
        if self.offer is not None:
            self.offer.abandon()
        if isinstance(self.handed, Grant) and not self.acquired:
            handoff.forget(lock, self.handed)
        if not self.settled:
            # Left by an exception (maybe asynchronous: a soft time limit, our own
            # abort) at any point after the first request went out, or given up with a
            # request unanswered: whatever the nodes granted, or will grant when a
            # request still on the way arrives, must not outlive this call.
            lock._abandon(self.waiter)
            self.undone = True
        if self.subscription is not None:
            self.subscription.close()
        if self.blocking and not self.acquired:
            leave = lock.kind.leave_call(self.waiter.token)
            if leave is not None:  # else a queued place holds others up for a ttl
                lock.nodeset.call([leave])


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
