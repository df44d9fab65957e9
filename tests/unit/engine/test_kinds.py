"""The lock kinds (``engine/kinds.py``): what each kind sends and how it reads the
answers, without a server; then the family against real servers and processes:
shares and limits, writers among readers, several resources at once, fair waiting,
and holders that die."""

from __future__ import annotations

import itertools
import multiprocessing
import os
import random
import signal
import threading
import time

import pytest
import redis
from redis.connection import Connection

from celery_redlock import ConfigurationError, Redlock
from celery_redlock.engine.keys import lock_keys
from celery_redlock.engine.kinds import Exclusive, Fair, Holder, Shared, kind_of
from celery_redlock.engine.renewal import get_renewer
from celery_redlock.engine.scripts import (
    ACQUIRE,
    ACQUIRE_FAIR,
    ACQUIRE_SHARED,
    FAIR_LEAVE,
    FENCE_SYNC,
    FENCE_SYNC_SHARED,
    RELEASE,
    RELEASE_FAIR,
    RELEASE_SHARED,
)
from celery_redlock.engine.waiting import named_reserve_ms, process_channel
from celery_redlock.nodes import Call
from celery_redlock.nodes.fanout import pack
from tests.harness import wait_for

# -- each kind's calls and answers (no server) -----------------------------------------

UNREACHABLE = ["redis://127.0.0.1:1/0"]
HOLDER = Holder("task-1", "host", 42, "1700000000.000", "tasks.report")


@pytest.mark.parametrize(
    ("args", "kind", "mode", "limit", "fair"),
    [
        ({"names": ["a"]}, Exclusive, "exclusive", None, False),
        ({"names": ["a", "b"]}, Exclusive, "exclusive", None, False),
        ({"names": ["a"], "fair": True}, Fair, "exclusive", None, True),
        ({"names": ["a"], "mode": "shared"}, Shared, "shared", None, False),
        ({"names": ["a"], "limit": 3}, Shared, "shared", 3, False),
    ],
)
def test_the_arguments_pick_one_kind_and_redlock_keeps_its_shape(args, kind, mode, limit, fair):
    """kind_of picks the kind once; Redlock's mode, limit and fair are the kind's."""
    names = args.pop("names")
    picked = kind_of(
        names, "redlock:", args.get("mode"), args.get("limit"), args.get("fair", False)
    )
    assert type(picked) is kind
    assert [r.lock for r in picked.resources] == [lock_keys(n).lock for n in names]
    lock = Redlock(names, nodes=UNREACHABLE, **args)
    assert (type(lock.kind), lock.mode, lock.limit, lock.fair) == (kind, mode, limit, fair)


@pytest.mark.parametrize(
    ("nodes", "limit", "quorum"),
    [
        (1, None, 1),
        (3, None, 2),
        (5, None, 3),
        (7, None, 4),
        (3, 1, 2),
        (3, 2, 3),
        (5, 2, 4),
        (5, 3, 4),
        (5, 4, 5),
        (5, 100, 5),
    ],
)
def test_a_limit_above_one_needs_more_than_a_majority(nodes, limit, quorum):
    """limit + 1 holders must not fit on the nodes' limit * N admissions (docs/design.md)."""
    assert Shared(lock_keys("a"), limit).quorum(nodes) == quorum
    if limit is None:
        assert Exclusive((lock_keys("a"),)).quorum(nodes) == quorum


def test_an_exclusive_lock_on_two_resources_takes_and_frees_both_in_one_call():
    """Every resource's keys in one acquire and one release; one fence store per resource."""
    a, b = lock_keys("a"), lock_keys("b")
    kind = Exclusive((a, b))
    waiter = kind.new_waiter(True, 3)
    call = kind.acquire_call(waiter, 5000, HOLDER)
    assert call.script is ACQUIRE and call.keys == (*a.resource, *b.resource, a.abandoned)
    # No record of waiters (several resources): no waiter's place, arrival or channel.
    assert call.args == (waiter.token, 5000, *HOLDER, "1", "", "", "", 1, 1)
    assert kind.acquire_call(waiter, 5000, HOLDER).args[-2] == 2, "each attempt is numbered"
    assert kind.release_call("tok") == Call(
        RELEASE, (a.lock, a.channel, b.lock, b.channel), ("tok", "", "", "")
    )
    undo = kind.undo_call("tok", 2)
    assert undo.keys == (a.lock, a.channel, b.lock, b.channel)
    assert undo.args == ("tok", "", "", 2), "an undo names its attempt"
    assert kind.fence_sync_calls("tok", (3, 9)) == [
        Call(FENCE_SYNC, (a.lock, a.fence), ("tok", 3)),
        Call(FENCE_SYNC, (b.lock, b.fence), ("tok", 9)),
    ]
    assert kind.renew_entries() == ((a.lock, "x"), (b.lock, "x"))
    assert kind.leave_call("tok") is None and kind.wake_token(waiter) is None
    assert kind.refreshes_while_waiting and not kind.admits_others


