"""``celery redlock doctor``: each check as a pure function of crafted replies, then the
whole command against real servers."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import celery
import pytest
from celery.bin.celery import celery as celery_cli
from click.testing import CliRunner, Result

import tests.apps
from celery_redlock import ConfigurationError, LockedTask, Redlock
from celery_redlock.ops.doctor import (
    ERROR,
    OK,
    WARN,
    Finding,
    LeaseInUse,
    NodeFacts,
    TaskLocking,
    check_beat_leader,
    check_clock,
    check_eviction,
    check_independent,
    check_latency,
    check_node_count,
    check_persistence,
    check_reachable,
    check_replication,
    check_settings,
    check_uptime,
    diagnose,
    evaluate,
    exit_code,
    leases,
    parse_info,
    probe_nodes,
    task_locking,
)
from celery_redlock.settings import from_conf
from tests.apps.cli_app import CONF_ENV
from tests.harness import APP_URL_ENV, wait_for

APP_MODULE = "tests.apps.cli_app"
NODE = "redis://127.0.0.1:6379/0"
DURABLE = {"appendonly": "yes", "appendfsync": "always", "save": ""}


def settings(**conf: Any):
    """Validated settings from ``redlock_*`` keyword arguments (no prefix)."""
    return from_conf({f"redlock_{k}": v for k, v in conf.items()} | {"redlock_url": NODE})


def codes(findings: list[Finding], level: str | None = None) -> set[str]:
    return {f.code for f in findings if level is None or f.level == level}


# -- eviction ----------------------------------------------------------------------


def test_noeviction_is_ok():
    finding = check_eviction(NODE, {"maxmemory-policy": "noeviction", "maxmemory": "0"}, {})
    assert (finding.level, finding.code, finding.node) == (OK, "eviction", NODE)


@pytest.mark.parametrize("policy", ["allkeys-lru", "allkeys-lfu", "allkeys-random"])
def test_allkeys_policies_are_errors_naming_consequence_and_fix(policy):
    """allkeys-* can evict lock hashes and fence counters."""
    finding = check_eviction(NODE, {"maxmemory-policy": policy, "maxmemory": "104857600"}, {})
    assert (finding.level, finding.code) == (ERROR, "evicting-policy")
    assert policy in finding.message and "104857600 bytes" in finding.message
    assert "another worker takes it" in finding.message
    assert "fences go back" in finding.message
    assert "CONFIG SET maxmemory-policy noeviction" in finding.message


@pytest.mark.parametrize(
    "policy", ["volatile-lru", "volatile-lfu", "volatile-random", "volatile-ttl"]
)
def test_volatile_policies_are_errors_because_every_lock_has_a_ttl(policy):
    finding = check_eviction(NODE, {"maxmemory-policy": policy, "maxmemory": "1000000"}, {})
    assert (finding.level, finding.code) == (ERROR, "evicting-policy")
    assert "every lock key" in finding.message


def test_an_evicting_policy_without_maxmemory_is_still_an_error():
    """No limit yet means no eviction today, but setting one later turns it on."""
    finding = check_eviction(NODE, {"maxmemory-policy": "allkeys-lru", "maxmemory": "0"}, {})
    assert finding.level == ERROR
    assert "not set yet" in finding.message


def test_eviction_falls_back_to_info_when_config_is_refused():
    finding = check_eviction(NODE, {}, {"maxmemory_policy": "allkeys-lfu", "maxmemory": "0"})
    assert finding.level == ERROR
    assert check_eviction(NODE, {}, {"maxmemory_policy": "noeviction"}).level == OK
    unknown = check_eviction(NODE, {}, {})
    assert (unknown.level, unknown.code) == (WARN, "evicting-policy")
    assert check_eviction(NODE, {"maxmemory-policy": "something-new"}, {}).level == WARN


# -- persistence -------------------------------------------------------------------


def test_redlock_persistence_levels():
    """With 2+ nodes: off and RDB-only are errors, AOF without fsync always a warning."""

    def check(config: dict, info: dict | None = None) -> Finding:
        return check_persistence(NODE, config, info or {}, redlock=True)

    assert check(DURABLE).level == OK
    everysec = check({"appendonly": "yes", "appendfsync": "everysec"})
    assert (everysec.level, everysec.code) == (WARN, "appendfsync-not-always")
    assert "last second" in everysec.message and "appendfsync always" in everysec.message
    assert check({"appendonly": "yes", "appendfsync": "no"}).level == WARN
    off = check({"appendonly": "no", "save": ""})
    assert (off.level, off.code) == (ERROR, "persistence-off")
    assert "majority" in off.message and "delayed restart" in off.message
    rdb = check({"appendonly": "no", "save": "3600 1 300 100"})
    assert (rdb.level, rdb.code) == (ERROR, "persistence-rdb-only")
    assert "3600 1 300 100" in rdb.message
    from_info = check({}, {"aof_enabled": "1"})
    assert (from_info.level, from_info.code) == (WARN, "appendfsync-not-always")
    assert check({}, {"aof_enabled": "0"}).code == "persistence-off"
    assert check({}, {}).code == "persistence-unknown"


def test_single_node_persistence_off_is_a_warning_and_fsync_is_not_reported():
    off = check_persistence(NODE, {"appendonly": "no", "save": ""}, {}, redlock=False)
    assert (off.level, off.code) == (WARN, "persistence-off")
    assert "next renewal" in off.message
    everysec = {"appendonly": "yes", "appendfsync": "everysec"}
    assert check_persistence(NODE, everysec, {}, redlock=False).level == OK


# -- topology ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("count", "level", "code"),
    [
        (1, OK, "node-count"),
        (2, ERROR, "too-few-nodes"),
        (3, OK, "node-count"),
        (4, ERROR, "even-node-count"),
        (5, OK, "node-count"),
        (6, ERROR, "even-node-count"),
    ],
)
def test_node_count(count, level, code):
    finding = check_node_count(count)
    assert (finding.level, finding.code) == (level, code)


def test_even_node_count_message_suggests_odd_counts():
    message = check_node_count(4).message
    assert "a lock needs 3" in message and "(3 or 5)" in message


def test_replication_checks():
    replica = check_replication(
        NODE, {"role": "slave", "master_host": "10.0.0.1", "master_port": "6379"}, 0
    )
    assert (replica.level, replica.code) == (ERROR, "node-is-replica")
    assert "10.0.0.1:6379" in replica.message
    unwaited = check_replication(NODE, {"role": "master", "connected_slaves": "2"}, 0)
    assert (unwaited.level, unwaited.code) == (WARN, "replicas-without-wait")
    assert "redlock_min_replicas = 2" in unwaited.message
    unmet = check_replication(NODE, {"role": "master", "connected_slaves": "1"}, 2)
    assert (unmet.level, unmet.code) == (ERROR, "min-replicas-unmet")
    assert check_replication(NODE, {"role": "master", "connected_slaves": "2"}, 2).level == OK
    assert check_replication(NODE, {"role": "master", "connected_slaves": "0"}, 0).level == OK


def test_two_urls_of_one_server_are_not_independent():
    findings = check_independent({"redis://a/0": "r1", "redis://a/1": "r1", "redis://b/0": "r2"})
    (finding,) = findings
    assert (finding.level, finding.code) == (ERROR, "nodes-not-independent")
    assert "redis://a/0 and redis://a/1" in finding.message and "2 times" in finding.message
    ok = check_independent({"redis://a/0": "r1", "redis://b/0": "r2", "redis://c/0": "r3"})
    assert [f.level for f in ok] == [OK]


def test_unreachable_node_is_an_error():
    finding = check_reachable(NodeFacts(NODE, error="ConnectionError: refused"))
    assert (finding.level, finding.code) == (ERROR, "node-unreachable")
    assert check_reachable(NodeFacts(NODE)).level == OK


# -- restarts, clocks, latency -----------------------------------------------------


def test_uptime_below_the_longest_lease_warns_unless_writes_are_fsynced():
    longest = LeaseInUse("task proj.sync", 300.0)
    fresh = check_uptime(NODE, {"uptime_in_seconds": "42"}, {"appendonly": "no"}, longest)
    assert (fresh.level, fresh.code) == (WARN, "recent-restart")
    assert "42s" in fresh.message and "300s, task proj.sync" in fresh.message
    assert "delayed restart" in fresh.message
    assert check_uptime(NODE, {"uptime_in_seconds": "42"}, DURABLE, longest).level == OK
    assert check_uptime(NODE, {"uptime_in_seconds": "301"}, {}, longest).level == OK
    assert check_uptime(NODE, {}, {}, longest) is None


def test_clock_skew_beyond_the_drift_budget_warns():
    """Only the skew the round trip cannot explain counts, in either direction."""
    far = check_clock(NODE, 0.5, 0.001, 0.302, "redlock_ttl 30s x 0.01")
    assert (far.level, far.code) == (WARN, "clock-skew")
    assert "+0.500s" in far.message and "0.302s" in far.message and "NTP" in far.message
    assert check_clock(NODE, -0.5, 0.001, 0.302, "s").level == WARN
    assert check_clock(NODE, 0.2, 0.001, 0.302, "s").level == OK
    assert check_clock(NODE, 0.35, 0.1, 0.302, "s").level == OK, "within the round trip"
    assert check_clock(NODE, None, None, 0.302, "s") is None


def test_slow_node_warns_when_the_round_trip_eats_half_the_timeout():
    slow = check_latency(NODE, 0.2, 0.25)
    assert (slow.level, slow.code) == (WARN, "slow-node")
    assert "200 ms" in slow.message and "250 ms" in slow.message
    assert check_latency(NODE, 0.001, 0.25).level == OK
    assert check_latency(NODE, None, 0.25) is None


# -- settings ----------------------------------------------------------------------


def test_sound_settings_are_reported_ok():
    findings = check_settings(settings(), [TaskLocking("t", "task t", ttl=30, on_busy="skip")])
    assert [(f.level, f.code) for f in findings] == [(OK, "settings")]


def test_risky_settings_that_validate_are_warnings():
    findings = check_settings(settings(fail_open=True, drift_factor=0, renew_interval=20), [])
    assert codes(findings, WARN) == {"fail-open", "drift-factor-zero", "renew-slack"}
    slack = next(f for f in findings if f.code == "renew-slack")
    assert "renews every 20s for a 30s lease" in slack.message and "10.000s" in slack.message


def test_task_options_checks():
    tasks = [
        TaskLocking("a", "task a", ttl=30, renew_interval=25),
        TaskLocking("b", "task b", ttl=30, on_lost="ignore"),
        TaskLocking("c", "task c", ttl=30, on_busy="wait", wait_timeout=60, time_limit=60),
        TaskLocking("d", "task d", ttl=30, on_busy="wait", wait_timeout=60, soft_time_limit=30),
        TaskLocking("e", "task e", ttl=30, on_busy="wait", wait_timeout=10, time_limit=60),
        TaskLocking("f", "redlock_tasks['f*'] (task f)", error="lock_ttl must be > 0, got -1"),
    ]
    findings = check_settings(settings(), tasks, unmatched=["proj.typo_*"])
    by_code: dict[str, list[Finding]] = {}
    for finding in findings:
        by_code.setdefault(finding.code, []).append(finding)
    assert "task a renews every 25s" in by_code["renew-slack"][0].message
    assert "task b has on_lost='ignore'" in by_code["on-lost-ignore"][0].message
    waits = [f.message for f in by_code["wait-exceeds-limit"]]
    assert len(waits) == 2, "task e waits less than its limit"
    assert "task c waits up to 60s" in waits[0] and "time_limit is 60s" in waits[0]
    assert "soft_time_limit is 30s" in waits[1]
    (invalid,) = by_code["invalid-task-options"]
    assert invalid.level == ERROR and "redlock_tasks['f*']" in invalid.message
    assert "'proj.typo_*'" in by_code["unmatched-pattern"][0].message


def test_leases_include_beat_tasks_and_patterns():
    conf = settings(ttl=30, beat_ttl=10, tasks={"proj.slow_*": {"ttl": 600}})
    found = leases(conf, [TaskLocking("x", "task x", ttl=90), TaskLocking("y", "y", error="bad")])
    assert {(lease.source, lease.ttl) for lease in found} == {
        ("redlock_ttl", 30.0),
        ("redlock_beat_ttl", 10.0),
        ("redlock_tasks['proj.slow_*']", 600.0),
        ("task x", 90.0),
    }


def test_task_locking_reads_locked_tasks_and_configured_patterns_without_changing_them():
    """LockedTask options and redlock_tasks entries, resolved and validated as a worker
    would, with time limits; patterns that match nothing are reported."""
    app = celery.Celery("doctor-tasks", set_as_current=False)
    app.conf.update(
        redlock_url=NODE,
        task_soft_time_limit=45,
        redlock_tasks={
            "proj.plain_*": {"ttl": 120, "on_busy": "wait", "wait_timeout": 90},
            "proj.broken": {"ttl": 10, "renew_interval": 20},
            "proj.unknown_option": {"tll": 10},
            "proj.typo": {},
        },
    )

    @app.task(name="proj.locked", base=LockedTask, lock_ttl=60, lock_on_lost="ignore", shared=False)
    def locked():
        pass

    @app.task(name="proj.plain_one", time_limit=100, shared=False)
    def plain_one():
        pass

    @app.task(name="proj.broken", shared=False)
    def broken():
        pass

    @app.task(name="proj.unknown_option", shared=False)
    def unknown_option():
        pass

    @app.task(name="proj.free", shared=False)
    def free():
        pass

    conf = from_conf(app.conf)
    tasks, unmatched = task_locking(app, conf)
    by_name = {t.name: t for t in tasks}
    assert set(by_name) == {"proj.locked", "proj.plain_one", "proj.broken", "proj.unknown_option"}
    assert (by_name["proj.locked"].ttl, by_name["proj.locked"].on_lost) == (60, "ignore")
    plain = by_name["proj.plain_one"]
    assert (plain.ttl, plain.on_busy, plain.wait_timeout) == (120.0, "wait", 90)
    assert (plain.time_limit, plain.soft_time_limit) == (100, 45)
    assert "renew_interval must be shorter" in by_name["proj.broken"].error
    assert "'tll'" in by_name["proj.unknown_option"].error
    assert unmatched == ["proj.typo"]
    assert not isinstance(app.tasks["proj.plain_one"], LockedTask), "tasks are left as they are"
    findings = check_settings(conf, tasks, unmatched)
    assert codes(findings, ERROR) == {"invalid-task-options"}
    assert {"on-lost-ignore", "wait-exceeds-limit", "unmatched-pattern"} <= codes(findings, WARN)
    app.close()


@pytest.mark.parametrize(
    "entry",
    [
        {"on_busy": "bogus"},
        {"on_lost": "never"},
        {"retry_countdown": -1},
        {"mode": "sharde"},
        {"limit": 0},
        {"fair": True, "mode": "shared"},
        {"key": "{missing}"},
        {"args": ["missing"]},
    ],
)
def test_doctor_refuses_exactly_what_the_worker_refuses(entry):
    """A redlock_tasks entry the worker refuses at start is an invalid-task-options error
    in doctor, with the worker's own message: {"on_busy": "bogus"} used to pass as sound."""
    from celery_redlock import config_only
    from celery_redlock.task import lock_options

    app = celery.Celery("doctor-bogus", set_as_current=False)
    app.conf.update(redlock_url=NODE, redlock_tasks={"proj.t": entry})

    @app.task(name="proj.t", shared=False)
    def t(account_id):
        pass

    conf = from_conf(app.conf)
    tasks, _ = task_locking(app, conf)
    assert [task.name for task in tasks] == ["proj.t"]
    assert tasks[0].error is not None, "doctor passed options the worker refuses"
    assert codes(check_settings(conf, tasks), ERROR) == {"invalid-task-options"}
    with pytest.raises(ConfigurationError) as refused:
        config_only.apply(app, conf)
        lock_options(app.tasks["proj.t"])
    assert tasks[0].error == str(refused.value)
    app.close()


