"""The lock family from tasks: shared and exclusive runs, per-key limits, several
resources, with in-process workers and a prefork worker process."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from celery_redlock import ConfigurationError, LockBusy, LockedTask
from tests.apps.locked import create_app
from tests.harness import close_app, read_intervals, wait_for
from tests.harness.fences import CLOCK_FENCE_MIN


@pytest.fixture
def app(celery_redis):
    app = create_app(celery_redis.url)
    yield app
    close_app(app)


def get(result, timeout=30, **kwargs):
    return result.get(timeout=timeout, disable_sync_subtasks=False, **kwargs)


def peak(runs) -> int:
    """The largest number of runs that were going at one instant."""
    events = sorted([(r.start_ns, 1) for r in runs] + [(r.end_ns, -1) for r in runs])
    running = most = 0
    for _, step in events:
        running += step
        most = max(most, running)
    return most


def test_lock_limit_runs_at_most_n_per_key(app, inprocess_worker_factory, tmp_path):
    """Five calls for one tenant with lock_limit=2: two at a time, all of them run."""
    inprocess_worker_factory(app, pool="threads", concurrency=5)
    path = str(tmp_path / "runs")
    call_api = app.tasks["tests.apps.locked.call_api"]
    results = [call_api.delay("t1", path, f"call{i}", 0.5) for i in range(5)]
    other = call_api.delay("t2", path, "other", 0.5)
    assert sorted(get(r)["label"] for r in results) == [f"call{i}" for i in range(5)]
    get(other)
    runs = read_intervals(path)
    assert peak([runs[f"call{i}"] for i in range(5)]) == 2
    assert peak(runs.values()) == 3, "another tenant's call is not counted against t1"


def test_readers_share_a_key_and_a_writer_runs_alone(
    app, celery_redis, inprocess_worker_factory, tmp_path
):
    """Two readers overlap; the writer overlaps neither them nor the reader after it."""
    inprocess_worker_factory(app, pool="threads", concurrency=4)
    path = str(tmp_path / "runs")
    read, write = app.tasks["tests.apps.locked.read_doc"], app.tasks["tests.apps.locked.write_doc"]
    first = [read.delay("d", path, f"read{i}", 0.8) for i in range(2)]
    wait_for(lambda: len(read_intervals_started(path)) == 2, timeout=10, message="readers in")
    writer = write.delay("d", path, "write", 0.3)
    client = celery_redis.client()
    wait_for(lambda: writer_waiting(client), timeout=10, message="the writer waiting")
    late = read.delay("d", path, "late", 0.2)
    for result in [*first, writer, late]:
        get(result)
    runs = read_intervals(path)
    assert runs["read0"].overlaps(runs["read1"])
    for label in ("read0", "read1", "late"):
        assert not runs["write"].overlaps(runs[label]), f"the writer overlapped {label}"
    assert runs["late"].start_ns > runs["write"].end_ns, "a waiting writer goes before new readers"


def read_intervals_started(path):
    try:
        with open(path) as lines:
            return [line for line in lines if line.startswith("start")]
    except FileNotFoundError:
        return []


def writer_waiting(client) -> bool:
    """Whether a writer has marked itself waiting on a shared set (any key)."""
    return any(
        client.zscore(key, "!writer") is not None for key in client.scan_iter("redlock:*:shared")
    )


def test_a_transfer_locks_both_accounts(app, inprocess_worker_factory, tmp_path):
    """transfer(1, 2) excludes audits of 1 and 2 and transfer(2, 1), not an audit of 3."""
    inprocess_worker_factory(app, pool="threads", concurrency=4)
    path = str(tmp_path / "runs")
    transfer, audit = app.tasks["tests.apps.locked.transfer"], app.tasks["tests.apps.locked.audit"]
    running = transfer.delay(1, 2, path, "transfer", 1.5)
    wait_for(lambda: read_intervals_started(path), timeout=10, message="the transfer started")
    for busy in (audit.delay(1), audit.delay(2), transfer.delay(2, 1)):
        with pytest.raises(LockBusy) as info:
            get(busy)
        assert info.value.holder == running.id
    assert get(audit.delay(3, path, "audit3"))["label"] == "audit3"
    fences = get(running)["fences"]
    # Fresh keys: each resource's first fence comes from the node's clock (µs).
    assert len(fences) == 2 and all(fence > CLOCK_FENCE_MIN for fence in fences.values())
    assert get(audit.delay(1, path, "audit1"))["label"] == "audit1", "both were released"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"lock_mode": "read"}, "mode must be one of"),
        ({"lock_limit": 0}, "limit must be an integer"),
        ({"lock_mode": "exclusive", "lock_limit": 3}, "limit applies to shared"),
        ({"lock_fair": True, "lock_mode": "shared"}, "fair waiting applies"),
        ({"lock_key": ("a:{x}", "b:{x}"), "lock_limit": 2}, "covers one resource"),
        ({"lock_key": ("a:{x}", 3)}, "list of format strings"),
    ],
)
def test_impossible_family_options_fail_naming_the_task(celery_redis, options, message):
    """Each bad combination is refused with the task's name and the options involved."""
    app = create_app(celery_redis.url)
    try:

        @app.task(base=LockedTask, shared=False, name="proj.bad", **options)
        def bad(x):
            return x

        from celery_redlock.integration.task import lock_options

        with pytest.raises(ConfigurationError, match=f"task proj.bad: .*{message}"):
            lock_options(app.tasks["proj.bad"])
    finally:
        close_app(app)


def share_pid(server) -> int | None:
    """The pid recorded for the tenant's share, if one is held."""
    client = server.client()
    for key in client.scan_iter("redlock:*:holders"):
        for details in client.hvals(key):
            return int(json.loads(details)["pid"])
    return None


def test_parent_frees_the_share_of_a_sigkilled_child(celery_redis, app, worker_process_factory):
    """A prefork child holding a slot (30 s lease) is SIGKILLed: the slot is free at once."""
    worker = worker_process_factory(
        "tests.apps.locked", pool="prefork", concurrency=2, env={"REDLOCK_TEST_TTL": "30"}
    )
    result = app.tasks["tests.apps.locked.one_slot"].delay("t-kill", 60)
    wait_for(lambda: share_pid(celery_redis), timeout=20, message="the slot taken")
    child = share_pid(celery_redis)
    assert child in worker.child_pids()
    os.kill(child, signal.SIGKILL)
    killed_at = time.monotonic()
    wait_for(lambda: share_pid(celery_redis) is None, timeout=10, interval=0.01)
    assert time.monotonic() - killed_at < 5, "freed by the worker, not by the 30 s lease"
    with pytest.raises(Exception, match=r"WorkerLostError|exited"):
        result.get(timeout=30)
    second = app.tasks["tests.apps.locked.one_slot"].delay("t-kill", 0)
    assert second.get(timeout=30) == "done"
