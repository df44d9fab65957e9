"""The setup's checks (node count, independence, beat leader) and ``evaluate`` over
crafted facts."""

from __future__ import annotations

import pytest

from celery_redlock.ops.doctor.checks import (
    check_backlog,
    check_beat_leader,
    check_beat_leaders,
    check_independent,
    check_node_count,
    evaluate,
    unique_claim_limit,
)
from celery_redlock.ops.doctor.facts import (
    Backlog,
    BeatLeaderFacts,
    LeaderLock,
    LeaseInUse,
    NodeFacts,
    TaskLocking,
)
from celery_redlock.ops.doctor.report import ERROR, OK, WARN, exit_code
from tests.unit.ops.doctor.crafted import NODE, codes, healthy, settings

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


def test_two_urls_of_one_server_are_not_independent():
    findings = check_independent({"redis://a/0": "r1", "redis://a/1": "r1", "redis://b/0": "r2"})
    (finding,) = findings
    assert (finding.level, finding.code) == (ERROR, "nodes-not-independent")
    assert "redis://a/0 and redis://a/1" in finding.message and "2 times" in finding.message
    ok = check_independent({"redis://a/0": "r1", "redis://b/0": "r2", "redis://c/0": "r3"})
    assert [f.level for f in ok] == [OK]


# -- everything --------------------------------------------------------------------


def test_evaluate_a_healthy_redlock_setup_exits_zero():
    conf = settings(nodes=["redis://a/0", "redis://b/0", "redis://c/0"])
    facts = [healthy(f"redis://{n}/0", n) for n in "abc"]
    findings = evaluate(conf, facts)
    assert codes(findings, ERROR) == set() and codes(findings, WARN) == set()
    assert exit_code(findings) == 0
    assert findings[0].code == "node-count" and findings[0].node is None, "setup first"


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


def test_beat_leader_facts_are_checked_last_and_an_unread_broker_warns():
    """evaluate ends with the beat leader's findings: one per held name; a broker URL
    that cannot be read means the lock was not looked up, a warning."""
    beat = BeatLeaderFacts(
        OURS,
        (
            LeaderLock("redlock:{beat:proj}", (f"celery beat proj web-1:7 broker {OURS}",)),
            LeaderLock("redlock:{beat:celery}", (), legacy=True),
        ),
    )
    findings = evaluate(settings(), [healthy(NODE, "a")], beat=beat)
    assert (findings[-1].level, findings[-1].code) == (OK, "beat-leader")
    assert [f.code for f in check_beat_leaders(beat)] == ["beat-leader"], "nobody holds legacy"
    (unread,) = check_beat_leaders(BeatLeaderFacts(error="cannot read the broker URL"))
    assert (unread.level, unread.code) == (WARN, "beat-leader-unknown")
    assert unread.message == "beat leader lock not checked: cannot read the broker URL"


# -- backlogs of rate budgets --------------------------------------------------------


def test_a_backlog_that_outlasts_a_claim_warns_naming_it():
    """300 runs at 5 per minute take 3600 s to start: past a 600 s claim (a duplicate
    can be sent). The warning names the key, the backlog, the time measured, the limit
    and the fix; 10 runs at 5 a minute fit."""
    claims = LeaseInUse("lock_unique_ttl of task proj.sync", 600.0)
    slow = Backlog("redlock:{api:acme}", queued=300, limit=5, window=60.0)

    finding = check_backlog(slow, claims)

    assert finding is not None and (finding.level, finding.code) == (WARN, "budget-backlog")
    message = finding.message
    for part in (
        "redlock:{api:acme}: 300 run(s) wait on the queue for a budget of 5 per 60s",
        "They take 3600s to start",
        "lock_unique_ttl of task proj.sync (600s)",
        "a duplicate of a queued copy can be sent",
        "raise lock_unique_ttl above the drain time",
    ):
        assert part in message, part
    fast = Backlog("redlock:{api:acme}", queued=10, limit=5, window=60.0)
    assert check_backlog(fast, claims) is None
    assert check_backlog(slow, None) is None


def test_the_claim_at_stake_is_the_shortest_of_a_rated_unique_task():
    """Only a task with both lock_rate and lock_unique waits on the queue with a claim."""
    tasks = [
        TaskLocking("proj.a", "task proj.a", rate="5/s", unique="until_started", unique_ttl=900),
        TaskLocking("proj.b", "task proj.b", rate="5/s", unique="until_finished", unique_ttl=300),
        TaskLocking("proj.c", "task proj.c", unique="until_started", unique_ttl=10),
        TaskLocking("proj.d", "task proj.d", rate="5/s", unique_ttl=5),
    ]
    assert unique_claim_limit(tasks) == LeaseInUse("lock_unique_ttl of task proj.b", 300)
    assert unique_claim_limit(tasks[2:]) is None


def test_evaluate_reports_each_slow_backlog_after_the_rest():
    tasks = [
        TaskLocking("proj.a", "task proj.a", rate="1/s", unique="until_started", unique_ttl=60)
    ]
    backlogs = [
        Backlog("redlock:{a}", queued=100, limit=1, window=1.0),
        Backlog("redlock:{b}", queued=10, limit=1, window=1.0),
    ]
    findings = evaluate(settings(), [healthy(NODE, "r1")], tasks, backlogs=backlogs)
    assert findings[-1].code == "budget-backlog" and "redlock:{a}" in findings[-1].message
    assert [f.code for f in findings].count("budget-backlog") == 1
    assert exit_code(findings) == 0, "a warning"
