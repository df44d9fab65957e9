"""Send-time uniqueness (``lock_unique``) with real Redis and real in-process workers.

Each test asserts what the broker holds (messages published) and what the claim key
holds, not only what ``delay()`` returns: a duplicate must publish nothing.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import signal as signals_
import threading
import time

import pytest
from celery import chain, group, signals
from celery.beat import Scheduler, Service

from celery_redlock import (
    ConfigurationError,
    LockBusy,
    LockedTask,
    NodeUnavailable,
    Redlock,
    lock_configured_tasks,
)
from celery_redlock.integration.parking import LIFETIME
from tests.apps.unique import make_unique_app
from tests.harness import close_app, holder_pid, wait_for
from tests.harness.celery_workers import BROKER_DB, make_app, redis_url_with_db
from tests.harness.servers import free_port

CLAIM = "redlock:{%s}:claim"


@pytest.fixture
def app(celery_redis):
    app = make_unique_app(celery_redis.url)
    yield app
    close_app(app)


def queued(server, queue="celery"):
    """Messages waiting in the broker's queue."""
    return server.client(db=BROKER_DB).llen(queue)


def claim_keys(server, lock_name):
    """The claim keys of ``lock_name`` (one per task that claimed it)."""
    return sorted(server.client(db=0).scan_iter((CLAIM % lock_name) + "*"))


def claim_holder(server, item, name="item"):
    """The task id holding the claim of ``<name>:<item>`` (of its one claiming task)."""
    holders = [server.client(db=0).hget(k, "task_id") for k in claim_keys(server, f"{name}:{item}")]
    holders = [h for h in holders if h]
    assert len(holders) <= 1, holders
    return holders[0] if holders else None


def get(result, timeout=30, **kwargs):
    return result.get(timeout=timeout, disable_sync_subtasks=False, **kwargs)


@pytest.mark.smoke
def test_a_duplicate_publishes_nothing_and_returns_the_queued_copy(app, celery_redis):
    """until_started, no worker yet: the second delay() returns the first's result."""
    task = app.tasks["unique.until_started.return"]
    first = task.delay("a")
    second = task.delay("a")
    assert second.id == first.id
    assert queued(celery_redis) == 1, "the duplicate published nothing"
    assert claim_holder(celery_redis, "a") == first.id
    other = task.delay("b")
    assert other.id != first.id and queued(celery_redis) == 2, "another key is not a duplicate"


def test_the_claim_moves_to_the_execution_when_the_copy_starts(
    app, celery_redis, inprocess_worker_factory, tmp_path
):
    """until_started: once the copy runs, one more copy may queue (and only one)."""
    inprocess_worker_factory(app, pool="threads", concurrency=2)
    gate = tmp_path / "gate"
    task = app.tasks["unique.until_started.return"]
    running = task.delay("a", str(gate))
    wait_for(lambda: claim_holder(celery_redis, "a") is None, timeout=10)
    follow_up = task.delay("a", str(gate))
    assert follow_up.id != running.id, "a change made during the run gets its follow-up"
    assert task.delay("a", str(gate)).id == follow_up.id, "but only one queued copy"
    gate.touch()
    assert get(running) == "a" and get(follow_up) == "a"
    wait_for(lambda: claim_holder(celery_redis, "a") is None, timeout=10)


def test_until_finished_returns_the_running_copy(
    app, celery_redis, inprocess_worker_factory, tmp_path
):
    """until_finished: a send while the copy runs gets it; after it ends, a new copy."""
    inprocess_worker_factory(app, pool="threads", concurrency=2)
    gate, out = tmp_path / "gate", tmp_path / "runs"
    task = app.tasks["unique.until_finished.return"]
    running = task.delay("a", str(gate), str(out))
    wait_for(out.exists, timeout=10)
    assert task.delay("a", str(gate), str(out)).id == running.id
    gate.touch()
    assert get(running) == "a"
    wait_for(lambda: claim_holder(celery_redis, "a") is None, timeout=10)
    again = task.delay("a", str(gate), str(out))
    assert again.id != running.id
    assert get(again) == "a"
    assert out.read_text().split() == [running.id, again.id]


