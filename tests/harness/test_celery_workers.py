"""Tests of the Celery harness: real workers (in-process and subprocesses) on real Redis."""

from __future__ import annotations

import gc
import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
from celery.exceptions import TimeoutError as CeleryTimeoutError
from celery.exceptions import WorkerLostError

from tests.apps import PlainTasks, register_plain_tasks
from tests.harness import (
    REPO_ROOT,
    InProcessWorker,
    RedisServer,
    WorkerProcess,
    close_app,
    free_port,
    make_app,
    pid_exists,
    read_intervals,
    wait_for,
)

RESULT_TIMEOUT = 20


@pytest.fixture
def plain(celery_redis: RedisServer) -> Iterator[PlainTasks]:
    """The plain tasks, registered on an app of this test's server (closed at the end)."""
    app = make_app(celery_redis.url)
    yield register_plain_tasks(app)
    close_app(app)


def _file_contains(path: str, text: str) -> bool:
    try:
        return text in Path(path).read_text(errors="replace")
    except FileNotFoundError:
        return False


def _active_worker_pid(plain: PlainTasks, worker: WorkerProcess, task_id: str) -> int | None:
    """Pid of the pool process running ``task_id``, per ``inspect().active()``."""
    inspect = plain.app.control.inspect(destination=[worker.nodename], timeout=0.5)
    for task in (inspect.active() or {}).get(worker.nodename, []):
        if task["id"] == task_id and task.get("worker_pid"):
            return int(task["worker_pid"])
    return None


def test_make_app_uses_db1_for_broker_and_db2_for_results(celery_redis: RedisServer):
    """make_app puts the broker on db 1 and results on db 2 of the given server."""
    app = make_app(celery_redis.url, visibility_timeout=7, task_acks_late=True)
    try:
        assert app.conf.broker_url.endswith(f":{celery_redis.port}/1")
        assert app.conf.result_backend.endswith(f":{celery_redis.port}/2")
        assert app.conf.broker_transport_options == {"visibility_timeout": 7}
        assert app.conf.task_acks_late is True
    finally:
        app.close()
    assert make_app(celery_redis.url).conf.broker_transport_options == {}  # the default


@pytest.mark.smoke
def test_a_result_collected_after_close_app_does_no_io(redis_factory, monkeypatch):
    """A result still reachable at close_app and collected once its Redis is gone is quiet.

    Celery before 5.7 unsubscribes in AsyncResult.__del__ and raises (an unraisable error
    in whichever later test collects it) when the server is gone.
    """
    [server] = redis_factory()
    app = make_app(server.url)
    result = app.AsyncResult("never-sent")
    with pytest.raises(CeleryTimeoutError):
        result.get(timeout=0.05)  # subscribes: the result consumer now has a pubsub
    close_app(app)
    server.stop()
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    with warnings.catch_warnings():  # other garbage's unclosed sockets are not the subject
        warnings.simplefilter("ignore", ResourceWarning)
        del result
        gc.collect()
    assert not unraisable, [u.exc_value for u in unraisable]


def test_inprocess_solo_worker_runs_add(inprocess_worker_factory, plain: PlainTasks):
    """An in-process solo worker runs add and its result comes back from the backend."""
    inprocess_worker_factory(plain.app, pool="solo")
    result = plain.add.delay(2, 3)
    assert result.get(timeout=RESULT_TIMEOUT) == 5
    assert result.name == "plain.add"  # result_extended


def test_inprocess_threads_worker_runs_tasks_concurrently(
    inprocess_worker_factory, plain: PlainTasks, tmp_path: Path
):
    """An in-process threads worker of concurrency 4 runs 4 sleeping tasks at once."""
    inprocess_worker_factory(plain.app, pool="threads", concurrency=4)
    path = str(tmp_path / "intervals.txt")
    results = [plain.record.delay(path, f"t{i}", 1.0) for i in range(4)]
    assert [r.get(timeout=RESULT_TIMEOUT) for r in results] == ["t0", "t1", "t2", "t3"]
    intervals = read_intervals(path)
    assert sorted(intervals) == ["t0", "t1", "t2", "t3"]
    assert {i.pid for i in intervals.values()} == {os.getpid()}  # in-process indeed
    # All four were inside their bodies at one common instant.
    assert max(i.start_ns for i in intervals.values()) < min(i.end_ns for i in intervals.values())
    assert all(a.overlaps(b) for a, b in itertools.combinations(intervals.values(), 2))


