"""``celery -A <app> redlock ...`` run through Celery's own CLI group, against real servers.

The CLI loads ``tests.apps.cli_app``, which builds its app from the environment at
import; the ``cli`` fixture points it at the test's servers and drops the module from
``sys.modules`` first, so every invocation builds the app again.
"""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from celery.bin.celery import celery as celery_cli
from click.testing import CliRunner, Result

import tests.apps
from celery_redlock import LockLost, Redlock
from celery_redlock.engine import keys as redis_keys
from celery_redlock.nodes import NodeSet
from celery_redlock.ops.cli import (
    LockView,
    NodeView,
    Workers,
    classify,
    is_lock_key,
    read_locks,
    redlock,
    release_lock,
    resolve_key,
)
from celery_redlock.ops.shares import read_shares
from tests.apps.cli_app import CONF_ENV
from tests.apps.locked import create_app
from tests.harness import APP_URL_ENV, lock_keys, wait_for
from tests.harness.celery_workers import redis_url_with_db

APP_MODULE = "tests.apps.cli_app"
HOST = socket.gethostname()
HOLDER = f"{HOST}:{os.getpid()}"


@pytest.fixture
def cli(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Result]]:
    """``cli(url, *args, conf=None, input=None)``: run ``celery -A cli_app redlock *args``."""
    apps = []

    def run(url: str, *args: str, conf: dict | None = None, input: Any = None) -> Result:
        monkeypatch.setenv(APP_URL_ENV, url)
        monkeypatch.setenv(CONF_ENV, json.dumps(conf or {}))
        # Celery's find_app looks the module up as an attribute of its package first.
        monkeypatch.delitem(sys.modules, APP_MODULE, raising=False)
        monkeypatch.delattr(tests.apps, "cli_app", raising=False)
        try:
            return CliRunner().invoke(
                celery_cli,
                ["-A", APP_MODULE, "redlock", *args],
                input=input,
                catch_exceptions=False,
            )
        finally:
            module = sys.modules.get(APP_MODULE)
            if module is not None:
                apps.append(module.app)

    yield run
    for app in apps:
        app.close()


def lock_on(server: Any, name: str, **kwargs: Any) -> Redlock:
    """A lock taken on ``server`` (db 0, where the CLI app keeps its locks)."""
    kwargs.setdefault("ttl", 30)
    kwargs.setdefault("auto_renew", False)
    lock = Redlock(name, nodes=[server.url], **kwargs)
    assert lock.acquire(blocking=False)
    return lock


def rows(output: str) -> dict[str, dict[str, str]]:
    """Parse the ``ls`` table into ``{key: {column: cell}}`` using the header's columns."""
    lines = [line for line in output.splitlines() if line.strip()]
    header = lines[0]
    names = [n for n in header.split("  ") if n.strip()]
    starts = [header.index(n.strip()) for n in names]
    table = {}
    for line in lines[1:]:
        cells = [
            line[start : (starts[i + 1] if i + 1 < len(starts) else None)].strip()
            for i, start in enumerate(starts)
        ]
        table[cells[0]] = dict(zip([n.strip() for n in names], cells, strict=True))
    return table


def get(result: Any, timeout: float = 30, **kwargs: Any) -> Any:
    return result.get(timeout=timeout, disable_sync_subtasks=False, **kwargs)


# -- registration ----------------------------------------------------------------


@pytest.mark.smoke
def test_redlock_is_a_celery_subcommand_through_the_entry_point():
    """`pip install` registered celery.commands: redlock is Celery's own sub-command."""
    assert celery_cli.commands.get("redlock") is redlock, (
        "celery_redlock.ops.cli:redlock is not registered; run `pip install -e .`"
    )
    assert set(redlock.commands) == {"ls", "inspect", "release", "doctor"}


# -- ls ----------------------------------------------------------------------------


