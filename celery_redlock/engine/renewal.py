"""The watchdog: one renewer per process renews every lease it holds.

A thread per lock (python-redis-lock) costs a thread and a round trip per lock per
renewal. Here one thread keeps a heap of leases ordered by when they are next due;
at each tick it takes every lease that is due (or nearly), and sends one
``renew_many`` script call per node per chunk of :data:`CHUNK` keys. The number of
threads never grows with the number of locks.

For each lease the tick decides, from the nodes' answers:

* a quorum renewed it: the local deadline moves to *send time + ttl - drift*;
* enough nodes say the key is gone or someone else's that no quorum can renew it:
  the lease is **lost at once**;
* otherwise (timeouts, connection errors) it is retried soon, until the local
  deadline minus a margin; past that it is **lost**, before Redis could let anyone
  else in.

A loss is logged at ERROR and handed to the lease's callbacks; it is never silent.

Fork safety: a forked child gets a fresh, empty renewer of its own (started on first
use). It cannot renew its parent's leases, which stay the parent's responsibility.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import os
import select
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from redis.exceptions import ResponseError

from .. import metrics
from ..exceptions import LockLost
from ..nodes import Call
from .scripts import RENEW_MANY, RenewStatus
from .threads import START_GRACE, start_daemon

if TYPE_CHECKING:
    from ..nodes import NodeSet, Reply
    from .keys import LockKeys
    from .timing import Timing

__all__ = ["CHUNK", "Lease", "Renewer", "clock", "get_renewer", "lease_verdict", "renew_call"]

logger = logging.getLogger("celery_redlock.renewal")

#: Keys renewed by one script call. Large enough that 1,000 locks cost one call per
#: node, small enough that one call does not block Redis for long (~4 ms).
CHUNK = 1000

#: Extra time allowed per additional chunk in one tick: 1,000 renewals take ~8 ms of
#: server time on a 2-core machine; 20 ms leaves room for a busy server.
CHUNK_BUDGET = 0.02

#: Leases due within this share of their renewal interval ride along with the tick.
COALESCE = 0.1


def _boottime() -> float:
    return time.clock_gettime(time.CLOCK_BOOTTIME)


#: The clock of lease deadlines: like ``time.monotonic`` (never stepped by NTP or an
#: operator), but on Linux it keeps counting while the machine is suspended, so a host
#: that wakes from suspend knows its leases ran out. Elsewhere, ``time.monotonic``.
clock = _boottime if hasattr(time, "CLOCK_BOOTTIME") else time.monotonic


class Lease:
    """The state of one acquisition, shared by its lock, the renewer and callbacks.

    The deadline is local and monotonic: the time the granting request was *sent*,
    plus the lease, minus the drift allowance. Redis cannot have let anyone else in
    before it, whatever the network did to the reply.
    """

    __slots__ = (
        "_lock",
        "deadline",
        "entries",
        "fence",
        "fences",
        "keys",
        "lost",
        "nodeset",
        "on_lost",
        "owner",
        "pid",
        "quorum",
        "released",
        "renewing",
        "sent_at",
        "task_name",
        "timing",
        "token",
    )

    def __init__(
        self,
        keys: LockKeys,
        token: str,
        fence: int,
        nodeset: NodeSet,
        timing: Timing,
        sent_at: float,
        on_lost: list[Callable[[LockLost], object]] | None = None,
        *,
        owner: str = "-",
        task_name: str | None = None,
        entries: tuple[tuple[str, str], ...] | None = None,
        fences: tuple[int, ...] | None = None,
        quorum: int | None = None,
    ) -> None:
        self.keys = keys
        #: What each renewal extends: (key, kind) pairs as ``renew_many.lua`` takes
        #: them; several for a lock on several resources, two for a share.
        self.entries = entries or ((keys.lock, "x"),)
        self.token = token
        self.fence = fence
        self.fences = fences or (fence,)
        #: Nodes that must confirm a renewal (more than a majority for a limit > 1).
        self.quorum = quorum or nodeset.quorum
        self.nodeset = nodeset
        self.timing = timing
        self.sent_at = sent_at
        self.deadline = sent_at + timing.ttl - timing.drift
        self.owner = owner
        self.task_name = task_name
        self.on_lost = list(on_lost or ())
        self.lost: LockLost | None = None
        self.released = False
        #: Handed to the renewer (``auto_renew``).
        self.renewing = False
        self.pid = os.getpid()
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"<Lease {self.keys.lock} fence={self.fence} remaining={self.remaining():.3f}>"

    @property
    def give_up_at(self) -> float:
        """When an unconfirmed lease counts as lost: the deadline minus the margin."""
        return self.deadline - self.timing.margin

    def remaining(self) -> float:
        """Seconds of lease left by the local deadline (0 once lost or released)."""
        if self.lost is not None or self.released or self.pid != os.getpid():
            return 0.0
        return max(0.0, self.deadline - clock())

    def renewed(self, sent_at: float, read_at: float) -> bool:
        """A quorum confirmed, at ``read_at``, a renewal sent at ``sent_at``.

        The confirmation is judged when it is read. If the holder was paused between
        sending and reading (SIGSTOP, a VM pause, a stop-the-world GC), the renewed
        lease may already have run out by the local clock: someone else may hold the
        lock by now, so the lease is lost at once rather than at the next renewal.
        Returns True if the lease is still held.
        """
        deadline = max(self.deadline, sent_at + self.timing.ttl - self.timing.drift)
        if read_at >= deadline - self.timing.margin:
            self.mark_lost(
                f"renewal confirmed {read_at - sent_at:.3f}s after it was sent, "
                "too late: the lease may have ended meanwhile"
            )
            return False
        self.deadline = deadline
        return True

    def check(self) -> None:
        """Raise :class:`LockLost` unless the lease is held and not in doubt."""
        if self.pid != os.getpid():
            raise LockLost(
                self.keys.lock,
                f"acquired by process {self.pid}; a forked child does not hold its parent's locks",
                self.fence,
            )
        if self.lost is None and not self.released and clock() >= self.give_up_at:
            self.mark_lost("renewal not confirmed before the lease deadline")
        if self.lost is not None:
            raise self.lost
        if self.released:
            raise LockLost(self.keys.lock, "released", self.fence)

    def mark_lost(self, reason: str) -> bool:
        """Record the loss once, log it and run the callbacks; False if already known."""
        with self._lock:
            if self.lost is not None or self.released:
                return False
            self.lost = LockLost(self.keys.lock, reason, self.fence)
        logger.error(
            "Lock(%r) held by %s lost: %s (fence %s, %d node(s))",
            self.keys.lock,
            self.owner,
            reason,
            self.fence,
            len(self.nodeset),
        )
        if metrics.enabled:
            metrics.lost(self.task_name)
        for callback in self.on_lost:
            try:
                callback(self.lost)
            except Exception:
                logger.exception("Lock(%r) on_lost callback %r failed", self.keys.lock, callback)
        return True


class Renewer:
    """Renews the leases of one process in batches, from one background thread.

    Only the renewer thread touches its heap. Other threads hand it leases through
    a deque and wake it through a pipe, both single C calls: nothing they do can
    leave a lock or condition held that the renewer needs. Task threads receive
    asynchronous exceptions (a soft time limit, our own abort, Ctrl-C) at arbitrary
    points; with a ``threading.Condition`` shared with them, one landing inside
    ``notify()`` or ``Condition.__enter__`` left the renewer blocked for ever and
    every lease of the process expired without a word (issue 12, item 4).
    """

    #: Longest sleep of the renewer thread: a wake-up lost to an exception raised
    #: between queueing a lease and writing the pipe costs at most this much.
    MAX_SLEEP = 1.0

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Lease]] = []
        self._inbox: deque[tuple[float, Lease]] = deque()
        self._releases: deque[tuple[NodeSet, Call]] = deque()
        self._seq = itertools.count()
        #: The thread running the loop, once it runs (it sets this itself).
        self._thread: threading.Thread | None = None
        self._ident: int | None = None
        self._start_lock = threading.Lock()
        self._started_at = -START_GRACE
        # Held for ever by the one thread that runs the loop: a second thread started
        # by a racing start() finds it taken and exits at once.
        self._run_lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self.pid = os.getpid()
        #: Ticks run and script calls sent, for tests and metrics.
        self.ticks = 0
        self.calls = 0
        #: Leases are out of the heap in a tick being renewed (set by the renewer thread).
        self._ticking = False

    def add(self, lease: Lease) -> None:
        """Start renewing ``lease``; stop by setting ``released`` or on loss."""
        lease.renewing = True
        self._schedule(lease, clock() + lease.timing.renew_interval)
        self.start()

    def release_later(self, nodeset: NodeSet, call: Call) -> None:
        """Send ``call`` (a release) from the renewer thread, best effort.

        For finalizers, which may run inside another call to the same nodes.
        """
        try:
            self._releases.append((nodeset, call))
        finally:
            self._wake()
        self.start()

    def _send_releases(self) -> None:
        while self._releases:
            nodeset, call = self._releases.popleft()
            try:
                nodeset.call([call])
            except Exception:
                logger.warning("releasing a garbage-collected lock failed", exc_info=True)

    def start(self) -> None:
        """Start the renewer thread, if it is not running (or starting) yet."""
        if self._run_lock.locked():
            return
        with self._start_lock:
            now = clock()
            if self._run_lock.locked() or now < self._started_at + START_GRACE:
                return
            self._started_at = now
            start_daemon(self._run, "celery_redlock-renewer")

    def __len__(self) -> int:
        held = list(self._heap) + [(0.0, 0, lease) for _, lease in list(self._inbox)]
        return len({id(lease) for _, _, lease in held if _alive(lease)})

    def _schedule(self, lease: Lease, due: float) -> None:
        """Renew ``lease`` at ``due`` (any thread)."""
        try:
            self._inbox.append((due, lease))
        finally:
            self._wake()

    def _schedule_many(self, items: list[tuple[float, Lease]]) -> None:
        if not items:
            return
        if self._ident == threading.get_ident():
            for due, lease in items:
                heapq.heappush(self._heap, (due, next(self._seq), lease))
            return
        try:
            self._inbox.extend(items)
        finally:
            self._wake()

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._wake_w, b"\0")

    def _take_inbox(self) -> None:
        inbox, heap = self._inbox, self._heap
        while inbox:
            due, lease = inbox.popleft()
            heapq.heappush(heap, (due, next(self._seq), lease))

    def _sleep(self, timeout: float) -> None:
        select.select([self._wake_r], [], [], max(0.0, min(timeout, self.MAX_SLEEP)))
        with contextlib.suppress(BlockingIOError, OSError):
            while os.read(self._wake_r, 4096):
                pass

    def _take_due(self) -> tuple[list[Lease], float]:
        """Wait for due leases; return them and when the first of them was due."""
        heap = self._heap
        while True:
            self._send_releases()
            self._take_inbox()
            while heap and not _alive(heap[0][2]):
                heapq.heappop(heap)
            if not heap:
                self._sleep(self.MAX_SLEEP)
                continue
            due, _, lease = heap[0]
            wait = due - clock()
            if wait > 0:
                self._sleep(wait)
                continue
            now, first_due = clock(), due
            self._ticking = True  # before the leases leave the heap: see abandon_all()
            taken = []
            while heap:
                due, _, lease = heap[0]
                if due > now + COALESCE * lease.timing.renew_interval:
                    break
                heapq.heappop(heap)
                if _alive(lease):
                    taken.append(lease)
            if taken:
                return taken, first_due
            self._ticking = False

    def _run(self) -> None:
        if not self._run_lock.acquire(blocking=False):
            return  # another thread runs this renewer already
        self._ident = threading.get_ident()
        self._thread = threading.current_thread()
        while True:
            leases: list[Lease] = []
            try:
                leases, due = self._take_due()
                self.renew(leases, due)
            except Exception as exc:  # never let the watchdog die; retry these leases soon
                logger.exception("renewer tick failed")
                now = clock()
                for lease in leases:
                    self._retry_or_lose(lease, now, f"renewer error: {exc!r}")
            finally:
                self._ticking = False

    def abandon_all(self) -> bool:
        """Stop renewing every lease, silently; True once no tick is in flight.

        For test isolation: a lease one test leaves held must not be renewed, nor
        reported lost, during the next test (its keys expire on their own). Call until
        it returns True: a tick in flight puts its leases back when it ends.
        """
        held = [lease for _, _, lease in list(self._heap)]
        held += [lease for _, lease in list(self._inbox)]
        for lease in held:
            with lease._lock:  # mark_lost checks ``released`` under it
                lease.released = True
        return not self._ticking

    def renew(self, leases: list[Lease], due: float | None = None) -> None:
        """Renew ``leases`` now: one script call per node per chunk, per node set."""
        started = clock()
        by_nodeset: dict[int, list[Lease]] = {}
        for lease in leases:
            by_nodeset.setdefault(id(lease.nodeset), []).append(lease)
        try:
            for group in by_nodeset.values():
                self._renew_group(group)
        finally:
            # Counted once its calls are in: a reader never sees a tick without them.
            self.ticks += 1
        if metrics.enabled:
            metrics.tick(clock() - started, 0.0 if due is None else started - due)

    def _renew_group(self, leases: list[Lease]) -> None:
        nodeset = leases[0].nodeset
        # Entries (not leases) are chunked: a lease on several resources has several.
        entries = [(lease, entry) for lease in leases for entry in lease.entries]
        calls = [_renew_entries(entries[i : i + CHUNK]) for i in range(0, len(entries), CHUNK)]
        sent_at = clock()
        # Chunks go pipelined on one connection per node and the server runs them one
        # after another, so the budget grows with them (one budget for 50 chunks of a
        # 50,000-lock tick timed out every time).
        replies = nodeset.call(calls, timeout=nodeset.timeout + CHUNK_BUDGET * (len(calls) - 1))
        self.calls += len(calls) * sum(1 for r in replies if r is not None)
        # Judged now, when the replies are read: a pause between sending and reading
        # (SIGSTOP, a VM pause, a long GC) may have let the lease run out meanwhile.
        now = clock()
        n = len(nodeset)
        retried: list[str] = []
        again: list[tuple[float, Lease]] = []
        offset = 0
        for lease in leases:
            quorum = lease.quorum
            renewed = refused = 0
            errors = []
            for reply in replies:
                code, error = lease_verdict(reply, offset, len(lease.entries))
                if code == RenewStatus.RENEWED:
                    renewed += 1
                elif code in (RenewStatus.GONE, RenewStatus.TAKEN):
                    refused += 1
                else:
                    errors.append(error)
            offset += len(lease.entries)
            if lease.released:
                continue
            if renewed >= quorum:
                if lease.renewed(sent_at, now):
                    again.append((now + lease.timing.renew_interval, lease))
            elif refused > n - quorum:
                lease.mark_lost(
                    "the key expired, was deleted or is held by another owner"
                    if n == 1
                    else f"only {renewed} of {n} nodes still hold it (quorum {quorum})"
                )
            else:
                why = "; ".join(errors) or "no quorum"
                retry_at = self._retry_at(lease, now, why)
                if retry_at is not None:
                    again.append((retry_at, lease))
                    retried.append(why)
                    if metrics.enabled:
                        metrics.renew_failed(lease.task_name)
        self._schedule_many(again)
        if retried:
            # One line per tick, not per lock: 10,000 locks on a dead node are one event.
            logger.warning(
                "renewal of %d lock(s) failed, retrying before their deadlines: %s",
                len(retried),
                retried[0],
            )

    def _retry_at(self, lease: Lease, now: float, why: str) -> float | None:
        """When to retry a renewal, or None once past the give-up time (then lost)."""
        if now >= lease.give_up_at:
            lease.mark_lost(f"renewal not confirmed before the lease deadline ({why})")
            return None
        return min(now + lease.timing.renew_interval / 4, lease.give_up_at)

    def _retry_or_lose(self, lease: Lease, now: float, why: str) -> bool:
        """Schedule a prompt retry, or declare the loss once past the give-up time."""
        retry_at = self._retry_at(lease, now, why)
        if retry_at is None:
            return False
        self._schedule_many([(retry_at, lease)])
        return True

    def close(self) -> None:
        """Close the wake-up pipe (a forked child's copy of its parent's renewer)."""
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)


def _alive(lease: Lease) -> bool:
    return lease.lost is None and not lease.released


def lease_verdict(reply: Reply | None, offset: int, count: int) -> tuple[int | None, str]:
    """One node's verdict on a lease whose entries start at ``offset``, or (None, why not).

    ``reply`` answers renew_many calls of :data:`CHUNK` entries each; a lease is renewed
    on the node when every entry is, lost there when any is gone or taken.
    """
    if reply is None:
        return None, "no reply"
    if reply.error is not None:
        return None, reply.describe_error()
    chunk = offset // CHUNK
    for value in reply.values[chunk : (offset + count - 1) // CHUNK + 1]:
        if isinstance(value, ResponseError):
            return None, f"{reply.node.safe_url}: {value}"
    codes = [reply.values[(offset + k) // CHUNK][(offset + k) % CHUNK] for k in range(count)]
    for code in codes:
        if isinstance(code, ResponseError):  # one key's part of a call split per cluster slot
            return None, f"{reply.node.safe_url}: {code}"
    return _verdict(codes), ""


def _verdict(codes: list[int]) -> int:
    """A lease is renewed on a node when every entry is; lost there when any is not."""
    for code in codes:
        if code not in tuple(RenewStatus):
            raise ValueError(f"renew_many returned unknown code {code!r}")
    if all(code == RenewStatus.RENEWED for code in codes):
        return RenewStatus.RENEWED
    return RenewStatus.TAKEN if RenewStatus.TAKEN in codes else RenewStatus.GONE


def _renew_entries(entries: list[tuple[Lease, tuple[str, str]]]) -> Call:
    return Call(
        RENEW_MANY,
        tuple(key for _, (key, _) in entries),
        tuple(
            item
            for lease, (_, kind) in entries
            for item in (lease.token, lease.timing.ttl_ms, kind)
        ),
    )


def renew_call(leases: list[Lease]) -> Call:
    """One renew_many call for every entry of ``leases`` (at most :data:`CHUNK` entries)."""
    return _renew_entries([(lease, entry) for lease in leases for entry in lease.entries])


_renewer: Renewer | None = None
_renewer_lock = threading.Lock()


def get_renewer() -> Renewer:
    """The renewer of this process, created on first use."""
    global _renewer  # noqa: PLW0603
    renewer = _renewer
    if renewer is None or renewer.pid != os.getpid():
        with _renewer_lock:
            if _renewer is None or _renewer.pid != os.getpid():
                _renewer = Renewer()
            renewer = _renewer
    return renewer


def _after_fork_in_child() -> None:
    global _renewer, _renewer_lock  # noqa: PLW0603
    # The parent's renewer thread does not exist here, and its locks may be held
    # by the parent's other threads at fork time: start from nothing.
    if _renewer is not None:
        _renewer.close()
    _renewer = None
    _renewer_lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)
