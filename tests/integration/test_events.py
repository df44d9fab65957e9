"""The event log tells each task id's story (``celery redlock why``), with real workers.

Every scenario the operators ask about: ran at once, a duplicate send returned, skipped
as busy, retried as busy, deferred by its rate budget, requeued while busy, lost and
aborted, reaped after its pool process died, started after its claim expired. Each runs
on a real worker (in-process threads pool; prefork ``celery worker`` where only
prefork shows it) and a real Redis, and the story is read back as ``why`` reads it.
"""

from __future__ import annotations

import os
import signal

import pytest
from celery.exceptions import Ignore

from celery_redlock import LockBusy, LockedTask, LockLost, lock_for
from celery_redlock.engine.lease import clock
from celery_redlock.integration import events, policies
from celery_redlock.integration.task import lock_options
from celery_redlock.nodes import NodeSet
from celery_redlock.ops.events import describe, key_log, story, summary
from tests.apps.locked import create_app
from tests.harness import close_app, holder_pid, lock_keys, steal_locks, wait_for
from tests.harness.celery_workers import redis_url_with_db


@pytest.fixture
def app(celery_redis):
    app = create_app(celery_redis.url)
    common = {"base": LockedTask, "bind": True, "shared": False, "max_retries": 5}

    @app.task(
        name="ev.rated", lock_key="api:{n}", lock_rate="2/s", lock_mode="shared",
        **{**common, "bind": False},
    )  # fmt: skip
    def rated(n, i):
        return i

    @app.task(name="ev.requeue", lock_key="exp:{n}", lock_on_busy="requeue", **common)
    def requeue(self, n):
        return self.request.id

    @app.task(name="ev.unique", lock_key="u:{n}", lock_unique="until_started", **common)
    def unique(self, n):
        return self.request.id

    @app.task(
        name="ev.expiring",
        lock_key="x:{n}",
        lock_unique="until_started",
        lock_unique_ttl=0.05,
        **common,
    )
    def expiring(self, n):
        return self.request.id

    yield app
    close_app(app)


@pytest.fixture
def nodes(celery_redis):
    nodeset = NodeSet([redis_url_with_db(celery_redis.url, 0)], timeout=1.0)
    yield nodeset
    nodeset.close()


def told(nodes, task_id, *expected, timeout=20.0):
    """The events of ``task_id`` once they include each kind in ``expected`` (in order)."""

    def read():
        found, errors = story(nodes, "redlock:", task_id)
        assert not errors
        kinds = [event["e"] for event in found]
        position = 0
        for kind in kinds:
            if position < len(expected) and kind == expected[position]:
                position += 1
        return found if position == len(expected) else None

    return wait_for(read, timeout=timeout, interval=0.05)


def get(result, timeout=30, **kwargs):
    return result.get(timeout=timeout, disable_sync_subtasks=False, **kwargs)


def test_a_run_that_ran_at_once_says_acquired_then_released(app, nodes, inprocess_worker_factory):
    inprocess_worker_factory(app, pool="threads", concurrency=2)
    result = app.tasks["tests.apps.locked.hold"].delay("acct-1")
    get(result)
    found = told(nodes, result.id, "acquired", "released")
    assert [e["e"] for e in found] == ["acquired", "released"]
    acquired = found[0]
    assert acquired["k"] == "tests.apps.locked.hold:" + acquired["k"].split(":", 1)[1]
    assert acquired["task"] == "tests.apps.locked.hold" and acquired["fence"] > 0
    assert acquired["pid"] == os.getpid() and acquired["waited_ms"] == 0
    assert found[1]["t"] >= acquired["t"], "one clock: the node's"
    text = summary(result.id, found)
    assert "started" in text and "ended" in text and "deferred" not in text
    assert describe(acquired).startswith(f"acquired {acquired['k']} (fence ")


