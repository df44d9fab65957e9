"""The per-process renewer: batching, thread count, loss detection, fork safety."""

from __future__ import annotations

import collections
import importlib
import math
import multiprocessing
import threading
import time

import pytest

from celery_redlock import LockLost, LockNotOwned, Redlock
from celery_redlock.engine import renewal
from celery_redlock.engine.lease import CHUNK, clock
from celery_redlock.engine.renewal import Renewer, get_renewer
from tests.harness.servers import wait_for


def test_ten_thousand_locks_cost_one_call_per_node_per_chunk_per_tick(redis_factory):
    """10,000 held locks on 3 nodes: each tick is 10 renew_many calls per node, one thread."""
    servers = redis_factory(3)
    urls = [s.url for s in servers]
    n_locks = 10_000
    # A long lease so none expires while 10,000 are taken.
    locks = [Redlock(f"bulk:{i}", nodes=urls, ttl=60, auto_renew=False) for i in range(n_locks)]
    for lock in locks:
        assert lock.acquire(blocking=False)
    locks[0].extend()  # the first renew_many loads the script: measure a steady tick
    renewer = Renewer()  # private, so other tests' locks do not ride along
    try:
        check_one_tick(renewer, servers, locks)
    finally:
        for lock in locks:
            lock.lease.released = True


def ours(before):
    """Threads the library started since ``before`` (other tests' threads may come and go)."""
    return [
        t for t in threading.enumerate() if t not in before and t.name.startswith("celery_redlock")
    ]


def check_one_tick(renewer, servers, locks):
    threads_before = set(threading.enumerate())
    for server in servers:
        server.reset_stats()
    # All due at one instant, so the batching is measured, not the machine's speed
    # at handing 10,000 leases over.
    due = clock() + 0.5
    for lock in locks:
        renewer._schedule(lock.lease, due)
    renewer.start()
    wait_for(lambda: renewer._thread is not None, timeout=5)  # start() does not wait for it
    assert ours(threads_before) == [renewer._thread], "one renewer thread for all"
    deadlines = [lock.lease.deadline for lock in locks]
    wait_for(
        lambda: (
            renewer.ticks >= 1
            and all(lock.lease.deadline > d for lock, d in zip(locks, deadlines, strict=True))
        ),
        timeout=10,
    )
    assert renewer.ticks == 1, "every lease was due in the same tick"
    chunks = math.ceil(len(locks) / CHUNK)
    for server in servers:
        stats = server.commandstats()
        assert stats.get("evalsha") == chunks, f"{server.url}: {stats}"
        assert "eval" not in stats
    assert renewer.calls == chunks * len(servers)
    assert ours(threads_before) == [renewer._thread]


def test_node_unreachable_is_a_loss_before_the_local_deadline(redis_factory):
    """With the only node dead, on_lost fires before the lease could have expired."""
    (server,) = redis_factory(1)
    lost_at = []
    lock = Redlock(
        "job",
        nodes=[server.url],
        ttl=1.5,
        on_lost=lambda exc: lost_at.append((clock(), exc)),
    )
    assert lock.acquire()
    server.kill()
    wait_for(lambda: lost_at, timeout=10)
    when, exc = lost_at[0]
    assert isinstance(exc, LockLost)
    assert when < lock.lease.deadline, "the loss must be reported before the lease ends"
    assert "renewal not confirmed" in exc.reason


def test_blackholed_node_is_a_loss_before_the_local_deadline(redis_node, fault_proxy):
    """A node that stops answering mid-hold: the renewer gives up in time, never silently."""
    proxy = fault_proxy(redis_node)
    lost_at = []
    lock = Redlock("job", nodes=[proxy.url], ttl=1.5, on_lost=lambda exc: lost_at.append(clock()))
    assert lock.acquire()
    proxy.blackhole()
    wait_for(lambda: lost_at, timeout=10)
    assert lost_at[0] < lock.lease.deadline


def test_no_renewal_call_runs_past_the_give_up_time(redis_node, fault_proxy):
    """Retried renewals of a blackholed node are each given a budget that ends by the
    lease's give-up time: the loss is then declared there, the whole margin before the
    deadline. A budget that ran past it declared it up to a node timeout later, and a
    stall of the loaded CI machine took the rest (reported 0.17 s after the deadline,
    ``tests/reliability/test_partition.py``)."""
    proxy = fault_proxy(redis_node)
    lost_at = []
    lock = Redlock("job", nodes=[proxy.url], ttl=1.5, on_lost=lambda exc: lost_at.append(clock()))
    assert lock.acquire()
    calls = []
    real = lock.nodeset.call

    def recorded(*args, **kwargs):
        if threading.current_thread().name == "celery_redlock-renewer":
            calls.append((clock(), kwargs.get("timeout")))
        return real(*args, **kwargs)

    lock.nodeset.call = recorded
    try:
        proxy.blackhole()
        wait_for(lambda: lost_at, timeout=10)
    finally:
        del lock.nodeset.call
    give_up_at = lock.lease.give_up_at
    assert calls, "the renewer retried"
    late = [(at, timeout) for at, timeout in calls if at + timeout > give_up_at + 0.01]
    assert not late, f"renewal budgets past the give-up time {give_up_at:.3f}: {late}"
    assert lost_at[0] < lock.lease.deadline


