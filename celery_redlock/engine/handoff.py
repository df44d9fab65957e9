"""Handing a released lock straight to a waiter of the same process.

Without it, a release deletes the lock and announces it; the process's listener
thread wakes a waiting thread, which sends its own acquisition: two wake-ups and two
round trips from ``release()`` to the next holder, and the lock is free in between
for anyone (measured: most of a threads pool's contended throughput). With it, the
releasing thread sends the waiter's acquisition itself, naming its own token as the
*predecessor*: ``acquire.lua`` takes the lock over in place (a new fence, the new
holder's fields, the new holder's lease), and the waiter wakes up holding it. One
round trip, one wake-up, and the lock is never free in between.

Nothing about the lock weakens: the takeover is an ordinary acquisition by the
waiter's token, voted and fenced like any other, its lease counted from when the
releasing thread sent it (same process, same clock); a fair lock still serves only
the head of its queue (``acquire.lua`` refuses anyone else, and the release then
goes the usual way). Only exclusive locks hand over; shares do not.

Both threads may be interrupted at any point by an asynchronous exception (a soft
time limit, our own abort), so the two sides agree through two single-use tickets,
each taken by one atomic ``dict.pop``, never through a lock either side could leave
held:

* **claim**: taken by the releaser (it will act for the waiter) or by the waiter
  (it stopped waiting: withdrawn). Whoever takes it first decides.
* **deliver**: once the releaser's attempt is over, taken by the releaser (the
  result is the waiter's: a hold to record, or a refusal to retry after) or by a
  waiter that gave up on the claimed offer (then the releaser undoes what it got).

The releaser reads the replies of the nodes that keep pace before delivering; on a
lagging node the takeover runs on, and what the releaser sends there next (the release
of its own token, the undo of a takeover that lost) goes out behind it, on the same
connection. While the takeover is decided the lock counts as held here, so the
process's other threads queue for the next handoff instead of asking the nodes.

A thread that starts a blocking ``acquire()`` while another thread of its process
holds the lock (its lease valid by the local clock) does not ask Redis first: it
subscribes, offers itself and waits, since the answer could only be "busy". The
thread that has just handed the lock over, coming back for its next turn, thus
queues behind the others without a round trip.

**Other processes' turn** (the *service across processes* invariant). Handed among
its threads, a lock would never be free in Redis while the process has a waiting
thread, and a waiter of
another process would wait until its timeout (measured before this bound: 2
processes x 4 threads, 1 ms holds, 12 s: 8,565 acquisitions for one, 0 and 8
timeouts for the other). So ``acquire.lua`` keeps the process's *turn* on the lock:
the first blocking attempt of another process (by host and pid) that it refuses starts
the turn's count, and from then the lock is handed over at most
``TURN.handoffs`` more times, and none past ``TURN.ms`` milliseconds: the next
takeover is refused, and the holder's release, which then goes through Redis,
*reserves* the lock (its token becomes :data:`~.keys.YIELD_MARK`) for up to
``TURN.reserve_ms`` ms: refused to this process, free for any other, and announced
as any release, so the other process's woken waiter takes it while this process's
threads (the releaser coming back included) are told to wait. A waiter of another
process is thus served within ``TURN.handoffs + 1`` holds of the process that has
the lock, or ``TURN.ms`` plus the hold under way, plus its own wake-up, provided it
asks within the reservation (one that misses it is refused, and the count starts
again). A blocking attempt of the yielding process refused by the reservation starts
the next holder's count at once, so the turns alternate. With several other
processes waiting, the first of them to ask wins each reservation. Without a waiter
elsewhere nothing changes: no count, no reservation. The cost of a reservation that
nobody takes (the other waiter gave up meanwhile) is a lock left idle for up to
``TURN.reserve_ms``.
"""

from __future__ import annotations

import contextlib
import secrets
import weakref
from collections import deque
from typing import TYPE_CHECKING, NamedTuple, Protocol

from ..base import forksafe
from .lease import clock
from .timing import TURN, Turn
from .vote import Attempt

if TYPE_CHECKING:
    from ..nodes import NodeSet, Reply
    from .kinds import Kind, Waiter
    from .lease import Lease
    from .timing import Timing
    from .waiting import Wakeup

__all__ = [
    "NOT_HANDED",
    "TURN",
    "Grant",
    "Handed",
    "Offer",
    "Turn",
    "forget",
    "hand_over",
    "held_here",
    "holding",
    "offer",
    "released",
]

_OPEN = "open"

#: Takeovers this process sent, and those that left a waiter holding the lock (for
#: tests and benchmarks).
attempts = 0
handovers = 0

#: Longest a waiter whose offer was claimed waits for the releaser's result, in
#: budgets of one vote: past it, the releaser undoes what it got.
PATIENCE_BUDGETS = 4


