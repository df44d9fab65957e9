"""Rate budgets (``lock_rate``) and ``lock_on_busy="requeue"`` with real Redis and real
workers: in-process (threads) and two prefork worker processes.

Every body records its task id, key, start and end (:mod:`tests.apps.rated`); the
assertions are about those records: each task id ran once, no sliding window of one
second holds more than N starts of a key, bodies under ``lock_limit=3`` never overlap
more than 3 deep.
"""

from __future__ import annotations

import base64
import itertools
import json
import time
from collections import Counter, defaultdict

import pytest
from celery.worker import state as worker_state

from celery_redlock.integration.parking import PARKED_HEADER
from celery_redlock.integration.policies import DEFERRALS_HEADER
from tests.apps.rated import make_late_app, make_rated_app
from tests.harness import close_app, unique_nodename, wait_for

#: Slack for the gap between a start's admission (node clock) and the body's record of
#: it (worker clock, a few ms later): the bound checked is N starts per (1 s - SLACK).
SLACK = 0.05


@pytest.fixture
def app(celery_redis):
    app = make_rated_app(celery_redis.url)
    yield app
    close_app(app)


def runs_of(out):
    """(task id, key, start, end, pid) of each run recorded."""
    lines = out.read_text().splitlines() if out.exists() else []
    return [(i, k, float(s), float(e), int(p)) for i, k, s, e, p, _ in map(str.split, lines)]


def get(result, timeout=60):
    return result.get(timeout=timeout, disable_sync_subtasks=False)


def deferred_copies_waiting(server):
    """Unacknowledged messages (held by a worker) that are deferred copies of a run."""
    held = server.client(db=1).hvals("unacked")
    return [m for m in map(json.loads, held) if m[0]["headers"].get(DEFERRALS_HEADER)]


def parked_runs(server):
    """The runs parked in Redis (db 0): task id -> (due time, epoch s; the copy's headers)."""
    client = server.client(db=0)
    parked = {}
    due_times = client.zrange("redlock:parked", 0, -1, withscores=True)
    for line in client.zrange("redlock:parked:lines", 0, -1):  # runs waiting for a key
        due_times += client.zrange(line, 0, -1, withscores=True)
    for task_id, due in due_times:
        text = client.hget("redlock:parked:runs", task_id)
        if text is None:
            continue  # its copy started since the zrange
        record = json.loads(text)
        fields = json.loads(base64.b64decode(record["body"]))
        parked[task_id] = (due / 1000, fields["options"]["headers"])
    return parked


def busiest_window(starts, window=1.0):
    """The most starts in any half-open window of ``window`` seconds (less SLACK)."""
    starts = sorted(starts)
    return max(
        (sum(1 for t in starts[i:] if t < s + window - SLACK) for i, s in enumerate(starts)),
        default=0,
    )


def most_at_once(runs):
    """The most bodies running at one instant."""
    events = sorted([(s, 1) for _, _, s, _, _ in runs] + [(e, -1) for _, _, _, e, _ in runs])
    depth = peak = 0
    for _, step in events:
        depth += step
        peak = max(peak, depth)
    return peak


def test_two_prefork_workers_share_each_keys_budget_exactly(app, worker_process_factory, tmp_path):
    """25 calls of each of two keys at 5/s, sent at once to two prefork workers (2
    processes each): every call runs exactly once and succeeds with max_retries=0 (an
    early run is requeued, not retried); no second holds more than 5 starts of a key; and
    the budget is used: a key's 25 starts take 4 s ideally, here at most 1.5x that."""
    for _ in range(2):
        worker_process_factory("tests.apps.rated", pool="prefork", concurrency=2)
    out = tmp_path / "runs"
    task = app.tasks["rated.call"]
    results = [task.delay(key, str(out)) for key in ("a", "b") for _ in range(25)]
    assert [get(r) for r in results] == ["a"] * 25 + ["b"] * 25
    runs = runs_of(out)
    assert Counter(i for i, *_ in runs) == Counter(r.id for r in results), "each ran once"
    assert len({pid for *_, pid in runs}) >= 2, "more than one process ran them"
    for key in ("a", "b"):
        starts = sorted(s for _, k, s, _, _ in runs if k == key)
        assert busiest_window(starts) <= 5, (key, starts)
        assert 4.0 - SLACK <= starts[-1] - starts[0] <= 1.5 * 4.0, (key, starts)


