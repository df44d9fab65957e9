"""Waiting for a lock: woken by the holder's release (one waiter per release), or by
the end of the holder's lease, and never past the caller's timeout."""

from __future__ import annotations

import multiprocessing
import threading
import time
from typing import Any

import pytest

from celery_redlock import Redlock
from tests.harness.servers import wait_for


@pytest.mark.smoke
def test_waiter_is_woken_by_the_release_not_by_the_ttl(redis_node):
    """With the holder's lease 30 s out, a waiter gets the lock within 2 s of the release."""
    holder = Redlock("job", nodes=[redis_node.url], ttl=30)
    waiter = Redlock("job", nodes=[redis_node.url], ttl=30)
    assert holder.acquire()
    got = {}
    attempts = []
    real_attempt = waiter._attempt

    def counted_attempt(*args):
        attempts.append(time.monotonic())
        return real_attempt(*args)

    waiter._attempt = counted_attempt

    def wait() -> None:
        got["ok"] = waiter.acquire(timeout=20)
        got["at"] = time.monotonic()
        got["owned"] = waiter.owned()  # a hold belongs to the thread that acquired it
        waiter.release()

    thread = threading.Thread(target=wait)
    thread.start()
    # The waiter is parked once it has subscribed to the release channel.
    client = redis_node.client()
    wait_for(lambda: client.pubsub_numsub("redlock:{job}:released")[0][1] >= 1, timeout=5)
    released_at = time.monotonic()
    holder.release()
    thread.join(10)
    assert got["ok"] is True
    assert got["at"] - released_at < 2.0
    assert got["owned"]
    # First try, one more once subscribed (closing the race with a release), one
    # after the wake-up: a poller would have made dozens by now.
    assert len(attempts) <= 3, f"the waiter polled: {len(attempts)} attempts"


def test_waiter_falls_back_to_the_holders_ttl(redis_node):
    """A lease that expires (no release message) still wakes the waiter."""
    holder = Redlock("job", nodes=[redis_node.url], ttl=0.6, auto_renew=False)
    waiter = Redlock("job", nodes=[redis_node.url], ttl=5)
    assert holder.acquire()
    assert waiter.acquire(timeout=5)
    waiter.release()


def test_blocking_acquire_times_out(redis_node):
    """acquire(timeout=...) returns False once the timeout passes."""
    holder = Redlock("job", nodes=[redis_node.url], ttl=10)
    waiter = Redlock("job", nodes=[redis_node.url], ttl=10)
    assert holder.acquire()
    assert waiter.acquire(timeout=0.3) is False
    holder.release()


def _hold_in_a_child(url, name, held, let_go):
    lock = Redlock(name, nodes=[url], ttl=30)
    assert lock.acquire(timeout=10)
    held.set()
    let_go.wait(60)
    lock.release()


def test_a_release_wakes_one_waiter_not_all(redis_node):
    """8 threads wait on a lock held by another process: its release sends one of them
    to Redis, not all 8 (and that one hands it on to the next, in this process)."""
    ctx = multiprocessing.get_context("fork")
    held, let_go = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold_in_a_child, args=(redis_node.url, "herd", held, let_go))
    holder.start()
    assert held.wait(20)
    attempts = []
    waiters = [Redlock("herd", nodes=[redis_node.url], ttl=30) for _ in range(8)]
    for waiter in waiters:
        real = waiter._attempt
        waiter._attempt = lambda *args, real=real: attempts.append(1) or real(*args)

    def take_and_pass(lock: Redlock) -> None:
        assert lock.acquire(timeout=30)
        lock.release()

    threads = [threading.Thread(target=take_and_pass, args=(w,)) for w in waiters]
    for thread in threads:
        thread.start()
    client = redis_node.client()
    from celery_redlock.engine.waiting import get_listener

    listener = get_listener(waiters[0].nodeset.nodes[0])
    channel = waiters[0].keys.channel
    # Each waiter has tried and is registered (the first also retried once subscribed;
    # the others, finding the channel subscribed, registered before their first try).
    wait_for(
        lambda: (
            client.pubsub_numsub(channel)[0][1] >= 1
            and len(attempts) >= 8
            and len(listener._waiters.get(channel, {})) == 8
        ),
        timeout=10,
    )
    before = len(attempts)
    let_go.set()
    holder.join(20)
    assert holder.exitcode == 0
    for thread in threads:
        thread.join(30)
    # One attempt per release (8), not 8 + 7 + ... + 1 = 36; a little slack for a
    # waiter that races a release between its tries.
    assert len(attempts) - before <= 8 + 4, f"{len(attempts) - before} attempts for 8 handoffs"


