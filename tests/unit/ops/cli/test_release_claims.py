"""``celery redlock release KEY``: the send-time claims of KEY's name (``lock_unique``) are
shown, kept without --force, and cleared with it (issue 25 item 10), against a real server."""

from __future__ import annotations

import json

from celery_redlock.engine.keys import claim_key, lock_keys
from celery_redlock.integration.claims import claim
from celery_redlock.nodes import NodeSet
from tests.unit.ops.cli.helpers import lock_on

LOCK = "redlock:{report:mon}"


def claims_of(server, lock=LOCK):
    """The claim keys of ``lock`` on ``server`` and their holders."""
    client = server.client(db=0)
    return {k: client.hget(k, "task_id") for k in client.scan_iter(lock + ":claim:*")}


def test_release_force_clears_the_stale_claims_of_every_task_on_the_name(redis_node, cli):
    """After a purge a claim holds its name for lock_unique_ttl: without --force the
    command says so and how to clear it (exit 1); with --force each task's claim of that
    name is cleared, another name's is left alone."""
    nodeset = NodeSet([redis_node.url], timeout=0.5)
    keys = lock_keys("report:mon")
    claim(nodeset, keys, "copy-1", 600, task_name="proj.report")
    claim(nodeset, keys, "copy-2", 600, task_name="proj.close")
    claim(nodeset, lock_keys("report:tue"), "copy-3", 600, task_name="proj.report")
    nodeset.close()
    report, close = claim_key(keys, "proj.report"), claim_key(keys, "proj.close")
    assert claims_of(redis_node) == {report: "copy-1", close: "copy-2"}

    kept = cli(redis_node.url, "release", "report:mon", "--yes")

    assert kept.exit_code == 1, kept.output
    assert f"{report}: send-time claim of task proj.report [copy-1]" in kept.stdout
    assert f"refused {close}: a send-time claim of task proj.close" in kept.stderr
    assert "use --force to clear the claim" in kept.stderr
    assert "nothing to release" not in kept.output
    as_json = cli(redis_node.url, "release", "report:mon", "--yes", "--json")
    assert as_json.exit_code == 1, as_json.output
    data = json.loads(as_json.stdout)
    assert (data["released"], data["cleared"]) == ([], [])
    refused = {item["key"]: item for item in data["refused"]}
    assert set(refused) == {report, close}
    assert refused[report]["task_id"] == "copy-1" and refused[report]["state"] == "claimed"
    assert "--force" in refused[report]["reason"]
    assert len(claims_of(redis_node)) == 2, "kept without --force"

    forced = cli(redis_node.url, "release", "report:mon", "--force", "--json", input="y\n")

    assert forced.exit_code == 0, forced.output
    assert f"Clear 2 send-time claim(s) of {LOCK}?" in forced.stderr
    data = json.loads(forced.stdout)
    assert (data["released"], data["refused"], data["error"]) == ([], [], None)
    cleared = {item["key"]: item for item in data["cleared"]}
    assert set(cleared) == {report, close}
    item = cleared[close]
    assert (item["lock"], item["task_id"], item["task_name"]) == (LOCK, "copy-2", "proj.close")
    assert item["cleared_on"] == 1
    assert item["nodes"] == [{"node": redis_node.url, "result": "cleared", "error": None}]
    assert claims_of(redis_node) == {}
    assert list(claims_of(redis_node, "redlock:{report:tue}").values()) == ["copy-3"]


def test_release_force_releases_the_lock_and_clears_its_claim_in_one_go(redis_node, cli):
    """A lock and a claim of its name (KEY given as the claim's own key): --force releases
    the lock and clears the claim, and says both in the text form."""
    nodeset = NodeSet([redis_node.url], timeout=0.5)
    claim(nodeset, lock_keys("report:mon"), "copy-1", 600, task_name="proj.report")
    nodeset.close()
    lock = lock_on(redis_node, "report:mon")
    (key,) = claims_of(redis_node)

    done = cli(redis_node.url, "release", key, "--force", "--yes")

    assert done.exit_code == 0, done.output
    assert f"released {LOCK} (fence {lock.fence}) on 1 node(s)" in done.stdout
    assert f"cleared claim {key} (task proj.report [copy-1]) on 1 node(s)" in done.stdout
    assert not lock.locked()
    assert claims_of(redis_node) == {}
    again = cli(redis_node.url, "release", "report:mon", "--force", "--yes", "--json")
    assert again.exit_code == 0, again.output
    assert "nothing to release" in again.stderr
