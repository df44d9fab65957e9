"""Deployment variants against real servers: an ACL user with the minimal commands, TLS."""

from __future__ import annotations

import shutil
import subprocess
import threading

import pytest
import redis

from celery_redlock import NodeUnavailable, Redlock
from celery_redlock.engine.keys import lock_keys, release_keys
from celery_redlock.engine.scripts import ACQUIRE_WAKE, RELEASE_WAKE
from celery_redlock.integration import events
from celery_redlock.integration.settings import Settings
from celery_redlock.nodes import NodeSet
from tests.harness import free_port
from tests.harness.fences import assert_clock_fence

#: Everything the library sends, directly or from its Lua scripts (scripts run with the
#: caller's permissions). Documented in the README; keep both in step.
MINIMAL_ACL = (
    "+evalsha",
    "+script|load",
    "+exists",
    "+wait",
    "+subscribe",
    "+unsubscribe",
    "+hgetall",
    "+hget",
    "+hset",
    "+hsetnx",
    "+hincrby",
    "+hmget",
    "+incr",
    "+pexpire",
    "+pttl",
    "+del",
    "+publish",
    "+get",
    "+set",
    "+time",
    "+hdel",
    "+hexists",
    "+zadd",
    "+zrem",
    "+zscore",
    "+zrange",
    "+zrangebyscore",
    "+zremrangebyscore",
    "+zcard",
    "+zcount",
    "+lpush",
    "+ltrim",
)


#: Lease and per-call budget of the exercise: what it tests is which commands, keys and
#: channels a topology needs, not timing, so a loaded machine must not spend them (a
#: ttl of 1 s, with its 0.1 s node budget, ran out while acquiring on 2 busy cores).
TIMING = {"ttl": 10.0, "node_timeout": 1.0}


def exercise(url: str, *, several: bool = True) -> None:
    """Acquire, renew, wait for a release, inspect and release through ``url``."""
    holder = Redlock("topology", nodes=[url], **TIMING)
    waiter = Redlock("topology", nodes=[url], **TIMING)
    assert holder.acquire() and holder.locked() and holder.owned()
    first = holder.fence
    assert_clock_fence(first)  # a fresh key: its fence counter starts from the clock
    holder.extend()
    result = {}
    acquired_by_waiter = threading.Event()
    release_waiter = threading.Event()

    def wait_then_hold() -> None:
        result["got"] = waiter.acquire(timeout=10)
        acquired_by_waiter.set()
        release_waiter.wait(15)
        waiter.release()  # a hold is released by the thread that took it

    thread = threading.Thread(target=wait_then_hold)
    thread.start()
    holder.release()
    assert acquired_by_waiter.wait(15)
    assert result["got"] is True
    assert waiter.inspect()[0]["fence_counter"] == waiter.fence == first + 1
    release_waiter.set()
    thread.join(15)
    # The rest of the lock family: shares with a limit, a writer among them, fair
    # waiting and several resources at once.
    reader = Redlock("topology", nodes=[url], **TIMING, limit=2)
    writer = Redlock("topology", nodes=[url], **TIMING)
    assert reader.acquire() and reader.owned()
    reader.extend()
    assert not writer.acquire(timeout=0.05), "a writer waits for the share"
    reader.release()
    fair = Redlock("topology", nodes=[url], **TIMING, fair=True)
    assert fair.acquire(timeout=1)
    fair.release()
    if several:
        both = Redlock(["topology", "other"], nodes=[url], **TIMING)
        assert both.acquire(timeout=1) and both.owned()
        both.extend()
        both.release()


def acl_user(server, commands) -> str:
    """Create user ``locker`` limited to ``commands`` and the lock keys; return its URL."""
    server.client().execute_command(
        "ACL", "SETUSER", "locker", "on", ">pw", "resetkeys", "~redlock:*",
        "resetchannels", "&redlock:*", "-@all", *commands,
    )  # fmt: skip
    return f"redis://locker:pw@127.0.0.1:{server.port}/0"


