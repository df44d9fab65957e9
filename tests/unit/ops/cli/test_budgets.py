"""``celery redlock ls`` and ``inspect KEY`` show a key's rate budget and the runs waiting
on the queue for it, against a real server."""

from __future__ import annotations

import json

import pytest

from celery_redlock.engine.keys import lock_keys
from celery_redlock.integration.queued import note_queued
from celery_redlock.nodes import NodeSet
from tests.unit.ops.cli.helpers import backlog_on, park_run, rows

BUDGET_ITEM = {
    "key", "name", "rate", "limit", "window", "used", "next_free", "queued", "drain", "nodes",
    "waiting",
}  # fmt: skip


@pytest.fixture
def backlog(redis_node):
    """``api:acme`` at 2/m with both starts used and 3 runs refused (waiting on the
    queue); ``export:7``, a busy key with no budget, with 2 runs put back."""
    backlog_on(redis_node.url)
    nodeset = NodeSet([redis_node.url], timeout=1.0)
    for n in range(2):
        note_queued(nodeset, lock_keys("export:7"), f"busy-{n}", 30.0)
    nodeset.close()


def test_ls_shows_used_of_the_limit_the_next_free_slot_and_the_runs_queued(
    redis_node, cli, backlog
):
    """A BUDGET KEY table after the locks: 2/2 per 1m, next slot in about a minute,
    3 queued; a key with runs put back and no budget: queued only. Neither the budget
    nor the queue is taken for a lock."""
    result = cli(redis_node.url, "ls")

    assert result.exit_code == 0, result.output
    table = rows(result.stdout)
    assert list(table) == ["redlock:{api:acme}", "redlock:{export:7}"], "no lock rows"
    acme = table["redlock:{api:acme}"]
    assert (acme["USED"], acme["QUEUED"]) == ("2/2 per 1m", "3")
    # A minute and the window's guard (10 ms) at most: "59.9s" to "1m00s".
    free = acme["NEXT FREE"]
    assert free == "1m00s" or 55 < float(free.removesuffix("s")) <= 60, free
    assert table["redlock:{export:7}"] == {
        "BUDGET KEY": "redlock:{export:7}", "USED": "-", "NEXT FREE": "-", "QUEUED": "2",
    }  # fmt: skip

    data = json.loads(cli(redis_node.url, "ls", "--json").stdout)
    assert data["locks"] == [] and data["shares"] == [] and data["claims"] == []
    acme, export = data["budgets"]
    assert set(acme) == set(export) == BUDGET_ITEM
    assert (acme["key"], acme["name"], acme["rate"]) == ("redlock:{api:acme}", "api:acme", "2/m")
    assert (acme["limit"], acme["window"], acme["used"], acme["queued"]) == (2, 60.0, 2, 3)
    assert 55 < acme["next_free"] <= 60.01
    assert acme["drain"] == 90.0, "3 runs at 2 per minute"
    assert (export["key"], export["rate"], export["used"], export["queued"]) == (
        "redlock:{export:7}", None, None, 2,
    )  # fmt: skip
    assert export["next_free"] is None and export["drain"] is None


def test_ls_verbose_lists_the_waiting_runs_with_their_due_times_and_places(
    redis_node, cli, backlog
):
    """QUEUED was a bare count: ls --verbose lists each waiting run (task id, key, due
    in, place in line), and --json has them under each budget's "waiting": api:acme's
    three refused runs in the order of their places (two per minute: the third a window
    later), export:7's two put back for 30 s."""
    result = cli(redis_node.url, "ls", "--verbose")
    assert result.exit_code == 0, result.output
    table = rows(result.stdout.split("\n\n")[1])
    assert list(table) == ["run-0", "run-1", "run-2", "busy-0", "busy-1"]
    assert [r["PLACE"] for r in table.values()] == ["1", "2", "3", "1", "2"]
    assert {r["KEY"] for r in list(table.values())[:3]} == {"redlock:{api:acme}"}
    assert "QUEUED TASK ID" not in cli(redis_node.url, "ls").stdout, "only with --verbose"

    acme, export = json.loads(cli(redis_node.url, "ls", "--json").stdout)["budgets"]
    assert [(w["task_id"], w["place"]) for w in acme["waiting"]] == [
        ("run-0", 1), ("run-1", 2), ("run-2", 3),
    ]  # fmt: skip
    first, _, third = (w["due_in"] for w in acme["waiting"])
    assert 55 < first <= 60.2 and third == pytest.approx(first + 60, abs=1)
    assert [w["task_id"] for w in export["waiting"]] == ["busy-0", "busy-1"]
    assert all(25 < w["due_in"] <= 30 for w in export["waiting"])


def test_ls_task_keeps_the_budgets_of_the_keys_its_runs_use(redis_node, cli, backlog):
    """No task holds a budget: --task keeps those of the keys the task's runs hold,
    share or are parked for (a run of proj.call parked on api:acme), and no other."""
    park_run(redis_node, "p-1", "proj.call", "rate", "redlock:{api:acme}", 60_000)
    data = json.loads(cli(redis_node.url, "ls", "--json", "--task", "proj.*").stdout)
    assert [b["key"] for b in data["budgets"]] == ["redlock:{api:acme}"]
    assert [p["task_id"] for p in data["parked"]] == ["p-1"]
    other = json.loads(cli(redis_node.url, "ls", "--json", "--task", "other.*").stdout)
    assert other["budgets"] == [] and other["parked"] == []
    assert "No locks held." in cli(redis_node.url, "ls", "--task", "other.*").stdout


def test_inspect_shows_the_budget_of_a_key_and_its_queue(redis_node, cli, backlog):
    """inspect KEY: a budget line (used/limit per window, next free slot, queued), and
    the same under "budget" in the JSON; null for a key with neither."""
    text = cli(redis_node.url, "inspect", "api:acme")
    assert text.exit_code == 0, text.output
    (line,) = [x for x in text.stdout.splitlines() if x.startswith("budget ")]
    assert line.startswith("budget 2/2 per 1m, next free slot in ")
    assert line.endswith("s, queued 3")
    busy = cli(redis_node.url, "inspect", "redlock:{export:7}:queued").stdout
    assert "no rate budget recorded, queued 2" in busy

    data = json.loads(cli(redis_node.url, "inspect", "api:acme", "--json").stdout)
    budget = data["budget"]
    assert set(budget) == BUDGET_ITEM
    assert (budget["used"], budget["limit"], budget["queued"]) == (2, 2, 3)
    assert 55 < budget["next_free"] <= 60.01
    assert data["held"] is False
    none = json.loads(cli(redis_node.url, "inspect", "other", "--json").stdout)
    assert none["budget"] is None
    assert "budget" not in cli(redis_node.url, "inspect", "other").stdout