def test_a_minority_failing_does_not_lose_the_lock(redis_factory):
    """Renewal needs a quorum, not every node."""
    servers = redis_factory(3)
    lost = []
    lock = Redlock("job", nodes=[s.url for s in servers], ttl=1.2, on_lost=lost.append)
    assert lock.acquire()
    servers[0].kill()
    start = get_renewer().ticks
    wait_for(lambda: get_renewer().ticks >= start + 4, timeout=10)
    assert not lost
    lock.check()
    lock.release()


def _child(lock: Redlock, conn) -> None:
    report = {}
    try:
        lock.release()
    except LockNotOwned as exc:
        report["release"] = str(exc)
    try:
        lock.extend()
    except LockNotOwned as exc:
        report["extend"] = str(exc)
    try:
        lock.check()
    except LockLost as exc:
        report["check"] = exc.reason
    report["owned"] = lock.owned()
    report["pending"] = len(get_renewer())
    # The child has a working renewer of its own.
    own = Redlock("child-job", nodes=lock.nodeset.nodes[0].url, ttl=0.9)
    own.acquire()
    time.sleep(2)  # the scenario: hold past two lease lengths, renewed by the child
    report["own_renewed"] = own.remaining() > 0 and own.owned()
    own.release()
    conn.send(report)
    conn.close()


def test_a_forked_child_cannot_renew_or_release_its_parents_lock(redis_node):
    """The child's release/extend raise, its renewer starts empty, and works for its own."""
    lock = Redlock("job", nodes=[redis_node.url], ttl=5)
    assert lock.acquire()
    ctx = multiprocessing.get_context("fork")
    parent_end, child_end = ctx.Pipe()
    child = ctx.Process(target=_child, args=(lock, child_end))
    child.start()
    assert parent_end.poll(20), "child did not report"
    report = parent_end.recv()
    child.join(10)
    assert child.exitcode == 0
    assert "forked child" in report["release"]
    assert "forked child" in report["extend"]
    assert "forked child" in report["check"]
    assert report["owned"] is False
    assert report["pending"] == 0
    assert report["own_renewed"] is True
    assert lock.owned(), "the parent still holds its lock"
    lock.check()
    lock.release()


def test_the_drain_after_each_test_finds_the_renewer():
    """conftest looks the renewer's module up by name after every test; a stale name
    (the module moved) would silently stop draining the leases tests leave behind."""
    from tests.conftest import RENEWAL_MODULE

    assert importlib.import_module(RENEWAL_MODULE)._renewer is renewal._renewer


def _held(redis_node, name, ttl=30):
    lock = Redlock(name, nodes=[redis_node.url], ttl=ttl, auto_renew=False)
    assert lock.acquire(blocking=False)
    return lock


def test_a_lease_due_after_the_renewers_wake_up_time_does_not_wake_it(redis_node):
    """Taking a lock costs the renewer thread no wake-up unless the lease is due first.

    The task path adds a lease per task; a pipe write and a thread switch for each
    showed in the pool children's CPU (issue 17). A lease due before the thread's
    wake-up time still wakes it: with a 60 s sleep, only a wake-up renews it in time.
    """
    renewer = Renewer()
    renewer.MAX_SLEEP = 60.0
    first = _held(redis_node, "first")
    later = [_held(redis_node, f"later:{i}") for i in range(100)]
    urgent = _held(redis_node, "urgent")
    try:
        renewer._schedule(first.lease, clock() + 20)
        renewer.start()
        wait_for(lambda: renewer._wakes_at > 0, timeout=5, message="renewer never slept")
        before = renewer.wakeups
        for lock in later:
            renewer._schedule(lock.lease, clock() + 30)
        assert renewer.wakeups == before, "leases due after its wake-up time woke it"
        deadline = urgent.lease.deadline
        renewer._schedule(urgent.lease, clock())
        assert renewer.wakeups == before + 1
        wait_for(lambda: urgent.lease.deadline > deadline, timeout=10, message="not renewed")
    finally:
        for lock in [first, *later, urgent]:
            lock.lease.released = True
        renewer._wake()


