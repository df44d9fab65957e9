"""Parked runs (:mod:`celery_redlock.integration.parking`): a run that must wait (its rate budget's
slot, its busy key's release, lock nodes that answer late) waits in Redis, not as a
message some worker holds, and goes through the broker once more, whoever dies.

Real ``celery worker`` processes (prefork, Celery's default options: the Redis broker's
visibility timeout is an hour, so a message a dead worker held does not come back within
a test) and real redis-servers. Every body records its task id, start, pid and how
often its run was put back (:func:`tests.apps.rated.record_counted`).

``REDLOCK_SOAK_TRIALS=5`` repeats each crash scenario five times (the short form, one
trial per scenario, is in the default run).
"""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from collections import Counter
from functools import partial

import pytest
from celery import _state as celery_state
from celery.exceptions import WorkerLostError

from celery_redlock import RateLimit
from celery_redlock.engine.keys import (
    DEFAULT_PREFIX,
    handed_key,
    line_key,
    lock_keys,
    parked_keys,
)
from celery_redlock.engine.rate import Budget
from celery_redlock.engine.scripts import TAKE_DUE
from celery_redlock.exceptions import NodeUnavailable
from celery_redlock.integration import parking, policies
from celery_redlock.nodes import NodeSet
from tests.apps.rated import make_rated_app
from tests.harness import close_app, wait_for
from tests.harness.lua import run
from tests.integration.test_rate import busiest_window, parked_runs, runs_of

TRIALS = int(os.environ.get("REDLOCK_SOAK_TRIALS", "1"))
RUNS = 100
#: backlog.rate's budget: 20 starts per second.
RATE = 20
#: The backlog tasks' lease (lock_ttl), seconds.
TTL = 3.0


@pytest.fixture
def app(celery_redis):
    app = make_rated_app(celery_redis.url)
    yield app
    close_app(app)


def counted_runs(out):
    """(task id, start, pid, deferrals) of each run recorded."""
    lines = out.read_text().splitlines() if out.exists() else []
    return [(i, float(s), int(p), int(d)) for i, _, s, _, p, _, d in map(str.split, lines)]


def keys_without_ttl(server):
    """Keys of the lock database (db 0) that would live for ever."""
    client = server.client(db=0)
    return [key for key in client.scan_iter() if client.pttl(key) == -1]


def whereabouts(server, task_id, out):
    """Where a run that never ended is: its messages, its parked record, its starts."""
    broker, locks = server.client(db=1), server.client(db=0)

    def text(message):
        return message if isinstance(message, str) else message.decode()

    queued = [m for m in map(text, broker.lrange("celery", 0, -1)) if task_id in m]
    unacked = [m for m in map(text, broker.hvals("unacked")) if task_id in m]
    return (
        f"run {task_id} never ended: {len(queued)} message(s) queued, {len(unacked)} "
        f"unacknowledged; parked record {locks.hget('redlock:parked:runs', task_id)!r}, "
        f"due {locks.zscore('redlock:parked', task_id)!r}, taken "
        f"{locks.hget('redlock:parked:taken', task_id)!r}; started "
        f"{[r for r in counted_runs(out) if r[0] == task_id]}; unacked headers "
        f"{[json.loads(m)[0]['headers'] for m in unacked]}"
    )


def first_deliveries(server):
    """Messages on the broker (queued or held by a worker) as sent: no run put back."""
    broker = server.client(db=1)
    raw = [*broker.lrange("celery", 0, -1), *broker.hvals("unacked")]
    bodies = [json.loads(m) for m in raw]
    held = [m[0] if isinstance(m, list) else m for m in bodies]
    return [m for m in held if not m["headers"].get(policies.DEFERRALS_HEADER)]


