"""Waiting for a lock by release notification instead of polling.

A process keeps **one pub/sub connection per node**, owned by one listener thread,
whatever the number of waiters: a waiter registers an event for its lock's channel,
the listener subscribes (once per channel) to that channel and to this process's
own channel of the lock (:func:`process_channel`), and wakes waiters when a release is
announced. redis-py's default polling wakes a waiter up to 0.1 s late; this wakes it
about one round trip after the release.

**One process, one waiter per release.** An exclusive lock on one resource keeps a
record of its blocked waiters on each node (``acquire.lua`` writes a refused blocking
requester's token, arrival, process channel, and what a grant to it writes; see
``scripts/wake.lua``). Its release *grants* the lock to the oldest recorded waiter:
it writes the lock in that waiter's name (a new fence, for the short lease
:func:`grant_ms`) and publishes ``"TOKEN ATTEMPT FENCE ELAPSED"`` on that waiter's
process channel, so one process hears it and its listener wakes that one waiter,
which holds the lock without asking again (a fair lock's oldest waiter is the head of
its queue).
Before, every subscribed process heard every release and woke its
own longest waiter: with N waiting processes about N script calls per acquisition
(28.7 waiters woken per acquisition measured with 32 processes); and a named waiter's
own try was one more round trip per handoff. A requester that did not wait (the
releaser coming straight back, a new arrival) finds the lock held and is recorded
behind the others, so waiters are served in arrival order. The granted waiter left the
record; a refused try, a timeout or a refresh records it again. A waiter that gives up
removes itself (``fair_leave.lua``), releasing a grant made to it.

**A grant is counted from the waiter's own request.** The announcement names the
attempt that the node recorded the waiter by; the waiter counts the grant only while
that attempt is its last (:meth:`Subscription.granted`), with its lease counted from
when it sent that attempt plus the time the node counted from recording that attempt
to the grant (``ELAPSED``, less the drift factor of it): the node recorded the attempt
after it was sent, so the waiter's deadline is never later than the node's, however
long the holder held on. A waiter that asked again since
counts what its later attempt's reply says (the lock held by its own token), and one
frozen (SIGSTOP, a debugger) past its place counts nothing when it resumes, and asks.

**A granted waiter that does not come keeps the lock idle for the grant's lease.** The
grant's lease is the granted waiter's take-up bound: its process may be stopped or
dead. With the grant, the release tells a recorded waiter of *another* process
``"TOKEN MS"`` on that process's channel: its stand-by. That waiter's listener wakes
it ``MS`` (the grant's lease) later, unless a release names it first: it tries then,
and takes the lock if the granted waiter never came, or is refused (and waits no
longer than what is left of the lock's lease) if it did. A lock whose granted waiter
is frozen therefore passes on within one grant's lease (:func:`grant_ms`:
:data:`NAMED_RESERVE` and the margins), not one lease. A fair lock's stand-by is the
oldest such waiter (only the head may take a free fair lock), told at every grant.
Any waiter may take a free lock that is not fair: its stand-by is the *newest* such
waiter, which stays it (untold) at the grants that follow while it is still recorded
and was told less than half a grant's lease ago, its wake-up then due no later than
the new grant's lease ends; the oldest would be granted the lock next, and each
handoff would tell a new one: one more delivery, a thread woken in another process
(measured with 4-32 processes on one key: 1.9 deliveries per acquisition with the
oldest as stand-by, 1.04-1.6 with the newest).
On the lock's own channel a release says ``''`` only when nobody is recorded; the
listener then wakes the process's longest waiter (one per process), as do a share's
release and a lock of several resources, whose waiters are not recorded.

With Redlock each node grants the lock to its own oldest waiter (arrivals are stamped
by the waiter, so the nodes agree); the nodes number fences apart, so the waiter asks
once a quorum of nodes announced the release to it (:meth:`Subscription.wait`), and
its attempt finds the grants held by its token; a split vote's undo keeps its place
(:meth:`.kinds.Kind.undo_call`).

A lock that *expires* publishes nothing, and a notification can be lost with a
dropped connection; waiters therefore never wait longer than the holder's
remaining lease (the "TTL fallback") before trying again, and a recorded waiter no
longer than its renewal interval.

Waiters are woken through a :class:`Wakeup`, not a ``threading.Event``: an
``Event`` guards its flag with a ``Condition`` whose lock is taken in Python code,
and an exception raised asynchronously in a waiting task thread (a soft time limit,
an abort) can leave that lock held; the listener thread setting the event then
blocks for ever, and with it every waiter of the process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import socket
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from redis.connection import AbstractConnection
from redis.exceptions import RedisError

from ..base import forksafe
from ..base.poll import readable
from ..nodes import LockNode
from ..nodes.pubsub import PubSubReader
from . import keys
from .threads import START_GRACE, start_daemon

if TYPE_CHECKING:
    from .timing import Timing

__all__ = [
    "HOST",
    "NAMED_RESERVE",
    "Granted",
    "LoopWakeup",
    "Named",
    "Subscription",
    "Wakeup",
    "get_listener",
    "process_channel",
]

logger = logging.getLogger("celery_redlock.waiting")

#: Longest pause between reconnection attempts of a listener whose node is down.
MAX_BACKOFF = 1.0

#: Longest a listener leaves waiters that were cut off (collected without leaving)
#: registered: it tidies up when it wakes, and wakes at least this often.
SYNC_INTERVAL = 1.0

#: How long a listener stays subscribed to a channel after its last waiter left (it
#: unsubscribes at its first wake-up after that, within :data:`SYNC_INTERVAL` more). A
#: process that waits for the same lock again (a prefork child's next task on a hot key)
#: then finds the channel subscribed: no SUBSCRIBE round trip, and no retry once
#: subscribed (measured: one of the three script calls per acquisition).
LINGER = SYNC_INTERVAL

#: How long a waiter granted the lock by a release has to count the grant (seconds),
#: from when the grant was made by its count (:meth:`.acquisition.Core.hold_granted`);
#: the grant's lease on the node adds
#: the drift allowance and loss margin (:func:`grant_ms`). It covers the waiter's
#: wake-up; a granted waiter that died costs the grant's lease (the others refresh
#: their places within their renewal interval anyway).
NAMED_RESERVE = 0.5

#: How much later than the grant's lease ends a stand-by wakes (seconds): the lease
#: is counted from the release on the node, the stand-by from when its listener read
#: the announcement, which is later; this covers the rest (a node clock's granularity,
#: the lease's expiry on the node's next look).
STANDBY_MARGIN = 0.005

#: This host's name, as the acquire scripts record a holder's and a waiter's.
HOST = socket.gethostname()


def process_channel(channel: str) -> str:
    """The channel of this process for the lock whose release channel is ``channel``."""
    return keys.process_channel(channel, HOST, forksafe.pid())


def named_reserve_ms() -> int:
    """:data:`NAMED_RESERVE` in ms, as the release scripts take it."""
    return round(NAMED_RESERVE * 1000)


def grant_window(timing: Timing) -> float:
    """How long a waiter of a lock of ``timing`` has to count a grant (seconds).

    :data:`NAMED_RESERVE`, or half the renewal interval of a short lease: a granted
    waiter that never comes keeps the lock idle for this and the margins below, which
    must stay a small part of the lease.
    """
    return min(NAMED_RESERVE, timing.renew_interval / 2)


def grant_ms(timing: Timing) -> int:
    """The lease, in ms, of a grant to a waiter of a lock of ``timing``.

    Counted by the waiter from when the grant was made by its count (no later than
    on the node: :meth:`.acquisition.Core.hold_granted`), less the drift allowance and
    the loss margin of every lease: what is left is :func:`grant_window`, the time the
    waiter has to count the grant before it asks the nodes instead. The grant's lease
    is also how long a granted waiter that never comes (stopped, or dead) keeps the
    lock idle.
    """
    return max(1, math.ceil((grant_window(timing) + timing.margin + timing.drift) * 1000))


class Granted(NamedTuple):
    """A node's grant of the lock to a waiter, as its release announced it."""

    token: str
    #: The number of the waiter's attempt that the node recorded it by: the grant
    #: counts only while that attempt is the waiter's last (:meth:`Subscription.granted`).
    attempt: int
    fence: int
    #: What the node counted (ms) from recording that attempt to the grant.
    elapsed_ms: int


