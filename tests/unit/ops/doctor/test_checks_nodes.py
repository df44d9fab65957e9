"""Each node's checks, as pure functions of crafted replies (``CONFIG GET``, ``INFO``,
``TIME``)."""

from __future__ import annotations

import pytest

from celery_redlock.ops.doctor.checks_nodes import (
    check_clock,
    check_config_access,
    check_eviction,
    check_latency,
    check_persistence,
    check_reachable,
    check_replication,
    check_uptime,
)
from celery_redlock.ops.doctor.facts import LeaseInUse, NodeFacts
from celery_redlock.ops.doctor.report import ERROR, OK, WARN, Finding
from tests.unit.ops.doctor.crafted import DURABLE, NODE

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


# -- replication, reachability -----------------------------------------------------


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


def test_a_refused_config_is_a_warning_naming_the_reply():
    refused = check_config_access(NodeFacts(NODE, config_error="ERR unknown command 'CONFIG'"))
    assert (refused.level, refused.code, refused.node) == (WARN, "config-unreadable", NODE)
    assert "(ERR unknown command 'CONFIG')" in refused.message
    assert "provider's settings" in refused.message
    assert check_config_access(NodeFacts(NODE)) is None