def _numsub(client, channel: str) -> int:
    return client.pubsub_numsub(channel)[0][1]


def test_a_waiter_cut_off_before_it_could_unregister_leaves_nothing_behind(redis_node):
    """An exception landing in a blocking acquire() between the listener's registration
    of its wake-up and the Subscription reaching the caller (a soft time limit) leaves
    no registration once the waiter is gone: the channel is unsubscribed, and the next
    release wakes a waiter that is still there, not the one that left."""
    import gc

    from celery_redlock.engine.waiting import Subscription, Wakeup, get_listener
    from celery_redlock.nodes import NodeSet

    node = NodeSet.get([redis_node.url], timeout=1.0).nodes[0]
    listener = get_listener(node)
    client = redis_node.client()
    channel = "redlock:{cut}:released"
    listener.add(channel, Wakeup())  # what a cut-off Subscription() leaves: nobody keeps it
    gc.collect()
    wait_for(lambda: channel not in listener._waiters, timeout=5, message="registration kept")
    wait_for(lambda: _numsub(client, channel) == 0, timeout=5, message="still subscribed")

    gone = Wakeup()
    listener.add(channel, gone)
    with Subscription((node,), channel, confirm_timeout=5) as staying:
        assert staying.confirmed()
        del gone  # registered before the waiter that stays: first in line to be woken
        gc.collect()
        client.publish(channel, "")
        assert staying.wait(5), "the release woke the waiter that left"


def test_an_announcement_is_dispatched_without_the_subscription_bookkeeping(redis_node):
    """The listener hands announcements to waiters without bringing its subscriptions
    up to date each time (it does that when a waiter asks, and once per
    SYNC_INTERVAL): the woken waiter needs the GIL, and the listener's Python work
    before its next blocking call is on every handoff's path (issue 27, P8). Before,
    every announcement cost one pass over the channels (50 here)."""
    from celery_redlock.engine.waiting import Subscription, get_listener
    from celery_redlock.nodes import NodeSet

    node = NodeSet.get([redis_node.url], timeout=1.0).nodes[0]
    listener = get_listener(node)
    client = redis_node.client()
    channel = "redlock:{bookkeeping}:released"
    syncs: list[float] = []
    real_sync = listener._sync

    def counted_sync(conn):
        syncs.append(time.monotonic())
        return real_sync(conn)

    listener._sync = counted_sync
    try:
        with Subscription((node,), channel, confirm_timeout=5) as waiter:
            assert waiter.confirmed()
            syncs.clear()
            began = time.monotonic()
            for _ in range(50):
                client.publish(channel, "")
                assert waiter.wait(5), "an announcement was lost"
            took = time.monotonic() - began
    finally:
        del listener._sync
        client.close()
    # At most one per SYNC_INTERVAL (1 s) passed, and one more at either end.
    assert len(syncs) <= took + 2, (len(syncs), took)


class _Stop(BaseException):
    """Not an Exception: what a thread cannot handle but must end on."""


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # _Stop
@pytest.mark.parametrize("raised", [RuntimeError, _Stop])
def test_a_listener_hit_by_an_exception_serves_again(redis_node, raised):
    """An exception raised asynchronously in the listener thread (as the threads pool's
    abort or a soft time limit does in whatever thread it targets): an ``Exception`` is
    logged and the listener reconnects; a ``BaseException`` ends the thread, and the
    next waiter starts another. Either way releases wake waiters again. Before, either
    stopped the thread with its run lock held: no listener was ever started again in the
    process, every waiter waited out its timeout, and pokes filled the wake-up socket
    until a waiter's registration blocked for good (seen in a full test run)."""
    import ctypes

    from celery_redlock.engine.waiting import Subscription, get_listener
    from celery_redlock.nodes import NodeSet

    node = NodeSet.get([redis_node.url], timeout=1.0).nodes[0]
    listener = get_listener(node)
    wait_for(listener._run_lock.locked, timeout=5)
    (thread,) = [t for t in threading.enumerate() if t.name == listener.name]
    hit = ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread.ident), ctypes.py_object(raised)
    )
    assert hit == 1
    listener._poke()  # back in Python at once, where the exception lands
    if raised is _Stop:
        wait_for(lambda: not listener._run_lock.locked(), timeout=5, message="still running")
        listener._started_at = -60.0  # its start grace is long over in a real process
    client = redis_node.client()
    channel = f"redlock:{{hit-{raised.__name__}}}:released"
    try:
        with Subscription((node,), channel, confirm_timeout=5) as waiter:
            assert waiter.confirmed(), "no listener subscribed"
            client.publish(channel, "")
            assert waiter.wait(5), "the release woke nobody"
    finally:
        client.close()