@pytest.mark.smoke
def test_ls_shows_a_task_lock_with_its_holder_age_ttl_and_fence(redis_node, cli):
    """The table names key, task, task id, holder host:pid, age, TTL and fence; no KEYS."""
    Redlock("warm-up", nodes=[redis_node.url], auto_renew=False).acquire()
    first = lock_on(redis_node, "proj:sync:42", task_id="task-42", task_name="proj.tasks.sync")
    first.release()
    task_lock = lock_on(redis_node, "proj:sync:42", task_id="task-43", task_name="proj.tasks.sync")
    plain = lock_on(redis_node, "reports:daily")
    redis_node.reset_stats()

    result = cli(redis_node.url, "ls")

    assert result.exit_code == 0, result.output
    table = rows(result.stdout)
    row = table["redlock:{proj:sync:42}"]
    assert row["TASK"] == "proj.tasks.sync"
    assert row["TASK ID"] == "task-43"
    assert row["HOLDER"] == HOLDER
    assert row["FENCE"] == "2" == str(task_lock.fence)
    assert row["AGE"].endswith("s") and float(row["AGE"][:-1]) < 10
    assert 20 < float(row["TTL"][:-1]) <= 30
    assert "NODES" not in row, "one node: no quorum column"
    assert table["redlock:{reports:daily}"]["TASK"] == "-"
    assert table["redlock:{reports:daily}"]["TASK ID"] == "-"
    assert "redlock:{warm-up}" in table
    assert len(table) == 3, "fence counters are not listed"
    stats = redis_node.commandstats()
    assert "keys" not in stats and stats.get("scan", 0) >= 1
    plain.release()


def test_ls_json_has_stable_keys_and_values(redis_node, cli):
    """--json prints one object: nodes, quorum, locks (each with the documented keys)."""
    lock = lock_on(redis_node, "proj:sync:7", task_id="task-7", task_name="proj.tasks.sync")

    result = cli(redis_node.url, "ls", "--json")

    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert set(data) == {"nodes", "quorum", "complete", "locks", "shares", "unknown", "workers"}
    assert data["complete"] is True and data["unknown"] is None
    assert data["shares"] == []
    assert data["nodes"] == [{"node": redis_node.url, "ok": True, "error": None}]
    assert data["quorum"] == 1
    assert data["workers"] is None
    (item,) = data["locks"]
    assert set(item) == {
        "key", "name", "task_name", "task_id", "host", "pid", "acquired_at", "age", "ttl",
        "lease", "fence", "held_on", "nodes", "quorum", "other_tokens",
    }  # fmt: skip
    assert item["key"] == "redlock:{proj:sync:7}"
    assert item["name"] == "proj:sync:7"
    assert (item["task_name"], item["task_id"]) == ("proj.tasks.sync", "task-7")
    assert (item["host"], item["pid"]) == (HOST, os.getpid())
    assert item["fence"] == lock.fence
    assert 0 <= item["age"] < 10
    assert 20 < item["ttl"] <= 30
    assert item["lease"] == 30.0
    assert (item["held_on"], item["nodes"], item["quorum"]) == (1, 1, True)
    assert "keys" not in redis_node.commandstats()
    lock.release()


def test_ls_lists_shares_after_the_locks(redis_node, cli):
    """Two holders of a limited resource appear as shares, with holder, TTL and fence."""
    exclusive = lock_on(redis_node, "reports:daily")
    slots = [
        lock_on(redis_node, "tenant:9", limit=2, task_id=f"call-{i}", task_name="proj.call_api")
        for i in range(2)
    ]

    result = cli(redis_node.url, "ls")

    assert result.exit_code == 0, result.output
    locks_table, shares_table = result.stdout.split("\n\n")
    assert list(rows(locks_table)) == ["redlock:{reports:daily}"]
    lines = shares_table.strip().splitlines()
    assert lines[0].startswith("SHARED KEY")
    assert len(lines) == 3 and all(line.startswith("redlock:{tenant:9}") for line in lines[1:])
    assert {"call-0", "call-1"} <= set(shares_table.split())
    assert {str(slot.fence) for slot in slots} <= set(shares_table.split())

    data = json.loads(cli(redis_node.url, "ls", "--json").stdout)
    assert [item["key"] for item in data["locks"]] == ["redlock:{reports:daily}"]
    shares = data["shares"]
    assert sorted(share["task_id"] for share in shares) == ["call-0", "call-1"]
    for share in shares:
        assert share["kind"] == "shared" and share["name"] == "tenant:9"
        assert (share["host"], share["pid"]) == (HOST, os.getpid())
        assert 20 < share["ttl"] <= 30 and share["held_on"] == 1
    filtered = json.loads(cli(redis_node.url, "ls", "--json", "--task", "other.*").stdout)
    assert filtered["shares"] == []
    for lock in (exclusive, *slots):
        lock.release()
    assert "No locks held." in cli(redis_node.url, "ls").stdout


