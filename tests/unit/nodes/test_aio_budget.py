"""The asyncio fan-out's budget: the node's time, not the time the event loop stalled.

Pure loop logic, on futures that stand for requests (the behaviour against a real
node is tested in ``tests/unit/engine/test_async_lock.py``).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from celery_redlock.nodes import aio

BUDGET = 0.05


def reply_after_steps(
    loop: asyncio.AbstractEventLoop, request: asyncio.Future[Any], steps: int
) -> None:
    """Complete ``request`` ``steps`` loop steps from now (the reading of a reply)."""
    if steps == 0:
        request.set_result(["OK"])
    else:
        loop.call_soon(reply_after_steps, loop, request, steps - 1)


def test_a_reply_readable_at_the_end_of_the_budget_is_read():
    """A reply that reached the socket as the budget ends takes loop steps to read."""

    async def scenario() -> bool:
        loop = asyncio.get_running_loop()
        request: asyncio.Future[Any] = loop.create_future()
        # Due with the wait's last timer: both run in the same loop step.
        loop.call_at(loop.time() + BUDGET, reply_after_steps, loop, request, 2)
        await aio._wait_budget([request], BUDGET)
        return request.done()

    assert asyncio.run(scenario())


def test_a_stall_while_waiting_is_not_counted_and_a_silent_node_still_times_out():
    """A stall of 3 budgets while waiting: the wait goes on after it, for one budget."""

    async def scenario() -> tuple[bool, float]:
        loop = asyncio.get_running_loop()
        answered: asyncio.Future[Any] = loop.create_future()
        silent: asyncio.Future[Any] = loop.create_future()
        started = loop.time()
        # The loop is blocked from 10 ms in for 150 ms; the reply is readable after it
        # returns (its node answered in time) and a few ms later.
        loop.call_at(started + 0.01, time.sleep, 3 * BUDGET)
        loop.call_at(started + 0.17, reply_after_steps, loop, answered, 0)
        await aio._wait_budget([answered, silent], BUDGET)
        return answered.done() and not silent.done(), loop.time() - started

    both, waited = asyncio.run(scenario())
    assert both
    # The stall (150 ms, seen up to one tick short) added to the budget (50 ms); and the
    # silent node is given up soon, not after the connections' own 2 s.
    assert 3 * BUDGET + BUDGET - BUDGET / aio._TICKS <= waited < 1.0