def test_two_until_finished_copies_whose_claims_a_restart_lost_run_one_after_the_other(
    app, celery_redis, inprocess_worker_factory, tmp_path, caplog
):
    """The lock node restarted empty with a copy queued: its claim is gone, so a second
    copy is published. They never run at once (the execution lock), and the second is
    not failed as busy either: it waits on the queue and runs after the first, as an
    until_started follow-up does."""
    gate, out = tmp_path / "gate", tmp_path / "runs"
    task = app.tasks["unique.until_finished.return"]
    first = task.delay("a", str(gate), str(out))
    celery_redis.client(db=0).delete(*claim_keys(celery_redis, "item:a"))  # the restart
    second = task.delay("a", str(gate), str(out))
    assert second.id != first.id, "without its claim, the key looks free at send time"
    with caplog.at_level(logging.INFO, logger="celery_redlock.task"):
        inprocess_worker_factory(app, pool="threads", concurrency=2)
        # The file exists from its open, before the body's task id is in it.
        wait_for(lambda: out.exists() and out.read_text().split(), timeout=10)
        wait_for(lambda: "follows the running copy" in caplog.text, timeout=10)
    assert len(out.read_text().split()) == 1, "both bodies ran at once"
    gate.touch()
    assert get(first) == "a" and get(second) == "a"
    assert sorted(out.read_text().split()) == sorted([first.id, second.id])


def test_on_duplicate_raise_names_the_queued_copy(app, celery_redis):
    """lock_on_duplicate='raise': LockBusy whose holder is the queued copy's task id."""
    task = app.tasks["unique.until_started.raise"]
    first = task.delay("a")
    with pytest.raises(LockBusy) as info:
        task.delay("a")
    assert info.value.holder == first.id
    assert info.value.key == "redlock:{item:a}"
    assert queued(celery_redis) == 1


