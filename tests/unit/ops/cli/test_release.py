"""``celery redlock release``: one lock or every stale one, only what is proven dead, against
real servers and workers."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
import redis

from celery_redlock import LockLost, Redlock
from tests.apps.locked import create_app
from tests.harness import lock_keys, wait_for
from tests.harness.celery_workers import redis_url_with_db
from tests.unit.ops.cli.helpers import lock_on, rows


def get(result: Any, timeout: float = 30, **kwargs: Any) -> Any:
    return result.get(timeout=timeout, disable_sync_subtasks=False, **kwargs)


def test_release_refuses_a_running_holder_unless_forced(
    celery_redis, inprocess_worker_factory, cli
):
    """A lock whose task is active on a worker is refused; --force releases it (and the
    task, losing its lock, is aborted)."""
    app = create_app(celery_redis.url)
    worker = inprocess_worker_factory(app, pool="threads", concurrency=2)
    result = app.tasks["tests.apps.locked.hold"].delay("acct-7", None, "long", 60)
    (key,) = wait_for(lambda: lock_keys(celery_redis), timeout=10)

    refused = cli(celery_redis.url, "release", key, "--yes", "--json")

    assert refused.exit_code == 1, refused.output
    data = json.loads(refused.stdout)
    assert data["released"] == []
    (item,) = data["refused"]
    assert (item["key"], item["task_id"], item["state"]) == (key, result.id, "active")
    assert worker.hostname in item["reason"] and "--force" in item["reason"]
    assert lock_keys(celery_redis) == [key], "the lock is still there"

    forced = cli(celery_redis.url, "release", key, "--force", input="y\n")

    assert forced.exit_code == 0, forced.output
    assert f"Release {key}?" in forced.stderr
    assert f"released {key}" in forced.stdout and ": released" in forced.stdout
    with pytest.raises(LockLost):
        get(result)


def test_release_asks_for_confirmation_and_stops_on_no(redis_node, cli):
    """Without --yes the operator is asked; anything but yes releases nothing (exit 1)."""
    lock = lock_on(redis_node, "reports:daily")
    declined = cli(redis_node.url, "release", "reports:daily", input="n\n")
    assert declined.exit_code == 1
    assert lock.locked()
    no_terminal = cli(redis_node.url, "release", "reports:daily")
    assert no_terminal.exit_code == 1, "no answer at all is not a yes"
    assert lock.locked()

    done = cli(redis_node.url, "release", "reports:daily", "--yes", "--json")
    assert done.exit_code == 0, done.output
    (item,) = json.loads(done.stdout)["released"]
    assert item["released_on"] == 1
    assert item["nodes"] == [{"node": redis_node.url, "result": "released", "error": None}]
    assert not lock.locked()


def test_release_of_a_free_key_does_nothing(redis_node, cli):
    """Nothing held: nothing released, exit 0."""
    result = cli(redis_node.url, "release", "nothing:here", "--yes", "--json")
    assert result.exit_code == 0
    assert json.loads(result.stdout) == {
        "released": [],
        "cleared": [],
        "refused": [],
        "error": None,
    }
    assert "not held" in result.stderr


class _ConfirmAfter(io.RawIOBase):
    """A stdin whose first read runs ``action`` (the CLI is at its prompt), then says yes."""

    def __init__(self, action: Callable[[], None]) -> None:
        self.action: Callable[[], None] | None = action
        self.data = b"y\n"

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        if not len(buffer):
            return 0
        if self.action is not None:
            action, self.action = self.action, None
            action()
        n = min(len(buffer), len(self.data))
        buffer[:n], self.data = self.data[:n], self.data[n:]
        return n


def test_release_leaves_a_lock_reacquired_meanwhile_alone(redis_node, cli):
    """The token read is the token deleted: a new holder (new token) keeps its lock."""
    first = lock_on(redis_node, "reports:daily")
    second = Redlock("reports:daily", nodes=[redis_node.url], ttl=30, auto_renew=False)

    def hand_over() -> None:  # while the operator reads the prompt
        first.release()
        assert second.acquire(blocking=False)

    result = cli(
        redis_node.url,
        "release",
        "reports:daily",
        input=io.BufferedReader(_ConfirmAfter(hand_over)),
    )

    assert result.exit_code == 0, result.output
    assert second.fence == first.fence + 1, "the prompt ran in between"
    assert f"on 0 node(s): {redis_node.url}: taken" in result.stdout
    assert second.owned(), "the new holder's lock is untouched"
    second.release()


def test_release_usage_errors(redis_node, cli):
    """KEY or --stale, not both nor neither; --force only with KEY."""
    assert cli(redis_node.url, "release").exit_code == 2
    assert cli(redis_node.url, "release", "k", "--stale").exit_code == 2
    assert cli(redis_node.url, "release", "--stale", "--force").exit_code == 2
    assert cli(redis_node.url, "release", "k", "--task", "x").exit_code == 2


# -- stale: only what is proven dead is released ---------------------------------


def _dead_holder_lock(url: str, name: str, task_id: str) -> None:
    """A lock taken by a process of this host that then died (SIGKILL): its pid is gone."""
    code = (
        "import os, sys\n"
        "from celery_redlock import Redlock\n"
        f"lock = Redlock({name!r}, nodes=[{url!r}], ttl=60, auto_renew=False,"
        f" task_id={task_id!r}, task_name='proj.t')\n"
        "assert lock.acquire(blocking=False)\n"
        "os.kill(os.getpid(), 9)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], check=False, timeout=60)
    assert proc.returncode == -9


@pytest.mark.smoke
def test_stale_locks_are_listed_and_released_and_running_ones_kept(
    celery_redis, inprocess_worker_factory, cli
):
    """A lock naming a task id that no answering worker runs is stale; `release --stale
    --yes` frees it, and leaves the running task's lock and the task-less lock alone."""
    app = create_app(celery_redis.url)
    inprocess_worker_factory(app, pool="threads", concurrency=2)
    running = app.tasks["tests.apps.locked.hold"].delay("busy", None, "busy", 60)
    wait_for(lambda: lock_keys(celery_redis), timeout=10)
    db0 = redis_url_with_db(celery_redis.url, 0)
    # The in-process worker runs in this process and is busy, so an orphan taken here
    # would be unknown: take it in a process that then dies.
    _dead_holder_lock(db0, "orphan", "gone-1")
    orphan = Redlock("orphan", nodes=[db0])
    no_task = Redlock("no-task", nodes=[db0], ttl=30, auto_renew=False)
    assert no_task.acquire(blocking=False)
    url = celery_redis.url

    listed = cli(url, "ls", "--stale")
    assert listed.exit_code == 0, listed.output
    table = rows(listed.stdout)
    assert set(table) == {"redlock:{orphan}"}
    assert table["redlock:{orphan}"]["STATE"] == "stale"

    data = json.loads(cli(url, "ls", "--stale", "--json").stdout)
    (item,) = data["locks"]
    assert (item["key"], item["state"], item["task_id"]) == ("redlock:{orphan}", "stale", "gone-1")
    assert running.id in data["workers"]["active"]

    released = cli(url, "release", "--stale", "--yes", "--json")
    assert released.exit_code == 0, released.output
    (done,) = json.loads(released.stdout)["released"]
    assert (done["key"], done["released_on"]) == ("redlock:{orphan}", 1)
    assert not orphan.locked()
    assert no_task.locked()
    remaining = {k for k in lock_keys(celery_redis)}
    assert "redlock:{no-task}" in remaining and len(remaining) == 2, "the running task's lock stays"

    # End the running task: forced release, and it aborts.
    (task_key,) = remaining - {"redlock:{no-task}"}
    assert cli(url, "release", task_key, "--force", "--yes").exit_code == 0
    with pytest.raises(LockLost):
        get(running)
    no_task.release()


