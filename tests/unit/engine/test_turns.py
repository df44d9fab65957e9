"""An event loop's tasks take turns at an exclusive lock (:mod:`celery_redlock.engine.turns`).

Counted, not timed: a task waiting for its turn sends nothing, so N tasks of one loop
make one attempt per acquisition. Before turns, each waiting task asked the nodes
itself (refused tries), and with one node of three slow two tasks split the two nodes
that keep pace: no acquisition for seconds (CI, ``tests/reliability/test_minority.py``,
asyncio on one key).
"""

from __future__ import annotations

import asyncio
import time

from celery_redlock import AsyncRedlock
from celery_redlock.engine import turns as turns_module
from celery_redlock.engine.lease import clock
from celery_redlock.engine.turns import Turns, turns_of


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def test_the_tasks_of_a_loop_make_one_attempt_per_acquisition(redis_node, monkeypatch):
    """4 tasks, 15 acquisitions each, on one key: 60 attempts, none refused, one holder."""
    attempts: list[bool] = []
    real = AsyncRedlock._attempt

    async def counted(self, waiter):
        outcome = await real(self, waiter)
        attempts.append(outcome is None)
        return outcome

    monkeypatch.setattr(AsyncRedlock, "_attempt", counted)
    holding = []

    async def worker(lock: AsyncRedlock) -> None:
        for _ in range(15):
            assert await lock.acquire(timeout=20)
            holding.append(1)
            assert len(holding) == 1, "two tasks hold the lock"
            await asyncio.sleep(0.001)  # the others come to wait meanwhile
            holding.pop()
            await lock.release()

    async def scenario() -> None:
        locks = [AsyncRedlock("turns", nodes=[redis_node.url]) for _ in range(4)]
        await asyncio.gather(*(worker(lock) for lock in locks))

    run(scenario())
    assert len(attempts) == 60 and all(attempts), f"{attempts.count(False)} refused tries"


def test_a_wait_for_the_turn_counts_against_the_timeout_and_asks_nothing(redis_node, monkeypatch):
    """A task held up by another task's hold gives up at its timeout, without a try."""
    asked = []

    async def scenario() -> None:
        holder = AsyncRedlock("turn-timeout", nodes=[redis_node.url])
        assert await holder.acquire()
        waiter = AsyncRedlock("turn-timeout", nodes=[redis_node.url])
        real = waiter._attempt

        async def counted(w):
            asked.append(w)
            return await real(w)

        monkeypatch.setattr(waiter, "_attempt", counted)
        started = time.monotonic()
        assert await waiter.acquire(timeout=0.3) is False
        assert 0.25 < time.monotonic() - started < 5
        assert not turns_of(holder.local_key).waiting, "the timed-out waiter left its place"
        assert await waiter.acquire(blocking=False) is False, "a try asks the nodes"
        await holder.release()
        assert await waiter.acquire(timeout=5)
        await waiter.release()

    run(scenario())
    assert len(asked) == 2, "the timed-out wait asked nothing; the try and the last did"


def test_a_turn_whose_hold_is_never_released_ends_with_its_lease(redis_node):
    """A task that forgets to release (its lease not renewed, then run out) holds the
    others up for that lease only: the next task then asks the nodes."""

    async def scenario() -> float:
        forgetful = AsyncRedlock("turn-forgotten", nodes=[redis_node.url], ttl=1, auto_renew=False)
        assert await forgetful.acquire()
        waiter = AsyncRedlock("turn-forgotten", nodes=[redis_node.url])
        started = time.monotonic()
        assert await waiter.acquire(timeout=10)
        waited = time.monotonic() - started
        await waiter.release()
        return waited

    waited = run(scenario())
    assert 0.5 < waited < 5, waited


def test_a_cancelled_waiter_passes_its_turn_on(redis_node):
    """Cancelled while waiting, or in the very step the turn was handed to it: the next
    waiter gets the turn."""

    async def scenario() -> None:
        holder = AsyncRedlock("turn-cancel", nodes=[redis_node.url])
        assert await holder.acquire()
        turns = turns_of(holder.local_key)

        async def take_and_release() -> bool:
            lock = AsyncRedlock("turn-cancel", nodes=[redis_node.url])
            acquired = await lock.acquire(timeout=20)
            await lock.release()
            return acquired

        waiting = [asyncio.ensure_future(take_and_release()) for _ in range(3)]
        while len(turns.waiting) < 3:
            await asyncio.sleep(0.001)
        waiting[0].cancel()  # while waiting
        await asyncio.gather(waiting[0], return_exceptions=True)
        await holder.release()  # hands the turn to waiting[1] ...
        waiting[1].cancel()  # ... cancelled before it runs
        await asyncio.gather(waiting[1], return_exceptions=True)
        assert await waiting[2]
        assert waiting[0].cancelled() and waiting[1].cancelled()
        assert turns.current is None

    run(scenario())


class _Lease:
    def __init__(self, left: float) -> None:
        self.left = left

    def remaining(self) -> float:
        return self.left


def test_turns_serve_the_oldest_waiter_and_forget_an_idle_lock():
    """Pure logic: FIFO handing (across the holder's renewals), a stale holder's release
    changes nothing, and a lock with no turn and no waiter leaves the loop's table."""

    async def scenario() -> None:
        key = (("redis://x",), ("k",))
        turns = turns_of(key)
        first = await turns.take(None)
        assert first is not None
        # A lease the watchdog keeps renewing: the waiters look again every 5 ms and
        # keep their places.
        first.lease = _Lease(0.005)  # type: ignore[assignment]
        order: list[int] = []

        async def take(n: int) -> None:
            turn = await turns.take(None)
            order.append(n)
            assert turn is not None
            turns.give_back(turn)

        tasks = [asyncio.ensure_future(take(n)) for n in range(3)]
        while len(turns.waiting) < 3:
            await asyncio.sleep(0)
        turns.release(_Lease(1.0))  # type: ignore[arg-type]  # not the current hold's
        await asyncio.sleep(0.05)
        assert order == [] and len(turns.waiting) == 3
        turns.release(first.lease)  # type: ignore[arg-type]
        await asyncio.gather(*tasks)
        assert order == [0, 1, 2]
        assert turns_of(key) is not turns, "forgotten once idle"

    run(scenario())


def test_a_turn_whose_lease_is_over_is_taken_at_once():
    """Its holder did not release it: the next task takes it, and the late release
    leaves the new turn alone."""

    async def scenario() -> None:
        turns = Turns({}, (("redis://x",), ("k",)))
        stale = await turns.take(None)
        assert stale is not None
        stale.lease = _Lease(0.0)  # type: ignore[assignment]
        fresh = await turns.take(clock() + 0.01)
        assert fresh is not None and fresh is not stale
        turns.give_back(stale)  # its late release
        assert turns.current is fresh

    run(scenario())


def test_tries_leave_no_turns_behind(redis_node):
    """A hold taken by a try has no turn; its release makes no entry in the loop's table
    (one per key a loop ever tried would stay)."""

    async def scenario() -> int:
        for n in range(20):
            lock = AsyncRedlock(f"tried:{n}", nodes=[redis_node.url])
            assert await lock.acquire(blocking=False)
            await lock.release()
        return len(turns_module._turns.get(asyncio.get_running_loop(), {}))

    assert run(scenario()) == 0