def test_ls_task_filter_matches_task_names_by_glob(redis_node, cli):
    """--task keeps locks whose task name matches; locks without a task never match."""
    locks = [
        lock_on(redis_node, "a", task_id="1", task_name="proj.tasks.sync_account"),
        lock_on(redis_node, "b", task_id="2", task_name="proj.tasks.sync_invoices"),
        lock_on(redis_node, "c", task_id="3", task_name="proj.tasks.report"),
        lock_on(redis_node, "d"),
    ]

    result = cli(redis_node.url, "ls", "--task", "proj.tasks.sync_*")
    assert result.exit_code == 0, result.output
    assert set(rows(result.stdout)) == {"redlock:{a}", "redlock:{b}"}

    exact = json.loads(cli(redis_node.url, "ls", "--task", "proj.tasks.report", "-j").stdout)
    assert [lock["key"] for lock in exact["locks"]] == ["redlock:{c}"]

    none = cli(redis_node.url, "ls", "--task", "other.*")
    assert none.exit_code == 0
    assert none.stdout.strip() == "No locks held."
    for lock in locks:
        lock.release()


def test_ls_skips_beat_state_and_other_keys(redis_node, cli):
    """Only lock hashes are listed: not fence counters, beat state, or foreign keys."""
    lock = lock_on(redis_node, "beat:proj")
    with redis_node.client() as conn:
        conn.hset("redlock:{beat:proj}:state", "entry", "1")
        conn.set("redlock:{loose}", "a string, not a lock hash")
        conn.hset("other:{x}", "token", "t")
    result = cli(redis_node.url, "ls", "--json")
    assert [item["key"] for item in json.loads(result.stdout)["locks"]] == ["redlock:{beat:proj}"]
    lock.release()


def test_ls_on_three_nodes_with_one_down_shows_two_of_three_with_quorum(redis_factory, cli):
    """Redlock: each key says on how many nodes it is held, and whether that is a quorum."""
    servers = redis_factory(3)
    urls = [s.url for s in servers]
    lock = Redlock("shared", nodes=urls, ttl=30, auto_renew=False, task_id="t-1", task_name="x.y")
    assert lock.acquire(blocking=False)
    servers[2].kill()
    conf = {"redlock_nodes": urls}

    result = cli(urls[0], "ls", conf=conf)

    assert result.exit_code == 0, result.output
    row = rows(result.stdout)["redlock:{shared}"]
    assert row["NODES"] == "2/3 quorum"
    assert row["TASK ID"] == "t-1"
    assert f"node {urls[2]} did not answer" in result.stderr

    data = json.loads(cli(urls[0], "ls", "--json", conf=conf).stdout)
    assert [n["ok"] for n in data["nodes"]] == [True, True, False]
    assert data["quorum"] == 2
    (item,) = data["locks"]
    assert (item["held_on"], item["nodes"], item["quorum"]) == (2, 3, True)
    for server in servers[:2]:
        assert "keys" not in server.commandstats()

    # With two nodes down nobody can tell who holds it: shown, but exit EX_UNAVAILABLE.
    servers[1].kill()
    partial = cli(urls[0], "ls", conf=conf)
    assert partial.exit_code == 69
    assert rows(partial.stdout)["redlock:{shared}"]["NODES"] == "1/3 NO QUORUM"
    assert "only 1 of 3 lock node(s) answered" in partial.stderr