def test_a_skipped_run_says_who_held_its_key(app, nodes, inprocess_worker_factory):
    inprocess_worker_factory(app, pool="threads", concurrency=2)
    hold = app.tasks["tests.apps.locked.hold"]
    with lock_for(hold, "acct-2") as held:  # an operator's lock on the same key
        result = hold.delay("acct-2")
        with pytest.raises(LockBusy):
            get(result)
    (busy,) = told(nodes, result.id, "busy")
    assert (busy["then"], busy["k"]) == ("skip", held.name)
    assert "skipped" in summary(result.id, [busy]) and "skipped" in describe(busy)


def test_a_refusal_is_logged_as_of_its_request(app, celery_redis, nodes):
    """A refused run slowed between the refusal and its record (a loaded worker) logs
    ``busy`` at the time it asked, not when it got to the record: else the story could
    show it refused after the holder's ``released``."""
    hold = app.tasks["tests.apps.locked.hold"]
    with lock_for(hold, "acct-9") as held:
        lock = lock_for(hold, "acct-9")
        before = clock()
        with pytest.raises(LockBusy) as refused:
            lock.try_acquire()
        after = clock()
    busy = refused.value
    assert before <= busy.asked_at <= after
    busy.asked_at -= 2.0  # as if this process got to its record two seconds later
    with pytest.raises((Ignore, LockBusy)):
        policies.apply_on_busy(hold, "late-id", busy, lock_options(hold), held.nodeset)
    assert events.flush()
    (event,) = told(nodes, "late-id", "busy")
    seconds, micros = celery_redis.client().time()
    ago = seconds * 1000 + micros // 1000 - event["t"]
    assert 1_900 <= ago <= 3_000, ago


def test_a_retried_run_says_busy_retry_then_acquired(app, nodes, inprocess_worker_factory):
    inprocess_worker_factory(app, pool="threads", concurrency=2)
    task = app.tasks["tests.apps.locked.hold_retry"]
    lock = lock_for(task, "acct-3")
    lock.acquire()
    result = task.delay("acct-3")
    told(nodes, result.id, "busy")
    lock.release()
    get(result)
    found = told(nodes, result.id, "busy", "acquired", "released")
    assert found[0]["then"] == "retry"
    assert "retried" in describe(found[0])
    text = summary(result.id, found)
    retries = sum(1 for e in found if e["e"] == "busy")
    assert f"retried {retries} time(s): res:acct-3 was busy" in text and "started" in text, text


def test_a_rated_run_says_how_often_its_budget_deferred_it(app, nodes, inprocess_worker_factory):
    """Five runs at 2/s: the last ones are deferred by the budget (parked), each deferral
    is one event, and the story counts them."""
    inprocess_worker_factory(app, pool="threads", concurrency=2)
    results = [app.tasks["ev.rated"].delay("acme", i) for i in range(5)]
    assert [get(r) for r in results] == list(range(5))
    stories = {r.id: told(nodes, r.id, "acquired", "released") for r in results}
    deferred = {
        task_id: [e for e in found if e["e"] == "deferred"] for task_id, found in stories.items()
    }
    assert sum(1 for d in deferred.values() if d) >= 2, "5 runs at 2/s: some waited"
    task_id, mine = max(deferred.items(), key=lambda item: len(item[1]))
    assert {e["reason"] for e in mine} == {"rate"} and all(e["parked"] for e in mine)
    assert all(e["rate"] == "2/s" and e["place"] >= 1 for e in mine), mine
    assert "(2/s: slot " in describe(mine[0])
    text = summary(task_id, stories[task_id])
    assert f"deferred {len(mine)} time(s) (rate) on api:acme" in text, text


def test_a_requeued_run_says_it_waited_for_the_key(app, nodes, inprocess_worker_factory):
    inprocess_worker_factory(app, pool="threads", concurrency=2)
    task = app.tasks["ev.requeue"]
    lock = lock_for(task, "7")
    lock.acquire()
    result = task.delay("7")
    found = told(nodes, result.id, "busy", "deferred")
    lock.release()
    assert get(result) == result.id
    found = told(nodes, result.id, "busy", "deferred", "acquired", "released")
    busy, deferred = found[0], found[1]
    assert busy["then"] == "requeue" and deferred["reason"] == "busy"
    assert "deferred 1 time(s) (busy) on exp:7" in summary(result.id, found)


