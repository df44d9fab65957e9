"""Redis memory is bounded by what is in use (invariant 14).

Nothing the library writes for a key outlives the key's last use by more than the
fence horizon (``keys.FENCE_HORIZON_LEASES`` leases, at least ``FENCE_HORIZON_MIN``
seconds), however many distinct keys were used; and a key taken again after its state
expired gets a fence larger than every fence it was ever given. Each test uses a 1 s
lease, so the horizon is 5 s (at most 10 leases, as documented), and waits for the keys
to go with a deadline a little past it.

The event log (``redlock_events``, on by default) keeps a key's events
``redlock_events_ttl`` after its last one (an hour by default), and at most 100 of
them: the Celery paths here set it to the horizon, so what they leave is bounded by the
same deadline.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import pytest

from celery_redlock import LockedTask, Redlock
from celery_redlock.engine.keys import FENCE_HORIZON_LEASES, FENCE_HORIZON_MIN
from celery_redlock.integration.beat import LeaderScheduler
from tests.apps.locked import create_app
from tests.apps.unique import make_unique_app
from tests.harness import close_app, wait_for
from tests.harness.celery_workers import make_app, redis_url_with_db

TTL = 1.0
HORIZON = max(FENCE_HORIZON_LEASES * TTL, FENCE_HORIZON_MIN)


def library_keys(server) -> list[str]:
    """Every key of the library's prefix on ``server`` (db 0: the locks' database)."""
    return sorted(server.client(db=0).scan_iter("redlock:*"))


def without_ttl(server) -> list[str]:
    client = server.client(db=0)
    return [key for key in library_keys(server) if client.pttl(key) == -1]


def wait_until_empty(server, began: float) -> float:
    """Wait for every key of the prefix to expire; seconds it took after ``began``."""
    wait_for(lambda: not library_keys(server), timeout=HORIZON + 10, interval=0.1)
    return time.monotonic() - began


def test_the_horizon_is_at_most_ten_leases_of_a_one_second_lock():
    assert HORIZON <= 10 * TTL


def test_two_thousand_distinct_keys_leave_nothing_once_the_horizon_has_passed(redis_node):
    """2,000 distinct names (exclusive, shared, limited and fair), each taken and
    released: nothing is left after the horizon, and none of it was ever permanent.
    The first name taken again afterwards gets a larger fence than before."""
    url = redis_node.url
    fences: dict[str, int] = {}
    kinds = [{}, {"mode": "shared"}, {"limit": 3}, {"fair": True}]
    for n in range(2000):
        lock = Redlock(f"mem:{n}", nodes=[url], ttl=TTL, **kinds[n % len(kinds)])
        assert lock.acquire(blocking=False)
        fences[lock.name] = lock.fence
        lock.release()
    released_at = time.monotonic()
    assert library_keys(redis_node), "the fence counters live on for the horizon"
    assert without_ttl(redis_node) == [], "a key that would stay for ever"
    took = wait_until_empty(redis_node, released_at)
    assert took <= HORIZON + 2
    for n in range(len(kinds)):
        again = Redlock(f"mem:{n}", nodes=[url], ttl=TTL, **kinds[n])
        assert again.acquire(blocking=False)
        assert again.fence > fences[f"mem:{n}"], "a fence went back after the state expired"
        again.release()


def test_a_key_whose_state_expired_between_two_holders_keeps_its_fences_growing(redis_node):
    """Fenced storage never refuses an honest new holder because a counter restarted:
    every holder of one name, with expiries in between, has a larger fence."""
    client = redis_node.client(db=0)
    last = 0
    for _ in range(5):
        lock = Redlock("mem:again", nodes=[redis_node.url], ttl=TTL)
        assert lock.acquire(blocking=False)
        assert lock.fence > last
        last = lock.fence
        lock.release()
        client.delete(lock.keys.fence)  # as if the horizon had passed


def _hold_or_wait(url: str, name: str) -> None:
    """A child that takes ``name`` (or waits for it) and is then killed."""
    lock = Redlock(name, nodes=[url], ttl=TTL)
    lock.acquire(timeout=60)
    time.sleep(60)  # until killed: a holder, or a waiter, that dies
    lock.release()


def test_waiters_killed_while_waiting_leave_nothing(redis_node):
    """A holder and two blocked waiters (recorded with their process channels), all
    killed: every key they wrote had a lifetime while they lived, and all of it is gone
    within the horizon."""
    ctx = multiprocessing.get_context("fork")
    lock = Redlock("mem:waited", nodes=[redis_node.url], ttl=TTL)
    queue, waiting, wake = lock.kind.keys.record
    client = redis_node.client(db=0)
    children = [ctx.Process(target=_hold_or_wait, args=(redis_node.url, lock.name))]
    children[0].start()
    try:
        wait_for(lambda: client.exists(lock.keys.lock), timeout=20)
        children += [
            ctx.Process(target=_hold_or_wait, args=(redis_node.url, lock.name)) for _ in range(2)
        ]
        for child in children[1:]:
            child.start()
        wait_for(lambda: client.hlen(wake) == 2, timeout=20)
        assert client.zcard(queue) == client.zcard(waiting) == 2
        assert without_ttl(redis_node) == [], "a key that would stay for ever"
    finally:
        for child in children:
            if child.pid:
                os.kill(child.pid, signal.SIGKILL)
            child.join(20)
    wait_until_empty(redis_node, time.monotonic())


@pytest.mark.parametrize("nodes", [3])
def test_redlock_fences_keep_growing_across_an_expiry_on_every_node(redis_factory, nodes):
    servers = redis_factory(nodes)
    urls = [s.url for s in servers]
    first = Redlock("mem:quorum", nodes=urls, ttl=TTL)
    assert first.acquire(blocking=False)
    first.release()
    for server in servers:
        server.client().delete(first.keys.fence)
    second = Redlock("mem:quorum", nodes=urls, ttl=TTL)
    assert second.acquire(blocking=False)
    assert second.fence > first.fence
    second.release()


# -- the Celery paths ----------------------------------------------------------------


@pytest.fixture
def locked_app(celery_redis):
    app = create_app(celery_redis.url, redlock_ttl=TTL, redlock_events_ttl=HORIZON)
    yield app
    close_app(app)


@pytest.fixture
def unique_app(celery_redis):
    app = make_unique_app(celery_redis.url, redlock_ttl=TTL, redlock_events_ttl=HORIZON)
    yield app
    close_app(app)


def test_locked_tasks_with_distinct_arguments_leave_nothing(
    locked_app, celery_redis, inprocess_worker_factory
):
    """LockedTask keyed by its arguments (the default), lock_limit, fair, a read lock:
    one key per distinct call, none left after the horizon."""
    inprocess_worker_factory(locked_app, pool="threads", concurrency=4)
    tasks = locked_app.tasks
    results = [tasks["tests.apps.locked.hold"].delay(f"acct-{n}") for n in range(100)]
    results += [tasks["tests.apps.locked.call_api"].delay(f"t-{n}") for n in range(20)]
    results += [tasks["tests.apps.locked.read_doc"].delay(f"d-{n}") for n in range(20)]
    for result in results:
        result.get(timeout=60, disable_sync_subtasks=False)
    ended = time.monotonic()
    assert without_ttl(celery_redis) == []
    assert wait_until_empty(celery_redis, ended) <= HORIZON + 2


def test_unique_debounced_and_throttled_tasks_leave_nothing(
    unique_app, celery_redis, inprocess_worker_factory, tmp_path
):
    """Send-time claims (lock_unique), debounce and throttle state: freed with their
    copy or ended by their window, and the lock's own keys after the horizon."""
    inprocess_worker_factory(unique_app, pool="threads", concurrency=4)
    tasks = unique_app.tasks
    results = [tasks["unique.until_finished.return"].delay(f"u-{n}") for n in range(30)]
    results += [tasks["unique.until_started.return"].delay(f"s-{n}") for n in range(30)]
    out = str(tmp_path / "runs")
    results += [tasks["unique.digest"].delay(f"k-{n}", n, out) for n in range(5)]
    results += [tasks["unique.poll"].delay(f"p-{n}", n, out) for n in range(5)]
    for result in results:
        result.get(timeout=60, disable_sync_subtasks=False)
    ended = time.monotonic()
    assert without_ttl(celery_redis) == []
    # The throttle window (2 s) is shorter than the horizon.
    assert wait_until_empty(celery_redis, ended) <= HORIZON + 2


