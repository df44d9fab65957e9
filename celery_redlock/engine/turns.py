"""An event loop's tasks take turns at an exclusive lock, one at a time.

Without turns, each task of a loop that blocks on the same lock asks the nodes itself:
the tasks of one process compete with each other there, each refused try costs a round
trip, and with several nodes their attempts land in different orders on different
nodes. With one node of three slow, two of a loop's tasks then split the two nodes that
keep pace, and only the slow node could decide: 4 tasks on one key made no acquisition
for seconds (``tests/reliability/test_minority.py``, asyncio, one key). Threads do not
compete so: a releasing thread hands the lock to a waiting one (:mod:`.handoff`).

With turns, one blocking acquisition of the loop at a time asks the nodes and then
holds the lock; the loop's other blocking acquisitions of that lock wait in the loop,
oldest first, sending nothing. The turn passes on when its holder releases the lock,
or its acquisition gives up (timeout) or raises (cancelled). A turn whose hold ends
without a release (its lease lost or run out: a task that forgot to release) ends
with the lease: the next task then asks the nodes, as it would without turns. A wait
for the turn counts against the acquisition's own timeout.

Tries (``blocking=False``, ``try_acquire``) take no turn: they ask the nodes at once,
and are refused while a task of the loop holds the lock, as any other caller is. Nor do
the locks that are not handed over between threads (:attr:`.kinds.Kind.hands_over`):
a fair lock's order is its queue on the nodes, where each waiting task keeps a place of
its own (a turn would queue the loop's next task there only when its turn came, behind
later arrivals of other processes), and shared holders do not exclude each other.
"""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections import deque
from typing import TYPE_CHECKING

from .lease import clock

if TYPE_CHECKING:
    from .lease import Lease

__all__ = ["Turn", "Turns", "release_turn", "turns_of"]

_Key = tuple[tuple[str, ...], tuple[str, ...]]


class Turn:
    """One acquisition's turn: asking the nodes (no lease yet), then holding ``lease``."""

    __slots__ = ("lease",)

    def __init__(self) -> None:
        self.lease: Lease | None = None

    def left(self) -> float | None:
        """Seconds the turn surely lasts: its lease's; None while it asks the nodes."""
        return None if self.lease is None else self.lease.remaining()


class Turns:
    """The turns of one lock in one event loop: the current one, and the waiting tasks."""

    __slots__ = ("__weakref__", "_key", "_loop_turns", "current", "waiting")

    def __init__(self, loop_turns: dict[_Key, Turns], key: _Key) -> None:
        self._loop_turns = loop_turns
        self._key = key
        self.current: Turn | None = None
        self.waiting: deque[asyncio.Future[Turn]] = deque()

    async def take(self, give_up: float | None) -> Turn | None:
        """Wait for the turn, oldest waiter first; None once ``give_up`` (local clock) passed.

        A waiter keeps its place until it is handed the turn, gives up, or finds the
        current holder's lease over (then it takes the turn, and that holder's late
        release finds it no longer its own).
        """
        if self._free():
            self.current = Turn()
            return self.current
        handed: asyncio.Future[Turn] = asyncio.get_running_loop().create_future()
        self.waiting.append(handed)
        try:
            while not handed.done() and not self._free():
                wait = None if give_up is None else give_up - clock()
                left = None if self.current is None else self.current.left()
                if left is not None:
                    wait = left if wait is None else min(wait, left)  # then look again
                if wait is not None and wait <= 0:
                    break
                # Not wait_for: before Python 3.12 it could return a result that came
                # with a cancellation and drop the cancellation.
                await asyncio.wait((handed,), timeout=wait)
        except BaseException:
            if handed.done() and not handed.cancelled():
                self.give_back(handed.result())  # handed to us as we were cancelled
            else:
                self._leave(handed)
            raise
        if handed.done():
            return handed.result()
        self._leave(handed)
        if not self._free():
            return None  # gave up
        self.current = Turn()
        return self.current

    def _free(self) -> bool:
        """Nobody's turn, or its holder's lease is over (a hold never released)."""
        return self.current is None or self.current.left() == 0.0

    def _leave(self, handed: asyncio.Future[Turn]) -> None:
        handed.cancel()
        with contextlib.suppress(ValueError):
            self.waiting.remove(handed)

    def give_back(self, turn: Turn) -> None:
        """End ``turn`` (released, or its acquisition gave up): the oldest waiter's now."""
        if self.current is not turn:
            return  # a waiter took over from it when its lease ran out
        while self.waiting:
            handed = self.waiting.popleft()
            if not handed.done():
                self.current = Turn()
                handed.set_result(self.current)
                return
        self.current = None
        if self._loop_turns.get(self._key) is self:
            del self._loop_turns[self._key]

    def release(self, lease: Lease) -> None:
        """The hold under ``lease`` was released: its turn passes on."""
        if self.current is not None and self.current.lease is lease:
            self.give_back(self.current)


# loop -> (node urls, lock keys) -> that lock's turns in the loop
_turns: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[_Key, Turns]] = (
    weakref.WeakKeyDictionary()
)


def turns_of(key: _Key) -> Turns:
    """The turns of the lock ``key`` (node urls, lock keys) in the running loop."""
    loop_turns = _turns.setdefault(asyncio.get_running_loop(), {})
    turns = loop_turns.get(key)
    if turns is None:
        turns = loop_turns[key] = Turns(loop_turns, key)
    return turns


def release_turn(key: _Key, lease: Lease) -> None:
    """The hold of lock ``key`` under ``lease`` was released: its turn, if any, passes on.

    Looked up, never made: a hold taken by a try has no turn, and a table entry made for
    each such release would stay (one per key a loop ever tried).
    """
    loop_turns = _turns.get(asyncio.get_running_loop())
    turns = None if loop_turns is None else loop_turns.get(key)
    if turns is not None:
        turns.release(lease)
