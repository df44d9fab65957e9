"""What every sub-command shares: the app's settings, and a quorum before any verdict."""

from __future__ import annotations

import json

from tests.unit.ops.cli.helpers import lock_on


def test_custom_prefix_and_invalid_settings(redis_node, cli):
    """The app's key prefix is used; settings that do not validate exit 1 with the reason."""
    lock = lock_on(redis_node, "job", key_prefix="app1:")
    data = json.loads(cli(redis_node.url, "ls", "-j", conf={"redlock_key_prefix": "app1:"}).stdout)
    assert [item["key"] for item in data["locks"]] == ["app1:{job}"]
    bad = cli(redis_node.url, "ls", conf={"redlock_ttl": -1})
    assert bad.exit_code == 1
    assert "redlock_ttl must be > 0" in bad.output
    lock.release()


def test_no_command_reports_no_locks_when_the_node_is_down(redis_factory, cli):
    """A node that does not answer is never reported as "no locks" (text or JSON)."""
    (server,) = redis_factory(1)
    url = server.url
    server.kill()
    for args in (("ls",), ("ls", "--stale", "-t", "0.2")):
        text = cli(url, *args, "--node-timeout", "0.2")
        assert text.exit_code == 69
        assert "No locks" not in text.output and "No stale locks" not in text.output
        assert text.stdout == "", text.stdout
        data = json.loads(cli(url, *args, "--json", "--node-timeout", "0.2").stdout)
        assert data["locks"] is None and data["shares"] is None
        assert data["complete"] is False
    inspected = cli(url, "inspect", "x", "--node-timeout", "0.2")
    assert inspected.exit_code == 69
    assert "not held" not in inspected.output
    data = json.loads(cli(url, "inspect", "x", "--json", "--node-timeout", "0.2").stdout)
    assert data["held"] is None and data["quorum"] is None
    released = cli(url, "release", "x", "--yes", "--json", "--node-timeout", "0.2")
    assert released.exit_code == 69
    assert "only 0 of 1" in json.loads(released.stdout)["error"]
