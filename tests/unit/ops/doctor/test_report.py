"""The command's exit status from the findings, and the report's JSON form."""

from __future__ import annotations

from celery_redlock.ops.doctor.checks import evaluate
from celery_redlock.ops.doctor.facts import NodeFacts
from celery_redlock.ops.doctor.report import ERROR, OK, WARN, Finding, Report, exit_code
from tests.unit.ops.doctor.crafted import codes, healthy, settings


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


def test_report_as_dict_is_the_json_of_the_command():
    """Stable keys: ok, exit_code, counts per level, findings, nodes."""
    findings = [
        Finding(OK, "reachable", "answered", "redis://a/0"),
        Finding(WARN, "fail-open", "fail open"),
        Finding(ERROR, "node-unreachable", "could not be asked", "redis://b/0"),
    ]
    report = Report(findings, [NodeFacts("redis://a/0"), NodeFacts("redis://b/0", error="x")])
    data = report.as_dict()
    assert (data["ok"], data["exit_code"]) == (False, 69)
    assert data["counts"] == {OK: 1, WARN: 1, ERROR: 1}
    assert data["findings"][1] == {
        "level": WARN,
        "code": "fail-open",
        "node": None,
        "message": "fail open",
    }
    assert [n["node"] for n in data["nodes"]] == ["redis://a/0", "redis://b/0"]
    assert Report(findings[:2], []).as_dict()["ok"] is True