@pytest.mark.parametrize("task_name", ["backlog.rate", "backlog.rate_requeue"])
def test_a_backlog_goes_through_the_broker_about_once_per_run(
    task_name, app, celery_redis, worker_process_factory, tmp_path
):
    """100 runs of a 20/s key (alone, or with the exclusive lock and requeue) sent at
    once to two prefork workers: each runs exactly once, the backlog's runs were put
    back (and so published again) at most 1.1 times per run on average, no second holds
    more than 20 starts, and no key is left without a TTL. (Before: a copy that came
    back as another held the key, or a hair early, went back again: 1.8 re-publishes
    per run at 5/s, 5.3 with requeue.)"""
    for _ in range(2):
        worker_process_factory("tests.apps.rated", pool="prefork", concurrency=2)
    out = tmp_path / "runs"
    results = [app.tasks[task_name].delay("a", str(out)) for _ in range(RUNS)]
    assert [r.get(timeout=120) for r in results] == ["a"] * RUNS
    runs = counted_runs(out)
    assert Counter(i for i, *_ in runs) == Counter(r.id for r in results), "each ran once"
    republished = sum(d for *_, d in runs)
    assert RUNS // 2 <= republished <= 1.1 * RUNS, republished
    assert busiest_window([s for _, s, _, _ in runs]) <= RATE
    assert nothing_parked(celery_redis), "nothing left parked"
    assert keys_without_ttl(celery_redis) == []


def nothing_parked(server):
    """Whether no run is parked (db 0): none due, none in a key's line, no record."""
    locks = server.client(db=0)
    return not (
        locks.zcard("redlock:parked")
        or locks.zcard("redlock:parked:lines")
        or locks.hlen("redlock:parked:runs")
    )


def _settled(results, in_flight, after):
    """Every run ended; or all but ``in_flight`` of them, once ``after`` (epoch) is past."""
    waiting = sum(not r.ready() for r in results)
    return not waiting or (waiting <= in_flight and time.time() > after)


