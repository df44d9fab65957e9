"""The runs waiting on the queue for a key, as a worker records them (``ls``: QUEUED).

A run refused by its rate budget is recorded by its admission's own script call, and
removed by the admission that lets it start; a run put back by
``lock_on_busy="requeue"`` costs one call when it is put back and one when it starts;
a plain run costs nothing. Every call to the lock nodes is counted (a spy on
``NodeSet.call``: the in-process worker shares this process).
"""

from __future__ import annotations

from collections import Counter

import pytest

from celery_redlock import LockedTask, Redlock
from celery_redlock.engine.keys import lock_keys
from celery_redlock.nodes import NodeSet
from tests.harness import close_app, wait_for
from tests.harness.celery_workers import make_app, redis_url_with_db


@pytest.fixture
def app(celery_redis):
    app = make_app(
        celery_redis.url, name="queued", redlock_url=redis_url_with_db(celery_redis.url, 0)
    )
    common = {"base": LockedTask, "shared": False, "max_retries": 0}
    app.task(
        name="queued.rated", lock_key="api:{key}", lock_rate="1/s", lock_mode="shared", **common
    )(noop)
    app.task(name="queued.requeue", lock_key="exp:{key}", lock_on_busy="requeue", **common)(noop)
    app.task(name="queued.plain", lock_key="plain:{key}", **common)(noop)
    yield app
    close_app(app)


def noop(key):
    return key


@pytest.fixture
def scripts(monkeypatch):
    """Counter of the scripts sent to the lock nodes, per kind of request sent."""
    sent: Counter[tuple[str, ...]] = Counter()
    call = NodeSet.call

    def spy(self, calls, **kwargs):
        flat = [c for group in calls for c in (group if isinstance(group, list) else [group])]
        if flat and all(c is not None for c in flat):
            sent[tuple(c.script.name if c.script else str(c.args[0]) for c in flat)] += 1
        return call(self, calls, **kwargs)

    monkeypatch.setattr(NodeSet, "call", spy)
    return sent


def get(result):
    return result.get(timeout=30, disable_sync_subtasks=False)


def test_a_rated_run_waits_on_the_queue_in_its_admissions_call_and_leaves_it_as_it_starts(
    app, celery_redis, inprocess_worker_factory, scripts
):
    """Three runs at 1 per second: the two refused are seen waiting, due at their slot,
    and leave as they start; each admission is one call, nothing more."""
    client = celery_redis.client(db=0)
    queued = lock_keys("api:k").queued
    inprocess_worker_factory(app, pool="threads", concurrency=3)
    results = [app.tasks["queued.rated"].delay("k") for _ in range(3)]
    wait_for(lambda: client.zcard(queued) == 2, timeout=10)
    assert set(client.zrange(queued, 0, -1)) <= {r.id for r in results}
    assert [get(r) for r in results] == ["k"] * 3
    assert not client.exists(queued), "every run left the queue as it started"
    assert client.get(lock_keys("api:k").budget) == "1/1000"
    admissions = scripts[("rate",)]
    assert admissions >= 5, "3 starts and at least 2 refusals"
    assert not [kind for kind in scripts if "rate" in kind and kind != ("rate",)]
    assert not [kind for kind in scripts if {"note_queued", "note_started"} & set(kind)], (
        "no call of its own"
    )


def test_a_busy_run_put_back_is_seen_waiting_until_it_starts_and_a_plain_run_pays_nothing(
    app, celery_redis, inprocess_worker_factory, scripts
):
    """lock_on_busy="requeue": one call records the copy (due when its backoff ends)
    before it is published, one removes it when it starts; a plain run makes neither."""
    client = celery_redis.client(db=0)
    queued = lock_keys("exp:k").queued
    inprocess_worker_factory(app, pool="threads", concurrency=2)
    assert get(app.tasks["queued.plain"].delay("k")) == "k"
    assert not [kind for kind in scripts if {"note_queued", "note_started"} & set(kind)], (
        "a plain run"
    )
    holder = Redlock("exp:k", nodes=[redis_url_with_db(celery_redis.url, 0)], ttl=30)
    assert holder.acquire(blocking=False)
    result = app.tasks["queued.requeue"].delay("k")
    wait_for(lambda: client.zscore(queued, result.id), timeout=10)
    holder.release()
    assert get(result) == "k"
    assert not client.exists(queued), "it left the queue as it started"
    assert scripts[("note_queued",)] >= 1, "one per deferral"
    assert scripts[("note_started",)] == 1, "one at the start"