@pytest.mark.parametrize(
    "kind",
    [
        Exclusive((lock_keys("a"),)),
        Exclusive((lock_keys("a"), lock_keys("b"))),
        Fair(lock_keys("a")),
    ],
    ids=["one", "two", "fair"],
)
def test_a_locks_calls_in_resp_say_what_their_keys_and_arguments_say(kind):
    """The acquire and release calls go out as RESP put together from the lock's keys
    encoded once: byte for byte what packing their keys and arguments writes, for
    every shape of call, again and again (the encoded keys are reused)."""
    conn = Connection()
    for _ in range(2):
        waiter = kind.new_waiter(True, 1)
        calls = [
            kind.acquire_call(waiter, 5000, HOLDER),
            kind.acquire_call(kind.new_waiter(False, 1), 5000, HOLDER),
            kind.acquire_call(waiter, 5000, HOLDER, predecessor="before"),
            kind.release_call(waiter.token),
            kind.undo_call(waiter.token, 3),
        ]
        for call in calls:
            assert call.resp is not None
            assert call.resp == pack(conn, [call.packed_args()])[0], call


def test_a_fair_waiter_queues_only_when_blocking_and_is_woken_by_name():
    """Blocking: queued for one lease; a try does not queue; arrival stamped on several nodes."""
    keys = lock_keys("a")
    kind = Fair(keys)
    one_node = kind.new_waiter(True, 1)
    several = kind.new_waiter(True, 3)
    assert one_node.arrival == "" and float(several.arrival) > 0
    call = kind.acquire_call(several, 5000, HOLDER, grant_ms=700)
    assert call.script is ACQUIRE_FAIR
    assert call.keys == (*keys.resource, *keys.record, keys.abandoned)
    channel = process_channel(keys.channel)
    assert call.args[-6:] == ("1", "5000", several.arrival, channel, 1, 700)
    try_call = kind.acquire_call(kind.new_waiter(False, 1), 5000, HOLDER, grant_ms=700)
    assert try_call.args[-6:] == ("", "0", "", channel, 1, 700)
    assert kind.release_call("tok").script is RELEASE_FAIR
    assert kind.release_call("tok").args == ("tok", named_reserve_ms(), channel, "")
    assert kind.undo_call("tok", 4).args == ("tok", named_reserve_ms(), channel, 4), (
        "a split vote's loser names its attempt, and keeps its place"
    )
    assert kind.release_call("tok").keys == (keys.lock, keys.channel, *keys.record, keys.fence)
    leave = kind.leave_call("tok")
    assert leave is not None and leave.script is FAIR_LEAVE
    assert leave.keys == (keys.lock, *keys.record, keys.channel, keys.fence)
    assert kind.wake_token(several) is several


def test_a_share_is_its_own_set_entry_and_a_full_limit_reads_as_locked():
    """Shares: acquire_shared with the limit, two renewal entries, and held = writer or full."""
    keys = lock_keys("a")
    limited, unlimited = Shared(keys, 2), Shared(keys)
    waiter = limited.new_waiter(True, 3)
    assert limited.acquire_call(waiter, 5000, HOLDER).args == (waiter.token, 5000, 2, *HOLDER, 1)
    assert limited.acquire_call(waiter, 5000, HOLDER).script is ACQUIRE_SHARED
    assert unlimited.acquire_call(waiter, 5000, HOLDER).args[2] == 0
    assert limited.release_call("tok").script is RELEASE_SHARED
    sync = limited.fence_sync_calls("tok", (4,))[0]
    assert (sync.script, sync.keys, sync.args) == (
        FENCE_SYNC_SHARED,
        (keys.fence, keys.holders),
        ("tok", 4),
    )
    assert limited.renew_entries() == ((keys.shared, "s"), (keys.holders, "d"))
    assert limited.admits_others and not limited.refreshes_while_waiting
    assert limited.held([0, 2]) and limited.held([1, 0]) and not limited.held([0, 1])
    assert not unlimited.held([0, 100]) and unlimited.held([1, 0])
    assert limited.owns(["1700000000"], "tok") and not limited.owns([None], "tok")