def test_a_confirmation_lost_by_one_waiter_is_not_lost_for_the_next(redis_node):
    """Each waiter has its own subscription confirmation. One shared by all, consumed
    and set again by each waiter, was lost for every later waiter of the process when
    an exception landed in between: each then waited its full confirmation timeout."""
    from celery_redlock.engine.waiting import Subscription
    from celery_redlock.nodes import NodeSet

    nodes = NodeSet.get([redis_node.url], timeout=1.0).nodes
    channel = "redlock:{confirm}:released"
    with Subscription(nodes, channel, confirm_timeout=5) as first:
        assert first.confirmation.wait(0)  # consumed, never set again: cut off here
        with Subscription(nodes, channel, confirm_timeout=2) as second:
            assert second.confirmed()


def test_an_exception_in_the_clean_up_after_acquiring_ends_the_hold(redis_node, monkeypatch):
    """A waiter takes the lock, then an exception lands while it stops listening (a
    soft time limit at that moment): acquire() raises, so its caller will never
    release; the lock must not stay held until its ttl runs out."""
    from celery_redlock.engine.waiting import Subscription
    from tests.unit.engine.test_lock_handles import Injected, _holding

    holder = Redlock("job", nodes=[redis_node.url], ttl=30)
    waiter = Redlock("job", nodes=[redis_node.url], ttl=30)
    assert holder.acquire()
    close = Subscription.close

    def cut_off(self):
        close(self)
        raise Injected

    monkeypatch.setattr(Subscription, "close", cut_off)
    raised = []

    def wait() -> None:
        try:
            waiter.acquire(timeout=20)
        except Injected as exc:
            raised.append(exc)
        raised.append(_holding(waiter))

    thread = threading.Thread(target=wait)
    thread.start()
    client = redis_node.client()
    wait_for(lambda: _numsub(client, "redlock:{job}:released") >= 1, timeout=5)
    holder.release()
    thread.join(10)
    assert len(raised) == 2 and isinstance(raised[0], Injected), raised
    assert raised[1] is False, "acquire() raised, yet the thread still holds the lock"
    assert not client.exists(holder.key)


def test_a_process_that_waits_again_finds_the_channel_subscribed(redis_node, monkeypatch):
    """A prefork child waiting for a hot key task after task: its second wait sends no
    SUBSCRIBE and no retry once subscribed: one refused try, then the release names it
    and its try takes the reserved lock (the first wait takes a SUBSCRIBE and at least
    two script calls, one of them the retry once subscribed)."""
    from celery_redlock.engine import waiting

    monkeypatch.setattr(waiting, "LINGER", 60.0)  # the second wait comes within it
    ctx = multiprocessing.get_context("fork")
    waiter = Redlock("again", nodes=[redis_node.url], ttl=30)
    attempts: list[int] = []
    real = waiter._attempt

    def counted_attempt(*args):
        result = real(*args)
        attempts.append(1)  # once answered: a refused try is over when it counts
        return result

    waiter._attempt = counted_attempt
    client = redis_node.client()
    counts, got = [], []
    for _ in range(2):
        held, let_go = ctx.Event(), ctx.Event()
        holder = ctx.Process(target=_hold_in_a_child, args=(redis_node.url, "again", held, let_go))
        holder.start()
        assert held.wait(20)
        redis_node.reset_stats()
        attempts.clear()

        def take_and_release() -> None:
            got.append(waiter.acquire(timeout=30))
            waiter.release()

        thread = threading.Thread(target=take_and_release)
        thread.start()
        listener = waiting.get_listener(waiter.nodeset.nodes[0])
        channel = waiter.keys.channel
        wait_for(lambda: attempts and listener._waiters.get(channel), timeout=10)  # noqa: B023
        wait_for(lambda: listener.subscribed(channel), timeout=10)  # noqa: B023
        let_go.set()
        holder.join(20)
        thread.join(20)
        assert got.pop() is True
        counts.append((len(attempts), redis_node.commandstats().get("subscribe", 0)))
    first, second = counts
    assert first[1] == 1 and first[0] >= 2, first  # subscribed, retried once subscribed
    assert client.pubsub_numsub(waiter.keys.channel)[0][1] == 1  # lingering
    assert second == (1, 0), second  # refused, then granted by the release: nothing else