class _HookedInbox(collections.deque):
    """An inbox that runs ``hook`` the first time the renewer asks whether it is empty."""

    def __init__(self, hook):
        super().__init__()
        self.hook = hook

    def __len__(self):
        hook, self.hook = self.hook, None
        if hook is not None:
            hook()
        return super().__len__()


@pytest.mark.parametrize(
    ("moment", "due_in", "woken_or_seen"),
    [
        ("before_sleeping", 0.0, True),
        ("before_looking", 0.0, True),
        ("after_looking", 0.0, True),
        # The control: a lease due after the wake-up time is meant to wait for it.
        ("after_looking", 3600.0, False),
    ],
)
def test_a_lease_queued_at_any_moment_of_the_renewers_sleep_is_seen(
    monkeypatch, moment, due_in, woken_or_seen
):
    """Whichever way a task thread's queueing interleaves with the renewer going to
    sleep, a lease due before the wake-up time is in the inbox before the thread
    sleeps, or the pipe is readable when it polls it."""
    renewer = Renewer()
    lease = object()

    def queue():
        renewer._schedule(lease, clock() + due_in)

    slept = []
    me = threading.get_ident()

    def fake_readable(readers, timeout):
        if threading.get_ident() != me:  # the process's own renewer, started by other tests
            return real_readable(readers, timeout)
        if moment == "after_looking":
            queue()
        ready = real_readable(readers, 0)
        slept.append(not ready)
        return ready

    real_readable = renewal.readable
    monkeypatch.setattr(renewal, "readable", fake_readable)
    renewer._inbox = _HookedInbox(queue if moment == "before_looking" else None)
    if moment == "before_sleeping":
        queue()
    try:
        renewer._sleep(30)
    finally:
        renewer.close()
    assert list(renewer._inbox) and renewer._inbox[0][1] is lease
    assert slept == ([] if moment != "after_looking" else [not woken_or_seen])
    assert renewer._wakes_at == 0.0, "awake again: queueing must not write the pipe"


def test_the_leases_of_a_tick_go_back_into_the_heap_as_one_group(redis_node):
    """Renewed together, due again together: after each tick the heap holds one entry
    for all 1,000 leases, not one per lease (the heap's work and the objects a tick
    leaves behind do not grow with the locks held; issue 27, P4)."""
    locks = [_held(redis_node, f"group:{i}", ttl=6) for i in range(1_000)]
    renewer = Renewer()

    def between_ticks(ticks):
        """The heap as the renewer thread left it after tick ``ticks``, or None yet."""
        heap = list(renewer._heap)
        settled = renewer.ticks == ticks and not renewer._ticking
        return heap if settled and heap else None

    try:
        due = clock() + 0.2
        for lock in locks:
            renewer._schedule(lock.lease, due)
        renewer.start()
        for ticks in (1, 2):  # the first from the leases scheduled one by one, then its own
            heap = wait_for(lambda ticks=ticks: between_ticks(ticks), timeout=10)
            ((next_due, _, window, group),) = heap
            assert sorted(map(id, group)) == sorted(id(lock.lease) for lock in locks)
            interval = locks[0].timing.renew_interval
            assert window == renewal.COALESCE * interval
            assert clock() < next_due <= clock() + interval, "due an interval after the tick"
            assert renewer.calls == ticks * math.ceil(len(locks) / CHUNK)
    finally:
        for lock in locks:
            lock.lease.released = True
        renewer._wake()


def test_a_lease_lost_in_a_tick_leaves_the_others_renewed_together(redis_node):
    """One key deleted under 20 held locks: that lease is reported lost at its first
    renewal and leaves the heap; the 19 others are renewed and stay one group."""
    locks = [_held(redis_node, f"one-lost:{i}") for i in range(20)]
    lost = []
    locks[7].lease.on_lost.append(lost.append)
    redis_node.client().delete(locks[7].key)
    renewer = Renewer()
    try:
        deadlines = [lock.lease.deadline for lock in locks]
        due = clock()
        for lock in locks:
            renewer._schedule(lock.lease, due)
        renewer.start()
        wait_for(lambda: renewer.ticks >= 1 and not renewer._ticking, timeout=10)
        assert [str(e) for e in lost] == [str(locks[7].lease.lost)]
        assert "expired, was deleted or is held by another owner" in str(lost[0])
        ((_, _, _, group),) = list(renewer._heap)
        assert [lease.keys.lock for lease in group] == [
            lock.key for i, lock in enumerate(locks) if i != 7
        ]
        assert all(
            lock.lease.deadline > d
            for i, (lock, d) in enumerate(zip(locks, deadlines, strict=True))
            if i != 7
        )
    finally:
        for lock in locks:
            lock.lease.released = True
        renewer._wake()