def test_an_exclusive_node_answer_owns_only_if_every_resource_has_the_token():
    """owned() on two resources: one node counts only if both hold this token."""
    kind = Exclusive((lock_keys("a"), lock_keys("b")))
    assert kind.owns(["tok", "tok"], "tok")
    assert not kind.owns(["tok", "other"], "tok") and not kind.owns(["tok", None], "tok")
    assert kind.held([1]) and not kind.held([0])


@pytest.mark.parametrize(
    ("args", "shown"),
    [
        ({}, "<Redlock 'redlock:{a}'"),
        ({"fair": True}, "<Redlock 'redlock:{a}'"),
        ({"mode": "shared"}, "<Redlock shared 'redlock:{a}'"),
        ({"limit": 2}, "<Redlock shared limit=2 'redlock:{a}'"),
    ],
)
def test_repr_names_the_kind(args, shown):
    """A lock's repr says shared (and its limit); exclusive locks, fair or not, say nothing."""
    assert repr(Redlock("a", nodes=UNREACHABLE, **args)).startswith(shown + " on 1 node(s)")


# -- the family against real servers and processes ------------------------------------

PROCESSES = 4

ctx = multiprocessing.get_context("spawn")


def run_processes(target, argsets, timeout=240):
    """Start one process per argument tuple at once; return what each put on the queue."""
    start, results = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args, start, results)) for args in argsets]
    for proc in procs:
        proc.start()
    start.set()
    collected = [results.get(timeout=timeout) for _ in procs]
    for proc in procs:
        proc.join(30)
        assert proc.exitcode == 0
    return collected


def max_concurrency(sections) -> int:
    """The largest number of (begin, end, ...) sections open at one instant."""
    events = sorted(
        [(begin, 1) for begin, end, *_ in sections] + [(end, -1) for begin, end, *_ in sections],
        key=lambda event: (event[0], event[1]),  # an end before a begin at the same instant
    )
    running = peak = 0
    for _, step in events:
        running += step
        peak = max(peak, running)
    return peak


def hold_slots(urls, limit, iterations, start, results) -> None:
    lock = Redlock("tenant:42", nodes=urls, ttl=10, limit=limit)
    sections = []
    start.wait(30)
    for _ in range(iterations):
        assert lock.acquire(timeout=120)
        begin = time.monotonic_ns()
        time.sleep(0.002)
        end = time.monotonic_ns()
        lock.release()
        sections.append((begin, end, os.getpid()))
    results.put(sections)


@pytest.mark.parametrize("n_nodes", [1, 3])
def test_a_limit_is_never_exceeded_and_is_used(redis_factory, n_nodes):
    """4 processes share 2 slots: never 3 at once, and 2 at once does happen."""
    urls = [s.url for s in redis_factory(n_nodes)]
    sections = [
        s for result in run_processes(hold_slots, [(urls, 2, 100)] * PROCESSES) for s in result
    ]
    assert len(sections) == PROCESSES * 100
    assert max_concurrency(sections) == 2


def read_or_write(urls, role, iterations, start, results) -> None:
    lock = Redlock("doc", nodes=urls, ttl=10, mode=role)
    sections = []
    start.wait(30)
    for _ in range(iterations):
        assert lock.acquire(timeout=120)
        begin = time.monotonic_ns()
        time.sleep(0.001)
        end = time.monotonic_ns()
        fence = lock.fence
        lock.release()
        sections.append((begin, end, role, fence))
    results.put(sections)