class _Entry:
    """A waiter's registration: what a release names it by, and which nodes told it."""

    __slots__ = ("grants", "heard", "named", "quorum")

    def __init__(
        self, named: Named | None, heard: set[str], quorum: int, grants: dict[str, Granted]
    ) -> None:
        self.named = named
        #: URLs of the nodes that announced a release to this waiter (named it, or
        #: said ``''`` to it) since its last wait; shared by its listeners.
        self.heard = heard
        #: The nodes it waits to hear from before it tries (see :meth:`Subscription.wait`).
        self.quorum = quorum
        #: Per node URL, the last grant announced to this waiter; shared by its listeners.
        self.grants = grants


class Named(Protocol):
    """A waiter a release can name, by its token.

    The token is read when an announcement arrives: an acquisition may change it
    (:meth:`.handoff.Offer.withdraw`).
    """

    token: str


class Wakeup:
    """A wake-up that the waker can always deliver without blocking.

    Built on one ``threading.Lock`` used as a binary semaphore: the lock is *taken*
    while no wake-up is pending. ``set`` releases it and ``wait`` takes it back (so
    a wait consumes the wake-up). Every operation is one C call: an exception
    raised asynchronously in the waiter can land only between them, never with an
    internal lock held that the waker needs.
    """

    __slots__ = ("__weakref__", "_lock", "reader")  # the listener holds its waiters weakly

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()
        #: While the waiter reads its node's announcements itself
        #: (:meth:`_Listener.read_for`), the socket that interrupts its poll.
        self.reader: socket.socket | None = None

    def set(self) -> None:
        """Deliver a wake-up (idempotent while one is pending)."""
        with contextlib.suppress(RuntimeError):  # one is pending already
            self._lock.release()
        reader = self.reader
        if reader is not None:
            with contextlib.suppress(OSError):  # full: a poke is pending anyway
                reader.send(b"x")

    def is_set(self) -> bool:
        """Whether a wake-up is pending."""
        return not self._lock.locked()

    def clear(self) -> None:
        """Drop a pending wake-up, if any."""
        self._lock.acquire(blocking=False)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for a wake-up and consume it; False if ``timeout`` passed first."""
        if timeout is None:
            return self._lock.acquire()
        return self._lock.acquire(timeout=max(0.0, timeout))


class LoopWakeup(Wakeup):
    """A :class:`Wakeup` that an asyncio waiter awaits (:meth:`wait_async`).

    The listener thread sets it as any other; the wake-up is also handed to the
    waiter's event loop, thread-safely.
    """

    __slots__ = ("_event", "_loop")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__()
        self._loop = loop
        self._event = asyncio.Event()

    def set(self) -> None:
        """Deliver a wake-up, and wake the loop's waiter."""
        super().set()
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
            self._loop.call_soon_threadsafe(self._event.set)

    def clear(self) -> None:
        """Drop a pending wake-up, the loop's included."""
        super().clear()
        self._event.clear()

    async def wait_async(self, timeout: float) -> bool:
        """Wait (in the loop) for a wake-up and consume it; False if ``timeout`` passed.

        A cancellation always propagates, even one that arrives with the wake-up.
        ``asyncio.wait_for`` before Python 3.12 returns the result instead when the
        awaited future finished in the same loop step as the cancel (the user's
        cancellation of a waiting ``acquire()`` lost, the task waiting on):
        ``asyncio.wait`` only watches the future and lets the cancellation through.
        """
        if not self.is_set():
            waiting = asyncio.ensure_future(self._event.wait())
            try:
                await asyncio.wait((waiting,), timeout=max(0.0, timeout))
            finally:
                waiting.cancel()
        self._event.clear()
        return self._lock.acquire(blocking=False)


