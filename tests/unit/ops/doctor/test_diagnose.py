"""``diagnose`` and ``celery redlock doctor`` as a whole, against real servers."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import celery
import pytest
from click.testing import Result

from celery_redlock import Redlock
from celery_redlock.engine.keys import parked_keys
from celery_redlock.integration.parking import line_of
from celery_redlock.ops.doctor import ERROR, diagnose
from tests.apps.drift import ARGS_ENV, make_drift_app
from tests.harness import wait_for
from tests.unit.ops.cli.helpers import backlog_on, park_run


def test_invalid_settings_are_one_error_and_no_node_is_asked():
    app = celery.Celery("bad", set_as_current=False)
    app.conf.update(redlock_url="redis://127.0.0.1:1/0", redlock_ttl=-1)
    report = diagnose(app)
    assert [(f.level, f.code) for f in report.findings] == [(ERROR, "invalid-settings")]
    assert "redlock_ttl" in report.findings[0].message
    assert report.exit_code == 1 and report.facts == []
    app.close()


# -- against real servers ----------------------------------------------------------


@pytest.fixture
def doctor_cli(cli: Callable[..., Result]) -> Callable[..., Result]:
    """``doctor_cli(url, *args, conf=None)``: ``celery -A cli_app redlock doctor *args``."""
    return lambda url, *args, conf=None: cli(url, "doctor", *args, conf=conf)


def findings_of(result: Result) -> list[dict[str, Any]]:
    return json.loads(result.stdout)["findings"]


def test_doctor_fails_on_an_evicting_server(redis_factory, doctor_cli):
    """allkeys-lru: exit 1, the finding names the node, the policy and the fix."""
    (server,) = redis_factory(1, "--maxmemory-policy", "allkeys-lru")

    text = doctor_cli(server.url)
    assert text.exit_code == 1, text.output
    assert "evicting-policy" in text.stdout and "allkeys-lru" in text.stdout
    assert "(exit 1)" in text.stdout

    result = doctor_cli(server.url, "--json")
    assert result.exit_code == 1
    data = json.loads(result.stdout)
    assert (data["ok"], data["exit_code"]) == (False, 1)
    errors = [f for f in data["findings"] if f["level"] == "error"]
    assert [(f["code"], f["node"]) for f in errors] == [("evicting-policy", server.url)]
    (node,) = data["nodes"]
    assert node["config"]["maxmemory-policy"] == "allkeys-lru"
    assert set(data["findings"][0]) == {"level", "code", "node", "message"}


def test_doctor_passes_a_healthy_three_node_setup(redis_factory, doctor_cli):
    """3 independent masters, AOF with fsync always, noeviction: exit 0.

    The servers are seconds old, less than the leases, but every write is fsynced,
    so a restart forgets nothing: uptime is reported ok, not as a delayed-restart risk.
    """
    servers = redis_factory(3, "--appendonly", "yes", "--appendfsync", "always")
    urls = [s.url for s in servers]

    result = doctor_cli(urls[0], "--json", conf={"redlock_nodes": urls})

    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["ok"] and data["counts"]["error"] == 0
    per_node = {(f["node"], f["code"]): f["level"] for f in data["findings"]}
    for url in urls:
        for code in ("reachable", "eviction", "persistence", "replication", "uptime", "clock"):
            assert per_node[(url, code)] == "ok", (url, code)
    assert per_node[(None, "node-count")] == "ok"
    assert per_node[(None, "independence")] == "ok"
    # The test app has a task with on_lost='ignore': a warning, which does not fail.
    assert {f["code"] for f in data["findings"] if f["level"] == "warn"} == {"on-lost-ignore"}


def test_doctor_flags_restarts_persistence_unreachable_nodes_and_shared_servers(
    redis_factory, doctor_cli
):
    """Harness servers run without persistence: errors with Redlock, and a fresh start
    below the lease warns; a node listed twice (two dbs) and a dead node are found."""
    first, second, dead = redis_factory(3)
    # 4 nodes: an even count, one server listed twice (db 0 and db 1), one down.
    urls = [first.url, first.url.replace("/0", "/1"), second.url, dead.url]
    dead.kill()

    result = doctor_cli(
        first.url,
        "--json",
        "--node-timeout",
        "0.5",
        conf={
            "redlock_nodes": urls,
            "redlock_ttl": 600.0,
        },
    )

    assert result.exit_code == 69, result.output
    found = {(f["code"], f["node"]): f["level"] for f in findings_of(result)}
    assert found[("even-node-count", None)] == "error"
    assert found[("nodes-not-independent", None)] == "error"
    assert found[("node-unreachable", dead.url)] == "error"
    for url in urls[:3]:
        assert found[("persistence-off", url)] == "error"
        assert found[("recent-restart", url)] == "warn"


def test_doctor_sees_replicas_through_info(redis_factory, doctor_cli):
    """A master with a replica and redlock_min_replicas 0 warns; 2 wanted with 1 is an error;
    pointing at the replica is an error."""
    master, replica = redis_factory(2)
    with replica.client() as conn:
        conn.replicaof(master.host, master.port)
    with master.client() as conn:
        wait_for(lambda: conn.info("replication")["connected_slaves"] == 1, timeout=10)

    warned = doctor_cli(master.url, "--json")
    assert warned.exit_code == 0, warned.output
    assert ("replicas-without-wait", "warn") in {
        (f["code"], f["level"]) for f in findings_of(warned)
    }

    unmet = doctor_cli(master.url, "--json", conf={"redlock_min_replicas": 2})
    assert unmet.exit_code == 1
    assert "min-replicas-unmet" in {f["code"] for f in findings_of(unmet) if f["level"] == "error"}

    on_replica = doctor_cli(replica.url, "--json")
    assert on_replica.exit_code == 1
    assert "node-is-replica" in {f["code"] for f in findings_of(on_replica)}


def test_doctor_with_config_disabled_reads_the_policy_from_info(redis_factory, doctor_cli):
    """Managed services rename CONFIG: the doctor says so and still checks eviction."""
    (server,) = redis_factory(
        1, "--rename-command", "CONFIG", "", "--maxmemory-policy", "volatile-lru"
    )
    result = doctor_cli(server.url, "--json")
    assert result.exit_code == 1, result.output
    found = {f["code"]: f["level"] for f in findings_of(result)}
    assert found["config-unreadable"] == "warn"
    assert found["evicting-policy"] == "error"


# -- the beat leader ---------------------------------------------------------------


def test_doctor_reports_a_leader_lock_held_by_a_beat_of_another_project(redis_factory, doctor_cli):
    """Two projects set one redlock_beat_name: the one whose lock the other holds is
    told so (exit 1), and no lock means no beat finding at all."""
    (server,) = redis_factory(1)
    conf = {"redlock_beat_name": "shared"}
    quiet = findings_of(doctor_cli(server.url, "--json", conf=conf))
    assert not [f for f in quiet if f["code"].startswith("beat-leader")]

    other = "celery beat proj web-2:41 broker redis://@elsewhere:6379/1"
    lock = Redlock("beat:shared", nodes=[server.url], ttl=30, auto_renew=False, task_name=other)
    assert lock.acquire(blocking=False)

    result = doctor_cli(server.url, "--json", conf=conf)

    assert result.exit_code == 1, result.output
    (finding,) = [f for f in findings_of(result) if f["code"].startswith("beat-leader")]
    assert (finding["level"], finding["code"]) == ("error", "beat-leader-foreign")
    assert "redlock:{beat:shared}" in finding["message"] and "web-2:41" in finding["message"]
    lock.release()


# -- budgets -----------------------------------------------------------------------


def test_doctor_warns_when_a_budgets_backlog_outlasts_a_unique_claim(redis_factory, doctor_cli):
    """3 runs queued for 2 starts a minute take 90 s to start: past the 30 s send-time
    claim of a task with both lock_rate and lock_unique (a warning: exit 0); without
    such a task there is no claim at stake and no finding."""
    (server,) = redis_factory(1)
    backlog_on(server.url)
    entry = {"key": "api:acme", "rate": "2/m", "unique": "until_started", "unique_ttl": 30}
    claims = {"redlock_tasks": {"*.hold": entry}}

    result = doctor_cli(server.url, "--json", conf=claims)

    assert result.exit_code == 0, result.output
    (finding,) = [f for f in findings_of(result) if f["code"] == "budget-backlog"]
    assert finding["level"] == "warn"
    assert "redlock:{api:acme}: 3 run(s)" in finding["message"]
    assert "They take 90s to start" in finding["message"]
    assert "lock_unique_ttl of task tests.apps.locked.hold (30s)" in finding["message"]
    text = doctor_cli(server.url, conf=claims)
    assert "budget-backlog" in text.stdout
    default = findings_of(doctor_cli(server.url, "--json"))
    assert "budget-backlog" not in {f["code"] for f in default}


# -- parked runs -------------------------------------------------------------------


def test_doctor_warns_of_parked_runs_no_worker_took(redis_factory, doctor_cli):
    """A run parked a minute past its due time (no worker's publisher takes it) is a
    warning naming it; one due a moment ago, or not yet, is a publisher's next tick."""
    (server,) = redis_factory(1)
    park_run(server, "id-stuck", "proj.report", "busy", "redlock:{report:3}", 0)
    park_run(server, "id-fine", "proj.call", "rate", "redlock:{api:acme}", 5_000)
    quiet = findings_of(doctor_cli(server.url, "--json"))
    assert "parked-overdue" not in {f["code"] for f in quiet}

    client = server.client()
    now_ms = int(client.time()[0]) * 1000
    line = line_of("redlock:{report:3}")[1]
    client.zadd(line, {"id-stuck": now_ms - 60_000})  # in its key's line, not looked at since
    client.zadd(parked_keys().lines, {line: now_ms - 60_000})

    result = doctor_cli(server.url, "--json")

    assert result.exit_code == 0, result.output
    (finding,) = [f for f in findings_of(result) if f["code"] == "parked-overdue"]
    assert finding["level"] == "warn"
    assert finding["message"].startswith("1 run(s) parked on the lock nodes are overdue by up to 6")
    assert "proj.report[id-stuck]" in finding["message"]


def test_doctor_finds_workers_that_disagree_on_a_tasks_lock(celery_redis, worker_process_factory):
    """Two workers of one project, one started with ``redlock_tasks`` locking
    drift.charge by ``account``, the other by ``account`` and ``amount``: they lock
    different keys for one call. doctor asks the workers (``inspect``) and reports
    ``settings-drift`` naming the task, the option and each worker's value; with both
    alike it reports none."""
    first = worker_process_factory("tests.apps.drift", env={ARGS_ENV: '["account"]'})
    second = worker_process_factory("tests.apps.drift", env={ARGS_ENV: '["account", "amount"]'})
    app = make_drift_app(celery_redis.url, ["account"])

    def drift_found():
        # Under load a worker can miss one inspect's 2 s: ask again, until both answered.
        return [f for f in diagnose(app, timeout=2.0).findings if f.code == "settings-drift"]

    try:
        (drift,) = wait_for(drift_found, timeout=30, interval=0.5)
    finally:
        app.close()
    assert drift.level == ERROR
    assert "drift.charge" in drift.message and "args:" in drift.message
    assert f"{first.nodename} ['account']" in drift.message
    assert f"{second.nodename} ['account', 'amount']" in drift.message

    second.stop()
    worker_process_factory("tests.apps.drift", env={ARGS_ENV: '["account"]'})
    app = make_drift_app(celery_redis.url, ["account"])
    try:
        report = diagnose(app, timeout=2.0)
    finally:
        app.close()
    assert [f for f in report.findings if f.code == "settings-drift"] == []