def test_readers_share_and_a_writer_is_alone(redis_factory):
    """3 reader processes and 1 writer: readers overlap, nothing overlaps a writer."""
    urls = [redis_factory(1)[0].url]
    roles = ["shared", "shared", "shared", "exclusive"]
    sections = [
        s
        for result in run_processes(read_or_write, [(urls, r, 150) for r in roles])
        for s in result
    ]
    writes = [s for s in sections if s[2] == "exclusive"]
    assert len(writes) == 150
    for write in writes:
        overlapping = [
            s for s in sections if s is not write and s[0] < write[1] and write[0] < s[1]
        ]
        assert overlapping == [], "a writer overlapped another holder"
    assert max_concurrency([s for s in sections if s[2] == "shared"]) >= 2, "readers never shared"
    fences = [fence for *_, fence in sorted(sections)]
    assert len(set(fences)) == len(fences), "every hold has its own fence"


def test_a_stream_of_readers_does_not_starve_a_writer(redis_server):
    """Readers that always overlap each other still let a waiting writer in."""
    stop = threading.Event()
    reads = itertools.count()

    def reader(offset):
        lock = Redlock("stream", nodes=[redis_server.url], ttl=5, mode="shared")
        time.sleep(offset)
        while not stop.is_set():
            if lock.acquire(timeout=0.5):
                time.sleep(0.03)
                lock.release()
                next(reads)

    threads = [threading.Thread(target=reader, args=(i * 0.01,)) for i in range(3)]
    for thread in threads:
        thread.start()
    try:
        wait_for(lambda: next(reads) > 10, timeout=10, message="readers running")
        writer = Redlock("stream", nodes=[redis_server.url], ttl=5)
        assert writer.acquire(timeout=10), "the writer starved"
        held_by_readers = redis_server.client().zcard(lock_keys("stream").shared)
        writer.release()
        assert held_by_readers == 0, "the writer held the lock alongside readers"
    finally:
        stop.set()
        for thread in threads:
            thread.join(10)


def transfer(urls, pairs, iterations, start, results) -> None:
    sections = []
    start.wait(30)
    rng = random.Random(os.getpid())
    for _ in range(iterations):
        names = rng.choice(pairs)
        lock = Redlock(names, nodes=urls, ttl=10)
        assert lock.acquire(timeout=120)
        begin = time.monotonic_ns()
        time.sleep(0.001)
        end = time.monotonic_ns()
        fences = lock.fences
        lock.release()
        sections.extend((begin, end, name, fences[name]) for name in names)
    results.put(sections)


@pytest.mark.parametrize("n_nodes", [1, 3])
def test_several_resources_are_taken_together_without_deadlock(redis_factory, n_nodes):
    """Transfers between accounts lock both (in either order): no overlap, no deadlock."""
    urls = [s.url for s in redis_factory(n_nodes)]
    pairs = [("a", "b"), ("b", "a"), ("b", "c"), ("c", "a")]
    sections = [
        s for result in run_processes(transfer, [(urls, pairs, 80)] * PROCESSES) for s in result
    ]
    assert len(sections) == 2 * PROCESSES * 80
    for name in "abc":
        mine = sorted(s for s in sections if s[2] == name)
        assert all(b[0] >= a[1] for a, b in itertools.pairwise(mine)), f"{name} overlapped"
        fences = [fence for *_, fence in mine]
        assert all(b > a for a, b in itertools.pairwise(fences)), f"{name}'s fences"


def fair_waiter(urls, index, start, results) -> None:
    start.wait(30)
    client_keys = lock_keys("fifo")
    lock = Redlock("fifo", nodes=urls, ttl=5, fair=True)
    assert lock.acquire(timeout=60)
    redis.Redis.from_url(urls[0]).rpush("fifo:order", index)
    time.sleep(0.01)
    lock.release()
    results.put((index, client_keys.queue))


@pytest.mark.parametrize("n_nodes", [1, 3])
def test_fair_waiters_are_served_in_arrival_order(redis_factory, n_nodes):
    """5 waiting processes, queued one after another, get the lock in that order."""
    servers = redis_factory(n_nodes)
    urls = [s.url for s in servers]
    client = servers[0].client()
    holder = Redlock("fifo", nodes=urls, ttl=5, fair=True)
    assert holder.acquire()
    queue = lock_keys("fifo").queue
    start, results = ctx.Event(), ctx.Queue()
    start.set()
    procs = []
    for index in range(5):
        proc = ctx.Process(target=fair_waiter, args=(urls, index, start, results))
        proc.start()
        procs.append(proc)
        wait_for(lambda n=index + 1: client.zcard(queue) == n, timeout=30, message="queued")
    holder.release()
    for _ in procs:
        results.get(timeout=60)
    for proc in procs:
        proc.join(30)
        assert proc.exitcode == 0
    assert client.lrange("fifo:order", 0, -1) == ["0", "1", "2", "3", "4"]