def test_a_duplicate_send_is_in_the_story_of_the_copy_it_returned(
    app, nodes, inprocess_worker_factory
):
    task = app.tasks["ev.unique"]
    first = task.delay("9")
    second = task.delay("9")  # no worker yet: the first copy is queued
    assert second.id == first.id
    inprocess_worker_factory(app, pool="threads", concurrency=2)
    assert get(first) == first.id
    found = told(nodes, first.id, "claimed", "duplicate", "acquired", "released")
    assert found[1]["then"] == "return"
    assert "claim_freed" in [e["e"] for e in found], "until_started: handed back at start"
    text = summary(first.id, found)
    assert text.startswith(f"{first.id}: sent ") and "returned to 1 duplicate send(s)" in text


def test_a_copy_whose_claim_expired_says_so(app, celery_redis, nodes, inprocess_worker_factory):
    task = app.tasks["ev.expiring"]
    result = task.delay("3")
    claims = celery_redis.client(db=0)
    wait_for(lambda: not list(claims.scan_iter("redlock:{x:3}:claim:*")), timeout=5)
    inprocess_worker_factory(app, pool="threads", concurrency=2)
    assert get(result) == result.id
    found = told(nodes, result.id, "claimed", "acquired", "claim_expired")
    assert "claim had expired" in summary(result.id, found)


def test_a_lost_lock_says_lost_and_aborted(app, celery_redis, nodes, inprocess_worker_factory):
    inprocess_worker_factory(app, pool="threads", concurrency=2)
    result = app.tasks["tests.apps.locked.hold"].delay("acct-lost", None, "lost", 30)
    wait_for(lambda: lock_keys(celery_redis), timeout=10)
    steal_locks(celery_redis)
    with pytest.raises(LockLost):
        get(result, timeout=10)
    found = told(nodes, result.id, "acquired", "lost")
    lost = next(e for e in found if e["e"] == "lost")
    assert lost["then"] == "abort"
    assert "lost its lock" in summary(result.id, found) and "aborted" in describe(lost)


def test_a_dead_pool_processs_lock_is_reaped_in_the_story(
    celery_redis, nodes, worker_process_factory
):
    """Prefork: SIGKILL of the child holding the lock; the main process releases it and
    logs ``reaped`` for the task id, naming the dead child."""
    worker_process_factory(
        "tests.apps.locked", pool="prefork", concurrency=2, env={"REDLOCK_TEST_TTL": "30"}
    )
    client = create_app(celery_redis.url)
    try:
        result = client.tasks["tests.apps.locked.sleeper"].delay("acct-kill", 60)
        wait_for(lambda: holder_pid(celery_redis), timeout=20)
        child = holder_pid(celery_redis)
        found = told(nodes, result.id, "acquired")  # written by the child within FLUSH
        os.kill(child, signal.SIGKILL)
        found = told(nodes, result.id, "acquired", "reaped")
    finally:
        close_app(client)
    reaped = found[-1]
    assert reaped["child"] == child and reaped["pid"] != child
    assert "lock was reaped" in summary(result.id, found)