# -- everything --------------------------------------------------------------------


def healthy(node: str, run_id: str) -> NodeFacts:
    return NodeFacts(
        node,
        config={"maxmemory-policy": "noeviction", "maxmemory": "0", **DURABLE},
        info={
            "uptime_in_seconds": "86400",
            "role": "master",
            "connected_slaves": "0",
            "run_id": run_id,
        },
        clock_skew=0.001,
        clock_uncertainty=0.0005,
        rtt=0.001,
    )


def test_evaluate_a_healthy_redlock_setup_exits_zero():
    conf = settings(nodes=["redis://a/0", "redis://b/0", "redis://c/0"])
    facts = [healthy(f"redis://{n}/0", n) for n in "abc"]
    findings = evaluate(conf, facts)
    assert codes(findings, ERROR) == set() and codes(findings, WARN) == set()
    assert exit_code(findings) == 0
    assert findings[0].code == "node-count" and findings[0].node is None, "setup first"


def test_exit_codes():
    """1 for error findings, 69 (EX_UNAVAILABLE) when a node could not be asked."""
    conf = settings(nodes=["redis://a/0", "redis://b/0", "redis://c/0"])
    facts = [healthy("redis://a/0", "a"), healthy("redis://b/0", "b")]
    down = [*facts, NodeFacts("redis://c/0", error="TimeoutError: no reply")]
    assert exit_code(evaluate(conf, down)) == 69
    evicting = healthy("redis://c/0", "c")
    evicting.config["maxmemory-policy"] = "volatile-ttl"
    assert exit_code(evaluate(conf, [*facts, evicting])) == 1
    warned = healthy("redis://c/0", "c")
    warned.clock_skew = 5.0
    findings = evaluate(conf, [*facts, warned])
    assert codes(findings, WARN) == {"clock-skew"} and exit_code(findings) == 0


