"""An interrupted call leaves no key under a token nobody holds (DESIGN invariant 13).

Issue 24, item 3: an asynchronous exception (or an asyncio cancellation) in
``acquire()`` with its request still on the way left the key under the abandoned
token for a whole ttl, unrenewed, refusing every other owner: the undo went out on
another connection and overtook the request it undid. The nodes here sit behind a
proxy that delays the connections open when a round starts (the pool's, which carry
the request) and lets new ones through at once, as when one TCP stream waits for a
retransmission while a fresh one gets through. Each round arms one or two
exceptions (cancellations) at random points of ``acquire()`` and ``release()``;
once the call has returned or raised and the network has delivered everything it
carried, no node may keep the key.
"""

from __future__ import annotations

import asyncio
import random
import signal
from collections.abc import Callable

import pytest

from celery_redlock import NodeUnavailable, Redlock
from celery_redlock.engine.aio import AsyncRedlock
from tests.harness import FaultProxy, RedisServer
from tests.harness.servers import wait_for
from tests.unit.engine.test_lock_handles import Injected

#: Node timeout (the budget of one fan-out) of the locks here, in seconds.
NODE_TIMEOUT = 0.2
#: One-way delays of the connections open at a round's start: within the budget (the
#: acquisition succeeds, and the release is interrupted too) and beyond it.
SLOW = (0.05, 0.3)
ROUNDS = 12


def _nodes(redis_factory, fault_proxy, count: int) -> tuple[list[RedisServer], list[FaultProxy]]:
    servers = redis_factory(count)
    return servers, [fault_proxy(server) for server in servers]


def _slow_down(proxies: list[FaultProxy]) -> None:
    slow = random.choice(SLOW)
    for proxy in proxies:
        proxy.slow_current(slow)


def _assert_no_orphan(servers: list[RedisServer], proxies: list[FaultProxy], key: str) -> None:
    """Once everything sent has arrived: no node keeps ``key`` (nobody holds it now)."""
    wait_for(lambda: not any(proxy.pending() for proxy in proxies), timeout=10)
    tokens = []
    for server in servers:
        with server.client(decode_responses=True) as client:
            # A direct round trip: Redis runs what the proxy delivered before it answers.
            tokens.append(client.hget(key, "token"))
    assert not any(tokens), (
        f"key left under a token nobody holds on {sum(map(bool, tokens))} of {len(servers)} "
        f"nodes: {tokens}"
    )


def _arm(exceptions: int) -> Callable[[], None]:
    """Raise Injected ``exceptions`` times from SIGALRM, as a soft time limit does.

    A signal interrupts a ``select`` waiting for a reply at once (an exception set on
    the thread would only land once the reply came). Returns the disarm function.
    """
    fired = 0

    def on_alarm(signum, frame):
        nonlocal fired
        fired += 1
        if fired >= exceptions:
            signal.setitimer(signal.ITIMER_REAL, 0)
        raise Injected()

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, random.uniform(1e-4, 0.3), random.uniform(1e-4, 0.15))

    def disarm() -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)

    return disarm


@pytest.mark.parametrize("exceptions", [1, 2])
@pytest.mark.parametrize("count", [1, 3])
@pytest.mark.timeout(120)
# An injected exception landing inside redis-py's connect() leaves its half-made socket
# to the collector (redis-py closes it only on OSError): a warning, not an orphan. Seen
# once in a full run under load (an unconnected socket, laddr 0.0.0.0:0).
@pytest.mark.filterwarnings("ignore:unclosed <socket:ResourceWarning")
@pytest.mark.filterwarnings(
    "ignore:Exception ignored in. <socket.socket:pytest.PytestUnraisableExceptionWarning"
)
def test_an_interrupted_acquire_or_release_leaves_no_orphan(
    redis_factory, fault_proxy, count, exceptions
):
    """One or two exceptions at random points, the request on the way: no orphan.

    Before the fix: the key stayed under the abandoned token on some node.
    """
    servers, proxies = _nodes(redis_factory, fault_proxy, count)
    lock = Redlock("job", nodes=[p.url for p in proxies], ttl=30, node_timeout=NODE_TIMEOUT)
    assert not lock.locked()  # a pooled connection per node, to be slowed down
    injected = 0
    for _ in range(ROUNDS):
        _slow_down(proxies)
        disarm = _arm(exceptions)
        try:
            try:
                if lock.acquire(blocking=False):
                    lock.release()
            except Injected:
                injected += 1
            except NodeUnavailable:
                pass  # the slow nodes did not answer within the budget
            finally:
                disarm()
        except Injected:  # landed in the round's own code, after the calls
            injected += 1
        while True:  # the caller's finally: release a hold the calls returned
            try:
                while lock._holds.live() is not None:
                    lock.release()
                break
            except Injected:
                injected += 1
        _assert_no_orphan(servers, proxies, lock.key)
    assert injected >= ROUNDS // 3, injected
    for proxy in proxies:
        proxy.restore()
    assert lock.acquire(blocking=False), "a later acquisition was refused"
    lock.release()


@pytest.mark.parametrize("cancels", [1, 2])
@pytest.mark.parametrize("count", [1, 3])
@pytest.mark.timeout(120)
def test_a_cancelled_async_acquire_or_release_leaves_no_orphan(
    redis_factory, fault_proxy, count, cancels
):
    """AsyncRedlock, cancelled once or twice at random points: no orphan.

    Before the fix: 5 of 5 cancellations against a slow node left the key behind.
    """
    servers, proxies = _nodes(redis_factory, fault_proxy, count)

    async def main() -> int:
        lock = AsyncRedlock(
            "job", nodes=[p.url for p in proxies], ttl=30, node_timeout=NODE_TIMEOUT
        )
        assert not await lock.locked()  # a pooled connection per node, to be slowed down
        cancelled = 0

        async def body() -> None:
            if await lock.acquire(blocking=False):
                try:
                    pass  # no await: a cancellation lands in acquire() or release()
                finally:
                    await lock.release()

        for _ in range(ROUNDS):
            _slow_down(proxies)
            task = asyncio.ensure_future(body())
            for _ in range(cancels):
                await asyncio.sleep(random.uniform(1e-4, 0.2))
                task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                cancelled += 1
            except NodeUnavailable:
                pass  # the slow nodes did not answer within the budget
            await asyncio.to_thread(_assert_no_orphan, servers, proxies, lock.key)
        for proxy in proxies:
            proxy.restore()
        assert await lock.acquire(blocking=False), "a later acquisition was refused"
        await lock.release()
        return cancelled

    assert asyncio.run(main()) >= ROUNDS // 3