@pytest.mark.parametrize("nodes", [1, 3])
def test_twenty_concurrent_sends_publish_one_message(redis_factory, nodes):
    """20 threads call delay() on one key at once: one message, one task id for all."""
    servers = redis_factory(nodes)
    conf = {}
    if nodes > 1:
        conf["redlock_nodes"] = [redis_url_with_db(s.url, 0) for s in servers]
    app = make_unique_app(servers[0].url, **conf)
    try:
        task = app.tasks["unique.until_finished.return"]
        barrier = threading.Barrier(20)
        ids: list[str] = []

        def send():
            barrier.wait()
            ids.append(task.delay("hot").id)

        threads = [threading.Thread(target=send) for _ in range(20)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert len(ids) == 20
        assert len(set(ids)) == 1, "every caller got the same copy"
        assert queued(servers[0]) == 1, "exactly one message was published"
    finally:
        close_app(app)


def test_a_revoked_queued_copy_does_not_block_a_new_one(
    app, celery_redis, inprocess_worker_factory
):
    """A copy revoked while queued (countdown) frees its key (celery-singleton #29)."""
    inprocess_worker_factory(app, pool="threads", concurrency=2)
    task = app.tasks["unique.until_started.return"]
    waiting = task.apply_async(("a",), countdown=3)
    assert task.delay("a").id == waiting.id
    waiting.revoke()
    # The worker holds the countdown copy. Celery 5.7 stores REVOKED as the revoke
    # arrives, and the next send takes the claim over; earlier versions discard the
    # copy when its countdown ends, and task_revoked frees the claim then.
    wait_for(lambda: task.delay("a").id != waiting.id, timeout=15)
    assert app.backend.get_state(waiting.id) == "REVOKED"


def test_a_revoke_no_worker_receives_does_nothing_and_a_send_gets_the_copy_that_runs(
    app, celery_redis, inprocess_worker_factory
):
    """No worker online: the revoke broadcast reaches nobody and nothing is stored (Celery
    keeps revoked ids in workers' memory only), so the copy is not revoked: a send
    meanwhile gets it, and it runs once a worker starts (docs/failure-modes.md)."""
    task = app.tasks["unique.until_started.return"]
    first = task.delay("a")
    first.revoke()
    again = task.delay("a")
    assert again.id == first.id and app.backend.get_state(first.id) == "PENDING"
    assert queued(celery_redis) == 1
    inprocess_worker_factory(app, pool="threads", concurrency=2)
    assert get(again) == "a", "the revoke did nothing: the copy ran, for both sends"


def test_an_expired_copy_frees_its_key_when_the_worker_discards_it(
    app, celery_redis, inprocess_worker_factory
):
    """expires= passed before a worker took the copy: discarding it frees the claim."""
    task = app.tasks["unique.until_started.return"]
    stale = task.apply_async(("a",), expires=0.2)
    past = time.time() + 0.3
    wait_for(lambda: time.time() > past, timeout=2)
    inprocess_worker_factory(app, pool="threads", concurrency=2)
    wait_for(lambda: claim_holder(celery_redis, "a") is None, timeout=10)
    fresh = task.delay("a")
    assert fresh.id != stale.id
    assert get(fresh) == "a"


def test_a_retry_is_the_same_copy_not_a_duplicate(
    app, celery_redis, inprocess_worker_factory, tmp_path
):
    """self.retry() re-publishes the copy (until_finished keeps its claim across retries)."""
    inprocess_worker_factory(app, pool="threads", concurrency=2)
    out = tmp_path / "runs"
    task = app.tasks["unique.retrying"]
    result = task.delay("r", str(out))
    assert get(result) == 2
    runs = out.read_text().split("\n")[:-1]
    assert runs == [f"{result.id} {n}" for n in range(3)]
    wait_for(lambda: claim_holder(celery_redis, "r", "retry") is None, timeout=10)


def test_a_copy_failing_before_its_body_frees_its_claim(
    app, celery_redis, inprocess_worker_factory
):
    """The execution lock busy (lock_on_busy='raise'): the copy fails, its claim is freed."""
    inprocess_worker_factory(app, pool="threads", concurrency=2)
    task = app.tasks["unique.busy_raise"]
    web = Redlock("item:a", nodes=[redis_url_with_db(celery_redis.url, 0)])
    with web:
        first = task.delay("a")
        with pytest.raises(LockBusy):
            get(first)
    wait_for(lambda: claim_holder(celery_redis, "a") is None, timeout=10)
    second = task.delay("a")
    assert second.id != first.id
    assert get(second) == "a"


def test_a_rejected_copy_frees_its_claim(app, celery_redis, inprocess_worker_factory):
    """Reject (requeue=False) ends the copy: the key is free for the next send."""
    inprocess_worker_factory(app, pool="threads", concurrency=2)
    task = app.tasks["unique.rejected"]
    first = task.delay("r")
    wait_for(lambda: claim_holder(celery_redis, "r") is None, timeout=10)
    assert task.delay("r").id != first.id


def test_a_claim_whose_copy_is_lost_ends_after_unique_ttl(app, celery_redis):
    """A purged queue loses the copy: its claim is free after lock_unique_ttl."""
    task = app.tasks["unique.short_claim"]
    lost = task.delay("x")
    app.control.purge()
    assert task.delay("x").id == lost.id, "within the TTL the claim stands"
    wait_for(lambda: claim_holder(celery_redis, "x", "short") is None, timeout=5)
    assert task.delay("x").id != lost.id


def test_redis_down_at_send_publishes_with_a_warning_or_raises(celery_redis, caplog):
    """No lock node: 'return' publishes anyway (WARNING); 'raise' raises, publishes nothing."""
    app = make_unique_app(
        celery_redis.url, redlock_url=f"redis://127.0.0.1:{free_port()}/0", redlock_ttl=1.0
    )
    try:
        with caplog.at_level(logging.WARNING, logger="celery_redlock.unique"):
            app.tasks["unique.until_started.return"].delay("a")
        assert queued(celery_redis) == 1
        assert any("without checking" in r.message for r in caplog.records)
        with pytest.raises(NodeUnavailable):
            app.tasks["unique.until_started.raise"].delay("a")
        assert queued(celery_redis) == 1
    finally:
        close_app(app)


def test_a_send_costs_one_script_call_and_a_duplicate_publishes_nothing(app, celery_redis):
    """One EVALSHA per send; the duplicate adds no broker write."""
    task = app.tasks["unique.until_started.return"]
    task.delay("warm")  # loads the script, connects
    celery_redis.reset_stats()
    task.delay("a")
    stats = celery_redis.commandstats()
    assert stats.get("evalsha") == 1
    pushes = stats.get("lpush", 0)
    assert pushes == 1
    celery_redis.reset_stats()
    task.delay("a")
    stats = celery_redis.commandstats()
    assert stats.get("evalsha") == 1
    assert stats.get("lpush", 0) == 0, "the duplicate published nothing"


def plain_app(redis_url: str, entry: dict, *, late: bool = False):
    """An app whose task is plain, locked by configuration alone with ``entry``.

    ``late``: the task is registered after the app finalized, so that finalizing has
    not locked it (issue 25 item 12): only a worker, beat or lock_configured_tasks do.
    """
    app = make_app(
        redis_url,
        name="plain",
        redlock_url=redis_url_with_db(redis_url, 0),
        redlock_tasks={"plain.report": entry},
    )
    if late:
        app.finalize()

    @app.task(shared=False, name="plain.report")
    def report(day):
        return day

    return app


def test_configuration_only_uniqueness_in_the_worker_and_beat(
    celery_redis, inprocess_worker_factory
):
    """redlock_tasks {"unique": ...}: sends from a worker's process, and from beat, are
    deduplicated (the worker and beat lock the task class when they start)."""
    app = plain_app(
        celery_redis.url, {"unique": "until_finished", "key": "report:{day}"}, late=True
    )
    try:
        task = app.tasks["plain.report"]
        assert not isinstance(task, LockedTask), "registered after finalize: not locked yet"
        signals.beat_init.send(sender=Service(app=app))  # as celery beat does at start
        assert isinstance(app.tasks["plain.report"], LockedTask)
        first = task.delay("mon")
        assert task.delay("mon").id == first.id
        assert queued(celery_redis) == 1
        inprocess_worker_factory(app, pool="threads", concurrency=2)
        assert get(first) == "mon"
        wait_for(lambda: claim_holder(celery_redis, "mon", "report") is None, timeout=10)
    finally:
        close_app(app)


def test_a_process_that_only_sends_locks_configured_tasks_on_request(celery_redis):
    """A web process starts no worker or beat: lock_configured_tasks(app) applies
    redlock_tasks there, and its sends are deduplicated; bad entries are refused."""
    app = plain_app(celery_redis.url, {"unique": "until_started", "key": "report:{day}"}, late=True)
    try:
        assert not isinstance(app.tasks["plain.report"], LockedTask)
        assert lock_configured_tasks(app) == ["plain.report"]
        task = app.tasks["plain.report"]
        assert isinstance(task, LockedTask)
        assert task.delay("tue").id == task.delay("tue").id
        assert queued(celery_redis) == 1
    finally:
        close_app(app)
    bad = plain_app(celery_redis.url, {"unique": "sometimes"})
    try:
        with pytest.raises(ConfigurationError, match="lock_unique must be one of"):
            lock_configured_tasks(bad)
            bad.tasks["plain.report"].delay("wed")
    finally:
        close_app(bad)


def test_duplicates_and_expired_claims_are_counted(
    app, celery_redis, inprocess_worker_factory, metrics_registry
):
    """redlock_duplicates_total per suppressed send; redlock_claims_expired_total for a copy
    that started after its claim's TTL."""
    registry = metrics_registry
    task = app.tasks["unique.short_claim"]
    first = task.delay("m")
    task.delay("m")
    task.delay("m")
    assert (
        registry.get_sample_value("redlock_duplicates_total", {"task": "unique.short_claim"}) == 2
    )
    wait_for(lambda: claim_holder(celery_redis, "m", "short") is None, timeout=5)
    inprocess_worker_factory(app, pool="threads", concurrency=2)
    assert get(first) == "m"
    wait_for(
        lambda: (
            registry.get_sample_value(
                "redlock_claims_expired_total", {"task": "unique.short_claim"}
            )
            == 1
        ),
        timeout=10,
    )


def test_prefork_a_running_copy_terminated_or_killed_frees_its_key(
    app, celery_redis, worker_process_factory, tmp_path
):
    """until_finished with a prefork worker: revoke(terminate=True) frees the claim (the
    main process's task_revoked); a copy whose child is SIGKILLed (WorkerLostError stored)
    no longer blocks the next send."""
    worker_process_factory("tests.apps.unique", pool="prefork", concurrency=2)
    task = app.tasks["unique.until_finished.return"]
    gate, out = tmp_path / "never", tmp_path / "runs"
    killed = task.delay("k", str(gate), str(out))
    wait_for(lambda: holder_pid(celery_redis), timeout=30)
    os.kill(holder_pid(celery_redis), signals_.SIGKILL)
    wait_for(lambda: killed.state == "FAILURE", timeout=30)
    assert claim_holder(celery_redis, "k") == killed.id, "the killed child freed nothing"
    fresh = task.delay("k", "", str(out))
    assert fresh.id != killed.id, "a copy with a final state is taken over"
    assert get(fresh) == "k"
    # Last: billiard may hand a task sent right after a terminate to the dying child.
    running = task.delay("t", str(gate), str(out))
    wait_for(lambda: out.read_text().count("\n") == 3, timeout=30)
    assert task.delay("t", str(gate), str(out)).id == running.id
    running.revoke(terminate=True)
    wait_for(lambda: claim_holder(celery_redis, "t") is None, timeout=20)


def test_a_send_never_hangs_on_a_blackholed_lock_node(celery_redis, fault_proxy, caplog):
    """The lock node accepts and never answers: the send gives up after the node timeout
    (a bound, with a wide margin for a loaded machine) and publishes with a WARNING."""
    lock_server = fault_proxy(celery_redis)
    app = make_unique_app(celery_redis.url, redlock_url=lock_server.url, redlock_node_timeout=0.2)
    try:
        task = app.tasks["unique.until_started.return"]
        task.delay("warm")  # connects through the proxy
        lock_server.blackhole()
        began = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="celery_redlock.unique"):
            task.delay("a")
        assert time.monotonic() - began < 5 * 0.2 + 2.0
        assert queued(celery_redis) == 2
        assert any("without checking" in r.message for r in caplog.records)
    finally:
        close_app(app)