def _kill(worker, target):
    """SIGKILL the worker's main process, or one of its pool children (the main process
    then releases the child's lock and starts another)."""
    if target == "main":
        os.kill(worker.pid, signal.SIGKILL)
    else:
        os.kill(random.choice(worker.child_pids()), signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.parametrize("target", ["main", "child"])
@pytest.mark.parametrize("task_name", ["backlog.rate", "backlog.requeue"])
def test_a_worker_killed_mid_backlog_strands_loses_and_repeats_no_run(
    task_name, target, app, celery_redis, worker_process_factory, tmp_path
):
    """A 100-run backlog (20/s, or one at a time with requeue) on two prefork workers;
    at a random point, one worker's main process (or one pool child) is SIGKILLed.

    Every run starts exactly once, within max(LEASE, the lock's TTL) + 10 s of the time
    the whole backlog would take alone (runs parked in Redis wait for no worker: a run
    the dead worker had taken or received is published again by the other when its
    take's lease ends, and the copy the dead worker held never runs; a run whose
    delivery was killed after parking it and before releasing its lock waits for that
    lock's lease); the only exception is Celery's own: a run under way in a pool child
    that is killed (its message acknowledged as the child took it, Celery's default)
    runs no more. A killed child's run fails with WorkerLostError, which its main
    process reports; a killed main process takes its children with it (Celery sets
    PR_SET_PDEATHSIG), and the runs they had stay PENDING, with nobody left to report
    them: at most one per child, each queued nowhere, held by no worker, parked
    nowhere. Afterwards no key lives without a TTL. (Before: the copies the dead worker
    held in its timer waited for the broker's visibility timeout, an hour.)"""
    for trial in range(TRIALS):
        out = tmp_path / f"runs-{trial}"
        workers = [
            worker_process_factory("tests.apps.rated", pool="prefork", concurrency=2)
            for _ in range(2)
        ]
        hold = 0.02 if task_name == "backlog.requeue" else 0.0
        results = [app.tasks[task_name].delay(f"k{trial}", str(out), hold) for _ in range(RUNS)]
        sent = time.time()
        point = random.randint(5, 60)
        wait_for(
            lambda point=point, out=out: (
                len(counted_runs(out)) >= point and not first_deliveries(celery_redis)
            ),
            timeout=60,
            interval=0.01,
            message="the backlog to drain a while, every first delivery handled",
        )
        children = workers[0].child_pids()
        _kill(workers[0], target)
        ideal = RUNS / RATE if task_name == "backlog.rate" else RUNS * (hold + 0.2)
        # The bound: a lease of the take (a run the dead worker had taken or received),
        # or the lock's TTL (3 s: a delivery killed after parking its run and before
        # releasing its lock leaves the key to its lease), plus slack for the load.
        bound = ideal + max(parking.LEASE, TTL) + 10.0
        # A killed main process's runs under way never end: at most one per child.
        in_flight = len(children) if target == "main" else 0
        try:
            wait_for(
                partial(_settled, results, in_flight, sent + bound),
                timeout=bound + 120.0,
                interval=0.1,
                message="every run to end, but the runs a killed main process had",
            )
        except AssertionError as exc:
            raise AssertionError(
                "; ".join(whereabouts(celery_redis, r.id, out) for r in results if not r.ready())
            ) from exc
        runs = counted_runs(out)
        started = Counter(i for i, *_ in runs)
        assert max(started.values()) == 1, "no run started twice"
        assert max(s for _, s, _, _ in runs) - sent <= bound, "every start within the bound"
        for result in results:
            if not result.ready():  # killed with its main process: where is it?
                where = whereabouts(celery_redis, result.id, out)
                assert "0 message(s) queued, 0 unacknowledged; parked record None" in where
                assert all(pid in children for i, _, pid, _ in runs if i == result.id), where
        lost = {r.id for r in results if r.ready()} - started.keys()
        for task_id in lost:
            assert app.AsyncResult(task_id).state == "FAILURE", task_id
            assert isinstance(app.AsyncResult(task_id).result, WorkerLostError), task_id
        assert len(lost) <= (1 if target == "child" else 0), lost
        # A run whose pool child was killed after it parked the run has its parked copy
        # published still, which finds the WorkerLostError stored and does not run.
        wait_for(
            lambda: nothing_parked(celery_redis),
            timeout=parking.LEASE + 10.0,
            message="nothing left parked",
        )
        assert keys_without_ttl(celery_redis) == []
        for worker in workers:
            worker.kill()


@pytest.fixture
def slow_app(celery_redis, fault_proxy):
    proxy = fault_proxy(celery_redis)
    app = make_rated_app(
        celery_redis.url, redlock_url=proxy.url, redlock_node_timeout=0.25, redlock_ttl=3.0
    )
    yield app, proxy
    close_app(app)


def put_back_unavailable(server, task_id):
    """Whether the broker holds a copy of ``task_id`` put back for unreachable nodes."""
    broker = server.client(db=1)
    raw = [*broker.lrange("celery", 0, -1), *broker.hvals("unacked")]
    held = [m[0] if isinstance(m, list) else m for m in map(json.loads, raw)]
    return any(
        m["headers"].get("id") == task_id and m["headers"].get(policies.UNAVAILABLE_HEADER)
        for m in held
    )


def test_a_slow_reply_at_start_puts_the_run_back_and_it_runs(
    slow_app, celery_redis, inprocess_worker_factory, tmp_path
):
    """The lock node answers after 0.5 s (a delaying proxy) while a run starts, with a
    0.25 s node timeout: the run is put back like a busy one, not failed; it runs once
    the node answers in time again. (Before: FAILURE with NodeUnavailable.)"""
    app, proxy = slow_app
    inprocess_worker_factory(app, pool="threads", concurrency=2)
    out = tmp_path / "runs"
    proxy.delay(0.5)
    result = app.tasks["rated.plain"].delay("p", str(out))
    wait_for(
        lambda: put_back_unavailable(celery_redis, result.id),
        timeout=30,
        message="the run to go back on the queue (the node too slow to park it either)",
    )
    assert result.state == "PENDING" and not out.exists(), "put back, not failed"
    proxy.restore()
    assert result.get(timeout=60) == "p"


def test_a_node_that_stays_unreachable_fails_the_run_after_the_budget(
    slow_app, inprocess_worker_factory, tmp_path, monkeypatch
):
    """The lock node stays silent: the run is put back until UNAVAILABLE_BUDGET (2 s
    here) has passed since its first attempt, then fails with NodeUnavailable."""
    app, proxy = slow_app
    monkeypatch.setattr(policies, "UNAVAILABLE_BUDGET", 2.0)
    inprocess_worker_factory(app, pool="threads", concurrency=2)
    proxy.blackhole()
    sent = time.time()
    result = app.tasks["rated.plain"].delay("p", str(tmp_path / "runs"))
    with pytest.raises(NodeUnavailable):
        result.get(timeout=60)
    assert time.time() - sent >= 2.0


def test_the_parked_copy_of_a_run_that_already_ended_leaves_the_parked_runs(
    app, celery_redis, inprocess_worker_factory, tmp_path
):
    """A run whose result is final while it is parked (its pool child was killed after
    it parked the run: Celery stored WorkerLostError) does not run when its copy comes,
    and its copy takes it out of the parked runs. (Before: the record stayed, due again
    at the end of each take's lease, its copy published every 10 s for a day.)"""
    inprocess_worker_factory(app, pool="threads", concurrency=2)
    out = tmp_path / "runs"
    results = [app.tasks["rated.call"].delay("ended", str(out)) for _ in range(7)]
    waiting = wait_for(
        lambda: len(found := parked_runs(celery_redis)) == 2 and found,
        timeout=30,
        message="the 2 runs over the 5/s budget to be parked",
    )
    ended = next(iter(waiting))
    app.backend.mark_as_failure(ended, WorkerLostError("killed while it waited"))
    for result in results:
        if result.id != ended:
            assert result.get(timeout=30) == "ended"
    wait_for(
        lambda: nothing_parked(celery_redis),
        timeout=parking.LEASE - 2.0,  # before a take's lease could bring it back
        message="the ended run to leave the parked runs",
    )
    assert ended not in {i for i, *_ in runs_of(out)}, "it does not run again"


def test_the_publisher_does_not_subscribe_to_the_results_of_what_it_publishes(
    app, inprocess_worker_factory, tmp_path, monkeypatch
):
    """In a prefork worker's main process joins are allowed, so Celery subscribes a
    caller's result backend to each task it sends. The publisher waits for no result:
    it must not (a subscription per copy, for ever; and a pool child forked while it
    subscribed inherited the subscription's lock held, and hung)."""
    inprocess_worker_factory(app, pool="threads", concurrency=2)
    monkeypatch.setattr(celery_state, "_task_join_will_block", False)  # as in prefork's main
    by_thread = []
    consumer = type(app.backend.result_consumer)  # each thread has its own backend
    consume_from = consumer.consume_from

    def spy(self, task_id):
        by_thread.append(threading.current_thread().name)
        return consume_from(self, task_id)

    monkeypatch.setattr(consumer, "consume_from", spy)
    out = tmp_path / "runs"
    results = [app.tasks["rated.call"].delay("sub", str(out)) for _ in range(7)]
    assert [r.get(timeout=30) for r in results] == ["sub"] * 7
    assert parking._publishers[id(app)].published >= 2, "runs were parked and published"
    assert "celery_redlock-publisher" not in by_thread


def _park_rate_run(app, nodeset, task_id, spot):
    """Park a run of ``rated.call`` due now, as a refused delivery would be parked."""
    task = app.tasks["rated.call"]
    task.push_request(
        id=task_id, args=("deep", "/dev/null"), kwargs={},
        delivery_info={"exchange": "", "routing_key": "celery"},
    )  # fmt: skip
    try:
        assert parking.park(task, 0.0, {}, spot).parked
    finally:
        task.pop_request()


def test_the_publisher_keeps_one_broker_connection(app, celery_redis):
    """Twenty rate runs published (each with a look at its queue's depth) open at most
    four connections to the broker's server: the publisher's own connection and its
    channel, kept (kombu's Redis transport opens two clients for each). (Before: a
    producer from Celery's pool and a channel per look: 22 new connections for the 20
    copies, about 20 ms from a take to its publish.)"""
    nodeset = NodeSet.get([app.conf.redlock_url], timeout=2)
    keys = lock_keys("api:kept")
    spot = parking.Spot(nodeset, "rate", keys.lock, Budget(1000, 1.0))
    publisher = parking.Publisher(app, nodeset, DEFAULT_PREFIX)
    server = celery_redis.client(db=0)

    def received():
        return int(server.info("stats")["total_connections_received"])

    try:
        publisher.tick()  # connects to the lock node (not the broker's connections)
        before = received()
        for n in range(20):
            _park_rate_run(app, nodeset, f"kept-{n}", spot)
            publisher.tick()
        assert publisher.published == 20
        assert received() - before <= 4, "a connection and a channel (kombu: two clients each)"
    finally:
        publisher.stop()
        celery_redis.client(db=1).delete("celery")


def test_a_rate_run_is_not_published_behind_a_deep_queue(app, celery_redis, monkeypatch):
    """A rate run that comes due while its queue holds more than DEEP messages stays
    parked: its copy would wait behind them past its slot (a backlog sent at once: the
    runs still on the queue take the budget's slots meanwhile). With the queue short, it
    is published, its start reserved at its slot (the budget is full: a second on) and
    the copy counting down to it. Held HOLD, it is published whatever the queue."""
    monkeypatch.setattr(parking, "HOLD", 1.0)
    nodeset = NodeSet.get([app.conf.redlock_url], timeout=2)
    keys = lock_keys("api:deep")
    spot = parking.Spot(nodeset, "rate", keys.lock, Budget(5, 1.0))
    broker, locks = celery_redis.client(db=1), celery_redis.client(db=0)
    publisher = parking.Publisher(app, nodeset, DEFAULT_PREFIX)
    limit = RateLimit("api:deep", rate="5/s", nodes=[app.conf.redlock_url])
    assert [limit.try_acquire() for _ in range(5)] == [0.0] * 5
    broker.lpush("celery", *[f"other-{n}" for n in range(parking.DEEP + 1)])
    _park_rate_run(app, nodeset, "deep-1", spot)
    publisher.tick()
    assert publisher.published == 0, "held while the queue is deep"
    assert locks.zscore("redlock:parked", "deep-1") is not None
    broker.delete("celery")

    def published(count):
        publisher.tick()
        return publisher.published == count

    wait_for(partial(published, 1), timeout=5, interval=0.01, message="the copy published")
    (message,) = [json.loads(m) for m in broker.lrange("celery", 0, -1)]
    member = message["headers"][parking.MEMBER_HEADER]
    reserved = float(locks.zscore(keys.rate, member)) / 1000
    oldest = float(locks.zrange(keys.rate, 0, 0, withscores=True)[0][1]) / 1000
    assert reserved == pytest.approx(oldest + 1.01, abs=0.005), "the next slot"
    assert message["headers"]["eta"], "counting down to it"

    broker.lpush("celery", *[f"other-{n}" for n in range(parking.DEEP + 1)])
    _park_rate_run(app, nodeset, "deep-2", spot)
    wait_for(partial(published, 2), timeout=10, interval=0.01, message="held HOLD at most")
    assert broker.llen("celery") > parking.DEEP
    broker.delete("celery")


def test_a_run_waiting_for_a_held_key_is_looked_at_less_often_the_longer_it_is_held(
    celery_redis,
):
    """A run parked for its key's release is looked at again a quarter of the time its
    lock has been held since its acquisition or renewal, from RECHECK (a short hold: a
    key's runs follow each other as fast as the broker carries them) to IDLE (a long
    hold costs a few dozen looks per renewal, not one every few ms)."""
    c = celery_redis.client(db=0)
    keys, parked = lock_keys("turn:held"), parked_keys(DEFAULT_PREFIX)
    record = {"kind": "busy", "lock": keys.lock, "gate": handed_key(keys), "check": keys.lock}
    c.hset(parked.runs, "held-1", json.dumps(record))
    c.hset(keys.lock, mapping={"token": "t", "ttl": 10_000})
    line = line_key(keys)
    c.zadd(line, {"held-1": 0})

    def looked_at_again_in(left_ms):
        c.pexpire(keys.lock, left_ms)
        c.zadd(parked.lines, {line: 0})
        out = run(
            c, TAKE_DUE, due=parked.due, runs=parked.runs, taken=parked.taken,
            lines=parked.lines, most=10, lease_ms=10_000, recheck_ms=5, handoff_ms=2000,
            ahead_ms=500, longest_ms=250,
        )  # fmt: skip
        assert out[1:] == [], "not taken while its key is held"
        assert c.zscore(line, "held-1") == 0, "it keeps its place in its key's line"
        return c.zscore(parked.lines, line) - c.time()[0] * 1000 - c.time()[1] // 1000

    assert looked_at_again_in(10_000) == pytest.approx(5, abs=3), "just acquired"
    assert looked_at_again_in(9_600) == pytest.approx(100, abs=5), "held 400 ms"
    assert looked_at_again_in(2_000) == pytest.approx(250, abs=5), "held 8 s: at most IDLE"