def test_a_worker_killed_mid_backlog_loses_no_run(celery_redis, worker_process_factory, tmp_path):
    """acks_late: 25 calls of one key at 5/s on two prefork workers; one worker (its main
    process and pool children) is SIGKILLed while the backlog drains. The early runs wait
    parked in Redis, not in any worker; messages the killed worker held unacknowledged
    (prefetched, or a parked run's copy it received) come back to the other worker once
    the visibility timeout passes, or (parked copies) are published again when their
    take's lease ends: every task id runs and ends SUCCESS, and no second holds more than
    5 starts, counting the killed worker's (a start it was admitted for and never ran
    only leaves a slot unused).

    A task id may run twice in one way only: its first run was in the killed worker,
    which died after the body wrote its record and before the run's result was stored
    and its message acknowledged (the body is instant, but the run is not: the lock's
    check, the result, the release and the ack follow it). To Celery and celery_redlock
    that run never finished, so the message given again runs (at least once); it waits
    for the dead run's share of the key to expire (``redlock_ttl``, 3 s here) and runs
    in the other worker, after the kill. Any other second run fails this test."""
    late = make_late_app(celery_redis.url)
    workers = [
        worker_process_factory(
            "tests.apps.rated:late", name=unique_nodename("late"), pool="prefork", concurrency=2
        )
        for _ in range(2)
    ]
    doomed_pids, survivor_pids = (set(w.group_pids()) for w in workers)
    out = tmp_path / "runs"
    task = late.tasks["rated.call"]
    try:
        results = [task.delay("k", str(out)) for _ in range(25)]
        # Mid-backlog: the doomed worker ran bodies, deferred copies wait for their slot.
        wait_for(
            lambda: len(runs_of(out)) >= 6 and {p for *_, p in runs_of(out)} & doomed_pids,
            timeout=60,
            interval=0.01,
        )
        assert parked_runs(celery_redis), "runs wait for their slot parked in Redis"
        held = deferred_copies_waiting(celery_redis)
        assert all(m[0]["headers"].get(PARKED_HEADER) for m in held), "no ETA copy is held"
        killed_at = time.time()
        workers[0].kill()
        assert len(runs_of(out)) < 20, "the kill came while the backlog drained"
        assert [get(r, timeout=120) for r in results] == ["k"] * 25
        assert {late.AsyncResult(r.id).state for r in results} == {"SUCCESS"}
    finally:
        close_app(late)
    runs = runs_of(out)
    assert {i for i, *_ in runs} == {r.id for r in results}, "every task id ran"
    assert busiest_window(sorted(s for _, _, s, _, _ in runs)) <= 5, runs
    # The other worker ran the rest: the parked runs, whichever worker parked them.
    assert any(p in survivor_pids and s > killed_at for i, _, s, _, p in runs)
    for task_id, count in Counter(i for i, *_ in runs).items():
        if count > 1:
            first, second, *more = sorted((r for r in runs if r[0] == task_id), key=lambda r: r[2])
            assert not more and first[4] in doomed_pids and first[3] < killed_at, (first, second)
            assert second[4] in survivor_pids and second[2] > killed_at, (first, second)


def test_an_early_run_is_requeued_with_its_options_not_retried(
    app, inprocess_worker_factory, tmp_path
):
    """1/s twice over with the exclusive lock: the second run goes back on the queue (same
    task id, its headers kept, retries still 0) and runs one window after the first."""
    inprocess_worker_factory(app, pool="threads", concurrency=2)
    out = tmp_path / "runs"
    task = app.tasks["rated.exclusive"]
    results = [task.apply_async(("k", str(out)), headers={"trace": "t-1"}) for _ in range(7)]
    for result in results:
        assert get(result) == "k"
    runs = runs_of(out)
    assert sorted(i for i, *_ in runs) == sorted(r.id for r in results)
    starts = sorted(s for _, _, s, _, _ in runs)
    assert busiest_window(starts) <= 5
    assert starts[-1] - starts[0] >= 1.0 - SLACK, "the 6th and 7th waited for a slot"
    assert most_at_once(runs) == 1, "the exclusive lock still holds"
    meta = app.backend.get_task_meta(results[-1].id)
    assert meta["status"] == "SUCCESS" and meta.get("retries", 0) == 0


