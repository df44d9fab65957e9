"""Behaviour that only real worker processes show: prefork children, signals, kills."""

from __future__ import annotations

import os
import signal
import time

import pytest

from celery_redlock import LockBusy, LockLost
from tests.apps.locked import ODD_NAME, create_app
from tests.harness import (
    close_app,
    holder_pid,
    lock_keys,
    make_app,
    read_intervals,
    steal_locks,
    wait_for,
)

RESULT_TIMEOUT = 30


@pytest.fixture
def client(celery_redis):
    """The test side of the locked app: sends tasks and reads results."""
    app = create_app(celery_redis.url)
    yield app
    close_app(app)


def expect_abort(server, result) -> LockLost:
    """Steal the running task's lock; its body must end with LockLost, promptly."""
    wait_for(lambda: lock_keys(server), timeout=20)
    deleted_at = time.monotonic()
    steal_locks(server)
    with pytest.raises(LockLost) as info:
        result.get(timeout=RESULT_TIMEOUT)
    assert time.monotonic() - deleted_at < 10, "aborted long before the body's 60 s"
    return info.value


def locked_worker(worker_process_factory, pool="prefork", ttl="1.0", **kw):
    return worker_process_factory(
        "tests.apps.locked", pool=pool, concurrency=2, env={"REDLOCK_TEST_TTL": ttl}, **kw
    )


@pytest.mark.smoke
def test_parent_releases_the_lock_of_a_sigkilled_child_at_once(
    celery_redis, client, worker_process_factory
):
    """SIGKILL of the child holding a 30 s lease: the worker frees the lock right away."""
    worker = locked_worker(worker_process_factory, ttl="30")
    result = client.tasks["tests.apps.locked.sleeper"].delay("acct-kill", 60)
    wait_for(lambda: holder_pid(celery_redis), timeout=20)
    child = holder_pid(celery_redis)
    assert child in worker.child_pids()
    os.kill(child, signal.SIGKILL)
    killed_at = time.monotonic()
    wait_for(lambda: not lock_keys(celery_redis), timeout=10, interval=0.01)
    released_in = time.monotonic() - killed_at
    assert released_in < 5, f"released after {released_in:.2f}s (lease was 30 s)"
    worker.wait_for_log("lock released", timeout=10)
    with pytest.raises(Exception, match=r"WorkerLostError|exited"):
        result.get(timeout=RESULT_TIMEOUT)


def test_a_sigkilled_childs_lock_is_freed_whatever_its_task_name_and_id(
    celery_redis, client, worker_process_factory
):
    """Newlines and spaces in the task name (so the key) and the task id: freed at once too."""
    worker = locked_worker(worker_process_factory, ttl="30")
    result = client.send_task(ODD_NAME, ("acct\n odd", 60), task_id="id with space\nand newline")
    wait_for(lambda: holder_pid(celery_redis), timeout=20)
    (key,) = lock_keys(celery_redis)
    assert "\nname with spaces:" in key
    os.kill(holder_pid(celery_redis), signal.SIGKILL)
    killed_at = time.monotonic()
    wait_for(lambda: not lock_keys(celery_redis), timeout=10, interval=0.01)
    released_in = time.monotonic() - killed_at
    assert released_in < 5, f"released after {released_in:.2f}s (lease was 30 s)"
    worker.wait_for_log("lock released", timeout=10)
    assert "malformed" not in worker.log_text()
    with pytest.raises(Exception, match=r"WorkerLostError|exited"):
        result.get(timeout=RESULT_TIMEOUT)


@pytest.mark.parametrize("pool", ["prefork", "solo"])
@pytest.mark.smoke
def test_lost_lock_interrupts_a_body_blocked_in_sleep(
    celery_redis, client, worker_process_factory, pool, tmp_path
):
    """Main-thread pools: the abort signal breaks time.sleep(60) with LockLost, promptly."""
    worker = locked_worker(worker_process_factory, pool=pool)
    children_before = worker.child_pids()
    path = str(tmp_path / "runs")
    result = client.tasks["tests.apps.locked.sleeper"].delay("acct-sleep", 60, path)
    wait_for(lambda: lock_keys(celery_redis), timeout=20)
    deleted_at = time.monotonic()
    steal_locks(celery_redis)
    with pytest.raises(LockLost) as info:
        result.get(timeout=RESULT_TIMEOUT)
    assert time.monotonic() - deleted_at < 10, "aborted long before the 60 s sleep ended"
    assert "deleted" in info.value.reason
    assert "sleeper" not in read_intervals(path)
    worker.wait_for_log("aborting it", timeout=5)
    if pool == "prefork":
        assert worker.child_pids() == children_before, "the child survives the abort"
    # The worker keeps serving, and the same key can be locked again.
    again = client.tasks["tests.apps.locked.sleeper"].delay("acct-sleep", 0)
    assert again.get(timeout=RESULT_TIMEOUT) == "slept"


def test_lost_lock_interrupts_a_blocking_socket_read(celery_redis, client, worker_process_factory):
    """A body blocked in recv() on a silent socket is stopped by the abort too."""
    locked_worker(worker_process_factory)
    result = client.tasks["tests.apps.locked.reader"].delay("acct-read", 60)
    expect_abort(celery_redis, result)