def test_config_refused_is_reported_and_info_is_used():
    facts = NodeFacts(
        NODE,
        config_error="ERR unknown command 'CONFIG'",
        info={"maxmemory_policy": "noeviction", "aof_enabled": "0", "uptime_in_seconds": "99999"},
    )
    findings = evaluate(settings(), [facts])
    assert "config-unreadable" in codes(findings, WARN)
    assert "eviction" in codes(findings, OK)
    assert "persistence-off" in codes(findings, WARN)


def test_parse_info():
    text = "# Server\r\nredis_version:7.0.15\r\nrun_id:abc\r\n\r\n# Replication\r\nrole:master\r\n"
    assert parse_info(text) == {"redis_version": "7.0.15", "run_id": "abc", "role": "master"}


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
def doctor_cli(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Result]]:
    """``doctor_cli(url, *args, conf=None)``: ``celery -A cli_app redlock doctor *args``."""
    apps = []

    def run(url: str, *args: str, conf: dict | None = None) -> Result:
        monkeypatch.setenv(APP_URL_ENV, url)
        monkeypatch.setenv(CONF_ENV, json.dumps(conf or {}))
        monkeypatch.delitem(sys.modules, APP_MODULE, raising=False)
        monkeypatch.delattr(tests.apps, "cli_app", raising=False)
        try:
            return CliRunner().invoke(
                celery_cli, ["-A", APP_MODULE, "redlock", "doctor", *args], catch_exceptions=False
            )
        finally:
            if APP_MODULE in sys.modules:
                apps.append(sys.modules[APP_MODULE].app)

    yield run
    for app in apps:
        app.close()


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