def test_nothing_is_stale_when_no_worker_answers(redis_node, cli):
    """Without a worker's answer a live holder's lock is not stale: listed as unknown on
    stderr (never "No stale locks."), released none, exit 69."""
    lock = lock_on(redis_node, "orphan", task_id="gone-1", task_name="proj.t")

    listed = cli(redis_node.url, "ls", "--stale", "--timeout", "0.2")
    assert listed.exit_code == 69
    assert "no worker answered" in listed.stderr
    assert listed.stdout == ""

    released = cli(redis_node.url, "release", "--stale", "--yes", "-t", "0.2")
    assert released.exit_code == 69
    assert lock.locked()

    single = cli(redis_node.url, "release", "orphan", "--yes", "-t", "0.2", "--json")
    assert single.exit_code == 69
    (item,) = json.loads(single.stdout)["refused"]
    assert item["state"] == "unknown"
    assert lock.locked()
    lock.release()


def test_release_stale_leaves_the_lock_of_a_busy_solo_worker(
    celery_redis, worker_process_factory, cli
):
    """A busy solo worker cannot answer; another worker on the same host answering proves
    nothing about it: `release --stale --yes` lists the lock as unknown and keeps it."""
    workers = [
        worker_process_factory("tests.apps.locked", pool="solo", concurrency=1) for _ in range(2)
    ]
    app = create_app(celery_redis.url)
    try:
        app.tasks["tests.apps.locked.hold"].delay("busy-1", None, "busy", 120)
        (key,) = wait_for(lambda: lock_keys(celery_redis), timeout=20)
        db0 = redis.Redis.from_url(redis_url_with_db(celery_redis.url, 0), decode_responses=True)
        holder = int(db0.hget(key, "pid"))
        (busy,) = [w for w in workers if w.pid == holder]
        (idle,) = [w for w in workers if w is not busy]
        url = celery_redis.url

        listed = cli(url, "ls", "--stale", "--json", "-t", "1")
        data = json.loads(listed.stdout)
        assert data["locks"] == [], "the busy worker's lock is not stale"
        (unknown,) = data["unknown"]
        assert (unknown["key"], unknown["state"]) == (key, "unknown")
        assert idle.nodename in data["workers"]["answered"]
        assert busy.nodename not in data["workers"]["answered"]

        released = cli(url, "release", "--stale", "--yes", "--json", "-t", "1")
        assert lock_keys(celery_redis) == [key], "the running task's lock stays"
        assert released.exit_code == 1, released.output
        out = json.loads(released.stdout)
        assert out["released"] == []
        (refused,) = out["refused"]
        assert (refused["key"], refused["state"]) == (key, "unknown")
        assert str(holder) in refused["reason"]
    finally:
        app.close()
        busy.kill()


