"""The settings and task option checks, as pure functions of crafted settings and
resolved task options."""

from __future__ import annotations

from celery_redlock.ops.doctor.checks_settings import check_settings, invalid_settings, leases
from celery_redlock.ops.doctor.facts import TaskLocking
from celery_redlock.ops.doctor.report import ERROR, OK, WARN, Finding
from tests.unit.ops.doctor.crafted import codes, settings


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


def test_invalid_settings_are_one_error_saying_nothing_else_was_checked():
    finding = invalid_settings("redlock_ttl must be > 0, got -1")
    assert (finding.level, finding.code, finding.node) == (ERROR, "invalid-settings", None)
    assert finding.message == (
        "redlock_ttl must be > 0, got -1. Workers with this configuration refuse to start; "
        "nothing else was checked."
    )