def test_a_lone_waiter_reads_its_name_in_its_own_thread(redis_node, monkeypatch):
    """A prefork child waiting for a hot key is its process's only waiter: the name a
    release of another process publishes is read and dispatched by the waiting thread
    itself, and the listener thread reads nothing: no hop from the listener thread to
    the waiter on the handoff's path."""
    from celery_redlock.engine import waiting

    ctx = multiprocessing.get_context("fork")
    held, let_go = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold_in_a_child, args=(redis_node.url, "lone", held, let_go))
    holder.start()
    assert held.wait(20)
    readers: list[str] = []
    real_dispatch = waiting._Listener._dispatch

    def counted_dispatch(self, message):
        if isinstance(message, list) and message and message[0] == "message":
            readers.append(threading.current_thread().name)
        real_dispatch(self, message)

    monkeypatch.setattr(waiting._Listener, "_dispatch", counted_dispatch)
    waiter = Redlock("lone", nodes=[redis_node.url], ttl=30)
    got: dict[str, Any] = {}

    def wait() -> None:
        got["ok"] = waiter.acquire(timeout=20)
        waiter.release()

    thread = threading.Thread(target=wait, name="task")
    thread.start()
    try:
        listener = waiting.get_listener(waiter.nodeset.nodes[0])
        wait_for(lambda: listener._direct is not None, timeout=10, message="not reading")
        let_go.set()
        thread.join(20)
        assert got == {"ok": True}
        # The grant (and whatever else arrived while it waited): none by the listener.
        assert readers and set(readers) == {"task"}, readers
    finally:
        let_go.set()
        holder.join(20)


def test_a_waiter_reading_its_announcements_is_woken_by_a_thread_of_its_process(redis_node):
    """A wake-up from this process (a releasing thread handing the lock over, or
    granting it in place) reaches a waiter that polls the pub/sub connection itself:
    its poll is interrupted, instead of running to the end of its wait."""
    from celery_redlock.engine.waiting import Subscription, get_listener
    from celery_redlock.nodes import NodeSet

    node = NodeSet.get([redis_node.url], timeout=1.0).nodes[0]
    listener = get_listener(node)
    result: list[bool] = []
    with Subscription((node,), "redlock:{poked}:released", confirm_timeout=5) as waiter:
        assert waiter.confirmed()
        thread = threading.Thread(target=lambda: result.append(waiter.wait(60)))
        began = time.monotonic()
        thread.start()
        wait_for(lambda: listener._direct is not None, timeout=10, message="not reading")
        waiter.event.set()
        thread.join(20)
    assert result == [True]
    assert time.monotonic() - began < 20  # not the wait's 60 s
    assert listener._direct is None and waiter.event.reader is None


@pytest.mark.parametrize("where", ["while parsing", "holding the read lock"])
def test_a_waiter_cut_off_while_reading_costs_the_connection_not_the_waiters(
    redis_node, monkeypatch, where
):
    """An exception that lands in a waiter while it reads announcements itself (a soft
    time limit) leaves the connection's parser in an unknown state: the listener thread
    replaces the connection, and later waiters are woken by releases as before. One that
    left the read lock held (cut off between taking and returning it) costs the same,
    once its wait is over."""
    from celery_redlock.engine import waiting
    from celery_redlock.engine.waiting import Subscription, get_listener
    from celery_redlock.nodes import NodeSet

    node = NodeSet.get([redis_node.url], timeout=1.0).nodes[0]
    listener = get_listener(node)
    client = redis_node.client()
    channel = "redlock:{cut}:released"
    stale = (threading.get_ident(), time.monotonic())
    with Subscription((node,), channel, confirm_timeout=5) as waiter:
        assert waiter.confirmed()
        first = listener._conn
        if where == "while parsing":
            real_dispatch = waiting._Listener._dispatch

            def landed(self, message):
                raise RuntimeError("a soft time limit, say")

            raised: list[BaseException] = []

            def wait() -> None:
                try:
                    waiter.wait(10)
                except RuntimeError as exc:
                    raised.append(exc)

            thread = threading.Thread(target=wait)
            thread.start()
            wait_for(lambda: listener._direct is not None, timeout=10, message="not reading")
            monkeypatch.setattr(waiting._Listener, "_dispatch", landed)
            client.publish(channel, "")
            thread.join(20)
            monkeypatch.setattr(waiting._Listener, "_dispatch", real_dispatch)
            assert len(raised) == 1, "the exception did not reach the waiter"
        else:
            monkeypatch.setattr(waiting, "START_GRACE", 0.0)
            listener._read_lock.acquire()  # and never returned
            listener._direct = stale  # its wait is over
            listener._poke()
    try:
        wait_for(lambda: listener._conn not in (None, first), timeout=10, message="kept")
        with Subscription((node,), channel, confirm_timeout=5) as waiter:
            assert waiter.confirmed(), "no listener subscribed"
            woken: list[bool] = []
            thread = threading.Thread(target=lambda: woken.append(waiter.wait(10)))
            thread.start()
            # It reads the new connection itself again.
            wait_for(lambda: listener._direct not in (None, stale), timeout=10)
            client.publish(channel, "")
            thread.join(20)
            assert woken == [True], "the release woke nobody"
    finally:
        client.close()


