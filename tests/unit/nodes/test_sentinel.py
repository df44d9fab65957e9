"""A lock node given as a Redis Sentinel URL, against real sentinels, master and replica.

One group (master, replica, three sentinels) is shared by the module; tests that fail
over leave it with the roles swapped, so they ask the sentinels who the master is.
The test that kills a master has a group of its own.
"""

from __future__ import annotations

import threading
import time

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from celery_redlock import LockLost, NodeUnavailable, Redlock
from celery_redlock.exceptions import ConfigurationError
from celery_redlock.integration.settings import from_conf
from celery_redlock.nodes import Node
from celery_redlock.nodes.sentinel import MASTER_RECHECK
from tests.harness import HOST, wait_for
from tests.harness.sentinel import SentinelGroup


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    with SentinelGroup(tmp_path_factory.mktemp("sentinel")) as group:
        yield group


@pytest.fixture
def settled(group):
    """The shared group with the replica in sync with whichever server is master."""
    master = group.current_master()
    replica = next(s for s in group.servers if s is not master)
    wait_for(
        lambda: group.role(replica) == "slave" and group.replica_in_sync(master, replica),
        timeout=30,
        interval=0.05,
        message="the old master to be demoted and in sync",
    )
    return group


def on_master(group: SentinelGroup, key: str) -> dict:
    """The lock hash as stored on the master the sentinels report."""
    with group.current_master().client() as conn:
        return conn.hgetall(key)


# --------------------------------------------------------------------------- URLs


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("redis+sentinel://h1:26379,h2:26379/", "no service"),
        ("redis+sentinel://h1:x/mymaster", "bad port"),
        ("redis+sentinel://h1/mymaster/zero", "db must be a number"),
        ("redis+sentinel://h1/mymaster/0?master_name=x", "unknown option"),
        ("redis+sentinel://h1/mymaster/0/1", "unexpected path"),
    ],
)
def test_bad_sentinel_urls_name_the_expected_form(url, why):
    with pytest.raises(ConfigurationError, match=why) as info:
        Node(url, timeout=0.1)
    assert "redis+sentinel://[[user]:password@]host[:port][,host[:port]...]/service_name" in str(
        info.value
    )


def test_sentinel_url_is_accepted_and_passwords_are_masked():
    url = "redis+sentinel://:s3cret@h1:26379,h2/mymaster/2?sentinel_password=other"
    assert from_conf({"redlock_url": url}).node_urls() == (url,)
    node = Node(url, timeout=0.1)
    assert "s3cret" not in repr(node) and "other" not in node.safe_url
    kwargs = node._connection_kwargs
    assert (kwargs["db"], kwargs["password"], kwargs["protocol"]) == (2, "s3cret", 2)
    assert kwargs["socket_timeout"] == kwargs["socket_connect_timeout"] == 0.1
    manager = kwargs["connection_pool"].sentinel_manager
    assert [s.connection_pool.connection_kwargs["port"] for s in manager.sentinels] == [
        26379,
        26379,
    ]
    for sentinel in manager.sentinels:  # sentinel queries are bounded too, and not retried
        options = sentinel.connection_pool.connection_kwargs
        assert options["socket_timeout"] == options["socket_connect_timeout"] == 0.1
        assert options["password"] == "other"
        assert options["retry"].get_retries() == 0


# --------------------------------------------------------------------------- real servers


def test_acquire_extend_release_through_the_master(settled):
    group = settled
    lock = Redlock("sentinel-life", nodes=[group.url()], ttl=2.0, auto_renew=False)
    assert lock.acquire(blocking=False)
    stored = on_master(group, lock.key)
    assert stored["token"] and int(stored["fence"]) == lock.fence
    assert lock.extend() > 1.5
    assert lock.owned() and lock.locked()
    other = Redlock("sentinel-life", nodes=[group.url()], ttl=2.0)
    assert not other.acquire(blocking=False)
    lock.release()
    assert on_master(group, lock.key) == {}
    assert other.acquire(blocking=False)
    other.release()