def test_log_keeps_a_keys_newest_events_and_the_feed_is_capped(celery_redis, nodes, monkeypatch):
    """A lock's log keeps its newest EVENTS_PER_KEY, the feed its newest EVENTS_IN_FEED;
    each list expires redlock_events_ttl after its last event."""
    monkeypatch.setattr(events, "EVENTS_PER_KEY", 5)
    monkeypatch.setattr(events, "EVENTS_IN_FEED", 8)
    app = create_app(celery_redis.url, redlock_events_ttl=60)
    try:
        for n in range(12):
            key = "redlock:{a}" if n % 2 else "redlock:{b}"
            events.record(app, nodes, "released", (key,), "t", f"id-{n}", held_ms=n)
        assert events.flush()
    finally:
        close_app(app)
    found, _ = key_log(nodes, "redlock:{a}", 100)
    assert [e["id"] for e in found] == [f"id-{n}" for n in (3, 5, 7, 9, 11)]
    client = celery_redis.client(db=0)
    assert 59_000 < client.pttl("redlock:{a}:log") <= 60_000
    assert client.llen("redlock:log") == 8 and 59_000 < client.pttl("redlock:log") <= 60_000


def test_the_log_off_writes_nothing(celery_redis, nodes):
    app = create_app(celery_redis.url, redlock_events=False)
    try:
        events.record(app, nodes, "released", ("redlock:{off}",), "t", "id", held_ms=1)
        assert events.flush()
    finally:
        close_app(app)
    assert key_log(nodes, "redlock:{off}")[0] == []


def test_a_tick_that_ran_late_logs_renewed_late_for_the_running_task(celery_redis, nodes):
    """The watchdog's tick starts a second after it was due (a starved process): the
    lease of the task body running under it gets a ``renewed_late`` event with the lag."""
    from celery_redlock import Redlock
    from celery_redlock.engine.lease import clock
    from celery_redlock.engine.renewal import get_renewer
    from celery_redlock.integration import abort

    app = create_app(celery_redis.url)
    lock = Redlock("late:1", nodes=[nodes.nodes[0].url], ttl=3, task_name="proj.late")
    try:
        assert lock.acquire(blocking=False)
        events.record(app, lock.nodeset, "acquired", (lock.key,), "proj.late", "t-late", fence=1)
        abort.track(lock.lease, "t-late")
        try:
            get_renewer().renew([lock.lease], due=clock() - 1.0)
        finally:
            abort.untrack(lock.lease)
        assert events.flush()
    finally:
        lock.release()
        close_app(app)
    found = told(nodes, "t-late", "acquired", "renewed_late")
    late = found[-1]
    assert late["lag_ms"] >= 1000 and late["task"] == "proj.late"
    assert "renewed 1." in describe(late)


def test_a_redlock_outside_a_task_writes_no_event(redis_node, monkeypatch):
    """The engine's acquire, renew and release never log: the event log is the Celery
    layer's (so the engine benchmarks carry none of its cost)."""
    import threading

    from celery_redlock import Redlock

    sent = []
    call = NodeSet.call
    me = threading.get_ident()

    def spy(self, calls, **kwargs):
        # This thread's calls only: another test's writer may still be flushing.
        flat = [c for group in calls for c in (group if isinstance(group, list) else [group])]
        if threading.get_ident() == me:
            sent.extend(c.script.name for c in flat if c is not None and c.script is not None)
        return call(self, calls, **kwargs)

    monkeypatch.setattr(NodeSet, "call", spy)
    lock = Redlock("engine:only", nodes=[redis_node.url], ttl=1)
    for _ in range(3):
        assert lock.acquire(blocking=False)
        lock.extend()
        lock.release()
    assert sent and "log" not in sent, sent


def test_a_run_that_takes_its_lock_long_after_its_eta_logs_started_late(
    app, nodes, inprocess_worker_factory
):
    """A run whose eta was 5 s ago (a slot, a countdown, a worker that was down) takes
    its lock: ``started_late`` says by how much."""
    from datetime import datetime, timedelta, timezone

    inprocess_worker_factory(app, pool="threads", concurrency=2)
    eta = datetime.now(timezone.utc) - timedelta(seconds=5)
    result = app.tasks["tests.apps.locked.hold"].apply_async(("acct-late",), eta=eta)
    get(result)
    found = told(nodes, result.id, "acquired", "started_late")
    late = next(e for e in found if e["e"] == "started_late")
    assert late["late_ms"] >= 5000
    assert f"took {late['k']} 5." in describe(late)