def runs_of(out):
    """(task id, n, start time) of each run a task recorded."""
    lines = out.read_text().splitlines() if out.exists() else []
    return [(i, int(n), float(t)) for i, n, t in (line.split() for line in lines)]


def every(seconds, count):
    """Yield ``count`` times, ``seconds`` apart (waiting on the clock, not sleeping blind)."""
    began = time.monotonic()
    for k in range(count):
        wait_for(lambda k=k: time.monotonic() >= began + k * seconds, timeout=seconds + 5)
        yield k


@pytest.fixture(params=[1, 3], ids=["1-node", "3-nodes"])
def nodes_app(request, redis_factory):
    """The unique app on one lock node, or on three (Redlock; the broker is the first)."""
    servers = redis_factory(request.param)
    conf = {}
    if request.param > 1:
        conf["redlock_nodes"] = [redis_url_with_db(s.url, 0) for s in servers]
    app = make_unique_app(servers[0].url, **conf)
    yield app
    close_app(app)


def test_debounce_runs_once_after_the_last_call_with_its_arguments(
    nodes_app, inprocess_worker_factory, tmp_path, caplog
):
    """lock_debounce=1: 10 calls 100 ms apart give one run, >= 1 s after the last call,
    with the last call's arguments; every call's result is that run's. The copy that
    came too soon waits parked on a lock node (no worker holds it), as that call."""
    app = nodes_app
    inprocess_worker_factory(app, pool="threads", concurrency=2)
    out = tmp_path / "runs"
    task = app.tasks["unique.digest"]
    results, last_call = [], 0.0
    with caplog.at_level(logging.INFO, logger="celery_redlock.task"):
        for n in every(0.1, 10):
            last_call = time.time()
            results.append(task.delay("ann", n, str(out)))
        assert len({r.id for r in results}) == 1, "one copy for the whole burst"
        assert [get(r) for r in results] == [9] * 10
    assert "was called again; parked" in caplog.text
    ((run_id, n, started),) = runs_of(out)
    assert (run_id, n) == (results[0].id, 9)
    assert started >= last_call + 1.0
    again = task.delay("ann", 10, str(out))
    assert again.id != run_id, "a call after the run started gets a new run"
    assert get(again) == 10