def test_acl_user_with_the_documented_command_set_works(redis_factory):
    """A user allowed only the documented commands, keys and channels can do everything."""
    (server,) = redis_factory(1)
    url = acl_user(server, MINIMAL_ACL)
    exercise(url)
    # The event log of a locked task's run, written as the worker writes it.
    nodeset = NodeSet([url], timeout=1.0)
    events.record(Settings(url=url), nodeset, "released", ("redlock:{topology}",), "t", "id")
    assert events.flush()
    nodeset.close()
    assert server.client().llen("redlock:{topology}:log") == 1
    stats = server.commandstats()
    assert "keys" not in stats, "the KEYS command is never used"


def test_acl_user_runs_the_turn_of_a_process_another_process_waits_for(redis_factory):
    """What exercise() cannot reach from one process: another process's blocking attempt
    marks the lock ``waited`` (HSETNX), and the holder's process then counts its
    handoffs (HINCRBY). Both were missing from the documented set."""
    (server,) = redis_factory(1)
    client = redis.Redis.from_url(acl_user(server, MINIMAL_ACL), decode_responses=True)
    sha = client.script_load(ACQUIRE_WAKE.source)
    keys = lock_keys("topology")

    def acquire(token, pid, writer="", handoff=()):
        call = ACQUIRE_WAKE.call(
            resources=keys.resource, record=keys.record, abandoned=keys.abandoned, token=token,
            ttl_ms=10_000, task_id="t", host="h", pid=pid, acquired_at=0, task_name="task",
            blocking=writer, waiter_ms="10000" if writer else "0", arrival="",
            channel=f"{keys.channel}:h:{pid}", attempt=1, grant_ms=500, handoff=handoff,
        )  # fmt: skip
        return client.evalsha(sha, len(call.keys), *call.keys, *call.args)

    try:
        assert acquire("a", 100)[0] == 1
        assert acquire("b", 200, writer="1")[0] == 0, "another process waits (recorded)"
        assert server.client().hget(keys.lock, "waited") is not None
        assert acquire("a2", 100, handoff=("a", 8, 60_000, 1_000))[0] == 1, "a takeover"
        assert server.client().hget(keys.lock, "handoffs") == "1"
        # The release grants the lock to the recorded waiter, told on its process channel.
        release = RELEASE_WAKE.call(
            locks=release_keys([keys]), record=keys.record, fence=(keys.fence,), token="a2",
            reserve_ms=500, channel=f"{keys.channel}:h:100", attempt="",
        )  # fmt: skip
        sha = client.script_load(RELEASE_WAKE.source)
        assert client.evalsha(sha, len(release.keys), *release.keys, *release.args) == 1
        assert server.client().hget(keys.lock, "token") == "b"
    finally:
        client.close()


@pytest.mark.parametrize("missing", ["+time", "+incr"])
def test_acl_user_without_a_needed_command_gets_a_clear_error(redis_factory, missing):
    """Missing a permission names the command instead of failing silently. A fresh
    key's first fence needs INCR (which makes the counter) and TIME (the counter then
    starts from the node's clock): a user without either is refused at once, with a
    clear error."""
    (server,) = redis_factory(1)
    url = acl_user(server, [c for c in MINIMAL_ACL if c != missing])
    lock = Redlock("topology", nodes=[url], ttl=1.0)
    # Redis: "The user executing the script can't run this command";
    # Valkey: "ACL failure in script: User locker has no permissions to run the 'incr' command".
    denied = r"(?i)user.*(can't run this command|no permissions to run)"
    with pytest.raises(NodeUnavailable, match=denied):
        lock.acquire(blocking=False)


@pytest.fixture
def certificates(tmp_path):
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed: cannot make a test certificate")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    return key, cert


def test_tls_rediss_url(redis_factory, certificates):
    """rediss:// with a verified certificate works end to end (if the server has TLS)."""
    key, cert = certificates
    port = free_port()
    try:
        redis_factory(
            1,
            "--tls-port",
            str(port),
            "--tls-cert-file",
            str(cert),
            "--tls-key-file",
            str(key),
            "--tls-ca-cert-file",
            str(cert),
            "--tls-auth-clients",
            "no",
        )
    except RuntimeError as exc:
        if "tls" in str(exc).lower():
            pytest.skip(f"this redis-server was built without TLS: {exc}")
        raise
    url = f"rediss://127.0.0.1:{port}/0?ssl_cert_reqs=required&ssl_ca_certs={cert}"
    exercise(url)