def test_revoke_policy_terminates_the_child(celery_redis, client, worker_process_factory):
    """lock_on_lost='revoke': the task is terminated through Celery's revoke."""
    worker = locked_worker(worker_process_factory)
    result = client.tasks["tests.apps.locked.revoked_on_loss"].delay("acct-rev", 60)
    wait_for(lambda: holder_pid(celery_redis), timeout=20)
    child = holder_pid(celery_redis)
    steal_locks(celery_redis)
    wait_for(lambda: result.state == "REVOKED", timeout=RESULT_TIMEOUT)
    wait_for(lambda: child not in worker.child_pids(), timeout=10)
    worker.wait_for_log("revoking it", timeout=5)


def test_same_task_id_on_two_workers_runs_once(
    celery_redis, client, worker_process_factory, tmp_path
):
    """One task id delivered to two prefork workers: one body, one SUCCESS, lock intact."""
    locked_worker(worker_process_factory)
    locked_worker(worker_process_factory)
    path = str(tmp_path / "runs")
    hold = client.tasks["tests.apps.locked.hold"]
    first = hold.apply_async(("acct-dup", path, "first", 2.0), task_id="same-id")
    wait_for(lambda: lock_keys(celery_redis), timeout=20)
    (key,) = lock_keys(celery_redis)
    holder = celery_redis.client().hgetall(key)
    hold.apply_async(("acct-dup", path, "copy", 0), task_id="same-id")
    assert first.get(timeout=RESULT_TIMEOUT)["label"] == "first"
    assert first.state == "SUCCESS"
    assert set(read_intervals(path)) == {"first"}
    assert holder["task_id"] == "same-id"


def test_revoked_before_start_leaves_no_lock(celery_redis, client, worker_process_factory):
    """A task revoked while still waiting (eta) never takes its lock."""
    locked_worker(worker_process_factory)
    result = client.tasks["tests.apps.locked.hold"].apply_async(("acct-rev0",), countdown=3)
    result.revoke()
    wait_for(lambda: result.state == "REVOKED", timeout=RESULT_TIMEOUT)
    assert not list(celery_redis.client().scan_iter("redlock:*"))


@pytest.fixture
def sender(celery_redis):
    """A bare app that sends tasks by name and reads their results.

    Closed by the fixture, after the test's results are gone and before its server
    stops: an AsyncResult collected later would talk to a stopped server (on Celery
    before 5.7, an error in whichever test then collects it).
    """
    app = make_app(celery_redis.url)
    yield app
    close_app(app)


@pytest.mark.smoke
def test_configuration_only_enablement(celery_redis, sender, worker_process_factory, tmp_path):
    """redlock_tasks locks plain tasks in a worker that only lists celery_redlock in imports."""
    worker_process_factory("tests.apps.configonly", pool="prefork", concurrency=3)
    path = str(tmp_path / "runs")
    send = sender.send_task
    first = send("tests.apps.configonly_tasks.sync_account", (7, path, "first", 1.5))
    wait_for(lambda: lock_keys(celery_redis), timeout=20)
    second = send("tests.apps.configonly_tasks.sync_account", (7, path, "second", 0))
    other_account = send("tests.apps.configonly_tasks.sync_account", (8, path, "other", 0))
    free = send("tests.apps.configonly_tasks.unlocked", (path, "free", 0))
    with pytest.raises(LockBusy):
        second.get(timeout=RESULT_TIMEOUT)
    assert other_account.get(timeout=RESULT_TIMEOUT) == "other"
    assert free.get(timeout=RESULT_TIMEOUT) == "free"
    assert first.get(timeout=RESULT_TIMEOUT) == "first"
    assert set(read_intervals(path)) == {"first", "other", "free"}


def test_invalid_setting_stops_a_worker_process(celery_redis, worker_process_factory):
    """A bad redlock_on_busy in the celeryconfig: the worker exits naming the setting."""
    worker = worker_process_factory(
        "tests.apps.configonly", pool="prefork", start=False, env={"REDLOCK_TEST_ON_BUSY": "block"}
    )
    with pytest.raises(Exception):  # noqa: B017 (the harness reports the early exit)
        worker.start(timeout=30)
    assert "redlock_on_busy must be one of 'skip', 'retry', 'raise', 'wait'" in worker.log_text()


def test_hard_time_limit_kill_releases_the_lock(celery_redis, client, worker_process_factory):
    """A child killed by the hard time limit: its 30 s lock is freed by the main process."""
    locked_worker(worker_process_factory, ttl="30")
    result = client.tasks["tests.apps.locked.sleeper"].apply_async(("acct-limit", 60), time_limit=2)
    wait_for(lambda: lock_keys(celery_redis), timeout=20)
    with pytest.raises(Exception, match=r"TimeLimitExceeded|WorkerLostError"):
        result.get(timeout=RESULT_TIMEOUT)
    wait_for(lambda: not lock_keys(celery_redis), timeout=5, message="lock freed after the kill")


def test_gevent_pool_aborts_the_greenlet(celery_redis, client, worker_process_factory):
    """Under gevent the task's greenlet is killed with LockLost, even in a (patched) sleep."""
    pytest.importorskip("gevent", reason="gevent is an optional dependency (extra 'gevent')")
    locked_worker(worker_process_factory, pool="gevent")
    result = client.tasks["tests.apps.locked.sleeper"].delay("acct-gevent", 60)
    expect_abort(celery_redis, result)
