"""Rate budgets (``lock_rate``) and ``lock_on_busy="requeue"`` with real Redis and real
workers: in-process (threads) and two prefork worker processes.

Every body records its task id, key, start and end (:mod:`tests.apps.rated`); the
assertions are about those records: each task id ran once, no sliding window of one
second holds more than N starts of a key, bodies under ``lock_limit=3`` never overlap
more than 3 deep.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter, defaultdict

import pytest

from celery_redlock import LockedTask
from tests.apps.rated import make_rated_app
from tests.harness import close_app, wait_for
from tests.integration.test_inputs import start_fails

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
    return [(i, k, float(s), float(e), int(p)) for i, k, s, e, p in (x.split() for x in lines)]


def get(result, timeout=60):
    return result.get(timeout=timeout, disable_sync_subtasks=False)


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


def test_requeue_under_a_limit_keeps_three_at_once_and_loses_none(
    app, inprocess_worker_factory, tmp_path
):
    """lock_limit=3 with lock_on_busy="requeue": 30 runs of one key on 6 threads never
    run more than 3 bodies at once; every run happens once and succeeds."""
    inprocess_worker_factory(app, pool="threads", concurrency=6)
    out = tmp_path / "runs"
    task = app.tasks["rated.limited"]
    results = [task.delay("t", str(out), 0.1) for _ in range(30)]
    assert [get(r) for r in results] == ["t"] * 30
    runs = runs_of(out)
    assert Counter(i for i, *_ in runs) == Counter(r.id for r in results)
    assert most_at_once(runs) <= 3


def test_a_plain_task_starts_at_once_during_a_backlog(app, inprocess_worker_factory, tmp_path):
    """20 runs of a 5/s key wait on the queue for 3 s; a task without a budget sent after
    them starts at once: the early runs hold no worker while they wait."""
    inprocess_worker_factory(app, pool="threads", concurrency=2)
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


@pytest.mark.parametrize("bad", ["fast", "0/s", "-3/m", "5/fortnight", 5])
def test_a_bad_rate_stops_the_worker_naming_lock_rate(celery_redis, bad):
    app = make_rated_app(celery_redis.url)

    @app.task(name="bad.rate", base=LockedTask, bind=True, shared=False, lock_rate=bad)
    def bad_rate(self, key):
        return key

    message = start_fails(app)
    assert "task bad.rate: lock_rate must be a rate" in message
    assert '"N/s", "N/m" or "N/h"' in message


def test_a_rate_on_several_resources_stops_the_worker(celery_redis):
    app = make_rated_app(celery_redis.url)

    @app.task(
        name="bad.several",
        base=LockedTask,
        bind=True,
        shared=False,
        lock_rate="5/s",
        lock_key=["a:{x}", "b:{y}"],
    )
    def several(self, x, y):
        return x

    assert "lock_rate: a rate budget is for one resource" in start_fails(app)


def test_a_bad_rate_in_redlock_tasks_names_the_entry(celery_redis):
    app = make_rated_app(celery_redis.url, redlock_tasks={"rated.plain": {"rate": "10/fortnight"}})
    message = start_fails(app)
    assert "lock_rate must be a rate" in message and "redlock_tasks['rated.plain']" in message


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
