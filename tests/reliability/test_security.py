"""Security properties under a full scenario: tokens, commands sent, key contents, ACL."""

from __future__ import annotations

from celery_redlock import Redlock
from tests.apps.locked import create_app
from tests.harness import close_app, lock_keys, wait_for
from tests.reliability import scenarios
from tests.reliability.workload import run_holders
from tests.unit.nodes.test_topologies import MINIMAL_ACL, acl_user

SAMPLES = 1000


def test_tokens_are_128_random_bits(redis_node):
    """1,000 acquisitions: 32 hex digits each, all different, about half the bits set."""
    lock = Redlock("tokens", nodes=[redis_node.url], ttl=5, auto_renew=False)
    client = redis_node.client()
    tokens = []
    for _ in range(SAMPLES):
        assert lock.acquire(blocking=False)
        tokens.append(client.hget("redlock:{tokens}", "token"))
        lock.release()
    assert all(len(t) == 32 and int(t, 16) >= 0 for t in tokens)
    assert len(set(tokens)) == SAMPLES
    ones = sum(bin(int(t, 16)).count("1") for t in tokens)
    # 128,000 fair bits: mean 64,000, standard deviation ~179; 8 sigma of slack.
    assert abs(ones - SAMPLES * 64) < 1500, ones


def test_no_keys_command_in_a_full_scenario(lab):
    """Contention on 3 nodes and a network fault round: KEYS never reaches a lock node."""
    scenarios.contention(lab, 3, processes=4, iterations=10)
    scenarios.network(lab, processes=2)
    servers = lab.lock_servers()
    assert len(servers) == 6
    for server in servers:
        stats = server.commandstats()
        assert "evalsha" in stats, "the scenario did reach this node"
        assert "keys" not in stats, (server, stats)


def test_argument_values_never_appear_in_keys(celery_redis, inprocess_worker_factory, tmp_path):
    """While a task with distinctive arguments holds its lock: no key contains them."""
    app = create_app(celery_redis.url)
    try:
        inprocess_worker_factory(app, pool="threads", concurrency=2)
        secret = "SECRET-account-4f1c9e"
        task = app.tasks["tests.apps.locked.hold"]
        result = task.delay(secret, str(tmp_path / "runs"), "label-7c2a", 1.0)
        other = app.tasks["tests.apps.locked.anything"].delay({"card": secret, "n": 4111})
        assert other.get(timeout=30) == "ran"
        wait_for(lambda: lock_keys(celery_redis), timeout=30, message="the held lock")
        client = celery_redis.client()
        keys = list(client.scan_iter("*"))  # db 0: locks only
        (held,) = lock_keys(celery_redis)
        fields = client.hgetall(held)
        result.get(timeout=30)
    finally:
        close_app(app)
    assert keys and not [k for k in keys if secret in k or "4111" in k or "label" in k], keys
    assert secret not in " ".join(fields.values()), fields


def test_an_acl_user_with_the_documented_commands_runs_a_full_scenario(lab):
    """Eight processes on 3 nodes, as a user allowed only the documented command set.

    tests/unit/nodes/test_topologies.py checks each operation one by one; this is the same user
    under contention, renewals and waiting for releases.
    """
    servers = lab.servers(3)
    urls = [acl_user(server, MINIMAL_ACL) for server in servers]
    outcome = run_holders("acl", lab, urls, 8, iterations=10, hold=0.01)
    assert outcome.violations == [], outcome.as_dict()
    assert outcome.acquisitions == 80
    for server in servers:
        assert "keys" not in server.commandstats()