def test_inprocess_worker_can_be_started_and_stopped_repeatedly(plain: PlainTasks):
    """One InProcessWorker object can be started and stopped several times, leaving no thread."""
    threads_before = set(threading.enumerate())
    for pool in ("solo", "threads", "solo"):
        worker = InProcessWorker(plain.app, pool, 2)
        for value in range(2):
            with worker:
                assert worker.running
                assert plain.add.delay(value, 1).get(timeout=RESULT_TIMEOUT) == value + 1
            assert not worker.running
    wait_for(
        lambda: not set(threading.enumerate()) - threads_before,
        timeout=5,
        message="worker and pool threads to end",
    )


def test_inprocess_threads_worker_stops_while_a_task_runs(plain: PlainTasks, tmp_path: Path):
    """Stopping a threads worker with a task running returns at once; the body finishes alone."""
    path = str(tmp_path / "intervals.txt")
    worker = InProcessWorker(plain.app, "threads", 2, shutdown_timeout=5).start()
    busy = plain.record.delay(path, "busy", 2.0)
    wait_for(lambda: _file_contains(path, "start busy"), timeout=10)
    assert worker.stop() is True  # the worker thread ended, with the body still running
    assert "busy" not in read_intervals(path)
    assert busy.get(timeout=RESULT_TIMEOUT) == "busy"  # the body ends and stores its result
    assert "busy" in read_intervals(path)


def test_inprocess_solo_worker_stop_is_bounded_by_its_timeout(plain: PlainTasks, tmp_path: Path):
    """Stopping a solo worker busy in a task gives up after the timeout; the thread ends later."""
    path = str(tmp_path / "intervals.txt")
    worker = InProcessWorker(plain.app, "solo").start()
    busy = plain.record.delay(path, "busy", 2.0)
    wait_for(lambda: _file_contains(path, "start busy"), timeout=10)
    assert worker.stop(timeout=0.2) is False
    [thread] = worker.abandoned
    assert busy.get(timeout=RESULT_TIMEOUT) == "busy"
    wait_for(lambda: not thread.is_alive(), timeout=10, message="the abandoned thread to end")
    with InProcessWorker(plain.app, "solo"):  # a new worker is not disturbed by it
        assert plain.add.delay(20, 22).get(timeout=RESULT_TIMEOUT) == 42


def test_inprocess_worker_refuses_prefork_and_a_second_running_worker(plain: PlainTasks):
    """InProcessWorker refuses the prefork pool, and a second worker while one runs."""
    with pytest.raises(ValueError, match="prefork"):
        InProcessWorker(plain.app, "prefork")
    with (
        InProcessWorker(plain.app, "solo"),
        pytest.raises(RuntimeError, match="one in-process worker"),
    ):
        InProcessWorker(plain.app, "solo").start()


def test_inprocess_worker_fails_fast_on_an_unreachable_broker():
    """InProcessWorker.start() raises at once when the broker is unreachable, leaving no thread."""
    threads_before = set(threading.enumerate())
    app = make_app(f"redis://127.0.0.1:{free_port()}/0")
    try:
        with pytest.raises(RuntimeError, match="unreachable"):
            InProcessWorker(app, "solo").start()
    finally:
        app.close()
    assert not set(threading.enumerate()) - threads_before
    with pytest.raises(RuntimeError, match="unreachable"):  # and the slot was released
        InProcessWorker(app, "threads", 2).start()