def test_a_stopped_leader_beat_leaves_nothing(celery_redis, tmp_path):
    """LeaderScheduler: its leader lock and schedule state expire once it has stopped
    (the state ten leases after its last claim, as its entry runs every second)."""
    app = make_app(
        celery_redis.url,
        name="membeat",
        redlock_url=redis_url_with_db(celery_redis.url, 0),
        redlock_ttl=TTL,
        redlock_beat_ttl=TTL,
        redlock_events_ttl=HORIZON,
        beat_schedule={"every": {"task": "membeat.noop", "schedule": 1.0}},
    )
    try:
        scheduler = LeaderScheduler(app=app, schedule_filename=str(tmp_path / "s"), lazy=False)

        def claimed_a_run() -> bool:
            scheduler.tick()
            return any(key.endswith(":state") for key in library_keys(celery_redis))

        wait_for(claimed_a_run, timeout=30, interval=0.05)
        scheduler.close()
        closed = time.monotonic()
        assert without_ttl(celery_redis) == []
        wait_for(lambda: not library_keys(celery_redis), timeout=10 * TTL + 10, interval=0.2)
        assert time.monotonic() - closed <= 10 * TTL + 2
    finally:
        close_app(app)


def test_rated_and_requeued_tasks_leave_nothing(celery_redis, inprocess_worker_factory):
    """A rate budget (its log, the budget recorded beside it) and the runs queued for a
    key (by the budget, by lock_on_busy="requeue"): none permanent, all gone after the
    horizon (the budget with its log, one window after the last start; a queue as its
    last run starts)."""
    app = make_app(
        celery_redis.url,
        name="memrated",
        redlock_url=redis_url_with_db(celery_redis.url, 0),
        redlock_events_ttl=HORIZON,
    )
    try:
        common = {"base": LockedTask, "shared": False, "lock_ttl": TTL}
        rated = app.task(
            name="memrated.rated", lock_key="r:{key}", lock_rate="2/s", lock_mode="shared", **common
        )(_key)
        requeued = app.task(
            name="memrated.requeued", lock_key="q:{key}", lock_on_busy="requeue", **common
        )(_key)
        inprocess_worker_factory(app, pool="threads", concurrency=4)
        client = celery_redis.client(db=0)
        holder = Redlock("q:k", nodes=[redis_url_with_db(celery_redis.url, 0)], ttl=30)
        assert holder.acquire(blocking=False)
        results = [requeued.delay("k") for _ in range(4)]
        wait_for(lambda: client.zcard("redlock:{q:k}:queued") == 4, timeout=30)
        holder.release()
        results += [rated.delay(f"k{n % 3}") for n in range(12)]
        for result in results:
            result.get(timeout=60, disable_sync_subtasks=False)
        budgets = [client.get(f"redlock:{{r:k{n}}}:budget") for n in range(3)]
        assert "2/1000" in budgets, "the budget of the last start, recorded"
        ended = time.monotonic()
        assert without_ttl(celery_redis) == []
        assert wait_until_empty(celery_redis, ended) <= HORIZON + 2
    finally:
        close_app(app)


def _key(key):
    return key
