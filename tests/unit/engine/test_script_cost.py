"""What one lock costs Redis: the commands the scripts run inside one acquisition.

Each ``redis.call`` inside a script costs the node one to three microseconds (Redis
7.0: command lookup, checks, propagation), so on an uncontended lock the scripts'
inner commands, not the protocol, set the node's time per acquisition: an
acquire and a release took 26 us per EVALSHA where redis-py's ``SET NX`` and its
release script take 1.4 and 4.9 us (issue 27, P1). Counted here with ``INFO
commandstats`` around one acquisition (counts, not times).
"""

from __future__ import annotations

import contextlib
import multiprocessing
from collections.abc import Iterator

from celery_redlock import Redlock
from tests.harness import wait_for
from tests.unit.engine.test_waiting import _hold_in_a_child


def inner_commands(redis_node, action) -> dict[str, int]:
    """The commands ``action`` made the node run, scripts' own calls included."""
    action()  # warm: scripts loaded, connections made, fence counter exists
    redis_node.reset_stats()
    action()
    return scripts_commands(redis_node)


def scripts_commands(redis_node) -> dict[str, int]:
    """The node's command counts since its last reset, less the calls themselves."""
    stats = redis_node.commandstats()
    for command in ("evalsha", "config|resetstat", "hello", "client|setinfo", "select", "ping"):
        stats.pop(command, None)  # the call itself, or a connection being made
    return stats


@contextlib.contextmanager
def held_by_a_child(redis_node, name: str) -> Iterator[None]:
    """``name`` held by a forked child process for the length of the block."""
    ctx = multiprocessing.get_context("fork")
    held, let_go = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold_in_a_child, args=(redis_node.url, name, held, let_go))
    holder.start()
    try:
        assert held.wait(20)
        yield
    finally:
        let_go.set()
        holder.join(20)


def test_an_uncontended_acquire_and_release_run_few_commands(redis_node):
    """One node, nobody waiting: 13 commands inside the two scripts (there were 18:
    the fence counter was checked before its INCR, the shared set's writer mark removed
    where no shared set existed, the record left and read in two calls, and the
    release read the clock and lapsed waiters of an empty record)."""
    lock = Redlock("cost", nodes=[redis_node.url], ttl=30)

    def cycle() -> None:
        assert lock.acquire()
        lock.release()

    stats = inner_commands(redis_node, cycle)
    assert sum(stats.values()) <= 13, stats
    assert "time" not in stats and "exists" in stats, stats


def test_a_refused_blocking_try_reads_the_holder_once(redis_node):
    """A blocking try refused by another process's holder (every waiter's try, and the
    releaser's own coming back: one per acquisition across prefork children, issue 27's
    P8) reads the lock hash once. It read it in five calls: the token, the holder's host
    and pid, the holder's task id, and a write-if-absent of the 'waited' mark made even
    when the mark was there. A refreshed place extends no record key."""
    with held_by_a_child(redis_node, "cost-busy"):
        lock = Redlock("cost-busy", nodes=[redis_node.url], ttl=30)
        waiter = lock.kind.new_waiter(True, len(lock.nodeset))
        stats = inner_commands(redis_node, lambda: lock._attempt(waiter))
    assert stats.get("hmget") == 1, stats
    assert "hget" not in stats and "hsetnx" not in stats and "hset" in stats, stats
    # The place refreshed finds its record keys with twice a place's life given at the
    # first try: no PEXPIRE (there were one per key per try, once a millisecond passed).
    assert "pexpire" not in stats, stats


def test_a_first_refused_try_runs_few_commands(redis_node):
    """Every blocked waiter's first try (a token is new per acquisition: with prefork
    children on one key, one such try per acquisition, issue 27's P8) takes its place
    in 12 commands: it writes its place without asking first whether it had one (a write
    that keeps an existing place does both), and does not read the lifetime of the
    waiters' deadlines, which live and die with the queue."""
    with held_by_a_child(redis_node, "cost-first"):
        lock = Redlock("cost-first", nodes=[redis_node.url], ttl=30)

        def first_try() -> None:
            lock._attempt(lock.kind.new_waiter(True, len(lock.nodeset)))

        stats = inner_commands(redis_node, first_try)
    assert stats.get("zscore") == 1, stats  # the abandoned tokens only
    assert stats.get("pttl") == 3, stats  # the lock, the queue, the channels
    assert sum(stats.values()) <= 12, stats


def test_a_handoff_to_a_waiter_of_another_process_runs_few_commands(redis_node):
    """A release that grants the lock to a waiter of another process (every
    acquisition's release with prefork children on one key) runs 17 commands, and the
    waiter none: it holds the lock without asking. (Naming the waiter, which then took
    a reservation with a try of its own, ran 25 together; the stand-by that stays one
    while it waits costs one of them, the read of who stands by, and saves a delivery
    to another process at most handoffs.)"""
    ctx = multiprocessing.get_context("fork")
    lock = Redlock("cost-grant", nodes=[redis_node.url], ttl=30)
    queue = lock.kind.keys.record[0]
    client = redis_node.client()
    stats: dict[str, int] = {}
    for _ in range(2):  # the first warms: scripts loaded, fence counter there
        assert lock.acquire()
        holding, let_go = ctx.Event(), ctx.Event()
        args = (redis_node.url, lock.name, holding, let_go)
        waiter = ctx.Process(target=_hold_in_a_child, args=args)
        waiter.start()
        try:
            wait_for(lambda: client.zcard(queue) == 1, timeout=20)
            redis_node.reset_stats()
            lock.release()
            assert holding.wait(20), "the named waiter took the lock"
            stats = scripts_commands(redis_node)
        finally:
            let_go.set()
            waiter.join(20)
    # The queue read for the waiter to grant it to, and for a stand-by (none: nobody
    # else waits, so one announcement, and the stand-by field is read for nothing);
    # the fence counter; the grant written.
    assert stats.get("zrange") == 2 and stats.get("publish") == 1, stats
    assert stats.get("incr") == 1 and stats.get("hset") == 1, stats
    assert sum(stats.values()) <= 17, stats
