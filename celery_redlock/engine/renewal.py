"""The watchdog: one renewer per process renews every lease it holds.

A thread per lock (python-redis-lock) costs a thread and a round trip per lock per
renewal. Here one thread keeps a heap of groups of leases ordered by when they are
next due; at each tick it takes every lease that is due (or nearly), and sends one
``renew_many`` script call per node per chunk of :data:`~.lease.CHUNK` keys. The number of
threads never grows with the number of locks. The leases a tick renews are due again
together, so they go back into the heap as one group per renewal interval: the heap's
work per tick does not grow with the number of locks, and a tick leaves no object per
lease behind for the garbage collector to go through.

For each lease the tick decides, from the nodes' answers:

* a quorum renewed it: the local deadline moves to *send time + ttl - drift*;
* enough nodes say the key is gone or someone else's that no quorum can renew it:
  the lease is **lost at once**;
* otherwise (timeouts, connection errors) it is retried soon, until the local
  deadline minus a margin; past that it is **lost**, before Redis could let anyone
  else in.

A loss is logged at ERROR and handed to the lease's callbacks; it is never silent.
The lease itself, its deadline arithmetic and the reading of one node's answer are
in :mod:`.lease`; this module is the thread, its heap and its wake-up pipe.

Fork safety: a forked child gets a fresh, empty renewer of its own (started on first
use). It cannot renew its parent's leases, which stay the parent's responsibility.

``Renewer`` is a little over 250 lines because its thread owns the heap alone: every
step that touches the heap (add, release, tick, loss, abandon) is a method of the one
object whose thread runs it, so that no caller ever takes a lock the thread holds.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import operator
import os
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from ..base import forksafe, metrics
from ..base.poll import readable
from .lease import Lease, clock, renew_chunks, renewed_everywhere
from .threads import START_GRACE, start_daemon

if TYPE_CHECKING:
    from ..nodes import Call, NodeSet, Reply

__all__ = ["CHUNK_BUDGET", "COALESCE", "Renewer", "get_renewer"]

logger = logging.getLogger("celery_redlock.renewal")

#: Called after a tick that started more than a quarter of its renewal interval late,
#: with its leases and how late (seconds): the Celery layer logs ``renewed_late`` events
#: (:mod:`celery_redlock.integration.events`). On the renewer's thread, after the
#: renewal: a hook must be quick and must not raise.
LATE_HOOKS: list[Callable[[Sequence[Lease], float], None]] = []

_nodeset = operator.attrgetter("nodeset")
_give_up_at = operator.attrgetter("give_up_at")

#: Extra time allowed per additional chunk in one tick: a chunk's renewals take ~3-6 ms
#: of server time on a 2-core machine; 20 ms leaves room for a busy server.
CHUNK_BUDGET = 0.02

#: The least time a renewal call is given (seconds), when a lease of its group is at or
#: past its give-up time: a quorum's confirmation read before the deadline still counts.
MIN_BUDGET = 0.005

#: Leases due within this share of their renewal interval ride along with the tick.
COALESCE = 0.1


class Renewer:
    """Renews the leases of one process in batches, from one background thread.

    Only the renewer thread touches its heap. Other threads hand it leases through
    a deque and wake it through a pipe, both single C calls: nothing they do can
    leave a lock or condition held that the renewer needs. Task threads receive
    asynchronous exceptions (a soft time limit, our own abort, Ctrl-C) at arbitrary
    points; with a ``threading.Condition`` shared with them, one landing inside
    ``notify()`` or ``Condition.__enter__`` left the renewer blocked for ever and
    every lease of the process expired without a word.
    """

    #: Longest sleep of the renewer thread: a wake-up lost to an exception raised
    #: between queueing a lease and writing the pipe costs at most this much.
    MAX_SLEEP = 1.0
    #: How long the thread keeps napping after a lease whose first renewal was due
    #: sooner than :data:`MAX_SLEEP` (see :meth:`add`).
    NAP_HOLD = 5.0

    def __init__(self) -> None:
        #: (due, sequence, coalescing window, leases): leases due together.
        self._heap: list[tuple[float, int, float, list[Lease]]] = []
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
        self.pid = forksafe.pid()
        # When the renewer thread next looks at its inbox unasked: the end of its
        # current sleep, or 0.0 while it is awake (it looks before sleeping again).
        # A lease due later needs no wake-up: a task path that woke the thread for
        # each new lock paid a thread switch per task.
        self._wakes_at = 0.0
        # The longest nap while short leases come (seconds), and until when (clock()).
        self._nap = (self.MAX_SLEEP, 0.0)
        #: Ticks run, script calls sent and wake-ups written, for tests and metrics.
        self.ticks = 0
        self.calls = 0
        self.wakeups = 0
        #: Leases are out of the heap in a tick being renewed (set by the renewer thread).
        self._ticking = False

    def add(self, lease: Lease) -> None:
        """Start renewing ``lease``; stop by setting ``released`` or on loss.

        First after its renewal interval, or halfway to when it would be given up if
        that is sooner (a short lease: a grant by a release, :mod:`.waiting`). After a
        first renewal that soon, the thread naps no longer than that for a while
        (:data:`NAP_HOLD`), so that the next such lease needs no wake-up: a lock handed
        between processes many times a second would otherwise wake it for each hold,
        most of which end long before their first renewal.
        """
        lease.renewing = True
        now = clock()
        first = max(0.0, min(lease.timing.renew_interval, (lease.give_up_at - now) / 2))
        if first < self.MAX_SLEEP:
            nap, until = self._nap
            self._nap = (min(nap, first) if now < until else first, now + self.NAP_HOLD)
        self._schedule(lease, now + first)
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
        held = [lease for *_, group in list(self._heap) for lease in group]
        held += [lease for _, lease in list(self._inbox)]
        return len({id(lease) for lease in held if lease.alive})

    def _schedule(self, lease: Lease, due: float) -> None:
        """Renew ``lease`` at ``due`` (any thread)."""
        try:
            self._inbox.append((due, lease))
        finally:
            self._wake_before(due)

    def _schedule_group(self, due: float, interval: float, leases: list[Lease]) -> None:
        """Renew ``leases`` at ``due``, together (any thread).

        They ride along with a tick up to a :data:`COALESCE` share of ``interval``
        early, their renewal interval (their shortest, if they differ).
        """
        if self._ident != threading.get_ident():  # renew() called by another thread
            try:
                self._inbox.extend((due, lease) for lease in leases)
            finally:
                self._wake_before(due)
            return
        heapq.heappush(self._heap, (due, next(self._seq), COALESCE * interval, leases))

    def _wake_before(self, due: float) -> None:
        """Wake the thread if it would otherwise look at its inbox after ``due``.

        Queued first, read here second; the thread publishes its wake-up time first
        and looks at the inbox second (:meth:`_sleep`): whichever order the two
        threads interleave in, either the thread sees the lease or this sees the
        time it sleeps until. A wake-up time already past means the thread overslept
        it (a suspended machine, a starved thread): no promise, so wake it.
        """
        wakes_at = self._wakes_at
        if wakes_at and (due < wakes_at or wakes_at < clock()):
            self._wake()

    def _wake(self) -> None:
        self.wakeups += 1
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._wake_w, b"\0")

    def _take_inbox(self) -> None:
        inbox = self._inbox
        while inbox:
            due, lease = inbox.popleft()
            self._schedule_group(due, lease.timing.renew_interval, [lease])

    def _sleep(self, timeout: float) -> None:
        nap, until = self._nap
        longest = nap if clock() < until else self.MAX_SLEEP
        timeout = max(0.0, min(timeout, longest))
        self._wakes_at = clock() + timeout
        try:
            if not self._inbox and not self._releases:
                readable([self._wake_r], timeout)
        finally:
            self._wakes_at = 0.0
        with contextlib.suppress(BlockingIOError, OSError):
            while os.read(self._wake_r, 4096):
                pass

    def _take_due(self) -> tuple[list[Lease], float]:
        """Wait for due leases; return them and when the first of them was due."""
        heap = self._heap
        while True:
            self._send_releases()
            self._take_inbox()
            while heap and not any(lease.alive for lease in heap[0][3]):
                heapq.heappop(heap)
            if not heap:
                self._sleep(self.MAX_SLEEP)
                continue
            due = heap[0][0]
            wait = due - clock()
            if wait > 0:
                self._sleep(wait)
                continue
            now, first_due = clock(), due
            self._ticking = True  # before the leases leave the heap: see abandon_all()
            taken: list[Lease] = []
            while heap:
                due, _, window, group = heap[0]
                if due > now + window:
                    break
                heapq.heappop(heap)
                taken += [lease for lease in group if lease.alive]
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
        held = [lease for *_, group in list(self._heap) for lease in group]
        held += [lease for _, lease in list(self._inbox)]
        for lease in held:
            lease.abandon()
        return not self._ticking

    def renew(self, leases: list[Lease], due: float | None = None) -> None:
        """Renew ``leases`` now: one script call per node per chunk, per node set."""
        started = clock()
        nodesets = list(map(_nodeset, leases))
        if nodesets.count(nodesets[0]) == len(leases):  # the usual tick: one node set
            groups = [leases]
        else:
            by_nodeset: dict[int, list[Lease]] = {}
            for lease in leases:
                by_nodeset.setdefault(id(lease.nodeset), []).append(lease)
            groups = list(by_nodeset.values())
        try:
            for group in groups:
                self._renew_group(group)
        finally:
            # Counted once its calls are in: a reader never sees a tick without them.
            self.ticks += 1
        if metrics.enabled:
            metrics.tick(clock() - started, 0.0 if due is None else started - due)
        if due is not None and LATE_HOOKS and started - due > leases[0].timing.renew_interval / 4:
            for hook in LATE_HOOKS:
                hook(leases, started - due)

    def _renew_group(self, leases: list[Lease]) -> None:
        nodeset = leases[0].nodeset
        # Entries (not leases) are chunked: a lease on several resources has several.
        calls = renew_chunks(leases)
        sent_at = clock()
        # Chunks go pipelined on one connection per node and the server runs them one
        # after another, so the budget grows with them (one budget for 50 chunks of a
        # 50,000-lock tick timed out every time). It ends by the first give-up time of
        # the group: a lease unconfirmed then is lost, and a call running a budget past
        # it declared the loss that much nearer the deadline than the margin means (a
        # stall of the loaded CI machine then ate the rest: reported after the deadline).
        budget = nodeset.timeout + CHUNK_BUDGET * (len(calls) - 1)
        budget = min(budget, max(MIN_BUDGET, min(map(_give_up_at, leases)) - sent_at))
        replies = nodeset.call(calls, timeout=budget)
        self.calls += len(calls) * sum(1 for r in replies if r is not None)
        # Judged now, when the replies are read: a pause between sending and reading
        # (SIGSTOP, a VM pause, a long GC) may have let the lease run out meanwhile.
        now = clock()
        everywhere = renewed_everywhere(replies, sum(len(call.keys) for call in calls))
        if everywhere is not None and len(everywhere) != len(leases):
            everywhere = None  # a lease on several resources: judged one by one below
        # Renewed at ``now``, so due again together: one group per renewal interval.
        again: dict[float, list[Lease]] = {}
        retried: list[str] = []
        offset = 0
        for lease in leases:
            count = len(lease.entries)
            held = (everywhere is not None and everywhere[offset]) or self._judge(
                lease, replies, offset, now, retried
            )
            offset += count
            if held and not lease.released and lease.renewed(sent_at, now):
                interval = lease.timing.renew_interval
                group = again.get(interval)
                if group is None:
                    again[interval] = [lease]
                else:
                    group.append(lease)
        for interval, group in again.items():
            self._schedule_group(now + interval, interval, group)
        if retried:
            # One line per tick, not per lock: 10,000 locks on a dead node are one event.
            logger.warning(
                "renewal of %d lock(s) failed, retrying before their deadlines: %s",
                len(retried),
                retried[0],
            )

    def _judge(
        self, lease: Lease, replies: list[Reply | None], offset: int, now: float, retried: list[str]
    ) -> bool:
        """Whether a quorum renewed ``lease``; if not, declare it lost or retry it soon."""
        quorum, n = lease.quorum, len(lease.nodeset)
        renewed, refused, errors = lease.tally(replies, offset)
        if lease.released:
            return False
        if renewed >= quorum:
            return True
        if refused > n - quorum:
            lease.mark_lost(
                "the key expired, was deleted or is held by another owner"
                if n == 1
                else f"only {renewed} of {n} nodes still hold it (quorum {quorum})"
            )
            return False
        why = "; ".join(errors) or "no quorum"
        if self._retry_or_lose(lease, now, why):
            retried.append(why)
            if metrics.enabled:
                metrics.renew_failed(lease.task_name)
        return False

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
        self._schedule_group(retry_at, lease.timing.renew_interval, [lease])
        return True

    def close(self) -> None:
        """Close the wake-up pipe (a forked child's copy of its parent's renewer)."""
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)


_renewer: Renewer | None = None
_renewer_lock = threading.Lock()


def get_renewer() -> Renewer:
    """The renewer of this process, created on first use."""
    global _renewer  # noqa: PLW0603
    renewer = _renewer
    if renewer is None or renewer.pid != forksafe.pid():
        with _renewer_lock:
            if _renewer is None or _renewer.pid != forksafe.pid():
                _renewer = Renewer()
            renewer = _renewer
    return renewer


@forksafe.at_fork_in_child
def _after_fork_in_child() -> None:
    global _renewer, _renewer_lock  # noqa: PLW0603
    # The parent's renewer thread does not exist here, and its locks may be held
    # by the parent's other threads at fork time: start from nothing.
    if _renewer is not None:
        _renewer.close()
    _renewer = None
    _renewer_lock = threading.Lock()