def block(url, kind, start, results) -> None:
    """Hold (or wait for) a lock until killed."""
    start.wait(30)
    lock = Redlock("crash", nodes=[url], ttl=1.0, **kind)
    results.put(os.getpid())
    lock.acquire(timeout=60)
    results.put("acquired")
    time.sleep(600)


def start_blocked(url, kind):
    start, results = ctx.Event(), ctx.Queue()
    start.set()
    proc = ctx.Process(target=block, args=(url, kind, start, results))
    proc.start()
    results.get(timeout=30)
    return proc, results


def test_a_dead_fair_waiter_leaves_the_queue_within_one_ttl(redis_server):
    """SIGKILL the head of the queue: the next waiter still gets the lock."""
    client = redis_server.client()
    holder = Redlock("crash", nodes=[redis_server.url], ttl=1.0, fair=True)
    assert holder.acquire()
    queue = lock_keys("crash").queue
    dead, _ = start_blocked(redis_server.url, {"fair": True})
    wait_for(lambda: client.zcard(queue) == 1, timeout=30, message="the doomed waiter queued")
    os.kill(dead.pid, signal.SIGKILL)
    dead.join(10)
    holder.release()
    waiter = Redlock("crash", nodes=[redis_server.url], ttl=1.0, fair=True)
    started = time.monotonic()
    assert waiter.acquire(timeout=10)
    assert time.monotonic() - started < 1.0 + 1.0, "the dead waiter held the queue too long"
    waiter.release()


def test_a_crashed_holders_slot_comes_back_within_one_ttl(redis_server):
    """SIGKILL a process holding the only slot: it is free again after its lease."""
    holder, results = start_blocked(redis_server.url, {"limit": 1})
    assert results.get(timeout=30) == "acquired"
    os.kill(holder.pid, signal.SIGKILL)
    holder.join(10)
    killed_at = time.monotonic()
    other = Redlock("crash", nodes=[redis_server.url], ttl=1.0, limit=1)
    assert other.acquire(timeout=10)
    assert time.monotonic() - killed_at < 1.0 + 1.0
    other.release()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"name": ["a", "b"], "mode": "shared"}, "covers one resource"),
        ({"name": "a", "limit": 0}, "limit must be an integer >= 1"),
        ({"name": "a", "limit": True}, "limit must be an integer >= 1"),
        ({"name": "a", "mode": "exclusive", "limit": 2}, "limit applies to shared"),
        ({"name": "a", "mode": "read"}, "mode must be one of"),
        ({"name": "a", "mode": "shared", "fair": True}, "fair waiting applies"),
        ({"name": ["a", "b"], "fair": True}, "fair waiting applies"),
        ({"name": [], "mode": None}, "non-empty string"),
    ],
)
def test_a_lock_of_an_impossible_shape_is_refused(args, message):
    """Each impossible combination fails at construction with a message saying why."""
    name = args.pop("name")
    with pytest.raises(ConfigurationError, match=message):
        Redlock(name, nodes=["redis://127.0.0.1:1"], **args)


def test_shared_and_multi_key_holds_are_renewed_in_one_call(redis_server):
    """A share and a two-resource hold outlive their TTL, with one script call per tick."""
    share = Redlock("renewed", nodes=[redis_server.url], ttl=0.6, limit=3)
    pair = Redlock(["x", "y"], nodes=[redis_server.url], ttl=0.6)
    assert share.acquire() and pair.acquire()
    renewer = get_renewer()
    ticks, calls = renewer.ticks, renewer.calls
    wait_for(lambda: renewer.ticks >= ticks + 4, timeout=10, message="four renewal ticks")
    assert renewer.calls - calls == renewer.ticks - ticks, "one renew_many call per tick"
    share.check()
    pair.check()
    assert share.owned() and pair.owned()
    client = redis_server.client()
    assert client.pttl(lock_keys("x").lock) > 0 and client.pttl(lock_keys("y").lock) > 0
    share.release()
    pair.release()
    assert client.exists(lock_keys("x").lock, lock_keys("y").lock) == 0