def start_workers(pool, app, inprocess_worker_factory, worker_process_factory, slots):
    """``slots`` pool slots: one in-process worker (threads), or two prefork ``celery
    worker`` processes sharing them (where a copy waiting in a timer could only hold a
    pool process by blocking the child)."""
    if pool == "prefork":
        for _ in range(2):
            worker_process_factory("tests.apps.rated", pool="prefork", concurrency=slots // 2)
    else:
        inprocess_worker_factory(app, pool="threads", concurrency=slots)


@pytest.mark.parametrize("pool", ["threads", "prefork"])
def test_requeue_under_a_limit_keeps_three_at_once_and_loses_none(
    pool, app, inprocess_worker_factory, worker_process_factory, tmp_path
):
    """lock_limit=3 with lock_on_busy="requeue": 30 runs of one key on 6 pool slots (one
    worker's threads, or two prefork workers of 3 processes) never run more than 3
    bodies at once; every run happens once and succeeds."""
    start_workers(pool, app, inprocess_worker_factory, worker_process_factory, 6)
    out = tmp_path / "runs"
    task = app.tasks["rated.limited"]
    results = [task.delay("t", str(out), 0.1) for _ in range(30)]
    assert [get(r) for r in results] == ["t"] * 30
    runs = runs_of(out)
    assert Counter(i for i, *_ in runs) == Counter(r.id for r in results)
    assert most_at_once(runs) <= 3


@pytest.mark.parametrize("pool", ["threads", "prefork"])
def test_a_plain_task_starts_at_once_during_a_backlog(
    pool, app, inprocess_worker_factory, worker_process_factory, tmp_path
):
    """20 runs of a 5/s key wait on the queue for 3 s; a task without a budget sent after
    them starts at once: the early runs hold no pool slot while they wait (2 slots: one
    worker's threads, or two prefork workers of one process each)."""
    start_workers(pool, app, inprocess_worker_factory, worker_process_factory, 2)
    out = tmp_path / "runs"
    backlog = [app.tasks["rated.call"].delay("a", str(out)) for _ in range(20)]
    wait_for(lambda: len(runs_of(out)) >= 5, timeout=30)
    sent = time.time()
    plain = app.tasks["rated.plain"].delay("p", str(out))
    assert get(plain) == "p"
    (start,) = [s for _, k, s, _, _ in runs_of(out) if k == "p"]
    assert start - sent < 1.0
    for result in backlog:
        get(result)
    assert max(s for _, k, s, _, _ in runs_of(out) if k == "a") > start, "it was a backlog"


def test_windows_of_two_keys_are_apart(app, inprocess_worker_factory, tmp_path):
    """Two keys of one task have a budget each: 5 runs of each start at once."""
    inprocess_worker_factory(app, pool="threads", concurrency=4)
    out = tmp_path / "runs"
    results = [app.tasks["rated.call"].delay(k, str(out)) for k in "xy" for _ in range(5)]
    for result in results:
        get(result)
    by_key = defaultdict(list)
    for _, k, s, _, _ in runs_of(out):
        by_key[k].append(s)
    for starts in by_key.values():
        assert len(starts) == 5 and max(starts) - min(starts) < 1.0
    assert not any(b - a < 0 for a, b in itertools.pairwise(sorted(by_key["x"])))


def test_three_lock_nodes_bound_a_backlog_and_one_node_down_keeps_it_running(
    celery_redis, redis_factory, inprocess_worker_factory, tmp_path
):
    """Redlock at task level: ``redlock_nodes`` names three masters; 5/s, 20 calls of a key
    raced by 4 threads, then a node stopped and 15 calls of another key.

    What holds. Each node admits at most N = 5 starts of a key per window, and a start
    runs only when a majority (q = 2 of n = 3) admitted it, so at most floor(n·N/q) = 7
    start in any second with every node up: more than N when racing starts reach the
    nodes in different orders, each admitted by another pair (README, "Rate limits and
    budgets"). With one node down a start needs both nodes that answer, each admitting
    at most N: at most N = 5 start in any second, and every run still starts (a
    majority answers)."""
    nodes = redis_factory(3)
    app = make_rated_app(celery_redis.url, redlock_nodes=[n.url for n in nodes])
    inprocess_worker_factory(app, pool="threads", concurrency=4)
    out = tmp_path / "runs"
    task = app.tasks["rated.call"]

    def backlog(key, calls):
        results = [task.delay(key, str(out)) for _ in range(calls)]
        assert [get(r) for r in results] == [key] * calls, "every run starts"
        runs = [r for r in runs_of(out) if r[1] == key]
        assert sorted(i for i, *_ in runs) == sorted(r.id for r in results), "each ran once"
        return sorted(s for _, _, s, _, _ in runs)

    starts = backlog("a", 20)
    assert busiest_window(starts) <= 7, starts  # floor(3 * 5 / 2)
    logged = [n.client().zcard("redlock:{api:a}:rate") for n in nodes]
    assert all(count <= 5 for count in logged), f"each node logs at most N: {logged}"

    nodes[0].stop()
    starts = backlog("b", 15)
    assert busiest_window(starts) <= 5, starts
    assert starts[-1] - starts[0] >= 2.0 - SLACK, "15 starts at 5/s span 2 s at least"
    assert nodes[1].client().zcard("redlock:{api:b}:rate") <= 5


def test_a_message_delivered_again_after_its_run_finished_does_not_run_again(
    celery_redis, inprocess_worker_factory, tmp_path
):
    """acks_late: a worker killed after the body stored SUCCESS and before the ack has
    its message delivered again by the broker (kombu marks it ``redelivered``, as
    pushed back here): the task id's final result is found and the body does not run a
    second time. Before: it ran twice (found by the SIGKILL test above)."""
    app = make_late_app(celery_redis.url)
    out = tmp_path / "runs"
    broker = celery_redis.client(db=1)
    result = app.tasks["rated.exclusive"].delay("k", str(out))
    (raw,) = broker.lrange("celery", 0, -1)  # the message as the broker holds it
    inprocess_worker_factory(app, pool="threads", concurrency=2)
    assert get(result) == "k"
    message = json.loads(raw)  # what kombu's restore of a dead worker's message sends
    message["headers"]["redelivered"] = True
    message["properties"]["delivery_info"]["redelivered"] = True
    # Accepted twice by this (in-process) worker, and nothing running any more.
    accepted = worker_state.total_count.get("rated.exclusive", 0)
    broker.lpush("celery", json.dumps(message))
    wait_for(
        lambda: (
            worker_state.total_count.get("rated.exclusive", 0) > accepted
            and not worker_state.active_requests
        ),
        timeout=20,
    )
    assert [i for i, *_ in runs_of(out)] == [result.id]


def test_a_backlog_is_put_back_once_each_to_its_own_place_in_line(
    app, celery_redis, inprocess_worker_factory, tmp_path
):
    """25 runs of a 5/m key sent at once: 5 start, and each of the 20 others is parked
    in Redis once, due at its own place in line: 5 due one window after the first
    starts, 5 two windows after, and so on. So each goes through the broker once more
    (before: every run came back at the next slot, and every window until it won one:
    about 25 + 20 + 15 + 10 + 5 = 75 deliveries, B²/2N), and no worker holds it
    meanwhile (before: an unacknowledged ETA message in a worker's memory, stranded
    for the broker's visibility timeout if that worker died).

    A minute's window makes every count here exact whatever the machine's load: all 25
    are judged within seconds, and no run is due before the test ends, so the worker
    accepted exactly 25 deliveries."""
    inprocess_worker_factory(app, pool="threads", concurrency=4)
    out = tmp_path / "runs"
    before = worker_state.total_count.get("rated.per_minute", 0)
    results = [app.tasks["rated.per_minute"].delay("m", str(out)) for _ in range(25)]
    waiting = wait_for(
        lambda: len(found := parked_runs(celery_redis)) == 20 and found,
        timeout=60,
        message="the 20 early runs to be parked",
    )
    wait_for(lambda: len(runs_of(out)) == 5, timeout=60, message="the first 5 to run")
    assert worker_state.total_count.get("rated.per_minute", 0) - before == 25, "no copy is back"
    assert not deferred_copies_waiting(celery_redis), "no worker holds a copy: none is due"
    starts = sorted(s for _, _, s, _, _ in runs_of(out))
    ran = {i for i, *_ in runs_of(out)}
    assert ran | waiting.keys() == {r.id for r in results} and not ran & waiting.keys()
    assert {h[DEFERRALS_HEADER] for _, h in waiting.values()} == {1}, "each put back once"
    due = sorted(at for at, _ in waiting.values())
    for place, at in enumerate(due):
        # Its place's slot: the (place % 5)-th first start leaves the window of 60 s
        # place // 5 windows on (plus 30 ms of lag allowed per window, and its margin).
        windows = place // 5 + 1
        slot = starts[place % 5] + 60.0 * windows
        assert slot - 1.0 <= at <= slot + 1.0, (place, at - starts[0], starts)
    assert [r.state for r in results if r.id in waiting] == ["PENDING"] * 20
