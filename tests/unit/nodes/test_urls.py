"""Lock node URLs: host lists, masked passwords, and the node kind a URL makes."""

from __future__ import annotations

import subprocess
import sys

import pytest

from celery_redlock.nodes import Node, safe_url
from celery_redlock.nodes.cluster import ClusterNode
from celery_redlock.nodes.urls import make_node, parse_hosts


def test_host_lists_take_the_default_port_and_bracketed_ipv6():
    assert parse_hosts("a,b:7000,[::1]:7001,[::2]", 26379) == [
        ("a", 26379),
        ("b", 7000),
        ("::1", 7001),
        ("::2", 26379),
    ]


@pytest.mark.parametrize(
    ("hosts", "why"),
    [(":7000", "no sentinel host in ':7000'"), ("h:x", "bad port"), ("h:0", "bad port")],
)
def test_a_bad_host_list_names_the_item(hosts, why):
    with pytest.raises(ValueError, match=why):
        parse_hosts(f"ok:1,{hosts}", 6379, what="sentinel host")


@pytest.mark.parametrize(
    "url",
    [
        "redis://:s3cret@10.0.0.1:6379/0",
        "rediss://app:s3cret@10.0.0.1:6380/1",
        "redis+sentinel://:s3cret@10.0.0.1,10.0.0.2/mymaster/0?sentinel_password=s3cret",
        "redis+cluster://app:s3cret@10.0.0.1:7000,10.0.0.2:7000",
    ],
)
def test_safe_url_masks_the_password_of_every_url_form(url):
    masked = safe_url(url)
    assert "s3cret" not in masked and "**" in masked
    assert masked.split("://")[0] == url.split("://")[0]


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://127.0.0.1", "redis://127.0.0.1"),  # no credentials: no "@", no "/" added
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
        ("redis://app@10.0.0.1:6379/0", "redis://app@10.0.0.1:6379/0"),  # user only
        ("redis://:s3cret@10.0.0.1/2", "redis://:**@10.0.0.1/2"),  # password only
        ("redis://app:s3cret@10.0.0.1:6379/0", "redis://app:**@10.0.0.1:6379/0"),
        ("redis://:p%40ss@10.0.0.1/0", "redis://:**@10.0.0.1/0"),  # an encoded "@"
        (
            "rediss://app:s3cret@h:6380/1?ssl_cert_reqs=none",
            "rediss://app:**@h:6380/1?ssl_cert_reqs=none",
        ),
        ("redis://h/0?password=s3cret&db=1", "redis://h/0?password=**&db=1"),
        ("redis://[::1]:6379/0", "redis://[::1]:6379/0"),
        ("unix:///run/redis.sock?db=3", "unix:///run/redis.sock?db=3"),
        ("unix://:s3cret@/run/redis.sock?db=3", "unix://:**@/run/redis.sock?db=3"),
        ("unix://app:s3cret@/run/redis.sock", "unix://app:**@/run/redis.sock"),
        ("unix://app@/run/redis.sock", "unix://app@/run/redis.sock"),
    ],
)
def test_safe_url_changes_only_the_password(url, shown):
    """What a node is called in `ls`, logs and errors: the URL as written, less the secret."""
    assert safe_url(url) == shown
    assert Node(url, timeout=0.1).safe_url == shown


def test_a_url_no_kind_claims_is_made_by_the_callers_factory():
    made = []

    def factory(url, *, timeout):
        made.append((url, timeout))
        return made

    assert make_node("redis://127.0.0.1:1/0", timeout=0.5, default=factory) is made
    assert made == [("redis://127.0.0.1:1/0", 0.5)]
    cluster = make_node("redis+cluster://127.0.0.1:7000", timeout=0.5, default=factory)
    assert isinstance(cluster, ClusterNode) and len(made) == 1
    sentinel = make_node("redis+sentinel://127.0.0.1/mymaster", timeout=0.5, default=factory)
    assert isinstance(sentinel, Node) and len(made) == 1


@pytest.mark.parametrize(
    "first", ["celery_redlock.nodes.urls", "celery_redlock.nodes", "celery_redlock.nodes.calls"]
)
def test_a_cluster_url_makes_a_cluster_node_whatever_is_imported_first(first):
    """The cluster kind is registered by an import the package root makes, not by luck."""
    script = (
        f"import {first}\n"
        "from celery_redlock.nodes import NodeSet\n"
        "nodeset = NodeSet(['redis+cluster://127.0.0.1:7000'], timeout=0.5)\n"
        "print(type(nodeset.nodes[0]).__name__)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    assert result.stdout.strip() == "ClusterNode"