def test_throttle_starts_one_run_per_window(nodes_app, inprocess_worker_factory, tmp_path):
    """lock_throttle=2: calls every 200 ms for 5 s give at most 3 runs, starts >= 2 s apart."""
    app = nodes_app
    inprocess_worker_factory(app, pool="threads", concurrency=2)
    out = tmp_path / "runs"
    task = app.tasks["unique.poll"]
    results = [task.delay("f", n, str(out)) for n in every(0.2, 25)]
    ids = {r.id for r in results}
    assert len(ids) <= 3
    assert get(results[0]) == 0, "the window's first call is its run"
    for result in results:
        get(result)
    runs = runs_of(out)
    assert len(runs) == len(ids) >= 2
    starts = sorted(t for _, _, t in runs)
    assert all(b - a >= 2.0 for a, b in itertools.pairwise(starts))


def test_send_options_reach_the_message_and_canvases_are_not_deduplicated(app, celery_redis):
    """countdown, expires, queue and headers go through to the one message published; a
    chain or group member is published as Celery promised it (not deduplicated)."""
    task = app.tasks["unique.until_started.return"]
    first = task.apply_async(
        ("q",), countdown=60, expires=600, queue="other", headers={"trace": "t-1"}
    )
    assert task.apply_async(("q",), queue="other").id == first.id
    (raw,) = celery_redis.client(db=BROKER_DB).lrange("other", 0, -1)
    message = json.loads(raw)
    assert message["headers"]["id"] == first.id
    assert message["headers"]["eta"] and message["headers"]["expires"]
    assert message["headers"]["trace"] == "t-1"
    claim_ttl = celery_redis.client(db=0).pttl(claim_keys(celery_redis, "item:q")[0]) / 1000
    assert 3600 + 50 < claim_ttl <= 3600 + 60, "the claim waits out the countdown too"
    group([task.s("g"), task.s("g")]).apply_async()
    chain(task.s("c"), task.si("c")).apply_async()
    assert queued(celery_redis) == 3, "both group members and the chain's first task"


