"""Holds per thread: which thread of this process holds a lock object, and how often.

A hold belongs to the thread (greenlet, under gevent) that acquired it, as in
Redisson and redis-py's ``thread_local`` locks: each thread using one ``Redlock``
has its own acquisition, token and fence, and can never release, extend or renew a
hold that is not its own. Without that, a late release by one thread deletes
another thread's lock::

    thread A: acquire(token=a) ... paused past the lease ...
    thread B:                          acquire(token=b): granted
    thread A:                                      release(): must not delete b

:class:`Holds` is one lock object's table of them. Each thread reads and writes its
own entry only, with single dict operations (atomic): no lock is taken that an
asynchronous exception could leave held. A forked child holds none of its parent's
holds: a hold's lease records the pid that made it.

:func:`finalize` runs when a held lock object is garbage-collected.
"""

from __future__ import annotations

import logging
import threading
import warnings
from collections.abc import Callable, Hashable

from ..base import forksafe
from ..exceptions import LockNotOwned
from ..nodes import Call
from .lease import Lease
from .renewal import get_renewer

__all__ = ["KEEP_HOLDS", "Hold", "Holds", "finalize"]

# The lock's logger: the garbage-collection warning has always been logged under it.
logger = logging.getLogger("celery_redlock.lock")

#: Finished holds of other threads kept per lock object before they are pruned.
KEEP_HOLDS = 32


class Hold:
    """One thread's acquisition of a lock: its lease and its reentry count."""

    __slots__ = ("count", "lease")

    def __init__(self, lease: Lease) -> None:
        self.lease = lease
        self.count = 1

    @property
    def live(self) -> bool:
        """Counted, not released, and made by this process (not a forked parent)."""
        return bool(self.count) and not self.lease.released and self.lease.pid == forksafe.pid()


class Holds:
    """One lock object's holds, by thread: the calling thread's, or its last one.

    The last (finished) hold of a thread stays, so that ``fence`` still answers after
    a release.
    """

    __slots__ = ("_by_thread", "_owner", "_what")

    def __init__(
        self, owner: Callable[[], Hashable] = threading.get_ident, what: str = "thread"
    ) -> None:
        #: Who the caller is: its thread, or (for asyncio) its task.
        self._owner = owner
        self._what = what
        self._by_thread: dict[Hashable, Hold] = {}

    def entry(self) -> Hold | None:
        """The calling thread's entry, finished or not."""
        return self._by_thread.get(self._owner())

    def live(self) -> Hold | None:
        """The calling thread's hold, if it has one in this process."""
        hold = self.entry()
        return hold if hold is not None and hold.live else None

    def lease(self) -> Lease | None:
        """The calling thread's current (or last) lease.

        From a thread that never acquired this object (a callback, a helper thread),
        the lease of the only thread that did; ``None`` if several did.
        """
        hold = self.entry()
        if hold is None:
            holds = list(self._by_thread.values())
            hold = holds[0] if len(holds) == 1 else None
        return None if hold is None else hold.lease

    def own(self, key: str, action: str) -> Hold:
        """The calling thread's hold, or :class:`LockNotOwned` saying why there is none."""
        hold = self.entry()
        if hold is None or hold.count == 0 or hold.lease.released:
            me = self._owner()
            others = any(
                h.count and not h.lease.released
                for ident, h in list(self._by_thread.items())
                if ident != me
            )
            what = self._what
            why = (
                f"held by another {what} of this process; a hold belongs to the {what} that "
                "acquired it"
                if others
                else f"this {what} does not hold it"
            )
            raise LockNotOwned(key, f"cannot {action}: {why}")
        if hold.lease.pid != forksafe.pid():
            raise LockNotOwned(
                key,
                f"cannot {action}: acquired by process {hold.lease.pid}, and a forked child "
                "does not hold its parent's locks",
            )
        return hold

    def add(self, lease: Lease) -> None:
        """Record ``lease`` as the calling thread's hold, counted once."""
        me = self._owner()
        holds = self._by_thread
        if len(holds) > KEEP_HOLDS:
            # Drop other threads' finished holds, so a long-lived object does not grow.
            for ident, hold in list(holds.items()):
                if ident != me and (hold.count == 0 or hold.lease.released):
                    holds.pop(ident, None)
        holds[me] = Hold(lease)

    def values(self) -> list[Hold]:
        """Every thread's entry (a copy: other threads may change the table meanwhile)."""
        return list(self._by_thread.values())


def finalize(holds: Holds, name: str, release_call: Callable[[str], Call]) -> None:
    """A held lock object was garbage-collected: stop renewing it and release it.

    Runs in whatever thread the collector ran in, maybe inside another lock's call:
    it only marks the leases released and hands the network work to the renewer.
    With ``auto_renew=False`` a lease just runs out.
    """
    for hold in holds.values():
        lease = hold.lease
        if hold.count and lease.lost is None and not lease.released and lease.pid == forksafe.pid():
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
