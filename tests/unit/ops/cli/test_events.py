"""``celery redlock why TASK_ID`` and ``log KEY [--follow]`` read the event log, against a
real server (events written as a worker writes them: ``events.record``, then flushed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest

from celery_redlock.integration import events
from celery_redlock.integration.settings import Settings
from celery_redlock.nodes import NodeSet
from tests.harness import APP_URL_ENV, wait_for


@pytest.fixture
def log(redis_node):
    """``log(event, key, task_id, **fields)``: an event of task ``proj.sync`` written now."""
    nodeset = NodeSet([redis_node.url], timeout=1.0)
    settings = Settings(url=redis_node.url)

    def write(event, key, task_id, **fields):
        events.record(settings, nodeset, event, (f"redlock:{{{key}}}",), "proj.sync", task_id,
                      **fields)  # fmt: skip
        assert events.flush()

    yield write
    nodeset.close()


def test_why_tells_a_deferred_runs_story_in_order(redis_node, cli, log):
    log("deferred", "api:acme", "t-1", reason="rate", in_ms=400, parked=True)
    log("deferred", "api:acme", "t-1", reason="rate", in_ms=200, parked=True)
    log("acquired", "api:acme", "t-1", fence=7, waited_ms=0)
    log("released", "api:acme", "t-1", held_ms=1500)
    log("acquired", "api:acme", "t-2", fence=8, waited_ms=0)  # another task id

    result = cli(redis_node.url, "why", "t-1")

    assert result.exit_code == 0, result.output
    first, *lines = result.stdout.splitlines()
    assert first.startswith("t-1: deferred 2 time(s) (rate) on api:acme; started ")
    assert first.endswith(" ended " + first.rsplit(" ended ", 1)[1])
    assert len(lines) == 4 and "fence 8" not in result.stdout
    assert "rate budget (lock_rate) was used up; parked on a lock node, due in 0.400s" in lines[0]
    assert "released api:acme after 1.500s" in lines[3]
    data = json.loads(cli(redis_node.url, "why", "t-1", "--json").stdout)
    assert [e["e"] for e in data["events"]] == ["deferred", "deferred", "acquired", "released"]
    assert data["complete"] is True and data["summary"] == first


def test_why_of_an_unknown_task_id_says_why_nothing_is_kept(redis_node, cli):
    result = cli(redis_node.url, "why", "nobody")
    assert result.exit_code == 0
    assert "No event of nobody is kept" in result.stdout and "redlock_events_ttl" in result.stdout


def test_log_prints_a_keys_newest_events_oldest_first(redis_node, cli, log):
    for n in range(5):
        log("busy", "export:7", f"t-{n}", holder="h", then="skip")
    result = cli(redis_node.url, "log", "export:7", "--count", "3")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert [line.split()[1] for line in lines] == ["t-2", "t-3", "t-4"]
    assert all("found export:7 held by h: skipped" in line for line in lines)
    as_json = cli(redis_node.url, "log", "redlock:{export:7}", "--json").stdout.splitlines()
    assert [json.loads(line)["id"] for line in as_json] == [f"t-{n}" for n in range(5)]
    assert cli(redis_node.url, "log", "none:here").stdout.startswith("No event of")


def test_log_follow_prints_new_events_as_they_come(redis_node, log):
    """A real ``celery ... redlock log KEY --follow`` process: an event written after it
    started is printed within its polling interval, once."""
    log("acquired", "f:1", "t-old", fence=1, waited_ms=0)
    env = {**os.environ, APP_URL_ENV: redis_node.url}
    process = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "tests.apps.cli_app", "redlock", "log", "f:1",
         "--follow"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )  # fmt: skip
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(process.stdout), daemon=True)
    reader.start()
    try:
        wait_for(lambda: any("t-old" in line for line in lines), timeout=30)
        log("released", "f:1", "t-new", held_ms=5)
        wait_for(lambda: any("t-new" in line for line in lines), timeout=10)
    finally:
        process.terminate()
        process.wait(10)
        reader.join(5)
        process.stdout.close()
    assert sum("t-old" in line for line in lines) == 1, lines
    assert sum("t-new" in line for line in lines) == 1, lines