def test_beat_never_piles_up_copies_of_a_slow_periodic_task(app, celery_redis):
    """Celery's own Scheduler sends an until_finished task each tick while no worker
    takes it: one message in the queue, whatever the number of ticks."""
    scheduler = Scheduler(app, lazy=True)
    entry = scheduler.Entry(
        name="slow", task="unique.until_finished.return", args=("beat",), app=app
    )
    results = [scheduler.apply_async(entry, advance=False) for _ in range(5)]
    assert len({r.id for r in results}) == 1
    assert queued(celery_redis) == 1


# -- lifetimes far shorter than the work (issue 25) -------------------------------------


def test_until_finished_a_copy_running_past_its_claims_ttl_still_turns_duplicates_away(
    app, celery_redis, inprocess_worker_factory, tmp_path
):
    """lock_unique_ttl=1 and a body that runs on: once the claim's own TTL is over, the
    copy still holds it through its execution lock (renewed while it runs)."""
    inprocess_worker_factory(app, pool="threads", concurrency=2)
    gate, out = tmp_path / "gate", tmp_path / "runs"
    task = app.tasks["unique.brief.until_finished"]
    running = task.delay("a", str(gate), str(out))
    wait_for(out.exists, timeout=10)
    wait_for(lambda: not claim_keys(celery_redis, "brief:a"), timeout=10)  # its TTL is over
    assert task.delay("a", str(gate), str(out)).id == running.id, "published beside it"
    assert queued(celery_redis) == 0
    gate.touch()
    assert get(running) == "a"
    assert out.read_text().split() == [running.id]