def test_ls_exits_unavailable_when_the_node_is_down(redis_factory, cli):
    """No node answered: EX_UNAVAILABLE (69), and the reason on stderr."""
    (server,) = redis_factory(1)
    url = server.url
    server.kill()
    result = cli(url, "ls", "--node-timeout", "0.2")
    assert result.exit_code == 69
    assert "did not answer" in result.stderr


# -- inspect -----------------------------------------------------------------------


@pytest.mark.smoke
def test_inspect_shows_every_field_per_node_with_pttl_and_fence_counter(redis_node, cli):
    """inspect KEY (or the lock name) shows the hash, PTTL and the fence counter."""
    lock = lock_on(redis_node, "proj:sync:1", task_id="task-1", task_name="proj.tasks.sync")
    token = lock.lease.token

    by_key = cli(redis_node.url, "inspect", "redlock:{proj:sync:1}", "--json")
    by_name = cli(redis_node.url, "inspect", "proj:sync:1", "--json")

    assert by_key.exit_code == by_name.exit_code == 0, by_key.output
    data = json.loads(by_key.stdout)
    assert json.loads(by_name.stdout)["key"] == data["key"] == "redlock:{proj:sync:1}"
    assert (data["held"], data["held_on"], data["quorum"], data["quorum_size"]) == (
        True,
        1,
        True,
        1,
    )
    (node,) = data["nodes"]
    assert node["node"] == redis_node.url and node["ok"] and node["held"]
    assert 20_000 < node["pttl"] <= 30_000
    assert node["fence_counter"] == lock.fence == 1
    assert node["fields"] == {
        "token": token,
        "fence": "1",
        "task_id": "task-1",
        "task_name": "proj.tasks.sync",
        "host": HOST,
        "pid": str(os.getpid()),
        "acquired_at": node["fields"]["acquired_at"],
        "ttl": "30000",
    }
    assert data["holder"]["task_id"] == "task-1"

    text = cli(redis_node.url, "inspect", "proj:sync:1")
    assert text.exit_code == 0
    for expected in ("fence counter  1", f"token          {token}", "task_id        task-1"):
        assert expected in text.stdout
    lock.release()

    free = cli(redis_node.url, "inspect", "proj:sync:1", "--json")
    data = json.loads(free.stdout)
    assert free.exit_code == 0
    assert (data["held"], data["holder"], data["nodes"][0]["pttl"]) == (False, None, -2)
    assert data["nodes"][0]["fence_counter"] == 1, "the fence counter outlives the lock"


# -- release -----------------------------------------------------------------------


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
    assert json.loads(result.stdout) == {"released": [], "refused": [], "error": None}
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
    assert second.fence == 2, "the prompt ran in between"
    assert f"on 0 node(s): {redis_node.url}: taken" in result.stdout
    assert second.owned(), "the new holder's lock is untouched"
    second.release()


def test_release_lock_deletes_only_the_token_it_read(redis_factory):
    """release_lock on three nodes: released where the token is, left alone elsewhere."""
    servers = redis_factory(3)
    urls = [s.url for s in servers]
    nodeset = NodeSet(urls, timeout=1.0)
    lock = Redlock("r", nodes=urls, ttl=30, auto_renew=False)
    assert lock.acquire(blocking=False)
    (view,) = read_locks(nodeset, ["redlock:{r}"], "redlock:")
    assert view.token == lock.lease.token and view.held_on == 3
    with servers[1].client() as conn:  # node 1 now holds someone else's token
        conn.hset("redlock:{r}", "token", "someone-else")
    with servers[2].client() as conn:  # node 2 lost it
        conn.delete("redlock:{r}")

    results = release_lock(nodeset, view)

    assert [r["result"] for r in results] == ["released", "taken", "gone"]
    with servers[1].client() as conn:
        assert conn.hget("redlock:{r}", "token") == "someone-else"


# -- stale ---------------------------------------------------------------------------


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


