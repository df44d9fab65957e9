"""What ``doctor`` collects: the tasks' lock options as a worker resolves them, and the
nodes' facts from a real server."""

from __future__ import annotations

import time

import celery
import pytest

from celery_redlock import ConfigurationError, LockedTask
from celery_redlock.engine.keys import lock_keys
from celery_redlock.integration.queued import note_queued
from celery_redlock.integration.settings import from_conf
from celery_redlock.nodes import NodeSet
from celery_redlock.ops.doctor.checks import check_permanent_keys
from celery_redlock.ops.doctor.checks_nodes import check_clock
from celery_redlock.ops.doctor.checks_settings import check_settings
from celery_redlock.ops.doctor.collect import (
    backlogs,
    probe_nodes,
    task_locking,
)
from celery_redlock.ops.doctor.facts import Backlog
from celery_redlock.ops.doctor.report import ERROR, WARN
from tests.unit.ops.cli.helpers import backlog_on
from tests.unit.ops.doctor.crafted import NODE, codes

# -- tasks -------------------------------------------------------------------------


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
    # Finalized first: an app locks its redlock_tasks as it finalizes (in any process
    # that imported celery_redlock); tasks made afterwards stay as they are, so this
    # shows that doctor itself changes nothing.
    app.finalize()

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
    from celery_redlock.integration import config_only
    from celery_redlock.integration.task import lock_options

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


# -- nodes -------------------------------------------------------------------------


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


def test_doctor_finds_the_keys_of_the_prefix_that_never_expire(redis_node):
    """A fence counter left by an earlier version has no TTL: doctor counts such keys
    of the prefix (and only of the prefix) and warns, naming some; expiring keys pass."""
    client = redis_node.client()
    client.set("redlock:{old:1}:fence", 7)
    client.set("redlock:{old:2}:fence", 9)
    client.set("redlock:{new}:fence", 1, px=60_000)
    client.set("someone-else:{x}", 1)
    (facts,) = probe_nodes([redis_node.url], timeout=2.0, prefix="redlock:")
    assert facts.permanent_count == 2 and facts.keys_complete
    assert sorted(facts.permanent_keys) == ["redlock:{old:1}:fence", "redlock:{old:2}:fence"]
    finding = check_permanent_keys(facts, "redlock:")
    assert finding is not None and finding.level == WARN and "2 key(s)" in finding.message
    client.delete("redlock:{old:1}:fence", "redlock:{old:2}:fence")
    (facts,) = probe_nodes([redis_node.url], timeout=2.0, prefix="redlock:")
    assert facts.permanent_count == 0 and check_permanent_keys(facts, "redlock:") is None


# -- budgets -----------------------------------------------------------------------


def test_doctor_collects_rated_unique_tasks_and_the_backlogs_of_budgets(redis_node):
    """The tasks' lock_rate and lock_unique (with the claim's ttl) are read; a key with
    a budget and runs queued is a backlog (N and window from the node), a key with runs
    queued and no budget is not (its drain cannot be told)."""
    app = celery.Celery("doctor-rated", set_as_current=False)
    app.conf.update(redlock_url=redis_node.url, redlock_unique_ttl=900)

    @app.task(
        name="proj.rated",
        base=LockedTask,
        lock_rate="2/m",
        lock_unique="until_started",
        shared=False,
    )
    def rated():
        pass

    conf = from_conf(app.conf)
    (task,), _ = task_locking(app, conf)
    assert (task.rate, task.unique, task.unique_ttl) == ("2/m", "until_started", 900)

    backlog_on(redis_node.url)
    nodeset = NodeSet([redis_node.url], timeout=1.0)
    note_queued(nodeset, lock_keys("export:7"), "busy-1", 30.0)
    nodeset.close()
    assert backlogs(conf, timeout=1.0) == [Backlog("redlock:{api:acme}", 3, 2, 60.0)]
    app.close()