def test_release_stale_releases_a_lock_whose_holder_pid_is_gone_on_this_host(redis_node, cli):
    """The holder's pid is gone on this host: proven dead, released without any worker."""
    db0 = redis_node.url
    _dead_holder_lock(db0, "orphan", "gone-1")
    alive = lock_on(redis_node, "alive", task_id="gone-2", task_name="proj.t")  # our pid

    listed = cli(db0, "ls", "--stale", "-t", "0.2")
    assert set(rows(listed.stdout)) == {"redlock:{orphan}"}, listed.output

    released = cli(db0, "release", "--stale", "--yes", "--json", "-t", "0.2")

    data = json.loads(released.stdout)
    (done,) = data["released"]
    assert (done["key"], done["released_on"]) == ("redlock:{orphan}", 1)
    assert "redlock:{orphan}" not in lock_keys(redis_node)
    (refused,) = data["refused"]
    assert (refused["key"], refused["state"]) == ("redlock:{alive}", "unknown")
    assert released.exit_code == 69, "no worker answered about the live holder's task"
    assert "no worker answered" in data["error"]
    assert alive.locked()
    alive.release()
    _dead_holder_lock(db0, "orphan2", "gone-3")
    one = cli(db0, "release", "orphan2", "--yes", "-t", "0.2")
    assert one.exit_code == 0, one.output
    assert "released redlock:{orphan2}" in one.stdout