@pytest.mark.smoke
def test_prefork_worker_process_runs_task_in_a_pool_child(worker_process_factory, plain):
    """A prefork WorkerProcess runs pid() in one of its pool children."""
    worker = worker_process_factory(pool="prefork", concurrency=2)
    children = wait_for(lambda: len(worker.child_pids()) == 2 and worker.child_pids(), timeout=10)
    task_pid = plain.pid.delay().get(timeout=RESULT_TIMEOUT)
    assert task_pid in children
    assert task_pid != worker.pid


def test_sigkill_of_prefork_child_fails_task_with_worker_lost(worker_process_factory, plain):
    """SIGKILL of the pool child running a task fails it with WorkerLostError and is replaced."""
    worker = worker_process_factory(pool="prefork", concurrency=2)
    result = plain.sleep_then.delay(30, "never")
    victim = wait_for(lambda: _active_worker_pid(plain, worker, result.id), timeout=15)
    assert victim in worker.child_pids()
    os.kill(victim, signal.SIGKILL)
    with pytest.raises(WorkerLostError):
        result.get(timeout=RESULT_TIMEOUT, propagate=True)
    wait_for(
        lambda: len(children := worker.child_pids()) == 2 and victim not in children,
        timeout=15,
        message="a replacement pool child",
    )
    worker.wait_for_log("Worker exited prematurely", timeout=5)
    assert plain.add.delay(1, 1).get(timeout=RESULT_TIMEOUT) == 2  # the pool works again


def test_worker_process_stop_leaves_no_process_behind(worker_process_factory):
    """WorkerProcess.stop() ends the main process and all pool children, per /proc."""
    worker = worker_process_factory(pool="prefork", concurrency=2)
    children = wait_for(lambda: len(worker.child_pids()) == 2 and worker.child_pids(), timeout=10)
    pids = [worker.pid, *children]
    assert set(worker.group_pids()) == set(pids)
    assert worker.stop() == 0  # warm shutdown on SIGTERM
    assert [pid for pid in pids if pid_exists(pid) or Path(f"/proc/{pid}").exists()] == []
    assert worker.group_pids() == []
    assert not worker.alive()


def test_worker_process_kill_takes_its_children_along(worker_process_factory):
    """WorkerProcess.kill() SIGKILLs the main process and its pool children; start() works again."""
    worker = worker_process_factory(pool="prefork", concurrency=2)
    children = wait_for(lambda: len(worker.child_pids()) == 2 and worker.child_pids(), timeout=10)
    first_pid = worker.pid
    worker.kill()
    assert worker.returncode == -signal.SIGKILL
    assert [pid for pid in [worker.pid, *children] if pid_exists(pid)] == []
    assert worker.group_pids() == []

    worker.start()  # the same WorkerProcess starts again, and waits for its new "ready."
    assert worker.pid != first_pid
    assert worker.log_text().count(" ready.") == 2
    assert worker.log_text(since_start=True).count(" ready.") == 1


def test_worker_process_start_failure_reports_log_tail(worker_process_factory):
    """A worker that cannot start makes start() raise with the log tail, leaving nothing behind."""
    worker = worker_process_factory("tests.apps.does_not_exist", start=False, ready_timeout=30)
    with pytest.raises(RuntimeError, match="does_not_exist"):
        worker.start()
    assert not worker.alive()
    assert worker.group_pids() == []


def test_worker_processes_left_running_are_killed_at_interpreter_exit(
    celery_redis: RedisServer, tmp_path: Path
):
    """A WorkerProcess never stopped is killed, with its pool children, when its creator exits."""
    script = (
        "import json, sys\n"
        "from tests.harness import WorkerProcess\n"
        f"worker = WorkerProcess(redis_url={celery_redis.url!r}, log_dir={str(tmp_path)!r})\n"
        "worker.start()\n"
        "print(json.dumps([worker.pid, *worker.child_pids()]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        capture_output=True,
        text=True,
        timeout=90,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    pids = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(pids) == 3
    wait_for(lambda: not [pid for pid in pids if pid_exists(pid)], timeout=10)