def test_classify_names_a_running_task_and_a_task_less_holder():
    """A task active on any worker is active; a holder that is no task is never stale."""
    view = NodeView("n", pttl=1000, fields={"token": "t", "task_id": "a", "host": "web-1.example"})
    lock = LockView("redlock:{x}", "x", [view], 1)
    running = Workers(("celery@web-2",), {"a": "celery@web-2"})
    assert classify(lock, running) == ("active", "task a is running on celery@web-2")
    here = Workers(("celery@web-1.example",), {}, {"celery@web-1.example": (1,)})
    no_task = LockView("redlock:{y}", "y", [NodeView("n", pttl=1, fields={"token": "t"})], 1)
    assert classify(no_task, here)[0] == "no-task"


def test_lock_view_picks_the_majority_token_and_its_quorum_ttl():
    """Across nodes the holder is the token on most nodes; TTL is how long it keeps a quorum."""
    views = [
        NodeView("a", pttl=10_000, fields={"token": "t1", "fence": "5"}),
        NodeView("b", pttl=20_000, fields={"token": "t1", "fence": "5"}),
        NodeView("c", pttl=30_000, fields={"token": "t2", "fence": "6"}),
        NodeView("d", pttl=-2),
        NodeView("e", error="ConnectionError: refused"),
    ]
    lock = LockView("redlock:{k}", "k", views, 3)
    assert (lock.token, lock.held_on, lock.other_tokens, lock.has_quorum) == ("t1", 2, 1, False)
    assert lock.ttl == 20.0, "not a quorum: until the last holding node expires"
    assert lock.unreachable() == ["e"]
    quorum = LockView("redlock:{k}", "k", views[:2] + views[3:4], 2)
    assert quorum.has_quorum and quorum.ttl == 10.0


def test_keys_and_names_resolve_to_the_lock_key():
    """KEY may be the key, a sibling key of the lock, or the lock's name."""
    assert resolve_key("redlock:{a:b}", "redlock:") == "redlock:{a:b}"
    assert resolve_key("redlock:{a:b}:fence", "redlock:") == "redlock:{a:b}"
    assert resolve_key("a:b", "redlock:") == "redlock:{a:b}"
    assert resolve_key("a:b", "app1:") == "app1:{a:b}"
    assert is_lock_key("redlock:{beat:x}", "redlock:")
    assert not is_lock_key("redlock:{beat:x}:state", "redlock:")
    assert not is_lock_key("redlock:{x}:fence", "redlock:")
    assert not is_lock_key("redlock:{}", "redlock:")


@pytest.mark.parametrize(
    "which", ["lock", "fence", "channel", "state", "shared", "holders", "queue", "waiting"]
)
def test_every_key_of_a_lock_resolves_to_its_lock_key(which):
    """resolve_key("redlock:{x}:shared") used to return "redlock:{redlock:{x}:shared}", a key
    that does not exist: every key of a lock (keys.SUFFIXES) names that lock."""
    for name in ("x", "a:b", "}odd", "x}:shared"):
        keys = redis_keys.lock_keys(name)
        assert resolve_key(getattr(keys, which), "redlock:") == keys.lock
        assert (
            resolve_key(getattr(redis_keys.lock_keys(name, "app1:"), which), "app1:")
            == redis_keys.lock_keys(name, "app1:").lock
        )


def test_release_usage_errors(redis_node, cli):
    """KEY or --stale, not both nor neither; --force only with KEY."""
    assert cli(redis_node.url, "release").exit_code == 2
    assert cli(redis_node.url, "release", "k", "--stale").exit_code == 2
    assert cli(redis_node.url, "release", "--stale", "--force").exit_code == 2
    assert cli(redis_node.url, "release", "k", "--task", "x").exit_code == 2


def test_custom_prefix_and_invalid_settings(redis_node, cli):
    """The app's key prefix is used; settings that do not validate exit 1 with the reason."""
    lock = lock_on(redis_node, "job", key_prefix="app1:")
    data = json.loads(cli(redis_node.url, "ls", "-j", conf={"redlock_key_prefix": "app1:"}).stdout)
    assert [item["key"] for item in data["locks"]] == ["app1:{job}"]
    bad = cli(redis_node.url, "ls", conf={"redlock_ttl": -1})
    assert bad.exit_code == 1
    assert "redlock_ttl must be > 0" in bad.output
    lock.release()