def test_new_acquisition_after_sentinel_failover_lands_on_the_promoted_replica(settled):
    group = settled
    url = group.url()
    warm = Redlock("sentinel-warm", nodes=[url], ttl=2.0, auto_renew=False)
    assert warm.acquire(blocking=False)  # leaves idle connections to the old master
    warm.release()
    old = group.current_master()
    new = group.failover()  # the old master stays up, writable, until it is demoted
    assert new is not old
    started = time.monotonic()

    def acquired_on_new_master() -> bool:
        lock = Redlock("sentinel-after", nodes=[url], ttl=2.0, auto_renew=False)
        assert lock.acquire(blocking=False)
        with new.client() as conn:
            there = conn.hget(lock.key, "token")
        lock.release()
        return there is not None

    # Connections to the old master are dropped once the node asks the sentinels
    # again: at most MASTER_RECHECK after the failover, plus scheduling slack.
    wait_for(acquired_on_new_master, timeout=MASTER_RECHECK + 2, interval=0.05)
    assert time.monotonic() - started < MASTER_RECHECK + 2


def test_readonly_reply_drops_the_connection_and_stale_connections_are_not_reused(settled):
    group = settled
    url = group.url()
    lock = Redlock("sentinel-stale", nodes=[url], ttl=2.0, auto_renew=False)
    node = lock.nodeset.nodes[0]
    replica = next(s for s in group.servers if s is not group.current_master())
    conn = node.new_connection()
    conn.connect_to((HOST, replica.port))
    # A master demoted to a replica: its READONLY reply becomes a connection error,
    # so fan_out (which discards a connection on RedisError) never reuses it.
    conn.send_command("SET", "x", "1")
    with pytest.raises(RedisConnectionError, match="now a slave"):
        conn.read_response()
    assert conn._sock is None

    # An idle connection to a server that is no longer the master is dropped on checkout.
    stale = node.new_connection()
    stale.connect_to((HOST, replica.port))
    with node._lock:
        node._idle.append(stale)
    assert lock.acquire(blocking=False)
    assert stale._sock is None
    assert on_master(group, lock.key)["token"]
    lock.release()


def test_lock_held_across_a_failover_survives_or_is_reported_lost(settled):
    """Either renewal continues on the promoted replica, or on_lost gets LockLost.

    Replication is asynchronous, so the key may or may not have reached the replica
    before the failover. What must never happen is a lease that ``check()`` still
    vouches for while the new master has no key with our token.
    """
    group = settled
    lost: list[LockLost] = []
    reported = threading.Event()

    def on_lost(exc: LockLost) -> None:
        lost.append(exc)
        reported.set()

    ttl = 1.5
    lock = Redlock("sentinel-held", nodes=[group.url()], ttl=ttl, on_lost=on_lost)
    assert lock.acquire(blocking=False)
    token = on_master(group, lock.key)["token"]
    new = group.failover()
    failed_over = time.monotonic()

    def settled_outcome() -> bool:
        if reported.is_set():
            return True
        # The key has a TTL of `ttl`: still there one TTL after the failover means
        # renewals reached the new master.
        with new.client() as conn:
            held = conn.hget(lock.key, "token") == token
        return time.monotonic() > failed_over + ttl + MASTER_RECHECK and held

    wait_for(settled_outcome, timeout=ttl * 4 + MASTER_RECHECK + 5, interval=0.05)
    print(f"held across failover: {'lost: ' + str(lost[0]) if lost else 'survived'}")
    if reported.is_set():
        assert isinstance(lost[0], LockLost)
        with pytest.raises(LockLost):
            lock.check()
    else:
        lock.check()  # the lease is sure...
        with new.client() as conn:  # ...and the new master has it, renewed
            assert conn.hget(lock.key, "token") == token
            assert conn.pttl(lock.key) > 0
        assert lock.extend() > ttl / 2
        lock.release()
        with new.client() as conn:
            assert not conn.exists(lock.key)


def test_new_acquisition_after_the_master_is_killed(tmp_path):
    """No failover command: the master dies, the sentinels promote the replica."""
    with SentinelGroup(tmp_path) as group:
        url = group.url()
        lock = Redlock("sentinel-kill", nodes=[url], ttl=2.0, auto_renew=False)
        assert lock.acquire(blocking=False)
        lock.release()
        new = group.failover(kill=True)

        def acquired() -> bool:
            lock = Redlock("sentinel-kill", nodes=[url], ttl=2.0, auto_renew=False)
            try:
                if not lock.acquire(blocking=False):
                    return False
            except NodeUnavailable:
                return False
            with new.client() as conn:
                there = conn.hget(lock.key, "token")
            lock.release()
            return there is not None

        # The first call may still meet the dead master's connection (a connection
        # error, that node did not vote); the next one asks the sentinels.
        wait_for(acquired, timeout=5, interval=0.05)