def test_until_finished_a_retry_keeps_its_claim_over_a_countdown_longer_than_the_ttl(
    app, celery_redis, inprocess_worker_factory, tmp_path
):
    """self.retry(countdown=3) with a 1 s claim: a send during the countdown gets the
    retrying copy; one copy runs, with its retry, and nothing else."""
    inprocess_worker_factory(app, pool="threads", concurrency=2)
    out = tmp_path / "runs"
    task = app.tasks["unique.brief.retrying"]
    sent_at = time.monotonic()
    first = task.delay("a", str(out))
    wait_for(lambda: first.state == "RETRY", timeout=10)
    # Past the send's own claim (1 s), within the countdown (3 s).
    wait_for(lambda: time.monotonic() - sent_at > 1.5, timeout=10)
    assert task.delay("a", str(out)).id == first.id, "a second copy during the countdown"
    assert get(first) == "a"
    assert out.read_text().split("\n")[:-1] == [f"{first.id} 0", f"{first.id} 1"]


def test_until_started_the_waiting_follow_up_keeps_its_claim_while_it_waits(
    app, celery_redis, inprocess_worker_factory, tmp_path, caplog
):
    """A 1 s claim; the follow-up of a running copy waits, parked, for the running one
    to end: its claim is carried for as long as a parked run is kept (not the claim's
    1 s), so it stays the one follow-up (no second one published), and it runs after
    the running one, published once, when the key is free."""
    inprocess_worker_factory(app, pool="threads", concurrency=2)
    gate, out = tmp_path / "gate", tmp_path / "runs"
    task = app.tasks["unique.brief.until_started"]
    running = task.delay("a", str(gate), str(out))
    wait_for(out.exists, timeout=10)
    with caplog.at_level(logging.INFO, logger="celery_redlock.task"):
        follow_up = task.delay("a", str(gate), str(out))
        wait_for(lambda: "follows the running copy; parked" in caplog.text, timeout=20)
    assert claim_holder(celery_redis, "a", name="brief") == follow_up.id
    (claim,) = claim_keys(celery_redis, "brief:a")
    assert celery_redis.client(db=0).pttl(claim) > 0.9 * LIFETIME * 1000, "outlives 1 s"
    assert task.delay("a", str(gate), str(out)).id == follow_up.id
    gate.touch()
    assert get(running) == "a" and get(follow_up) == "a"
    assert out.read_text().split() == [running.id, follow_up.id]
    assert caplog.text.count("follows the running copy") == 1, "parked once, not put back"