def test_a_registration_that_never_waits_is_read_for_once_it_asks(redis_factory, monkeypatch):
    """After a waiter read the connection itself, the listener thread polls it again only
    when asked. A registration that never waits in ``wait()`` (a copy in the worker's
    timer, ``wakeups``) asks with ``watch()``, and the listener thread then reads the
    release for it, long before its next sync."""
    from celery_redlock.engine import waiting
    from celery_redlock.engine.waiting import Subscription, get_listener
    from celery_redlock.nodes import NodeSet

    # A server, node and listener of the test's own, made after the sync interval is
    # lengthened: a listener made before it (the worker's shared server's) may still be
    # in a poll timed by the old interval, wake from it, and poll the connection again
    # unasked (the full suite saw it).
    monkeypatch.setattr(waiting, "LINGER", 60.0)
    monkeypatch.setattr(waiting, "SYNC_INTERVAL", 60.0)
    (redis_node,) = redis_factory(1)
    node = NodeSet.get([redis_node.url], timeout=1.0).nodes[0]
    listener = get_listener(node)
    client = redis_node.client()
    channel = "redlock:{timer}:released"
    try:
        with Subscription((node,), channel, confirm_timeout=5) as first:
            assert first.confirmed()
            woken: list[bool] = []
            thread = threading.Thread(target=lambda: woken.append(first.wait(10)))
            thread.start()
            wait_for(lambda: listener._direct is not None, timeout=10, message="not reading")
            client.publish(channel, "")
            thread.join(20)
            assert woken == [True]
        assert not listener._watching  # nobody asked it to poll again
        with Subscription((node,), channel, confirm_timeout=5) as sleeper:
            assert sleeper.confirmed()  # still subscribed: registered without a poke
            sleeper.watch()
            wait_for(lambda: listener._watching, timeout=10, message="not polling")
            client.publish(channel, "")
            wait_for(sleeper.event.is_set, timeout=10, message="the release woke nobody")
    finally:
        client.close()


def test_announcements_read_by_either_thread_are_never_lost(redis_node):
    """2,000 releases in a row, each waited for by the process's only waiter, which reads
    the connection itself while the listener thread may too (it polled before the
    waiter's session began): every one wakes the waiter. Before, a reader's poll that
    began between the other's read and its count of that read trusted a "readable"
    already used up, and waited in ``recv`` for data that was not coming (a wait of the
    socket timeout, then the connection given up; seen as a lost announcement once in
    every few hundred to thousand waits)."""
    from celery_redlock.engine.waiting import Subscription
    from celery_redlock.nodes import NodeSet

    node = NodeSet.get([redis_node.url], timeout=1.0).nodes[0]
    client = redis_node.client()
    lost = 0
    try:
        for round_ in range(40):
            channel = f"redlock:{{often-{round_}}}:released"
            with Subscription((node,), channel, confirm_timeout=5) as waiter:
                assert waiter.confirmed()
                for _ in range(50):
                    client.publish(channel, "")
                    lost += not waiter.wait(2)
    finally:
        client.close()
    assert lost == 0, f"{lost} of 2,000 announcements lost"


def test_a_wake_up_no_node_announced_ends_a_redlock_wait_with_a_partial_quorum(
    redis_factory,
):
    """A Redlock waiter on 3 nodes waits for 2 nodes' announcements of a release; one
    has come. A wake-up no node announced (a releasing thread of this process handing
    it the lock) must end the wait at once, not be waited out with the first
    announcement until the timeout while the waiter holds the lock the handoff gave it
    (seen: every thread of a process stalled 0.5-0.67 s)."""
    from celery_redlock.engine.waiting import Subscription
    from celery_redlock.nodes import NodeSet

    nodes = NodeSet.get([s.url for s in redis_factory(3)], timeout=1.0).nodes
    with Subscription(nodes, "redlock:{partial}:released", confirm_timeout=2, quorum=2) as sub:
        sub._heard.add(nodes[0].url)  # one node announced a release to this waiter
        sub.event.set()  # then the handoff's wake-up, which no node announced
        began = time.monotonic()
        assert sub.wait(5.0) is True
        assert time.monotonic() - began < 5.0, "woken by the handoff, not by the timeout"