class Redlock(Protocol):
    """The lock as a handoff sees it (:class:`~celery_redlock.Redlock` is one).

    Declared here, not imported: the lock module imports this one, and a handoff needs
    only these.
    """

    kind: Kind
    local_key: tuple[tuple[str, ...], tuple[str, ...]]
    nodeset: NodeSet
    timing: Timing

    def _patience(self) -> float: ...

    def _unlock(self, token: str) -> list[Reply | None]: ...

    def _vote(self, waiter: Waiter, predecessor: str = "") -> Grant | Attempt: ...


class Grant(NamedTuple):
    """An acquisition that a quorum granted and whose fences agree, not yet recorded."""

    token: str
    fences: tuple[int, ...]
    sent_at: float
    attempt: Attempt


class Offer:
    """A blocked ``acquire()`` of this process, open to a takeover by a releaser."""

    __slots__ = ("_claim", "_deliver", "key", "lock", "result", "waiter", "wakeup")

    def __init__(self, lock: Redlock, waiter: Waiter, wakeup: Wakeup) -> None:
        self.lock = lock
        self.waiter = waiter
        self.wakeup = wakeup
        self.key = lock.local_key
        self._claim = {_OPEN: True}
        self._deliver = {_OPEN: True}
        #: What the releaser's attempt for this waiter got: a Grant, or the Attempt
        #: that did not win (set before ``deliver`` is taken).
        self.result: Grant | Attempt | None = None

    def withdraw(self, patience: float) -> Grant | Attempt | None:
        """Stop offering; what a releaser got for us meanwhile, if one claimed us.

        None: nobody claimed the offer (or its releaser did not finish within
        ``patience`` seconds, and undoes what it got). Else the releaser's result,
        which is ours: a Grant to record (or undo), an Attempt that did not win.
        """
        if self._claim.pop(_OPEN, None) is not None:
            _unregister(self)
            return None
        give_up = clock() + patience
        while _OPEN in self._deliver:
            left = give_up - clock()
            if left <= 0:
                if self._deliver.pop(_OPEN, None) is not None:
                    # The releaser undoes whatever it gets in our token's name, maybe
                    # after our next attempt re-entered that very grant: try on with
                    # a token of our own. Undo it here too, in case an exception
                    # stopped the releaser before it could.
                    stale, self.waiter.token = self.waiter.token, secrets.token_hex(16)
                    with contextlib.suppress(Exception):  # then the lease ends by itself
                        self.lock._unlock(stale)
                    return None
                break
            self.wakeup.wait(left)
        return self.result

    def abandon(self) -> None:
        """Stop offering on the way out of ``acquire()`` (an exception).

        A result delivered already is the waiter's to undo, which its acquisition's
        own clean-up does: the grant is in its token's name.
        """
        if self._claim.pop(_OPEN, None) is not None:
            _unregister(self)
            return
        if self._deliver.pop(_OPEN, None) is None and isinstance(self.result, Grant):
            forget(self.lock, self.result)


_Key = tuple[tuple[str, ...], tuple[str, ...]]

# (node urls, lock keys) -> the offers of this process's blocked acquisitions, oldest
# first. Offers leave it when a releaser claims them or their waiter withdraws.
_offers: dict[_Key, deque[Offer]] = {}

# (node urls, lock keys) -> the latest hold of the lock in this process: its lease,
# weakly (a lease keeps its on_lost callbacks, which may keep the lock object, whose
# collection releases a forgotten hold), or, between a takeover and its recording,
# the local time before which the takeover's lease surely runs. A hold's release
# removes it; a released, lost or collected lease, or a time past, says "not held".
_held: dict[_Key, weakref.ref[Lease] | float] = {}


def holding(lock: Redlock, lease: Lease | float) -> None:
    """Record that a thread of this process now holds ``lock`` under ``lease``."""
    if lock.kind.hands_over:
        _held[lock.local_key] = lease if isinstance(lease, float) else weakref.ref(lease)


def released(lock: Redlock, lease: Lease) -> None:
    """The hold under ``lease`` is over: forget it, unless another took its place."""
    entry = _held.get(lock.local_key)
    if entry is not None and not isinstance(entry, float) and entry() is lease:
        _held.pop(lock.local_key, None)


def _until(lock: Redlock, grant: Grant) -> float:
    """How long a takeover says "held here" before its waiter records its own lease.

    Its lease surely runs that long, and by then the waiter has recorded it or the
    takeover is undone: a record left by a path that forgot to :func:`forget` it
    keeps the process's waiters from asking Redis for no longer.
    """
    timing = lock.timing
    return min(grant.sent_at + timing.ttl - timing.drift, grant.sent_at + lock._patience())


def forget(lock: Redlock, grant: Grant) -> None:
    """The takeover ``grant`` will not be held (undone, or its waiter left)."""
    _unhold(lock, _until(lock, grant))


def _unhold(lock: Redlock, until: float) -> None:
    """Drop the "held here until ``until``" record of ``lock``, unless another replaced it."""
    if _held.get(lock.local_key) == until:
        _held.pop(lock.local_key, None)