class _Listener:
    """Owns the pub/sub connection to one node and wakes waiters on releases.

    For each lock with waiters it subscribes to the lock's channel and to this
    process's channel of the lock (one SUBSCRIBE for both); a waiter counts as
    subscribed once both are confirmed. An announcement naming a token wakes the
    waiter registered with it; ``''`` wakes the longest waiter not woken yet.

    Waiters are held weakly: one that an asynchronous exception cut off before it
    could unregister (a soft time limit landing in its ``acquire()``) leaves with its
    :class:`Wakeup` (within :data:`SYNC_INTERVAL`), instead of staying subscribed and
    taking release wake-ups that nobody uses. No callback tells the listener: it
    would run Python code in the waiter's thread, where another such exception could
    land. For the same reason the listener does not act on queued requests
    that such an exception could leave half made: when poked, and at least every
    :data:`SYNC_INTERVAL`, it subscribes to the channels that have waiters and
    unsubscribes from the others.
    """

    def __init__(self, node: LockNode) -> None:
        self.name = f"celery_redlock-listener {node.safe_url}"
        self.node = node
        self._mutex = threading.Lock()
        # lock channel -> waiters in arrival order, each with what a release names it by
        self._waiters: dict[str, dict[weakref.ref[Wakeup], _Entry]] = {}
        # Pub/sub channels (a lock's and this process's channel of it) subscribed on the
        # current connection, per channel the SUBSCRIBE replies still to come (a
        # subscribed channel with none is confirmed), each one's lock channel, and the
        # confirmations owed to waiters of unconfirmed locks. Each waiter has its own: a
        # shared one, consumed and set again by every waiter, is lost for all when an
        # exception lands in between.
        self._subscribed: set[str] = set()
        self._pending: dict[str, int] = {}
        self._lock_of: dict[str, str] = {}
        self._unconfirmed: dict[str, list[Wakeup]] = {}
        # Channels without waiters, kept subscribed until LINGER after the last one left.
        self._idle: dict[str, float] = {}
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        # A poke never blocks its waiter: a full buffer means pokes are pending anyway.
        self._wake_w.setblocking(False)
        self._conn: AbstractConnection | None = None
        self._run_lock = threading.Lock()
        self._started_at = -START_GRACE
        # Reading the connection directly (read_for): the one thread that parses at a
        # time holds _read_lock (one per connection: a lock left held by a reader cut
        # off goes with its connection, never released by another thread); the waiter
        # reading directly, as (thread, end of its wait), while it does; its poll's
        # interruption; whether the listener thread polls the connection (it does not
        # while a waiter reads it); and a connection a waiter found broken, for the
        # listener thread to replace.
        self._read_lock = threading.Lock()
        self._direct: tuple[int, float] | None = None
        self._direct_r, self._direct_w = socket.socketpair()
        self._direct_r.setblocking(False)
        self._direct_w.setblocking(False)
        self._watching = False
        self._broken: AbstractConnection | None = None
        # Messages read from the connection so far (by either thread, read lock held):
        # a poll's "readable" is stale once another thread read after it began.
        self._reads = 0
        # Parses what arrives on the current connection (see _serve).
        self._reader: PubSubReader | None = None
        # A waiter asked for a subscription (a poke for anything else syncs nothing).
        self._resync = True
        # Stand-bys (_stand_by): (due on the monotonic clock, lock channel, token).
        self._standby: list[tuple[float, str, str]] = []

    def start(self) -> None:
        """Start the listener thread unless it runs, or was started just now."""
        if self._run_lock.locked() or time.monotonic() < self._started_at + START_GRACE:
            return
        self._started_at = time.monotonic()
        start_daemon(self.run, self.name)

    def add(
        self,
        channel: str,
        event: Wakeup,
        named: Named | None = None,
        heard: set[str] | None = None,
        quorum: int = 1,
        confirmed: Wakeup | None = None,
        grants: dict[str, Granted] | None = None,
    ) -> Wakeup:
        """Register ``event`` for ``channel``; returns an event set once subscribed.

        ``confirmed``: the event to set (else a new one); one shared by a waiter's
        listeners on several nodes is set by whichever confirms first.

        ``named``: the waiter whose token a release may name (an exclusive lock on one
        resource, fair or not): an announcement naming it wakes only this waiter,
        wherever it runs. Each announcement that wakes the waiter adds this node's URL
        to ``heard``; with a ``quorum`` above 1, a ``''`` goes to the longest waiter that
        has not heard from this node yet, so that the nodes' announcements of one
        release reach one waiter. The caller keeps ``event``: the registration lasts
        until :meth:`remove`, or until ``event`` is collected.
        """
        ref = weakref.ref(event)
        confirmed = confirmed or Wakeup()
        self._drop_unheard()
        with self._mutex:
            self._idle.pop(channel, None)
            entry = _Entry(
                named, set() if heard is None else heard, quorum, {} if grants is None else grants
            )
            self._waiters.setdefault(channel, {})[ref] = entry
            if self._confirmed(channel):
                confirmed.set()
            else:
                self._unconfirmed.setdefault(channel, []).append(confirmed)
            alone = self._registered() == 1
        if not confirmed.is_set():
            self._resync = True  # before the poke: the listener clears it, then syncs
            self._poke()
        elif not alone:
            # Another waiter may read the connection itself (read_for) and stop before
            # this one is woken: the listener thread must be polling it then.
            self.ensure_watched()
        return confirmed

    def remove(self, channel: str, event: Wakeup) -> None:
        """Unregister ``event``; the channel is unsubscribed :data:`LINGER` after the last."""
        with self._mutex:
            waiters = self._waiters.get(channel)
            if waiters is None:
                return
            waiters.pop(weakref.ref(event), None)
            if event.is_set():
                # Woken but leaving without having used it (timed out, or gave up):
                # pass the wake-up on, or a released lock would wait for its TTL. (A
                # named waiter leaving also names the next on the nodes: fair_leave.lua.)
                self._wake_one(waiters)
            if not waiters:
                # Unsubscribed by the listener once it has lingered (_sync).
                self._idle.setdefault(channel, time.monotonic())

    def subscribed(self, channel: str) -> bool:
        """Whether ``channel`` is subscribed and confirmed on the current connection.

        Read without the mutex (atomic look-ups; called in a waiter's thread, where
        an asynchronous exception may land): a stale answer only costs the caller the
        subscription's confirmation wait, or a retry once subscribed.
        """
        return self._confirmed(channel)

    def _confirmed(self, channel: str) -> bool:
        """Both of the lock's channels are subscribed, with no SUBSCRIBE reply pending."""
        return all(
            name in self._subscribed and name not in self._pending
            for name in (channel, process_channel(channel))
        )

    def pass_on(self, channel: str, event: Wakeup) -> None:
        """Wake the next waiter for ``channel`` (after a share was taken: it may fit too)."""
        with self._mutex:
            waiters = self._waiters.get(channel, {})
            self._wake_one({ref: n for ref, n in waiters.items() if ref() is not event})

    def _registered(self) -> int:
        """How many waiters are registered, on every channel (mutex held)."""
        return sum(len(waiters) for waiters in self._waiters.values())

    def _direct_live(self, now: float) -> bool:
        """A waiter reads the connection itself, and has not overstayed its wait.

        A reader an exception cut off before it could say it stopped counts until
        the end of its wait (and a grace): the listener thread polls again then.
        """
        direct = self._direct
        return direct is not None and now < direct[1] + START_GRACE

    def ensure_watched(self) -> None:
        """Have the listener thread poll the connection, unless a waiter reads it."""
        if not self._watching and not self._direct_live(time.monotonic()):
            self._poke()

    def read_for(self, event: Wakeup, timeout: float) -> bool:
        """Wait for ``event`` as ``event.wait(timeout)`` does, reading announcements here.

        A waiter that is this listener's only one reads the node's pub/sub connection
        in its own thread: an announcement that names it wakes it where it is, with no
        hop from the listener thread to it (the wake-up of a waiting prefork child, the
        one task thread of its process, is on the path of every handoff between
        processes). Anything else it reads it dispatches as the listener would. A
        wake-up from elsewhere (a releasing thread of this process) interrupts its poll
        through :attr:`Wakeup.reader`. A waiter not alone waits for the listener thread.

        An exception raised while it parses (a soft time limit landing in it) leaves the
        connection's state unknown: the listener thread replaces the connection and
        wakes every waiter, as after a dropped connection.
        """
        conn = self._conn
        end = time.monotonic() + max(0.0, timeout)
        with self._mutex:
            direct = (
                conn is not None
                and not self._direct_live(time.monotonic())
                and self._registered() == 1
            )
        if not direct or conn is None:
            self.ensure_watched()
            return event.wait(timeout)
        session = (threading.get_ident(), end)
        try:
            self._direct = session
            event.reader = self._direct_w
            if self._watching:
                self._poke()  # the listener thread stops polling the connection
            sock = conn._sock
            while sock is not None and not event.is_set() and self._conn is conn:
                left = end - time.monotonic()
                if left <= 0:
                    break
                reads = self._reads
                standby = self._next_standby() - time.monotonic()
                ready = readable([sock, self._direct_r], max(0.0, min(left, standby)))
                self._fire_standbys()
                if self._direct_r in ready:
                    self._drain(self._direct_r)
                if sock in ready:
                    # Waking itself needs no poke of its poll (the loop looks first).
                    event.reader = None
                    self._read_here(conn, polled=reads)
                    event.reader = self._direct_w
        except (RedisError, OSError, ValueError):
            # Dropped, or closed by the listener thread's reconnection: it wakes us all.
            self._broken = conn
        finally:
            event.reader = None
            if self._direct is session:
                self._direct = None
            with self._mutex:
                others = self._registered() > 1
            if others or self._broken is conn:
                self._poke()
        return event.wait(0)

    def _drop_unheard(self) -> None:
        """Read what arrived while nobody read the connection and nobody waited.

        After a waiter read the connection itself, the listener thread polls it again
        only when asked (or at its next sync): an announcement that arrived meanwhile
        (a release that named nobody says ``''`` to every process) was for no waiter,
        and is dispatched to none here, before the next waiter registers, instead of
        waking that waiter for nothing.
        """
        conn = self._conn
        if conn is None or self._watching or self._direct_live(time.monotonic()):
            return
        with self._mutex:
            if self._registered():
                return
        try:
            self._read_here(conn)
        except (RedisError, OSError, ValueError):
            self._poke()  # the listener thread replaces it

    def _read_here(self, conn: AbstractConnection, polled: int | None = None) -> None:
        """Dispatch what arrived on ``conn``, in a waiter's thread (:meth:`read_for`)."""
        # The lock of the current connection (set before it): if that is not ``conn``
        # any more, nothing is read under it.
        lock = self._read_lock
        if not lock.acquire(timeout=SYNC_INTERVAL):
            # Held that long by a reader an exception cut off (or starved): the
            # connection's state is unknown. The listener thread replaces it.
            self._broken = conn
            self._poke()
            return
        try:
            if self._conn is conn and self._broken is not conn:
                self._dispatch_arrived(conn, polled)
        except BaseException:
            self._broken = conn  # stopped mid-message, maybe: the parser's state is unknown
            raise
        finally:
            lock.release()

    def _dispatch_arrived(self, conn: AbstractConnection, polled: int | None = None) -> None:
        """Dispatch every announcement already arrived (with :attr:`_read_lock`).

        ``polled``: the socket was found readable by a poll that began when
        :attr:`_reads` was this. Unless another thread read the connection since, it
        is read at once (one ``recv``); else only if a poll says it has something.
        What arrives after that makes the next poll return at once.
        """
        reader = self._reader
        if reader is None or not (polled == self._reads or readable([conn._sock], 0)):
            return
        messages = reader.read()
        # Counted once the socket was read, not before: a reader whose poll began
        # between the two would trust a "readable" that this read used up, and wait
        # in recv for data that is not coming.
        self._reads += 1
        for message in messages:
            self._dispatch(message)

    @staticmethod
    def _wake_one(waiters: dict[weakref.ref[Wakeup], _Entry], node: str = "") -> None:
        """Wake the longest-waiting waiter not already woken (by ``node``, if given).

        One release lets one holder in: waking every waiter would send all of them to
        Redis for one winner (measured: 45 script calls per acquisition with 64 waiting
        threads). The one woken tries; if it loses to another process, the next
        release wakes the next, and the holder's TTL bounds every wait anyway.
        """
        for ref, entry in waiters.items():
            waiter = ref()
            if waiter is None:
                continue
            if node and entry.quorum > 1:
                # Each node's announcement of one release to the same waiter, so that
                # one of them hears a quorum.
                if node not in entry.heard or not waiter.is_set():
                    entry.heard.add(node)
                    waiter.set()
                    return
            elif not waiter.is_set():
                if node:
                    entry.heard.add(node)
                waiter.set()
                return

    def _wake_named(
        self,
        waiters: dict[weakref.ref[Wakeup], _Entry],
        token: str,
        grant: Granted | None = None,
    ) -> bool:
        """Wake the waiter registered as ``token`` (mutex held); its stand-by is moot.

        ``grant``: the node granted it the lock (stored for the waiter before it wakes).
        """
        if self._standby:
            self._standby = [s for s in self._standby if s[2] != token]
        for ref, entry in waiters.items():
            waiter = ref()
            named = entry.named
            if waiter is not None and named is not None and named.token == token:
                if grant is not None:
                    entry.grants[self.node.url] = grant
                entry.heard.add(self.node.url)
                waiter.set()
                return True
        return False

    def _stand_by(self, channel: str, token: str, ms: int) -> None:
        """Wake ``token``'s waiter ``ms`` from now unless a release names it first (mutex held).

        The release that said so granted the lock to another waiter for ``ms``: if
        that one never comes (stopped, or dead), this one takes the lock when the
        grant ends, instead of when its own wait runs out.
        """
        # No poke: the thread that read the announcement polls next, and bounds its poll
        # by the earliest stand-by (a waiter reading alone reads its own stand-bys;
        # when it stops while others wait, it pokes the listener thread). A poke here
        # woke a second thread on every handoff between processes.
        self._standby.append((time.monotonic() + ms / 1000 + STANDBY_MARGIN, channel, token))

    def _next_standby(self) -> float:
        """When the earliest stand-by is due (monotonic clock); infinity if none."""
        standby = self._standby
        return min(due for due, _, _ in standby) if standby else float("inf")

    def _fire_standbys(self) -> None:
        """Wake the waiters whose stand-by is due."""
        if not self._standby or self._next_standby() > time.monotonic():
            return
        with self._mutex:
            now = time.monotonic()
            due = [s for s in self._standby if s[0] <= now]
            self._standby = [s for s in self._standby if s[0] > now]
            for _, channel, token in due:
                self._wake_named(self._waiters.get(channel, {}), token)

    def _poke(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    def _wake_all(self) -> None:
        with self._mutex:
            for waiters in self._waiters.values():
                for ref, entry in waiters.items():
                    waiter = ref()
                    if waiter is not None:
                        entry.heard.clear()  # no announcement: each tries at once
                        waiter.set()

    def run(self) -> None:
        """Serve the node's pub/sub connection for ever, reconnecting after failures."""
        if not self._run_lock.acquire(blocking=False):
            return  # another thread serves this node already
        try:
            self._run()
        finally:
            # Stopped by an exception that is not the node's (one raised asynchronously
            # in this thread): the next waiter's get_listener() starts another, where
            # a run lock kept would leave the process without a listener for good.
            self._disconnect()
            self._run_lock.release()

    def _run(self) -> None:
        backoff = 0.05
        while True:
            try:
                self._serve()
            except (RedisError, OSError) as exc:
                logger.debug("release listener for %s: %s", self.node.safe_url, exc)
            except Exception:
                # Not the node's failure: a bug. Waiters fall back on their timeouts
                # while the listener starts over, rather than for good.
                logger.warning("release listener for %s failed", self.node.safe_url, exc_info=True)
            self._disconnect()
            self._wait_wake(backoff)
            backoff = min(backoff * 2, MAX_BACKOFF)

    def _disconnect(self) -> None:
        """Drop the connection and its subscriptions; every waiter retries."""
        conn, self._conn = self._conn, None  # a waiter reading it stops (read_for)
        if conn is not None:
            # Not under a waiter that is parsing it (one cut off there: after a while;
            # a reader still going then fails on the closed socket, as the connection).
            lock = self._read_lock
            taken = lock.acquire(timeout=SYNC_INTERVAL)
            try:
                conn.disconnect()
            finally:
                if taken:
                    lock.release()
        # Anything published while we were away is lost: let every waiter retry.
        with self._mutex:
            self._subscribed.clear()
            self._pending.clear()
        self._wake_all()

    def _wait_wake(self, timeout: float) -> None:
        readable([self._wake_r], timeout)
        self._drain(self._wake_r)

    @staticmethod
    def _drain(wake: socket.socket) -> None:
        """Consume the pokes pending on a wake-up socket."""
        try:
            while wake.recv(4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass

    def _claim_reads(self, conn: AbstractConnection) -> None:
        """Take :attr:`_read_lock` in the listener thread, or give ``conn`` up.

        A waiter reading the connection holds it only while it parses; one held past
        that waiter's wait was left by an exception that cut the waiter off there (or
        its thread is starved). The connection is then replaced, and the lock goes
        with it: released by no one but its holder, so a holder still alive cannot
        release a lock another thread holds.
        """
        while not self._read_lock.acquire(timeout=SYNC_INTERVAL):
            if not self._direct_live(time.monotonic()):
                self._broken = conn
                raise ConnectionError("a waiter stopped while reading the connection")
        if self._broken is conn:
            self._read_lock.release()
            raise ConnectionError("a waiter stopped while reading the connection")

    def _serve(self) -> None:
        conn = self.node.new_connection()
        conn.connect()
        self._reader = PubSubReader(conn)  # from now on, the only reader of its socket
        self._read_lock = threading.Lock()  # before the connection: see _read_here
        self._conn = conn
        synced, polled = -SYNC_INTERVAL, None
        while True:
            # Subscriptions are brought up to date when a waiter asks (a poke) and at
            # least every SYNC_INTERVAL, not at every announcement: the waiter woken by
            # one needs the GIL, and the listener's Python work between the wake-up and
            # its next blocking call is on every handoff's path.
            # While a waiter reads the connection itself (read_for), this thread polls
            # only its wake-up socket: two threads woken by one announcement would
            # contend for the GIL on the handoff's path.
            self._watching = False
            now = time.monotonic()
            direct = self._direct_live(now)
            resync = self._resync or now - synced >= SYNC_INTERVAL
            if resync or not direct or self._broken is conn:
                self._claim_reads(conn)
                try:
                    if resync:
                        self._resync = False
                        self._sync(conn)
                        synced = now
                    if not direct:
                        self._dispatch_arrived(conn, polled)
                finally:
                    self._read_lock.release()
            self._watching = not direct
            watched = [self._wake_r] if direct else [conn._sock, self._wake_r]
            reads = self._reads
            until = min(synced + SYNC_INTERVAL, self._next_standby())
            ready = readable(watched, max(0.0, until - time.monotonic()))
            polled = reads if conn._sock in ready else None
            if self._wake_r in ready:
                self._drain(self._wake_r)
            self._fire_standbys()

    def _sync(self, conn: AbstractConnection) -> None:
        """Subscribe to the channels of locks that have waiters, unsubscribe from the others."""
        now = time.monotonic()
        with self._mutex:
            for channel, waiters in list(self._waiters.items()):
                gone = [ref for ref in waiters if ref() is None]
                for ref in gone:
                    del waiters[ref]
                if gone:
                    # A waiter cut off may have taken a release's wake-up with it.
                    self._wake_one(waiters)
                if not waiters and now - self._idle.setdefault(channel, now) >= LINGER:
                    del self._waiters[channel]
                    self._unconfirmed.pop(channel, None)
                    self._idle.pop(channel, None)
            wanted: dict[str, str] = {}
            for channel in self._waiters:
                wanted[channel] = wanted[process_channel(channel)] = channel
            subscribe = [c for c in wanted if c not in self._subscribed]
            unsubscribe = [c for c in self._subscribed if c not in wanted]
            self._subscribed.difference_update(unsubscribe)
            self._subscribed.update(subscribe)
            self._lock_of = wanted
            for channel in subscribe:
                self._pending[channel] = self._pending.get(channel, 0) + 1
        if subscribe:
            conn.send_command("SUBSCRIBE", *subscribe)
        if unsubscribe:
            conn.send_command("UNSUBSCRIBE", *unsubscribe)

    def _dispatch(self, message: Any) -> None:
        if not isinstance(message, list) or len(message) < 2:
            return
        kind, channel = message[0], message[1]
        with self._mutex:
            lock_channel = self._lock_of.get(channel) or str(channel)
            if kind == "message":
                waiters = self._waiters.get(lock_channel, {})
                text = message[2] if len(message) > 2 else ""
                if not text:
                    self._wake_one(waiters, self.node.url)
                    return
                # The release granted the lock to the waiter whose turn it is
                # ("TOKEN ATTEMPT FENCE ELAPSED"), named it ("TOKEN": it tries), or
                # made it the stand-by of the waiter it granted it to ("TOKEN MS").
                parts = str(text).split(" ")
                if len(parts) == 4 and all(part.isdigit() for part in parts[1:]):
                    attempt, fence, elapsed = (int(part) for part in parts[1:])
                    grant = Granted(parts[0], attempt, fence, elapsed)
                    self._wake_named(waiters, parts[0], grant)
                elif len(parts) == 2 and parts[1].isdigit():
                    self._stand_by(lock_channel, parts[0], int(parts[1]))
                else:
                    self._wake_named(waiters, parts[0])
            elif kind == "subscribe":
                left = self._pending.pop(channel, 1) - 1
                if left > 0:
                    self._pending[channel] = left
                elif self._confirmed(lock_channel):
                    for confirmed in self._unconfirmed.pop(lock_channel, ()):
                        confirmed.set()


class Subscription:
    """One waiter's registration for a lock's release channels on every node.

    Use as a context manager around the wait loop; :meth:`wait` returns when a
    release is announced or the timeout passes, whichever is first.
    """

    def __init__(
        self,
        nodes: tuple[LockNode, ...],
        channel: str,
        *,
        confirm_timeout: float | None,
        named: Named | None = None,
        event: Wakeup | None = None,
        quorum: int = 1,
    ) -> None:
        self.channel = channel
        self.event = event or Wakeup()
        #: Nodes that must announce a release to this waiter before :meth:`wait` ends.
        self.quorum = quorum
        self._heard: set[str] = set()
        #: The grants announced to this waiter, per node URL (the last one of each).
        self.grants: dict[str, Granted] = {}
        self._listeners: list[_Listener] = []
        #: Set by the first listener subscribed (one for every node: the first node to
        #: confirm ends the wait below, whichever it is, so a slow or silent node
        #: does not set its length).
        self.confirmation = Wakeup()
        for node in nodes:
            listener = get_listener(node)
            listener.add(
                channel, self.event, named, self._heard, quorum, self.confirmation, self.grants
            )
            self._listeners.append(listener)  # after add: close() removes only what was added
        # Wait until subscribed on at least one node before the caller retries, so
        # a release between that retry and the wait cannot go unnoticed. If no node
        # confirms in time the caller still has the TTL fallback. (None: the caller
        # waits for it, as an asyncio waiter does without blocking its loop.)
        if confirm_timeout is not None and self.confirmation.wait(confirm_timeout):
            self.confirmation.set()  # for confirmed(): the wait consumed it

    def confirmed(self) -> bool:
        """Subscribed on at least one node."""
        return self.confirmation.is_set()

    def granted(self, token: str, attempt: int) -> list[Granted]:
        """The nodes' grants of the lock to ``token``'s attempt ``attempt``.

        A grant is the node's answer to that attempt, made after the node recorded it:
        it counts only while ``attempt`` is the waiter's last. A later attempt may have
        found it (and counted it then), or its undo removed it; a grant to an earlier
        one is spent.
        """
        return [
            grant
            for grant in list(self.grants.values())
            if grant.token == token and grant.attempt == attempt
        ]

    def wait(self, timeout: float) -> bool:
        """Block until a release is announced or ``timeout`` passes; True if announced.

        With a :attr:`quorum` above 1 (a Redlock waiter), an announcement counts once a
        quorum of nodes made it to this waiter (named it, or said ``''``): a release goes
        to every node at once, and the first node's announcement could wake the waiter
        before the others have processed the release, or a node whose record of waiters
        lags behind says ``''`` while the others name another waiter. Tried then, the
        lock is still held on the others: a split vote, whose undo names yet another
        waiter (measured, 6 processes on 3 nodes, hold 0: 14% of acquisitions split).
        A wake-up that no node announced (an in-process handoff, a reconnection) ends
        the wait at once, and ``timeout`` (the holder's lease, or the renewal interval)
        bounds it as for any waiter.
        """
        end = time.monotonic() + max(0.0, timeout)
        try:
            while True:
                heard = len(self._heard)
                if not self._wait_event(max(0.0, end - time.monotonic())):
                    return False
                # A wake-up that added no node was announced by none (a listener adds
                # the node before it wakes): it ends the wait even when some nodes have
                # announced a release already, which a handoff's wake-up would
                # otherwise wait out with them.
                if len(self._heard) >= self.quorum or len(self._heard) == heard:
                    return True
        finally:
            self._heard.clear()

    async def wait_async(self, timeout: float) -> bool:
        """:meth:`wait` for an asyncio waiter, whose :attr:`event` is a :class:`LoopWakeup`."""
        event = self.event
        assert isinstance(event, LoopWakeup)
        end = time.monotonic() + max(0.0, timeout)
        try:
            while True:
                heard = len(self._heard)
                self.watch()
                if not await event.wait_async(max(0.0, end - time.monotonic())):
                    return False
                if len(self._heard) >= self.quorum or len(self._heard) == heard:
                    return True
        finally:
            self._heard.clear()

    def _wait_event(self, timeout: float) -> bool:
        """Wait for :attr:`event`: on one node, reading its announcements here if alone."""
        if len(self._listeners) == 1:
            return self._listeners[0].read_for(self.event, timeout)
        self.watch()
        return self.event.wait(timeout)

    def watch(self) -> None:
        """Make sure announcements are read for this waiter while it waits elsewhere.

        For a waiter that does not wait in :meth:`wait` (an asyncio waiter): another
        waiter of the process may have been reading them itself.
        """
        for listener in self._listeners:
            listener.ensure_watched()

    def clear(self) -> None:
        """Forget the announcements received so far (they woke this waiter for nothing)."""
        self.event.clear()
        self._heard.clear()

    def pass_on(self) -> None:
        """Wake this process's next waiter for the lock (this one no longer waits)."""
        for listener in self._listeners:
            listener.pass_on(self.channel, self.event)

    def close(self) -> None:
        """Stop listening for this waiter."""
        for listener in self._listeners:
            listener.remove(self.channel, self.event)

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


_listeners: dict[str, _Listener] = {}
_listeners_lock = threading.Lock()


def subscribed(nodes: tuple[LockNode, ...], channel: str) -> bool:
    """Whether this process listens to ``channel`` already, confirmed on some node."""
    listeners = (_listeners.get(node.url) for node in nodes)
    return any(listener is not None and listener.subscribed(channel) for listener in listeners)


def get_listener(node: LockNode) -> _Listener:
    """The listener for ``node`` in this process, started on first use."""
    listener = _listeners.get(node.url)
    if listener is None:
        with _listeners_lock:
            listener = _listeners.get(node.url)
            if listener is None:
                listener = _listeners[node.url] = _Listener(node)
    listener.start()  # also restarts one that died before it ran
    return listener


@forksafe.at_fork_in_child
def _after_fork_in_child() -> None:
    global _listeners_lock  # noqa: PLW0603
    # Listener threads do not survive fork; their sockets belong to the parent.
    _listeners.clear()
    _listeners_lock = threading.Lock()
