"""A rated run whose body would start late for its logged start logs it again at now.

The node logs a start when the admission reaches it; the body starts after the reply
came back and the run took its last steps. A body later than 10 ms (the guard) after
the admitting call left (a process descheduled, a slow reply) could make N + 1 bodies
start within one window although the node admitted N: its start is moved to now
(``budgets.keep_on_time``). Real Redis, eager runs (``apply()``): the body itself reads
the budget's log.
"""

from __future__ import annotations

import time

import pytest

from celery_redlock import LockedTask
from celery_redlock.integration import budgets
from celery_redlock.integration.settings import app_settings
from celery_redlock.integration.task import lock_options
from tests.harness import close_app
from tests.harness.celery_workers import make_app, redis_url_with_db

RATE_KEY = "redlock:{late:k}:rate"


@pytest.fixture
def app(celery_redis):
    url = redis_url_with_db(celery_redis.url, 0)
    app = make_app(celery_redis.url, name="late", redlock_url=url)
    yield app
    close_app(app)


def rated(app, rate, body):
    return app.task(
        name=f"late.{rate.replace('/', '_per_')}", bind=True, base=LockedTask, shared=False,
        lock_key="late:{key}", lock_rate=rate, lock_mode="shared",
    )(body)  # fmt: skip


def empty(self, key):
    return key


def log_of(client):
    return client.zrange(RATE_KEY, 0, -1, withscores=True)


def test_a_start_logged_long_before_the_body_moves_to_now(app, celery_redis):
    """Its member stays, its time moves to now (the windows after it had room); a body on
    time logs nothing again."""
    client = celery_redis.client(db=0)
    seen = {}

    def body(self, key):
        [(member, logged)] = log_of(client)
        args = (self, lock_options(self), app_settings(self.app), self.lock)
        budgets.keep_on_time(*args, budgets.Stamp(member, time.monotonic()))
        seen["on time"] = log_of(client)
        budgets.keep_on_time(*args, budgets.Stamp(member, time.monotonic() - 1.0))
        seen["late"] = log_of(client)
        seen["first"] = (member, logged)

    rated(app, "2/s", body).apply(("k",)).get()
    member, logged = seen["first"]
    assert seen["on time"] == [(member, logged)]
    [(moved, score)] = seen["late"]
    assert moved == member and score > logged


def test_a_late_body_without_room_at_now_waits_for_the_next_slot(app, celery_redis):
    """A start logged after its own, within a window of now: the run's start is given up
    and it waits like any refused run (eager: in its caller), then starts a window after
    the other start, never beside it."""
    client = celery_redis.client(db=0)
    seen = {}

    def body(self, key):
        [(member, logged)] = log_of(client)
        client.zadd(RATE_KEY, {"other": logged + 5})
        args = (self, lock_options(self), app_settings(self.app), self.lock)
        budgets.keep_on_time(*args, budgets.Stamp(member, time.monotonic() - 1.0))
        seen["member"], seen["other"], seen["log"] = member, logged + 5, dict(log_of(client))

    rated(app, "1/s", body).apply(("k",)).get()
    log = seen["log"]
    assert seen["member"] not in log, "its first start was given up"
    [score] = [s for m, s in log.items() if m != "other"]  # the other left the window since
    assert score >= seen["other"] + 1000


@pytest.mark.parametrize("path", ["fast", "slowed now", "always slow"])
def test_a_run_logs_its_start_again_only_when_its_reply_is_slower_than_usual(
    app, celery_redis, fault_proxy, monkeypatch, path
):
    """A path that turns slow (every reply 60 ms late, six times budgets.LATE):
    the run's start is logged again, at most RESTAMPS times. A fast path, or one that
    was always that slow (the process's usual round trip: every body is as late): one
    admission per run."""
    proxy = fault_proxy(celery_redis)
    app.conf.redlock_url = redis_url_with_db(proxy.url, 0)
    calls = []
    real = budgets.admit

    def spy(*args, **kwargs):
        calls.append(kwargs.get("member"))
        return real(*args, **kwargs)

    monkeypatch.setattr(budgets, "admit", spy)
    monkeypatch.setattr(budgets, "round_trips", budgets.RoundTrips())
    task = rated(app, "50/s", empty)
    task.apply(("k",)).get()  # connections made, scripts loaded
    if path != "fast":
        proxy.delay(0.03)
    if path == "always slow":
        budgets.round_trips.usual = 0.06
    calls.clear()
    task.apply(("k",)).get()
    assert calls[0] is None
    again = len([m for m in calls[1:] if m])
    if path == "slowed now":
        assert 1 <= again <= budgets.RESTAMPS
    else:
        assert again == 0
