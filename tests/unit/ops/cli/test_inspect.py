"""``celery redlock inspect KEY``: every field of one lock on every node, against a real server."""

from __future__ import annotations

import json
import os
import uuid

import pytest

from celery_redlock.engine.keys import lock_keys
from celery_redlock.integration.claims import claim, unclaim
from celery_redlock.nodes import NodeSet
from tests.harness.fences import assert_clock_fence, assert_counter_expires
from tests.unit.ops.cli.helpers import HOST, lock_on, park_run


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
    fence = lock.fence
    assert_clock_fence(fence, redis_node.client())  # a fresh key: from the node's clock
    assert node["fence_counter"] == fence
    assert node["fields"] == {
        "token": token,
        "attempt": "1",
        "fence": str(fence),
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
    for expected in (f"fence counter  {fence}", f"token          {token}", "task_id        task-1"):
        assert expected in text.stdout
    lock.release()

    free = cli(redis_node.url, "inspect", "proj:sync:1", "--json")
    data = json.loads(free.stdout)
    assert free.exit_code == 0
    assert (data["held"], data["holder"], data["nodes"][0]["pttl"]) == (False, None, -2)
    assert data["nodes"][0]["fence_counter"] == fence, "the fence counter outlives the lock"
    assert_counter_expires(redis_node.client(), "redlock:{proj:sync:1}:fence", 30_000)


@pytest.mark.parametrize("command", ["inspect", "release"])
@pytest.mark.parametrize("key", ["", "x" * 600])
def test_a_key_that_names_no_lock_is_a_usage_error_not_a_traceback(redis_node, cli, command, key):
    """`inspect ""` (or a name over the length limit) exits 2 naming KEY and why."""
    result = cli(redis_node.url, command, key, "--yes" if command == "release" else "--json")

    assert result.exit_code == 2, result.output
    assert "Invalid value for 'KEY'" in result.output
    assert ("non-empty" if not key else "the limit is") in result.output
    assert "Traceback" not in result.output


def test_inspect_a_task_id_tells_where_that_task_stands(redis_node, cli):
    """inspect TASK_ID: the lock it holds, the name its queued copy claims, its parked
    run (each in words and in JSON); a task id that none of these names is read as a
    lock name, as before."""
    holding, queued, waiting = (str(uuid.uuid4()) for _ in range(3))
    lock = lock_on(redis_node, "proj:sync:2", task_id=holding, task_name="proj.tasks.sync")
    nodeset = NodeSet([redis_node.url], timeout=0.5)
    claim(nodeset, lock_keys("report:mon"), queued, 600, task_name="proj.report")
    park_run(redis_node, waiting, "proj.call", "rate", "redlock:{api:acme}", 5_000)

    held = cli(redis_node.url, "inspect", holding)
    assert held.exit_code == 0, held.output
    assert f"task id {holding}" in held.stdout
    assert "holds redlock:{proj:sync:2} (proj.tasks.sync), fence " in held.stdout
    claimed = cli(redis_node.url, "inspect", queued).stdout
    assert "claims redlock:{report:mon}: its queued copy keeps the name" in claimed
    parked = cli(redis_node.url, "inspect", waiting).stdout
    assert "waits for its rate slot of redlock:{api:acme}, due in " in parked

    data = json.loads(cli(redis_node.url, "inspect", waiting, "--json").stdout)
    assert set(data) == {"task_id", "holds", "claims", "parked", "errors"}
    (run,) = data["parked"]
    assert (data["holds"], data["claims"], run["key"]) == ([], [], "redlock:{api:acme}")

    unknown = cli(redis_node.url, "inspect", str(uuid.uuid4()), "--json")
    assert json.loads(unknown.stdout)["held"] is False  # a lock name, not held
    lock.release()
    unclaim(nodeset, lock_keys("report:mon"), queued, "proj.report")
    nodeset.close()
