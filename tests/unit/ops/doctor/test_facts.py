"""Parsing the nodes' raw replies into facts."""

from __future__ import annotations

from redis.exceptions import ResponseError

from celery_redlock.nodes import Node, Reply
from celery_redlock.ops.doctor.facts import (
    CONFIG_PARAMETERS,
    NodeFacts,
    node_facts,
    parse_info,
    time_skew,
)
from tests.unit.ops.doctor.crafted import NODE


def test_parse_info():
    text = "# Server\r\nredis_version:7.0.15\r\nrun_id:abc\r\n\r\n# Replication\r\nrole:master\r\n"
    assert parse_info(text) == {"redis_version": "7.0.15", "run_id": "abc", "role": "master"}


def test_node_facts_read_config_pairs_and_info_sections():
    """One CONFIG GET reply per parameter (flat name/value pairs), then one INFO text
    per section; a refused INFO section adds nothing."""
    config = [[name, f"v-{name}"] for name in CONFIG_PARAMETERS]
    info = ["# Server\r\nrun_id:abc\r\n", ResponseError("ERR no such section"), "role:master\r\n"]
    facts = node_facts(Reply(Node(NODE, timeout=1.0), [*config, *info]))
    assert facts.node == NODE and facts.error is None and facts.config_error is None
    assert facts.config == {name: f"v-{name}" for name in CONFIG_PARAMETERS}
    assert facts.info == {"run_id": "abc", "role": "master"}


def test_node_facts_of_a_refused_config_or_a_silent_node():
    refused = ResponseError("ERR unknown command 'CONFIG'")
    replies = [refused] * len(CONFIG_PARAMETERS) + ["maxmemory_policy:noeviction\r\n"]
    facts = node_facts(Reply(Node(NODE, timeout=1.0), replies))
    assert facts.config == {} and facts.config_error == "ERR unknown command 'CONFIG'"
    assert facts.info == {"maxmemory_policy": "noeviction"}
    silent = node_facts(Reply(Node(NODE, timeout=1.0), error=TimeoutError("no reply")))
    assert silent == NodeFacts(NODE, error="TimeoutError: no reply")


def test_time_skew_is_measured_at_the_midpoint_of_the_round_trip():
    """TIME says seconds and microseconds; this host's clock read before and after."""
    node = Node(NODE, timeout=1.0)
    skew = time_skew(Reply(node, [["1005", "250000"]]), sent=1000.0, received=1000.5)
    assert skew == 5.0
    assert time_skew(None, 0.0, 1.0) is None
    assert time_skew(Reply(node, error=TimeoutError()), 0.0, 1.0) is None
    assert time_skew(Reply(node, [ResponseError("ERR")]), 0.0, 1.0) is None


def test_node_facts_as_dict_shows_the_facts_the_checks_used():
    facts = NodeFacts(
        NODE,
        info={"run_id": "abc", "role": "master", "tcp_port": "6379"},
        clock_skew=0.123456789,
        rtt=0.001,
    )
    shown = facts.as_dict()
    assert shown["info"] == {"run_id": "abc", "role": "master"}, "only the fields checked"
    assert (shown["clock_skew"], shown["clock_uncertainty"], shown["rtt"]) == (0.1235, None, 0.001)
