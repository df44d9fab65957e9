"""``celery redlock inspect KEY``: every field of one lock on every node, against a real server."""

from __future__ import annotations

import json
import os

import pytest

from tests.harness.fences import assert_clock_fence, assert_counter_expires
from tests.unit.ops.cli.helpers import HOST, lock_on


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
