"""``celery redlock ls``: the table and JSON of the locks and shares held, against real servers."""

from __future__ import annotations

import json
import os

import pytest

from celery_redlock import Redlock
from celery_redlock.engine.keys import lock_keys
from celery_redlock.integration.claims import claim, unclaim
from celery_redlock.nodes import NodeSet
from tests.unit.ops.cli.helpers import HOLDER, HOST, lock_on, park_run, rows


@pytest.mark.smoke
def test_ls_shows_a_task_lock_with_its_holder_age_ttl_and_fence(redis_node, cli):
    """The table names key, task, task id, holder host:pid, age, TTL and fence; no KEYS."""
    Redlock("warm-up", nodes=[redis_node.url], auto_renew=False).acquire()
    first = lock_on(redis_node, "proj:sync:42", task_id="task-42", task_name="proj.tasks.sync")
    fence = first.fence
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
    assert row["FENCE"] == str(fence + 1) == str(task_lock.fence), "every digit"
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
    assert set(data) == {
        "nodes", "quorum", "complete", "locks", "shares", "claims", "budgets", "parked",
        "unknown", "workers",
    }  # fmt: skip
    assert data["complete"] is True and data["unknown"] is None
    assert data["shares"] == [] and data["claims"] == [] and data["budgets"] == []
    assert data["parked"] == []
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


def test_ls_lists_queued_copies_after_the_locks(redis_node, cli):
    """A send-time claim (lock_unique) is a QUEUED KEY row: task, task id, age, TTL."""
    nodeset = NodeSet([redis_node.url], timeout=0.5)
    claim(nodeset, lock_keys("report:mon"), "copy-1", 600, task_name="proj.report")
    lock = lock_on(redis_node, "reports:daily")

    result = cli(redis_node.url, "ls")

    assert result.exit_code == 0, result.output
    locks_table, claims_table = result.stdout.split("\n\n")
    assert list(rows(locks_table)) == ["redlock:{reports:daily}"]
    row = rows(claims_table)["redlock:{report:mon}"]
    assert (row["TASK"], row["TASK ID"]) == ("proj.report", "copy-1")
    assert float(row["AGE"][:-1]) < 10 and row["TTL"].startswith(("9m5", "10m"))
    (item,) = json.loads(cli(redis_node.url, "ls", "--json").stdout)["claims"]
    assert item["name"] == "report:mon" and item["task_id"] == "copy-1"
    assert item["held_on"] == 1 and 590 < item["ttl"] <= 600
    filtered = json.loads(cli(redis_node.url, "ls", "--json", "--task", "other.*").stdout)
    assert filtered["claims"] == []
    lock.release()
    unclaim(nodeset, lock_keys("report:mon"), "copy-1", "proj.report")
    nodeset.close()
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


def test_ls_stale_without_workers_does_not_say_no_stale_locks(redis_node, cli):
    """No worker answered: a live holder's lock is unknown, never "No stale locks."."""
    lock = lock_on(redis_node, "orphan", task_id="gone-1", task_name="proj.t")
    listed = cli(redis_node.url, "ls", "--stale", "--timeout", "0.2")
    assert listed.exit_code == 69
    assert "No stale locks" not in listed.output
    assert "1 lock(s) could not be classified" in listed.stderr
    assert "redlock:{orphan}" in listed.stderr
    lock.release()


def test_ls_shows_a_beat_leaders_broker_without_credentials_as_written(redis_node, cli):
    """A beat whose broker URL has no user: `broker redis://host:port/0`, no `redis://@`.

    The default leader name still hashes the identity as earlier versions wrote it
    (pinned digest), and a leader recorded that way is the same broker.
    """
    from celery import Celery

    from celery_redlock.integration.beat import beat_holder, default_beat_name, same_broker

    app = Celery("proj", broker="redis://127.0.0.1", set_as_current=False)
    try:
        holder, name = beat_holder(app), default_beat_name(app)
    finally:
        app.close()
    assert holder.endswith(" broker redis://127.0.0.1:6379/0"), holder
    assert name == "proj@6ee557b01b9c"  # sha256("redis://@127.0.0.1:6379/0")[:12]
    assert same_broker("redis://@127.0.0.1:6379/0", "redis://127.0.0.1:6379/0")
    assert not same_broker("redis://@127.0.0.1:6379/0", "redis://127.0.0.1:6379/1")
    lock = lock_on(redis_node, f"beat:{name}", task_name=holder)

    result = cli(redis_node.url, "ls", "--json")

    assert result.exit_code == 0, result.output
    (shown,) = json.loads(result.stdout)["locks"]
    assert shown["task_name"] == holder and "://@" not in result.stdout
    lock.release()


def test_ls_lists_the_parked_runs_soonest_first(redis_node, cli):
    """Runs parked until their turn: task id, task, what each waits for, its key, when
    a worker may publish it, how often one did; ``--task`` filters them; JSON too."""
    park_run(redis_node, "id-late", "proj.report", "busy", "redlock:{report:3}", 60_000)
    park_run(redis_node, "id-soon", "proj.call", "rate", "redlock:{api:acme}", 5_000)

    result = cli(redis_node.url, "ls")
    assert result.exit_code == 0, result.output
    table = rows(result.stdout)
    assert list(table) == ["id-soon", "id-late"], result.stdout  # soonest first
    assert table["id-soon"]["WAITS FOR"] == "its rate slot"
    assert table["id-late"]["WAITS FOR"] == "its key's release"
    assert (table["id-late"]["TASK"], table["id-late"]["KEY"]) == (
        "proj.report", "redlock:{report:3}"
    )  # fmt: skip
    assert table["id-late"]["TAKEN"] == "0"
    data = json.loads(cli(redis_node.url, "ls", "--json", "--task", "proj.call").stdout)
    (run,) = data["parked"]
    assert (run["task_id"], run["kind"], run["name"], run["taken"]) == (
        "id-soon", "rate", "api:acme", 0
    )  # fmt: skip
    assert 4 < run["due_in"] <= 5