def test_probe_measures_clock_skew_against_this_host(redis_node):
    """TIME against a local clock 5 s fast: a skew of about -5 s, within the round trip."""
    (fast,) = probe_nodes([redis_node.url], timeout=1.0, clock=lambda: time.time() + 5)
    assert fast.error is None
    assert abs(fast.clock_skew + 5) < 0.05
    assert 0 < fast.clock_uncertainty < 0.05
    assert fast.config["maxmemory-policy"] == "noeviction"
    assert fast.info["role"] == "master" and int(fast.info["uptime_in_seconds"]) >= 0
    finding = check_clock(fast.node, fast.clock_skew, fast.clock_uncertainty, 0.302, "budget")
    assert finding.level == WARN


# -- the beat leader ---------------------------------------------------------------

OURS = "redis://@127.0.0.1:6379/1"


def test_beat_leader_check_names_a_beat_of_another_project():
    """Held by a beat with another broker: an error naming it; ours: ok; none: nothing."""
    key = "redlock:{beat:proj}"
    foreign = check_beat_leader(key, ["celery beat proj web-2:41 broker redis://@b:6379/1"], OURS)
    assert (foreign.level, foreign.code) == (ERROR, "beat-leader-foreign")
    assert "web-2:41" in foreign.message and "redis://@b:6379/1" in foreign.message
    ours = check_beat_leader(key, [f"celery beat proj web-1:7 broker {OURS}"], OURS)
    assert (ours.level, ours.code) == (OK, "beat-leader")
    old = check_beat_leader(key, ["celery beat web-1:7"], OURS)
    assert (old.level, old.code) == (WARN, "beat-leader-unknown")
    legacy = check_beat_leader(key, ["celery beat web-1:7"], OURS, legacy=True)
    assert (legacy.level, legacy.code) == (WARN, "beat-leader-legacy")
    assert check_beat_leader(key, [], OURS) is None


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
