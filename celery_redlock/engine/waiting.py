"""Waiting for a lock by release notification instead of polling.

``release.lua`` publishes on the lock's channel when it deletes the lock. A process
keeps **one pub/sub connection per node**, owned by one listener thread, whatever
the number of waiters: a waiter registers an event for its channel, the listener
subscribes (once per channel) and, when a release is announced, wakes the process's
longest-waiting waiter for it (only one: a release lets one holder in). redis-py's
default polling wakes a waiter up to 0.1 s late; this wakes it about one round trip
after the release.

A lock that *expires* publishes nothing, and a notification can be lost with a
dropped connection; waiters therefore never wait longer than the holder's
remaining lease (the "TTL fallback") before trying again.

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
import socket
import threading
import time
import weakref
from typing import Any

from redis.connection import AbstractConnection
from redis.exceptions import RedisError

from .. import forksafe
from ..nodes import LockNode
from ..poll import readable
from .threads import START_GRACE, start_daemon

__all__ = ["LoopWakeup", "Subscription", "Wakeup", "get_listener"]

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
#: subscribed (measured, issue 27's P8: one of the three script calls per acquisition).
LINGER = SYNC_INTERVAL


class Wakeup:
    """A wake-up that the waker can always deliver without blocking.

    Built on one ``threading.Lock`` used as a binary semaphore: the lock is *taken*
    while no wake-up is pending. ``set`` releases it and ``wait`` takes it back (so
    a wait consumes the wake-up). Every operation is one C call: an exception
    raised asynchronously in the waiter can land only between them, never with an
    internal lock held that the waker needs.
    """

    __slots__ = ("__weakref__", "_lock")  # the listener holds its waiters weakly

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()

    def set(self) -> None:
        """Deliver a wake-up (idempotent while one is pending)."""
        with contextlib.suppress(RuntimeError):  # one is pending already
            self._lock.release()

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
        """Wait (in the loop) for a wake-up and consume it; False if ``timeout`` passed."""
        if not self.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._event.wait(), max(0.0, timeout))
        self._event.clear()
        return self._lock.acquire(blocking=False)


class _Listener:
    """Owns the pub/sub connection to one node and wakes waiters on releases.

    Waiters are held weakly: one that an asynchronous exception cut off before it
    could unregister (a soft time limit landing in its ``acquire()``) leaves with its
    :class:`Wakeup` (within :data:`SYNC_INTERVAL`), instead of staying subscribed and
    taking release wake-ups that nobody uses. No callback tells the listener: it
    would run Python code in the waiter's thread, where another such exception could
    land. For the same reason the listener does not act on queued requests
    that such an exception could leave half made: each time it wakes it subscribes
    to the channels that have waiters and unsubscribes from the others.
    """

    def __init__(self, node: LockNode) -> None:
        self.name = f"celery_redlock-listener {node.safe_url}"
        self.node = node
        self._mutex = threading.Lock()
        # channel -> waiters in arrival order, each with its fair-waiting token (or None)
        self._waiters: dict[str, dict[weakref.ref[Wakeup], str | None]] = {}
        # Channels subscribed on the current connection, per channel the SUBSCRIBE
        # replies still to come (a subscribed channel with none is confirmed), and the
        # confirmations owed to waiters of unconfirmed channels. Each waiter has its
        # own: a shared one, consumed and set again by every waiter, is lost for all
        # when an exception lands in between.
        self._subscribed: set[str] = set()
        self._pending: dict[str, int] = {}
        self._unconfirmed: dict[str, list[Wakeup]] = {}
        # Channels without waiters, kept subscribed until LINGER after the last one left.
        self._idle: dict[str, float] = {}
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._conn: AbstractConnection | None = None
        self._run_lock = threading.Lock()
        self._started_at = -START_GRACE

    def start(self) -> None:
        """Start the listener thread unless it runs, or was started just now."""
        if self._run_lock.locked() or time.monotonic() < self._started_at + START_GRACE:
            return
        self._started_at = time.monotonic()
        start_daemon(self.run, self.name)

    def add(self, channel: str, event: Wakeup, token: str | None = None) -> Wakeup:
        """Register ``event`` for ``channel``; returns an event set once subscribed.

        A fair waiter gives its ``token``: an announcement naming a token wakes only
        that waiter (the head of the lock's queue), wherever it runs. The caller keeps
        ``event``: the registration lasts until :meth:`remove`, or until ``event`` is
        collected.
        """
        ref = weakref.ref(event)
        confirmed = Wakeup()
        with self._mutex:
            self._idle.pop(channel, None)
            self._waiters.setdefault(channel, {})[ref] = token
            if channel in self._subscribed and channel not in self._pending:
                confirmed.set()
            else:
                self._unconfirmed.setdefault(channel, []).append(confirmed)
        if not confirmed.is_set():
            self._poke()
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
                # pass the wake-up on, or a released lock would wait for its TTL.
                self._wake_one(waiters)
            if not waiters:
                # Unsubscribed by the listener once it has lingered (_sync).
                self._idle.setdefault(channel, time.monotonic())

    def subscribed(self, channel: str) -> bool:
        """Whether ``channel`` is subscribed and confirmed on the current connection.

        Read without the mutex (two atomic look-ups; called in a waiter's thread, where
        an asynchronous exception may land): a stale answer only costs the caller the
        subscription's confirmation wait, or a retry once subscribed.
        """
        return channel in self._subscribed and channel not in self._pending

    def pass_on(self, channel: str, event: Wakeup) -> None:
        """Wake the next waiter for ``channel`` (after a share was taken: it may fit too)."""
        with self._mutex:
            waiters = self._waiters.get(channel, {})
            self._wake_one({ref: t for ref, t in waiters.items() if ref() is not event})

    @staticmethod
    def _wake_one(waiters: dict[weakref.ref[Wakeup], str | None]) -> None:
        """Wake the longest-waiting waiter not already woken.

        One release lets one holder in: waking every waiter would send all of them to
        Redis for one winner (measured: 45 script calls per acquisition with 64 waiting
        threads). The one woken tries; if it loses to another process, the next
        release wakes the next, and the holder's TTL bounds every wait anyway.
        """
        for ref in waiters:
            waiter = ref()
            if waiter is not None and not waiter.is_set():
                waiter.set()
                return

    def _poke(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    def _wake_all(self) -> None:
        with self._mutex:
            for waiters in self._waiters.values():
                for ref in waiters:
                    waiter = ref()
                    if waiter is not None:
                        waiter.set()

    def run(self) -> None:
        """Serve the node's pub/sub connection for ever, reconnecting after failures."""
        if not self._run_lock.acquire(blocking=False):
            return  # another thread serves this node already
        backoff = 0.05
        while True:
            try:
                self._serve()
            except (RedisError, OSError) as exc:
                logger.debug("release listener for %s: %s", self.node.safe_url, exc)
            if self._conn is not None:
                self._conn.disconnect()
                self._conn = None
            # Anything published while we were away is lost: let every waiter retry.
            with self._mutex:
                self._subscribed.clear()
                self._pending.clear()
            self._wake_all()
            self._wait_wake(backoff)
            backoff = min(backoff * 2, MAX_BACKOFF)

    def _wait_wake(self, timeout: float) -> None:
        readable([self._wake_r], timeout)
        self._drain_wake()

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass

    def _serve(self) -> None:
        conn = self.node.new_connection()
        conn.connect()
        self._conn = conn
        while True:
            self._sync(conn)
            while conn.can_read(0):
                self._dispatch(conn.read_response())
            ready = readable([conn._sock, self._wake_r], SYNC_INTERVAL)
            if self._wake_r in ready:
                self._drain_wake()

    def _sync(self, conn: AbstractConnection) -> None:
        """Subscribe to the channels that have waiters, unsubscribe from the others."""
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
            subscribe = [c for c in self._waiters if c not in self._subscribed]
            unsubscribe = [c for c in self._subscribed if c not in self._waiters]
            self._subscribed.difference_update(unsubscribe)
            self._subscribed.update(subscribe)
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
            if kind == "message":
                waiters = self._waiters.get(channel, {})
                head = message[2] if len(message) > 2 else ""
                if not head:
                    self._wake_one(waiters)
                else:
                    # Fair waiting: the release names the waiter whose turn it is.
                    for ref, token in waiters.items():
                        waiter = ref()
                        if token == head and waiter is not None:
                            waiter.set()
            elif kind == "subscribe":
                left = self._pending.pop(channel, 1) - 1
                if left > 0:
                    self._pending[channel] = left
                elif channel in self._subscribed:
                    for confirmed in self._unconfirmed.pop(channel, ()):
                        confirmed.set()


class Subscription:
    """One waiter's registration for a lock's release channel on every node.

    Use as a context manager around the wait loop; :meth:`wait` returns when a
    release is announced or the timeout passes, whichever is first.
    """

    def __init__(
        self,
        nodes: tuple[LockNode, ...],
        channel: str,
        *,
        confirm_timeout: float | None,
        token: str | None = None,
        event: Wakeup | None = None,
    ) -> None:
        self.channel = channel
        self.event = event or Wakeup()
        self._listeners: list[_Listener] = []
        #: Set by the listeners once subscribed (one per node).
        self.confirmations: list[Wakeup] = []
        for node in nodes:
            listener = get_listener(node)
            self.confirmations.append(listener.add(channel, self.event, token))
            self._listeners.append(listener)  # after add: close() removes only what was added
        # Wait until subscribed on at least one node before the caller retries, so
        # a release between that retry and the wait cannot go unnoticed. If no node
        # confirms in time the caller still has the TTL fallback. (None: the caller
        # waits for it, as an asyncio waiter does without blocking its loop.)
        if confirm_timeout is not None:
            deadline = time.monotonic() + confirm_timeout
            for confirmed in self.confirmations:
                if confirmed.is_set() or confirmed.wait(max(0.0, deadline - time.monotonic())):
                    confirmed.set()  # for confirmed(); a confirmation stands for all nodes
                    break

    def confirmed(self) -> bool:
        """Subscribed on at least one node."""
        return any(confirmed.is_set() for confirmed in self.confirmations)

    def wait(self, timeout: float) -> bool:
        """Block until a release is announced or ``timeout`` passes; True if announced."""
        return self.event.wait(max(0.0, timeout))

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