# -- safety: only what is proven dead is stale; a dead node is never "no locks" ------


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


def test_classify_needs_the_holders_own_worker_or_its_pid_gone():
    """Stale only when the holder's own worker (host and pid) answered idle, or its pid
    is gone on this host; another worker on the same host proves nothing."""
    here = socket.gethostname()
    me = os.getpid()

    def lock_of(pid: int, host: str = here) -> LockView:
        fields = {"token": "t", "task_id": "a", "host": host, "pid": str(pid)}
        return LockView("redlock:{x}", "x", [NodeView("n", pttl=1000, fields=fields)], 1)

    other = Workers(("celery@" + here,), {}, {"celery@" + here: (me + 1_000_000,)}, {})
    own_idle = Workers(("celery@" + here,), {}, {"celery@" + here: (me,)}, {})
    own_busy = Workers(("celery@" + here,), {"b": "celery@" + here},
                       {"celery@" + here: (me,)}, {"celery@" + here: (me,)})  # fmt: skip
    assert classify(lock_of(me), other)[0] == "unknown", "another worker on the host"
    assert classify(lock_of(me), own_idle)[0] == "stale"
    assert classify(lock_of(me), own_busy)[0] == "unknown", "its process runs another task"
    assert classify(lock_of(me, "elsewhere"), own_idle)[0] == "unknown"
    assert classify(lock_of(me), None)[0] == "unknown"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    assert classify(lock_of(dead.pid), None)[0] == "stale", "pid gone on this host"
    assert classify(lock_of(dead.pid, "elsewhere"), None)[0] == "unknown"


def test_no_command_reports_no_locks_when_the_node_is_down(redis_factory, cli):
    """A node that does not answer is never reported as "no locks" (text or JSON)."""
    (server,) = redis_factory(1)
    url = server.url
    server.kill()
    for args in (("ls",), ("ls", "--stale", "-t", "0.2")):
        text = cli(url, *args, "--node-timeout", "0.2")
        assert text.exit_code == 69
        assert "No locks" not in text.output and "No stale locks" not in text.output
        assert text.stdout == "", text.stdout
        data = json.loads(cli(url, *args, "--json", "--node-timeout", "0.2").stdout)
        assert data["locks"] is None and data["shares"] is None
        assert data["complete"] is False
    inspected = cli(url, "inspect", "x", "--node-timeout", "0.2")
    assert inspected.exit_code == 69
    assert "not held" not in inspected.output
    data = json.loads(cli(url, "inspect", "x", "--json", "--node-timeout", "0.2").stdout)
    assert data["held"] is None and data["quorum"] is None
    released = cli(url, "release", "x", "--yes", "--json", "--node-timeout", "0.2")
    assert released.exit_code == 69
    assert "only 0 of 1" in json.loads(released.stdout)["error"]


def test_ls_stale_without_workers_does_not_say_no_stale_locks(redis_node, cli):
    """No worker answered: a live holder's lock is unknown, never "No stale locks."."""
    lock = lock_on(redis_node, "orphan", task_id="gone-1", task_name="proj.t")
    listed = cli(redis_node.url, "ls", "--stale", "--timeout", "0.2")
    assert listed.exit_code == 69
    assert "No stale locks" not in listed.output
    assert "1 lock(s) could not be classified" in listed.stderr
    assert "redlock:{orphan}" in listed.stderr
    lock.release()


def test_read_shares_reports_a_node_it_could_not_read(redis_factory):
    """A node that fails the share read (after answering SCAN) is an error, not "none"."""
    (server,) = redis_factory(1)
    nodeset = NodeSet([server.url], timeout=0.2)
    server.kill()
    try:
        shares, errors = read_shares(nodeset, ["redlock:{r}:shared"], "redlock:", timeout=0.2)
    finally:
        nodeset.nodes[0].close()
    assert shares == []
    assert set(errors) == {server.url}
