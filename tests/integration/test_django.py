"""Django projects: settings under the ``CELERY_`` namespace, django-celery-beat.

The project is ``tests.apps.djangoproj``: every Celery and celery_redlock setting is
in its Django settings module, read with ``config_from_object("django.conf:settings",
namespace="CELERY")``. Real worker and beat processes, a real SQLite database.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

pytest.importorskip("django", reason="Django: in the 'test' extra, not 'test-core'")
pytest.importorskip("django_celery_beat", reason="django-celery-beat: in the 'test' extra")

from celery_redlock import LockBusy
from tests.harness import BeatProcess, close_app, wait_for
from tests.harness.celery_workers import make_app
from tests.harness.celery_workers import run_python as python_process
from tests.integration.test_beat import assert_one_dispatch_per_slot, dispatches, leader

APP = "tests.apps.djangoproj.celery"
BEAT_TTL = 2.0


@pytest.fixture
def env(tmp_path, celery_redis):
    return {
        "DJANGO_SETTINGS_MODULE": "tests.apps.djangoproj.settings",
        "REDLOCK_TEST_DJANGO_DB": str(tmp_path / "db.sqlite3"),
        "REDLOCK_TEST_STAMPS": str(tmp_path / "stamps"),
        "REDLOCK_TEST_BEAT_TTL": str(BEAT_TTL),
        "REDLOCK_TEST_REDIS_URL": celery_redis.url,
    }


def run_python(env, *args: str) -> str:
    """``python ARGS`` in the project's environment; its stdout, once it exits 0."""
    return python_process(env, *args).stdout


def django_db(env, command: str) -> str:
    """Run ``python -m tests.apps.djangoproj.db COMMAND``."""
    return run_python(env, "-m", "tests.apps.djangoproj.db", command)


@pytest.fixture
def sender(celery_redis):
    app = make_app(celery_redis.url)
    yield app
    close_app(app)


def test_settings_in_the_celery_namespace_reach_worker_and_cli(
    env, tmp_path, celery_redis, worker_process_factory, sender
):
    """CELERY_REDLOCK_TASKS locks a task; CELERY_REDLOCK_TTL is its lease; `ls` finds it."""
    worker = worker_process_factory(APP, pool="prefork", concurrency=2, env=env)
    worker.wait_for_log("locking by configuration: tests.apps.djangoproj.celery.hold")
    first = sender.send_task(f"{APP}.hold", args=[str(tmp_path)])
    wait_for((tmp_path / "started").exists, timeout=30)
    second = sender.send_task(f"{APP}.hold", args=[str(tmp_path / "other")])
    with pytest.raises(LockBusy):
        second.get(timeout=30)  # args [] in the settings: one run at a time
    listed = run_python(env, "-m", "celery", "-A", APP, "redlock", "ls", "--json")
    (lock,) = json.loads(listed)["locks"]
    assert lock["task_name"] == f"{APP}.hold"
    assert 0 < lock["ttl"] <= 7  # CELERY_REDLOCK_TTL
    (tmp_path / "release").touch()
    assert first.get(timeout=30) == "held"


def test_a_standby_database_scheduler_writes_no_run_to_the_database(env, celery_redis):
    """A due entry on a standby: nothing sent, and the shared database records no run."""
    django_db(env, "setup")
    report = json.loads(django_db(env, "standby"))
    assert report == {
        "leading": False,
        "sent": [],
        "total_run_count": 0,
        "last_run_at_moved": False,
    }


def test_two_database_beats_fail_over_without_sending_a_run_twice(
    env, tmp_path, celery_redis, worker_process_factory
):
    """Two beats on one SQLite schedule: one sends; SIGKILLed, the standby takes over."""
    django_db(env, "setup")
    worker_process_factory(APP, pool="prefork", concurrency=2, env=env)
    beats = []
    try:
        for _ in range(2):  # CELERY_BEAT_SCHEDULER names DatabaseLeaderScheduler
            beat = BeatProcess(APP, redis_url=celery_redis.url, env=env, log_dir=tmp_path / "b")
            beats.append(beat)
            beat.start()
        stamps = tmp_path / "stamps"
        first = wait_for(lambda: leader(celery_redis, beats, app="djangoproj"), timeout=15)
        wait_for(lambda: len(dispatches(stamps, "stamp")) >= 3, timeout=30)
        os.kill(first.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        wait_for(lambda: not first.alive(), timeout=5)
        second = wait_for(
            lambda: leader(celery_redis, beats, app="djangoproj"), timeout=BEAT_TTL * 3
        )
        assert second is not first
        assert time.monotonic() - killed_at < BEAT_TTL + 1.0, "took over within one lease"
        count = len(dispatches(stamps, "stamp"))
        wait_for(lambda: len(dispatches(stamps, "stamp")) >= count + 3, timeout=30)
        assert "DatabaseLeaderScheduler" in first.log_text()
        assert_one_dispatch_per_slot(dispatches(stamps, "stamp"), window=BEAT_TTL + 2.0)
    finally:
        for beat in beats:
            beat.stop()
