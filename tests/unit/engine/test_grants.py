"""A release of another process grants the lock to the waiter it names.

The waiter wakes up holding it, on the grant's short lease, counted from the attempt
the node recorded it by (:mod:`celery_redlock.engine.waiting`): no try of its own. The
watchdog extends the short lease; a waiting Celery task extends it before its body.
"""

from __future__ import annotations

import multiprocessing
import threading
import time
from types import SimpleNamespace

import pytest

from celery_redlock import Redlock
from celery_redlock.engine.renewal import get_renewer
from celery_redlock.engine.waiting import NAMED_RESERVE
from celery_redlock.integration.task import _take
from tests.harness import wait_for


def _hold_in_a_child(url: str, name: str, held, let_go) -> None:
    lock = Redlock(name, nodes=[url], ttl=30)
    assert lock.acquire(timeout=10)
    held.set()
    let_go.wait(60)
    lock.release()


def after_waiting(url: str, name: str, client, work) -> object:
    """``work(lock)`` in a thread (a hold is its thread's) while a child process holds
    ``name``, which it releases a second after the thread waits (recorded); what
    ``work`` returned."""
    # Spawned: in the full suite a forked child of the pytest worker was refused its
    # connection (to a server the parent reached), from state some earlier test left.
    ctx = multiprocessing.get_context("spawn")
    held, let_go = ctx.Event(), ctx.Event()
    child = ctx.Process(target=_hold_in_a_child, args=(url, name, held, let_go))
    child.start()
    lock = Redlock(name, nodes=[url], ttl=30)
    results: list[object] = []
    try:
        assert held.wait(20)
        waiter = threading.Thread(target=lambda: results.append(work(lock)))
        waiter.start()
        wait_for(lambda: client.zcard(lock.keys.queue) == 1, timeout=20, message="recorded")
        # Held on well past the grant window after the waiter's attempt: the grant is
        # counted from when the node made it, not from the attempt.
        recorded = time.monotonic()
        wait_for(lambda: time.monotonic() - recorded > 1, timeout=5, message="a long hold")
        let_go.set()
        waiter.join(30)
    finally:
        let_go.set()
        child.join(20)
    assert len(results) == 1, "the waiting thread failed"
    return results[0]


@pytest.fixture
def node(redis_factory):
    """A server of the test's own: its children connect to nothing another test stops."""
    (server,) = redis_factory(1)
    return server


def test_a_granted_waiter_holds_on_a_short_lease_that_the_watchdog_extends(node):
    """The waiter's attempts are its refused ones (the first, and one more once subscribed);
    it returns holding the lock with at most the grant's usable window left (a try would
    have returned a whole lease), and the watchdog extends the lease to the ttl."""
    client = node.client()
    attempts: list[int] = []

    def work(lock: Redlock) -> tuple[float, float, str | None, str, float]:
        real = lock._attempt

        def counted(waiter):
            attempts.append(1)
            return real(waiter)

        lock._attempt = counted  # type: ignore[method-assign]
        assert lock.acquire(timeout=20)
        try:
            left, holder = lock.remaining(), client.hget(lock.key, "token")
            wait_for(
                lambda: lock.remaining() > lock.timing.renew_interval,
                timeout=NAMED_RESERVE * 4,
                message="the watchdog extended the grant's lease",
            )
            return left, lock.timing.margin, holder, lock.lease.token, lock.remaining()
        finally:
            lock.release()

    renewals = get_renewer().calls
    left, margin, holder, token, extended = after_waiting(node.url, "granted", client, work)
    assert len(attempts) <= 2, "refused, then granted: no try of its own"
    assert 0 < left <= NAMED_RESERVE + margin, "the grant's lease, less the drift allowance"
    assert holder == token
    assert extended > 10 and get_renewer().calls > renewals


def test_a_task_that_waited_starts_its_body_on_a_full_lease(node):
    """``lock_on_busy="wait"`` granted the lock by another process's release: the lease
    is extended before the body starts, so a body that holds the GIL from its first line
    does not keep the watchdog from a lease of a quarter of a second."""
    client = node.client()
    options = SimpleNamespace(on_busy="wait", wait_timeout=20)

    def work(lock: Redlock) -> tuple[bool, float]:
        waited = _take(lock, options, "task-id")  # type: ignore[arg-type]
        try:
            return waited, lock.remaining()
        finally:
            lock.release()

    waited, left = after_waiting(node.url, "granted-task", client, work)
    assert waited and left > 10, left
