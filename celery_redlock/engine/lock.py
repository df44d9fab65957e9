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

Ownership: a hold belongs to the thread (greenlet, under gevent) that acquired it,
as in Redisson and redis-py's ``thread_local`` locks. Each thread using one
``Redlock`` object has its own acquisition, token and fence; another thread using
the same object contends like any other owner, and can never release, extend or
renew a hold that is not its own. Without that, a late release by one thread
deletes another thread's lock::

    thread A: acquire(token=a) ... paused past the lease ...
    thread B:                          acquire(token=b): granted
    thread A:                                      release(): must not delete b

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
"""

from __future__ import annotations

import logging
import os
import random
import secrets
import socket
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from redis.exceptions import ResponseError

from .. import metrics
from ..exceptions import ConfigurationError, LockBusy, LockLost, LockNotOwned, NodeUnavailable
from ..nodes import Call, NodeSet, Reply
from ..nodes.cluster import is_cluster_url
from .keys import DEFAULT_PREFIX, LockKeys, lock_keys, release_keys
from .renewal import Lease, clock, get_renewer, lease_verdict, renew_call
from .scripts import (
    ACQUIRE,
    ACQUIRE_SHARED,
    FAIR_LEAVE,
    FENCE_SYNC,
    INSPECT,
    RELEASE,
    RELEASE_SHARED,
    AcquireStatus,
    FenceSyncStatus,
    ReleaseStatus,
    RenewStatus,
)
from .timing import MODES, Timing, check_kind
from .waiting import Subscription

__all__ = ["DEFAULT_URL", "MODES", "Redlock", "check_kind"]

logger = logging.getLogger("celery_redlock.lock")

DEFAULT_URL = "redis://localhost:6379/0"

#: Upper bound of the random pause between two attempts that failed without a
#: holder to wait for (split votes, unreachable nodes), as Redlock prescribes.
RETRY_DELAY = 0.2

#: Upper bound of the random pause after a split vote, per node: 10 ms x N.
SPLIT_BACKOFF = 0.002


_HOST = socket.gethostname()


class _Attempt:
    """What one acquisition attempt learned from the nodes."""

    __slots__ = ("busy_ttl", "errors", "fences", "granted", "holder")

    def __init__(self) -> None:
        self.granted: list[int] = []
        self.fences: list[tuple[int, ...]] = []  # per granting node, one per resource
        self.busy_ttl: list[float] = []
        self.holder: str | None = None
        self.errors: list[str] = []


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
        self.mode, self.limit, self.fair = check_kind(len(names), mode, limit, fair)
        self.names = tuple(names)
        self.name = names[0]
        self.resources: tuple[LockKeys, ...] = tuple(lock_keys(n, key_prefix) for n in names)
        self.keys = self.resources[0]
        self._acquire_keys = tuple(key for resource in self.resources for key in resource.resource)
        if self.fair:
            self._acquire_keys += self.keys.fair
        self.timing = timing or Timing.of(
            ttl, renew_interval, node_timeout, drift_factor, source=""
        )
        if nodes is None:
            nodes = [DEFAULT_URL]
        self.nodeset = NodeSet.get(nodes, timeout=self.timing.node_timeout)
        if len(self.resources) > 1 and any(is_cluster_url(n.url) for n in self.nodeset.nodes):
            raise ConfigurationError(
                f"a lock on several resources ({list(self.names)!r}) cannot use a Redis Cluster "
                "node: each resource's keys hash to a slot of their own, and one script "
                "cannot take keys in several slots; use independent nodes, or one resource"
            )
        self.quorum = _quorum(len(self.nodeset), self.limit)
        self.auto_renew = auto_renew
        self.on_lost = on_lost
        self.min_replicas = min_replicas
        self.task_id = task_id
        self.task_name = task_name
        # thread ident -> that thread's hold (or its last one, kept for ``fence``).
        # Each thread reads and writes its own entry only; the dict operations are
        # atomic, so no lock is held that an asynchronous exception could leave taken.
        self._holds: dict[int, _Hold] = {}
        self._finalizer: weakref.finalize[..., Redlock] | None = None

    def __repr__(self) -> str:
        kind = "" if self.mode == "exclusive" else f" {self.mode}"
        if self.limit:
            kind += f" limit={self.limit}"
        names = self.keys.lock if len(self.resources) == 1 else [k.lock for k in self.resources]
        return f"<Redlock{kind} {names!r} on {len(self.nodeset)} node(s) fence={self.fence}>"

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
        waiter = _Waiter(blocking, self.fair, len(self.nodeset))
        subscription: Subscription | None = None
        acquired = settled = False
        try:
            while True:
                attempt = self._attempt(waiter)
                if attempt is None:
                    acquired = settled = True
                    if metrics.enabled:
                        metrics.acquired(self.task_name, clock() - started)
                    if subscription is not None and self.mode == "shared":
                        subscription.pass_on()  # a share does not exclude the next waiter
                    return True
                if len(attempt.errors) > len(self.nodeset) - self.quorum:
                    # Too many nodes failed for any quorum: waiting would hide a
                    # Redis outage behind a lock that looks busy.
                    settled = True  # the attempt undid its part
                    raise NodeUnavailable(self.keys.lock, attempt.errors)
                if not blocking or (give_up is not None and clock() >= give_up):
                    settled = True
                    if metrics.enabled:
                        metrics.busy(self.task_name)
                    return False
                left = None if give_up is None else give_up - clock()
                if attempt.granted:
                    # A split vote: nobody won and every contender is undoing its part,
                    # which announces releases that would wake us all again at once.
                    # Step back a random moment, as Redlock prescribes, and ignore the
                    # wake-ups our own undo caused.
                    pause = random.uniform(0, SPLIT_BACKOFF * len(self.nodeset))
                    time.sleep(pause if left is None else max(0.0, min(pause, left)))
                    if subscription is not None:
                        subscription.event.clear()
                    continue
                if attempt.busy_ttl:
                    if subscription is None:
                        subscription = Subscription(
                            self.nodeset.nodes,
                            self.keys.channel,
                            confirm_timeout=self.timing.node_timeout,
                            token=waiter.token if self.fair else None,
                        )
                        continue  # retry once subscribed, so no release is missed
                    # TTL fallback: an expiry publishes nothing. A queued (fair) waiter
                    # or a writer waiting for shared holders also comes back before its
                    # mark on the nodes expires, to renew it.
                    pause = min(attempt.busy_ttl) + random.uniform(0, 0.01)
                    if self.fair or self.mode == "exclusive":
                        pause = min(pause, self.timing.renew_interval)
                    subscription.wait(pause if left is None else min(pause, left))
                else:
                    pause = random.uniform(0, RETRY_DELAY)
                    time.sleep(pause if left is None else min(pause, left))
        finally:
            if not settled:
                # Left by an exception (maybe asynchronous: a soft time limit, our own
                # abort) at any point after the first request went out: whatever the
                # nodes granted must not outlive this call.
                self._abandon(waiter)
            if subscription is not None:
                subscription.close()
            if self.fair and blocking and not acquired:
                self._leave_queue(waiter.token)

    def try_acquire(self) -> None:
        """Take the lock now or raise :class:`LockBusy` naming the holder."""
        if self._reenter():
            return
        started = clock()
        waiter = _Waiter(False, self.fair, len(self.nodeset))
        settled = False
        try:
            attempt = self._attempt(waiter)
            settled = True
        finally:
            if not settled:
                self._abandon(waiter)
        if attempt is None:
            if metrics.enabled:
                metrics.acquired(self.task_name, clock() - started)
            return
        if attempt.busy_ttl:
            if metrics.enabled:
                metrics.busy(self.task_name)
            raise LockBusy(self.keys.lock, attempt.holder, min(attempt.busy_ttl))
        raise NodeUnavailable(self.keys.lock, attempt.errors)

    def _acquire_call(self, waiter: _Waiter) -> Call:
        """The script call of one attempt on every node."""
        ttl_ms = self.timing.ttl_ms
        holder = (self.task_id or "", _HOST, os.getpid(), f"{time.time():.3f}")
        if self.mode == "shared":
            task_id, host, pid, acquired_at = holder
            return Call(
                ACQUIRE_SHARED,
                self.keys.resource,
                (waiter.token, ttl_ms, self.limit or 0, task_id, host, pid, acquired_at,
                 self.task_name or ""),
            )  # fmt: skip
        fair = ""
        if self.fair:
            fair = str(ttl_ms if waiter.blocking else 0)
        return Call(
            ACQUIRE,
            self._acquire_keys,
            (waiter.token, ttl_ms, *holder, self.task_name or "", "1" if waiter.blocking else "",
             fair, waiter.arrival),
        )  # fmt: skip

    def _leave_queue(self, token: str) -> None:
        """Give up a fair waiter's place (else it would hold up the queue for a TTL)."""
        self.nodeset.call([Call(FAIR_LEAVE, self.keys.fair_leave, (token,))])

    def _abandon(self, waiter: _Waiter) -> None:
        """Undo an acquisition interrupted by an exception, wherever it stopped."""
        hold = self._holds.get(threading.get_ident())
        if hold is not None and hold.lease.token == waiter.token:
            hold.lease.released = True  # first: the renewer must stop renewing it
            hold.count = 0
        if not waiter.sent:
            return
        try:
            self._unlock(waiter.token)
        except Exception:  # the original exception matters more; the lease ends by itself
            logger.warning(
                "Lock(%r): could not undo an interrupted acquisition; it expires within %.1fs",
                self.keys.lock,
                self.timing.ttl,
                exc_info=True,
            )

    def _attempt(self, waiter: _Waiter) -> _Attempt | None:
        """One acquisition attempt; None when it succeeded."""
        token = waiter.token
        calls = [self._acquire_call(waiter)]
        if self.min_replicas:
            calls.append(
                Call.command(
                    "WAIT", self.min_replicas, max(1, round(self.timing.node_timeout * 1000))
                )
            )
        nodeset = self.nodeset
        n, quorum = len(nodeset), self.quorum
        attempt = _Attempt()

        def decided(replies: list[Reply | None]) -> bool:
            yes = no = 0
            for reply in replies:
                if reply is not None:
                    if self._granted(reply) is not None:
                        yes += 1
                    else:
                        no += 1
            return yes >= quorum or no > n - quorum

        sent_at = clock()
        waiter.sent = True
        replies = nodeset.call(calls, timeout=self._budget(), decided=decided if n > 1 else None)
        elapsed = clock() - sent_at
        for i, reply in enumerate(replies):
            if reply is None:
                continue
            fences = self._granted(reply)
            if fences is not None:
                attempt.granted.append(i)
                attempt.fences.append(fences)
            elif reply.error is not None:
                attempt.errors.append(reply.describe_error())
            else:
                self._note_refusal(reply, attempt)

        validity = self.timing.ttl - elapsed - self.timing.drift
        if len(attempt.granted) >= quorum and validity > 0:
            # Per resource, the largest fence among the granting nodes.
            fences = tuple(max(column) for column in zip(*attempt.fences, strict=True))
            agreed = sum(1 for node_fences in attempt.fences if node_fences == fences)
            if (agreed >= quorum or self._sync_fence(token, fences, attempt)) and self._won(
                token, fences, sent_at, len(attempt.granted)
            ):
                return None
        if not all(_is_busy(reply) for reply in replies):
            # Undo everywhere, including nodes that did not answer (they may have
            # granted it after all) and nodes whose replicas did not confirm.
            # The undo is queued behind the acquisition on the same connection of each
            # node, so it cannot overtake it; wait for every node that may be reachable
            # (the failure path may thus cost one more budget), not for failed ones.
            self._unlock(token, wait_for=[i for i, r in enumerate(replies) if r is None or r.ok])
        if len(attempt.granted) >= quorum:
            attempt.errors.append(f"lease spent while acquiring ({elapsed:.3f}s)")
        return attempt

    def _budget(self) -> float:
        """Time one acquisition fan-out may take.

        With ``min_replicas`` each node also runs WAIT for up to one node timeout,
        and Redis checks WAIT timeouts on its cron (every 100 ms at the default hz).
        """
        node_timeout = self.timing.node_timeout
        return node_timeout if not self.min_replicas else 2 * node_timeout + 0.1

    def _granted(self, reply: Reply) -> tuple[int, ...] | None:
        """The fences a node granted (one per resource), or None if it refused or failed."""
        if reply.error is not None:
            return None
        value = reply.values[0]
        if isinstance(value, ResponseError) or value[0] not in (
            AcquireStatus.ACQUIRED,
            AcquireStatus.REENTERED,
        ):
            return None
        if self.min_replicas and (
            isinstance(reply.values[1], ResponseError) or reply.values[1] < self.min_replicas
        ):
            return None
        return tuple(int(fence) for fence in value[1:])

    def _note_refusal(self, reply: Reply, attempt: _Attempt) -> None:
        value = reply.values[0]
        if isinstance(value, ResponseError):
            attempt.errors.append(f"{reply.node.safe_url}: {value}")
        elif value[0] == AcquireStatus.BUSY:
            attempt.busy_ttl.append(max(0, int(value[1])) / 1000)
            attempt.holder = attempt.holder or value[2] or None
        elif value[0] in (AcquireStatus.ACQUIRED, AcquireStatus.REENTERED):
            attempt.errors.append(
                f"{reply.node.safe_url}: only {reply.values[1]} of {self.min_replicas} "
                "replicas acknowledged"
            )
        else:
            raise ValueError(f"acquire.lua returned unknown code {value[0]!r}")

    def _sync_fence(self, token: str, fences: tuple[int, ...], attempt: _Attempt) -> bool:
        """Store the fences back on the granting nodes; True if a quorum holds them."""
        if self.mode == "shared":
            calls = [Call(FENCE_SYNC, self.keys.fence_sync, (token, fences[0], "s"))]
        else:
            calls = [
                Call(FENCE_SYNC, resource.fence_sync, (token, fence, ""))
                for resource, fence in zip(self.resources, fences, strict=True)
            ]
        requests: list[list[Call] | None] = [None] * len(self.nodeset)
        for i in attempt.granted:
            requests[i] = calls
        replies = self.nodeset.call(requests, per_node=True)
        synced = sum(
            1
            for r in replies
            if r is not None and r.ok and all(v == FenceSyncStatus.SYNCED for v in r.values)
        )
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

    def _won(self, token: str, fences: tuple[int, ...], sent_at: float, granted: int) -> bool:
        """Record the hold; False if the lease ran out before it could be recorded."""
        callbacks = [self.on_lost] if self.on_lost is not None else []
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
            entries=self._entries(),
            fences=fences,
            quorum=self.quorum,
        )
        if clock() >= lease.give_up_at:
            # Paused (or slowed) between the vote and here, e.g. by the fence sync:
            # a lease that is over by the local clock is not a hold.
            return False
        me = threading.get_ident()
        self._forget_dead_holds(me)
        self._holds[me] = _Hold(lease)
        if self.auto_renew:
            if self._finalizer is None:
                self._finalizer = weakref.finalize(
                    self,
                    _finalize,
                    self._holds,
                    self.keys.lock,
                    partial(_release_call, self.mode, self.fair, self.resources),
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

    def _forget_dead_holds(self, me: int) -> None:
        """Drop other threads' finished holds, so a long-lived object does not grow."""
        holds = self._holds
        if len(holds) > _KEEP_HOLDS:
            for ident, hold in list(holds.items()):
                if ident != me and (hold.count == 0 or hold.lease.released):
                    holds.pop(ident, None)

    def _entries(self) -> tuple[tuple[str, str], ...]:
        """What renewal extends for a hold: (key, kind) pairs, as renew_many.lua takes."""
        if self.mode == "shared":
            return ((self.keys.shared, "s"), (self.keys.holders, "d"))
        return tuple((resource.lock, "x") for resource in self.resources)

    def _release_call(self, token: str) -> Call:
        return _release_call(self.mode, self.fair, self.resources, token)

    def _unlock(self, token: str, wait_for: Sequence[int] | None = None) -> list[Reply | None]:
        """Release ``token`` on every node; wait for the replies of ``wait_for`` (default all)."""

        def decided(replies: list[Reply | None]) -> bool:
            return all(replies[i] is not None for i in wait_for)  # type: ignore[union-attr]

        return self.nodeset.call(
            [self._release_call(token)],
            decided=None if wait_for is None else decided,
        )

    # -- holding -----------------------------------------------------------------

    def _hold(self) -> _Hold | None:
        """The calling thread's hold, if it has one in this process."""
        hold = self._holds.get(threading.get_ident())
        if hold is None or hold.count == 0 or hold.lease.released:
            return None
        return hold if hold.lease.pid == os.getpid() else None

    def _reenter(self) -> bool:
        """Count one more hold if this thread holds the lock on a lease still valid.

        A hold whose lease has run out by the local deadline (not renewed, or lost)
        is dropped instead: the caller then makes a real acquisition.
        """
        hold = self._hold()
        if hold is None:
            return False
        lease = hold.lease
        if lease.lost is None and clock() < lease.give_up_at:
            hold.count += 1
            return True
        # Over: stop renewing it and free whatever may be left of it on the nodes
        # (within the drift allowance it can still be there, under our old token).
        lease.released = True
        hold.count = 0
        self._unlock(lease.token)
        return False

    @property
    def lease(self) -> Lease | None:
        """The calling thread's current (or last) lease on this lock.

        From a thread that never acquired this object (a callback, a helper thread),
        the lease of the only thread that did; ``None`` if several did.
        """
        hold = self._holds.get(threading.get_ident())
        if hold is None:
            holds = list(self._holds.values())
            hold = holds[0] if len(holds) == 1 else None
        return None if hold is None else hold.lease

    def _own_hold(self, action: str) -> _Hold:
        hold = self._holds.get(threading.get_ident())
        if hold is None or hold.count == 0 or hold.lease.released:
            others = any(
                h.count and not h.lease.released
                for ident, h in list(self._holds.items())
                if ident != threading.get_ident()
            )
            why = (
                "held by another thread of this process; a hold belongs to the thread that "
                "acquired it"
                if others
                else "this thread does not hold it"
            )
            raise LockNotOwned(self.keys.lock, f"cannot {action}: {why}")
        if hold.lease.pid != os.getpid():
            raise LockNotOwned(
                self.keys.lock,
                f"cannot {action}: acquired by process {hold.lease.pid}, and a forked child "
                "does not hold its parent's locks",
            )
        return hold

    def release(self) -> None:
        """Release the calling thread's hold (its outermost release frees the lock).

        Only this acquisition's token is deleted; if the lease was lost and someone
        else holds the lock now, their lock is left alone. Raises
        :class:`LockNotOwned` if the calling thread does not hold the lock. A release
        interrupted by an exception (a soft time limit, an abort) still ends the hold:
        the exception propagates, and the lock is not renewed any more.
        """
        hold: _Hold | None = None
        counted = done = False
        try:
            hold = self._own_hold("release")
            hold.count -= 1
            counted = True
            if hold.count:
                done = True
                return
            lease = hold.lease
            lease.released = True
            replies = self._unlock(lease.token)
            done = True
        finally:
            if not done:
                self._end_interrupted_release(hold, counted)
        if metrics.enabled and lease.lost is None:
            metrics.released(self.task_name, clock() - lease.sent_at)
        codes = [r.values[0] for r in replies if r is not None and r.ok]
        released = codes.count(ReleaseStatus.RELEASED)
        if lease.lost is None and released < self.quorum:
            self._warn_release(lease, codes)
        logger.debug(
            "Lock(%r) released by %s: fence %s, %d of %d nodes",
            self.keys.lock,
            self.owner,
            lease.fence,
            released,
            len(self.nodeset),
        )

    def _end_interrupted_release(self, hold: _Hold | None, counted: bool) -> None:
        """Finish a release that an exception cut short, wherever it stopped."""
        if hold is None:  # stopped before it found the hold (or there was none)
            hold = self._holds.get(threading.get_ident())
            if hold is None or hold.count == 0 or hold.lease.released:
                return
            if hold.lease.pid != os.getpid():
                return
        if not counted:
            hold.count -= 1
        if hold.count > 0:
            return
        lease = hold.lease
        lease.released = True
        try:
            self._unlock(lease.token)
        except Exception:  # the original exception matters more; the lease ends by itself
            logger.warning(
                "Lock(%r): an interrupted release could not reach the nodes; "
                "the lock expires within %.1fs",
                self.keys.lock,
                max(0.0, lease.deadline - clock()),
                exc_info=True,
            )

    def _warn_release(self, lease: Lease, codes: list[Any]) -> None:
        """Say why a release was not confirmed by a quorum, and what follows."""
        left = max(0.0, lease.deadline - clock())
        unanswered = len(self.nodeset) - len(codes)
        if codes.count(ReleaseStatus.TAKEN) or codes.count(ReleaseStatus.GONE):
            if left <= 0:
                return  # the lease had simply run out
            logger.error(
                "Lock(%r) was no longer held by %s at release (fence %s): gone on %d and "
                "held by another owner on %d of %d nodes, %.1fs before its local deadline; "
                "the other owner's lock was left alone",
                self.keys.lock,
                self.owner,
                lease.fence,
                codes.count(ReleaseStatus.GONE),
                codes.count(ReleaseStatus.TAKEN),
                len(self.nodeset),
                left,
            )
        if unanswered and left > 0:
            logger.warning(
                "Lock(%r) release not confirmed by %d of %d nodes; there it expires within %.1fs",
                self.keys.lock,
                unanswered,
                len(self.nodeset),
                left,
            )

    def extend(self) -> float:
        """Renew the lease now, as the watchdog would.

        Returns the lease left, in seconds. Raises :class:`LockNotOwned` if this
        object does not hold the lock, :class:`LockLost` if Redis says it is gone,
        and :class:`NodeUnavailable` if too few nodes answered.
        """
        lease = self._own_hold("extend").lease
        lease.check()
        sent_at = clock()
        replies = self.nodeset.call([renew_call([lease])])
        verdicts = [lease_verdict(reply, 0, len(lease.entries)) for reply in replies]
        renewed = sum(1 for code, _ in verdicts if code == RenewStatus.RENEWED)
        refused = sum(1 for code, _ in verdicts if code is not None and code != RenewStatus.RENEWED)
        if renewed >= self.quorum:
            lease.renewed(sent_at, clock())
            lease.check()
            return lease.remaining()
        if refused > len(self.nodeset) - self.quorum:
            lease.mark_lost("the key expired, was deleted or is held by another owner")
            lease.check()
        raise NodeUnavailable(self.keys.lock, [why for code, why in verdicts if code is None])

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
        hold = self._hold()
        if hold is None:
            return False
        lease = hold.lease
        if self.mode == "shared":
            calls = [Call.command("ZSCORE", self.keys.shared, lease.token)]
        else:
            calls = [Call.command("HGET", resource.lock, "token") for resource in self.resources]
        holding = 0
        for reply in self.nodeset.call(calls):
            if reply is not None and reply.ok:
                if self.mode == "shared":
                    holding += reply.values[0] is not None
                else:
                    holding += all(value == lease.token for value in reply.values)
        return holding >= self.quorum

    def locked(self) -> bool:
        """True if a quorum of nodes says the lock is held, so that ``acquire`` would wait.

        Exclusive mode: any of its resources is held exclusively. Shared mode: the
        resource is held exclusively, or ``limit`` shares are taken.
        """
        if self.mode == "shared":
            calls = [
                Call.command("EXISTS", self.keys.lock),
                Call.command("ZCOUNT", self.keys.shared, "-inf", "+inf"),
            ]
        else:
            calls = [Call.command("EXISTS", *(resource.lock for resource in self.resources))]
        held = 0
        for reply in self.nodeset.call(calls):
            if reply is None or not reply.ok:
                continue
            if self.mode == "shared":
                held += reply.values[0] > 0 or bool(self.limit and reply.values[1] >= self.limit)
            else:
                held += reply.values[0] > 0
        return held >= self.quorum

    def inspect(self) -> list[dict[str, Any]]:
        """Each node's view of the lock: holder fields, ``pttl`` and the fence counter."""
        views = []
        for reply in self.nodeset.call([Call(INSPECT, self.keys.inspect)]):
            if reply is None or not reply.ok or isinstance(reply.values[0], ResponseError):
                error = reply.describe_error() if reply is not None and reply.error else "no reply"
                views.append({"node": reply.node.safe_url if reply else None, "error": error})
                continue
            value = reply.values[0]
            views.append(
                {
                    "node": reply.node.safe_url,
                    "pttl": value[0],
                    "fence_counter": value[1],
                    **_fields(value[2:]),
                }
            )
        return views

    @property
    def key(self) -> str:
        """The Redis key of the lock (``<prefix>{<name>}``)."""
        return self.keys.lock

    @property
    def fence(self) -> int | None:
        """The fencing token of the current acquisition (larger than any before it).

        For a lock on several resources, the fence of the first one; use
        :attr:`fences` to guard writes to the others.
        """
        lease = self.lease
        return None if lease is None else lease.fence

    @property
    def fences(self) -> dict[str, int]:
        """Each resource's fencing token for the current acquisition, by name."""
        lease = self.lease
        if lease is None:
            return {}
        return dict(zip(self.names, lease.fences, strict=True))

    def remaining(self) -> float:
        """Seconds of lease left by the local deadline; 0 when not held."""
        hold = self._hold()
        return 0.0 if hold is None else hold.lease.remaining()

    def __enter__(self) -> Redlock:
        self.acquire()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


def _is_busy(reply: Reply | None) -> bool:
    """The node answered that someone else holds the lock (so nothing to undo there)."""
    return (
        reply is not None
        and reply.ok
        and not isinstance(reply.values[0], ResponseError)
        and reply.values[0][0] == AcquireStatus.BUSY
    )


def _fields(flat: Sequence[Any]) -> dict[str, Any]:
    return dict(zip(flat[::2], flat[1::2], strict=True))


class _Hold:
    """One thread's acquisition of a lock: its lease and its reentry count."""

    __slots__ = ("count", "lease")

    def __init__(self, lease: Lease) -> None:
        self.lease = lease
        self.count = 1


#: Finished holds of other threads kept per lock object before they are pruned.
_KEEP_HOLDS = 32


def _finalize(holds: dict[int, _Hold], name: str, release_call: Callable[[str], Call]) -> None:
    """A held lock object was garbage-collected: stop renewing it and release it.

    Runs in whatever thread the collector ran in, maybe inside another lock's call:
    it only marks the leases released and hands the network work to the renewer.
    """
    for hold in list(holds.values()):
        lease = hold.lease
        if hold.count and lease.lost is None and not lease.released and lease.pid == os.getpid():
            if not lease.renewing:
                continue  # auto_renew=False: the lease runs out by itself
            lease.released = True
            get_renewer().release_later(lease.nodeset, release_call(lease.token))
            message = (
                f"Lock({name}) was garbage-collected while held by {lease.owner}: released. "
                "Release locks explicitly (a with block), or keep a reference while held."
            )
            # Python shows ResourceWarning only in development mode: log it as well, so
            # that a production worker says why its lock ended early.
            logger.warning(message)
            warnings.warn(message, ResourceWarning, stacklevel=2)


class _Waiter:
    """One acquire call's identity across its attempts (a fair waiter keeps its place)."""

    __slots__ = ("arrival", "blocking", "sent", "token")

    def __init__(self, blocking: bool, fair: bool, nodes: int) -> None:
        self.token = secrets.token_hex(16)
        self.blocking = blocking
        self.sent = False  # a request with this token went out
        # One node numbers arrivals itself; several must agree on the order, so the
        # waiter stamps its arrival (clocks of different hosts order it roughly).
        self.arrival = f"{time.time() * 1000:.3f}" if fair and nodes > 1 else ""


def _quorum(nodes: int, limit: int | None) -> int:
    """Nodes that must grant a hold: a majority, or more for a limit above 1.

    A majority keeps two exclusive holders apart (two majorities intersect), but
    not ``limit + 1`` holders of ``limit`` slots: with 3 nodes and 2 slots, three
    holders can each win 2 nodes while every node admits only 2 of them (measured
    by ``tests/unit/engine/test_lock_kinds.py``). ``limit + 1`` holds on ``q`` nodes each need
    more than the ``limit * N`` admissions the nodes have, so ``q > limit*N/(limit+1)``.
    """
    if not limit or limit == 1:
        return nodes // 2 + 1
    return limit * nodes // (limit + 1) + 1


def _release_call(mode: str, fair: bool, resources: Sequence[LockKeys], token: str) -> Call:
    """The script call that releases ``token``'s hold (a function: finalizers use it)."""
    keys = resources[0]
    if mode == "shared":
        return Call(RELEASE_SHARED, keys.release_shared, (token,))
    if fair:
        return Call(RELEASE, release_keys(resources, fair=True), (token, "fair"))
    return Call(RELEASE, release_keys(resources), (token,))