def test_two_tasks_naming_one_resource_are_not_duplicates_of_each_other(
    app, celery_redis, inprocess_worker_factory, tmp_path
):
    """close_account(7) sent while sync_account(7) is queued: published, and both run
    (one after the other: they share the resource's execution lock)."""
    gate, out = tmp_path / "gate", tmp_path / "runs"
    sync = app.tasks["unique.sync_account"].delay("7", str(gate), str(out))
    close = app.tasks["unique.close_account"].delay("7", str(gate), str(out))
    assert close.id != sync.id, "close_account was taken for a copy of sync_account"
    assert queued(celery_redis) == 2
    assert app.tasks["unique.close_account"].delay("7", str(gate), str(out)).id == close.id
    gate.touch()
    inprocess_worker_factory(app, pool="threads", concurrency=2)
    assert get(sync) == "7" and get(close) == "7"
    assert sorted(out.read_text().split()) == sorted([sync.id, close.id])


def test_a_task_id_sent_twice_while_queued_publishes_one_message(app, celery_redis):
    """A deterministic task id makes a send idempotent."""
    task = app.tasks["unique.until_started.return"]
    first = task.apply_async(("a",), task_id="order-42")
    again = task.apply_async(("a",), task_id="order-42")
    assert first.id == again.id == "order-42"
    assert queued(celery_redis) == 1
    with pytest.raises(LockBusy) as info:
        app.tasks["unique.until_started.raise"].apply_async(("b",), task_id="order-43")
        app.tasks["unique.until_started.raise"].apply_async(("b",), task_id="order-43")
    assert info.value.holder == "order-43"
    assert queued(celery_redis) == 2


def test_an_iso_string_eta_is_added_to_the_claims_ttl(app, celery_redis):
    """Celery accepts an eta as an ISO 8601 string: the claim covers it as a datetime's."""
    from datetime import datetime, timedelta, timezone

    task = app.tasks["unique.short_claim"]  # lock_unique_ttl=0.3
    eta = (datetime.now(timezone.utc) + timedelta(seconds=60)).isoformat()
    first = task.apply_async(("e",), eta=eta)
    ttl = celery_redis.client(db=0).pttl(claim_keys(celery_redis, "short:e")[0]) / 1000
    assert 55 < ttl <= 61
    assert task.apply_async(("e",), eta=eta).id == first.id
    assert queued(celery_redis) == 1


def test_debounce_takes_no_due_time_from_the_senders_clock(app, celery_redis):
    """The debounced copy is published with no eta of the sender's: its due time is the
    lock node's (judged when a worker starts it), as throttle's is."""
    task = app.tasks["unique.digest"]
    task.delay("k", 1, "")
    (raw,) = celery_redis.client(db=BROKER_DB).lrange("celery", 0, -1)
    headers = json.loads(raw)["headers"]
    assert headers.get("eta") is None and headers.get("countdown") is None


def test_a_unique_link_callback_is_published_while_a_copy_of_its_key_runs(
    app, celery_redis, inprocess_worker_factory, tmp_path
):
    """A callback's task id is promised to its parent's caller: never deduplicated away.
    It runs after the running copy of its key (they share the execution lock)."""
    inprocess_worker_factory(app, pool="threads", concurrency=2)
    gate, out = tmp_path / "gate", tmp_path / "runs"
    unique_task = app.tasks["unique.until_finished.return"]
    running = unique_task.delay("a", str(gate), str(out))
    wait_for(out.exists, timeout=10)
    callback = unique_task.s(str(gate), str(out))
    callback.freeze()
    parent = app.tasks["unique.echo"].apply_async(("a",), link=callback)
    assert get(parent) == "a"
    gate.touch()
    assert get(running) == "a"
    assert get(app.AsyncResult(callback.id)) == "a", "the callback was never published"
    assert out.read_text().split() == [running.id, callback.id]