def held_here(lock: Redlock) -> float:
    """Seconds for which another thread of this process surely holds ``lock`` (0: none)."""
    if not lock.kind.hands_over:
        return 0.0
    entry = _held.get(lock.local_key)
    if entry is None:
        return 0.0
    if isinstance(entry, float):
        return max(0.0, entry - clock())
    lease = entry()
    if lease is None or lease.released or lease.lost is not None:
        return 0.0
    return max(0.0, lease.give_up_at - clock())


def offer(lock: Redlock, waiter: Waiter, wakeup: Wakeup) -> Offer | None:
    """Offer ``waiter``'s blocked acquisition of ``lock`` to this process's releasers.

    None for a kind of lock that is not handed over.
    """
    if not lock.kind.hands_over:
        return None
    entry = Offer(lock, waiter, wakeup)
    _offers.setdefault(entry.key, deque()).append(entry)
    return entry


def _unregister(entry: Offer) -> None:
    queue = _offers.get(entry.key)
    if queue is None:
        return
    with contextlib.suppress(ValueError):
        queue.remove(entry)
    if not queue and _offers.get(entry.key) is queue:
        # An offer appended meanwhile stays in the dropped deque: its waiter is then
        # woken by the release announcement, as without handoff.
        _offers.pop(entry.key, None)


def _claim(lock: Redlock) -> Offer | None:
    """The oldest open offer for ``lock``, claimed for this releaser."""
    queue = _offers.get(lock.local_key)
    while queue:
        try:
            entry = queue.popleft()
        except IndexError:
            return None
        if entry._claim.pop(_OPEN, None) is not None:
            return entry
    return None


class Handed(NamedTuple):
    """What :func:`hand_over` did.

    ``handed``: a waiter holds the lock now. ``settled``: the nodes where the takeover
    removes the releaser's token: it was granted there, or it is still on its way (it
    takes the lock over when it lands, or finds the token gone; a release sent now
    would only go out behind it; should it be refused there, the token's lease ends
    unrenewed on that minority). ``touched``: a takeover was granted somewhere (and
    undone, if not handed), so the releaser's token may be gone from those nodes.
    """

    handed: bool
    touched: bool
    settled: tuple[int, ...] = ()


NOT_HANDED = Handed(False, False)


def hand_over(lock: Redlock, token: str) -> Handed:
    """Hand ``lock``, held by ``token`` and released by this thread, to a local waiter.

    On ``handed``, the waiter holds it, and ``token`` is gone from the ``settled``
    nodes (or will be); the caller releases it on the others (nodes that refused the
    takeover, usually none).
    """
    if not lock.kind.hands_over or not _offers:
        return NOT_HANDED
    entry = _claim(lock)
    if entry is None:
        return NOT_HANDED
    global attempts, handovers  # noqa: PLW0603
    attempts += 1
    result: Grant | Attempt | None = None
    taken_as = entry.waiter.token
    # Held here until the takeover is decided: the process's other waiters queue for
    # the next handoff rather than ask the nodes, which could only say "busy".
    deciding = clock() + lock._patience()
    holding(lock, deciding)
    try:
        result = entry.lock._vote(entry.waiter, predecessor=token)
    finally:
        # Interrupted or not, the waiter hears from us: with nothing (an interrupted
        # takeover), it tries again with the same token, which re-enters whatever the
        # takeover was granted.
        entry.result = result
        if isinstance(result, Grant):
            # Before the waiter can run, which records its lease in its place: written
            # after, this would outlive that hold and keep the process's next waiters
            # queuing for a handoff nobody makes.
            holding(entry.lock, _until(entry.lock, result))
        else:
            _unhold(lock, deciding)
        delivered = entry._deliver.pop(_OPEN, None) is not None
        if delivered:
            entry.wakeup.set()
        elif not isinstance(result, Grant):
            # The waiter stopped waiting for us and took a new token: what the takeover
            # was granted (interrupted) is in a token nobody will use or release, and a
            # refused takeover recorded that token among the lock's waiters, where a
            # release would grant it the lock (change C) for nobody. Out of both.
            with contextlib.suppress(Exception):  # the exception propagating matters more
                entry.lock._unlock(taken_as)
    if isinstance(result, Grant):
        if delivered:
            handovers += 1
            attempt = result.attempt
            pending = [i for i, reply in enumerate(attempt.replies) if reply is None]
            return Handed(True, True, (*attempt.granted, *pending))
        forget(entry.lock, result)
        entry.lock._unlock(result.token)  # the waiter left: the lock is ours to free
        return Handed(False, True)
    return Handed(False, bool(result is not None and result.granted))


@forksafe.at_fork_in_child
def _after_fork_in_child() -> None:
    # The parent's waiting and holding threads do not exist here.
    _offers.clear()
    _held.clear()
