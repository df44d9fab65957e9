"""A whole Redis Cluster as one lock node (``redis+cluster://``), against a real cluster.

Three cluster-enabled masters are started by ``tests/harness/cluster.py``. The tests
that only take locks share one cluster (each cleans up after itself); the tests that
move slots or kill a master get a fresh one (the ``redis_cluster`` fixture).
"""

from __future__ import annotations

import json
import logging
import threading

import pytest

from celery_redlock import LockBusy, LockLost, NodeUnavailable, Redlock
from celery_redlock.engine.keys import lock_keys
from celery_redlock.engine.renewal import Renewer
from celery_redlock.engine.scripts import RELEASE, RENEW_MANY
from celery_redlock.exceptions import ConfigurationError
from celery_redlock.integration.settings import from_conf
from celery_redlock.nodes import Call, NodeSet, safe_url
from celery_redlock.nodes import cluster as cluster_module
from celery_redlock.nodes.cluster import CrossSlotError, MasterUnavailable
from celery_redlock.ops.doctor import diagnose
from tests.apps.locked import create_app
from tests.apps.rated import make_rated_app
from tests.harness import close_app, wait_for
from tests.harness.cluster import RedisCluster, slot_of
from tests.harness.fences import CLOCK_FENCE_MIN, assert_clock_fence, assert_counter_expires
from tests.integration.test_rate import runs_of
from tests.unit.nodes.test_topologies import (
    MINIMAL_ACL,
    certificates,  # noqa: F401 (fixture)
    exercise,
)


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    with RedisCluster(tmp_path_factory.mktemp("cluster")) as cluster:
        yield cluster


@pytest.fixture
def cluster(shared):
    """The shared cluster, emptied (keys, scripts, command statistics)."""
    for server in shared.masters:
        with server.client() as conn:
            conn.flushall()
            conn.script_flush()
            conn.config_resetstat()
    return shared


def names_on(cluster: RedisCluster, count: int, *, prefix: str = "n") -> dict[int, list[str]]:
    """``count`` lock names whose keys live on each master: {port: [names]}."""
    found: dict[int, list[str]] = {s.port: [] for s in cluster.masters}
    i = 0
    while any(len(v) < count for v in found.values()):
        name = f"{prefix}{i}"
        i += 1
        port = cluster.master_for(lock_keys(name).lock).port
        if len(found[port]) < count:
            found[port].append(name)
    return found


def exists(cluster: RedisCluster, key: str) -> bool:
    """Whether ``key`` exists on the master of its slot."""
    with cluster.master_for(key).client() as conn:
        return bool(conn.exists(key))


def evalsha_calls(cluster: RedisCluster) -> dict[int, int]:
    return {s.port: s.commandstats().get("evalsha", 0) for s in cluster.masters}


# --------------------------------------------------------------------------- URLs


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("redis+cluster://h1:7000/1", "database 0 only"),
        ("redis+cluster://h1:x", "bad port"),
        ("redis+cluster://h1:7000,:7001", "no host"),
    ],
)
def test_bad_cluster_urls_name_the_expected_form(url, why):
    with pytest.raises(ConfigurationError, match=why) as info:
        NodeSet([url], timeout=0.5)
    assert "redis+cluster://[[user]:password@]host[:port]" in str(info.value)


def test_cluster_url_is_accepted_as_one_node_and_passwords_are_masked():
    url = "rediss+cluster://app:s3cret@10.0.0.1:7000,10.0.0.2:7000?ssl_cert_reqs=none"
    assert from_conf({"redlock_url": url}).node_urls() == (url,)
    nodeset = NodeSet([url], timeout=0.5)  # no I/O until the first request
    assert len(nodeset) == 1 and nodeset.quorum == 1
    assert "s3cret" not in repr(nodeset) and "app:**@" in nodeset.nodes[0].safe_url
    assert safe_url(url) == nodeset.nodes[0].safe_url  # what the worker logs at start


def test_a_cluster_url_naming_a_plain_server_fails_closed_and_says_why(redis_node):
    lock = Redlock("x", nodes=[f"redis+cluster://127.0.0.1:{redis_node.port}"], ttl=5)
    with pytest.raises(NodeUnavailable, match="cluster support disabled"):
        lock.acquire(blocking=False)


# --------------------------------------------------------------------------- locks


def test_acquire_extend_release_on_the_master_of_the_slot(cluster):
    """A lock's hash and fence counter live on its slot's master; fences only grow."""
    lock = Redlock("orders:42", nodes=[cluster.url()], ttl=10, auto_renew=False)
    owner = cluster.master_for(lock.keys.lock)
    fences = []
    for _ in range(3):
        assert lock.acquire(blocking=False)
        fences.append(lock.fence)
        assert lock.owned() and lock.locked()
        with owner.client() as conn:
            assert conn.hget(lock.keys.lock, "token") == lock.lease.token
            assert int(conn.get(lock.keys.fence)) == lock.fence
            assert_counter_expires(conn, lock.keys.fence, 10_000)
        lock.extend()
        (view,) = lock.inspect()
        assert int(view["fence"]) == lock.fence and view["node"] == cluster.url()
        assert not Redlock("orders:42", nodes=[cluster.url()], ttl=10).acquire(blocking=False)
        lock.release()
        assert not lock.locked()
    assert fences == sorted(set(fences)), "fencing tokens grow with every acquisition"
    with owner.client() as conn:
        assert_clock_fence(fences[0], conn)  # a fresh key: from the master's clock
    assert fences == [fences[0], fences[0] + 1, fences[0] + 2], "then one by one"
    for server in cluster.masters:
        if server is not owner:
            with server.client() as conn:
                assert conn.dbsize() == 0, "nothing of the lock lands on another master"


@pytest.mark.parametrize("name", ["}x", "}", "}{}", "{}", "\\}x", "a}b", "{user}:1"])
def test_a_lock_whose_name_holds_braces_lives_in_one_slot(cluster, name):
    """``redlock:{}x}`` would have no hash tag and its keys would span slots
    (CrossSlotError at acquire): every name's keys share a non-empty tag."""
    lock = Redlock(name, nodes=[cluster.url()], ttl=10, auto_renew=False)
    waiter = Redlock(name, nodes=[cluster.url()], ttl=10)
    assert lock.acquire(blocking=False)
    assert not waiter.acquire(blocking=False)
    lock.extend()
    Renewer().renew([lock.lease])
    (view,) = lock.inspect()
    assert int(view["fence"]) == lock.fence
    owner = cluster.master_for(lock.keys.lock)
    assert all(cluster.master_for(key) is owner for key in lock.keys)
    lock.release()
    assert waiter.acquire(blocking=False)
    waiter.release()


def test_renewal_is_one_pipelined_request_per_master(cluster):
    """Locks on all 3 masters: each master gets one renew_many call per slot, nothing more.

    Redis Cluster refuses a script whose declared keys span slots even on one master,
    so the per-key script is split per slot and the parts are pipelined per master.
    """
    names = [n for group in names_on(cluster, 4).values() for n in group]
    locks = [Redlock(n, nodes=[cluster.url()], ttl=30, auto_renew=False) for n in names]
    for lock in locks:
        assert lock.acquire(blocking=False)
    leases = [lock.lease for lock in locks]
    renewer = Renewer()
    renewer.renew(leases)  # loads the script on every master (NOSCRIPT, then SCRIPT LOAD)
    for server in cluster.masters:
        with server.client() as conn:
            for lock in locks:
                if cluster.master_for(lock.keys.lock) is server:
                    conn.pexpire(lock.keys.lock, 5000)
            conn.config_resetstat()
    deadlines = [lease.deadline for lease in leases]

    renewer.renew(leases)

    slots: dict[int, set[int]] = {s.port: set() for s in cluster.masters}
    for lock in locks:
        slots[cluster.master_for(lock.keys.lock).port].add(slot_of(lock.keys.lock))
    assert evalsha_calls(cluster) == {port: len(s) for port, s in slots.items()}
    assert all(len(s) == 4 for s in slots.values())
    assert all(lease.deadline > before for lease, before in zip(leases, deadlines, strict=True))
    for server in cluster.masters:
        with server.client() as conn:
            for lock in locks:
                if cluster.master_for(lock.keys.lock) is server:
                    assert conn.pttl(lock.keys.lock) > 20_000
    for lock in locks:
        lock.release()


def test_split_renew_many_reply_is_merged_in_key_order(cluster):
    """renew_many over keys on every master answers one code per key, in key order."""
    names = names_on(cluster, 2)
    held = [Redlock(g[0], nodes=[cluster.url()], ttl=30, auto_renew=False) for g in names.values()]
    for lock in held:
        assert lock.acquire(blocking=False)
    free = [lock_keys(g[1]).lock for g in names.values()]
    keys, args = [], []
    for lock, other in zip(held, free, strict=True):
        keys += [lock.keys.lock, other]
        args += [lock.lease.token, 30_000, "x", "no-such-token", 30_000, "x"]
    nodeset = NodeSet.get([cluster.url()], timeout=1.0)
    (reply,) = nodeset.call([Call(RENEW_MANY, tuple(keys), tuple(args))])
    assert reply.values == [[1, 0] * 3]
    for lock in held:
        lock.release()


def test_a_call_across_slots_that_cannot_be_split_is_refused_naming_the_keys(cluster):
    nodeset = NodeSet.get([cluster.url()], timeout=1.0)
    keys = (lock_keys("a").lock, lock_keys("b").lock)
    assert slot_of(keys[0]) != slot_of(keys[1])
    with pytest.raises(CrossSlotError, match=r"release: keys \['redlock:\{a\}', 'redlock:\{b\}'\]"):
        nodeset.call([Call(RELEASE, keys, ("token",))])
    with pytest.raises(CrossSlotError, match="EXISTS"):
        nodeset.call([Call.command("EXISTS", *keys)])
    assert sum(evalsha_calls(cluster).values()) == 0, "nothing was sent"


def subscribers(server, channel: str) -> int:
    with server.client() as conn:
        return conn.pubsub_numsub(channel)[0][1]


def test_a_release_on_one_master_wakes_a_waiter_listening_on_another(cluster):
    """PUBLISH is broadcast in a cluster: the waiter is woken, not left to the TTL."""
    url = cluster.url()
    # The listener subscribes on the master of slot 0 (first in rotation); the lock
    # lives on another master.
    first = cluster.slot_owner(0)
    name = next(
        n
        for group in names_on(cluster, 1).values()
        for n in group
        if cluster.master_for(lock_keys(n).lock) is not first
    )
    holder = Redlock(name, nodes=[url], ttl=30)
    assert holder.acquire(blocking=False)
    got: list[bool] = []

    def wait() -> None:
        lock = Redlock(name, nodes=[url], ttl=30)
        got.append(lock.acquire(timeout=20))
        lock.release()

    waiter = threading.Thread(target=wait)
    waiter.start()
    channel = holder.keys.channel
    wait_for(lambda: sum(subscribers(s, channel) for s in cluster.masters) == 1, timeout=10)
    assert subscribers(cluster.master_for(holder.keys.lock), channel) == 0
    holder.release()
    waiter.join(25)
    assert got == [True], "woken by the release well before the holder's 30 s lease"


def test_a_cluster_is_one_vote_in_redlock(cluster, redis_factory):
    """Redlock over [cluster, node, node]: quorum 2; the cluster's masters are one vote."""
    plain = redis_factory(2)
    urls = [cluster.url(), *(s.url for s in plain)]
    lock = Redlock("quorum", nodes=urls, ttl=10, auto_renew=False)
    assert len(lock.nodeset) == 3 and lock.nodeset.quorum == 2
    # A read that waits for every node first: the cluster node (shared per URL) reads a
    # current slot map. Else an acquisition decided by the two plain nodes could leave
    # the cluster's leg on a MOVED reply nobody follows, and the lock on two nodes only.
    assert not lock.locked()
    # And a first round (its release waits for every node): the fixture flushes the
    # cluster's scripts, and an acquisition decided by the plain nodes before the
    # cluster answered NOSCRIPT left the lock on two nodes only (seen once, on a loaded
    # machine); that NOSCRIPT, drained, makes the release load the scripts again.
    with lock:
        pass
    assert lock.acquire(blocking=False)
    wait_for(lambda: exists(cluster, lock.keys.lock), timeout=5, message="not on the cluster")
    assert [view.get("error") for view in lock.inspect()] == [None, None, None]
    plain[0].kill()
    lock.extend()  # the cluster and one node still make a quorum
    lock.release()
    assert not exists(cluster, lock.keys.lock)


def test_rediss_cluster_url_with_a_verified_certificate(tmp_path, certificates):  # noqa: F811
    """rediss+cluster://: TLS to every master, which CLUSTER SLOTS names by TLS port."""
    key, cert = certificates
    with RedisCluster(tmp_path / "tls", tls=(str(cert), str(key))) as cluster:
        url = cluster.url()
        assert url.startswith("rediss+cluster://")
        names = names_on(cluster, 1)
        locks = [Redlock(n[0], nodes=[url], ttl=10, auto_renew=False) for n in names.values()]
        for lock in locks:
            assert lock.acquire(blocking=False)
            lock.extend()
        Renewer().renew([lock.lease for lock in locks])
        for lock in locks:
            assert exists(cluster, lock.keys.lock)
            lock.release()


def test_the_documented_acl_plus_cluster_commands_is_enough(redis_cluster):
    """The README's minimal ACL plus +asking and +cluster|slots runs a lock's whole life
    on a cluster, a slot migration (ASK, MOVED) included; without +cluster|slots the
    node cannot read its slot map and says so."""
    for server in redis_cluster.masters:
        with server.client() as conn:
            conn.execute_command(
                "ACL", "SETUSER", "locker", "on", ">pw", "resetkeys", "~redlock:*",
                "resetchannels", "&redlock:*", "-@all", *MINIMAL_ACL, "+asking", "+cluster|slots",
            )  # fmt: skip
            conn.execute_command(
                "ACL", "SETUSER", "blind", "on", ">pw", "allkeys", "+@all", "-cluster"
            )
    url = redis_cluster.url().replace("://", "://locker:pw@")
    exercise(url, several=False)
    lock = Redlock("acl-migrating", nodes=[url], ttl=10, auto_renew=False)
    assert lock.acquire(blocking=False)
    slot = slot_of(lock.keys.lock)
    source = redis_cluster.master_for(lock.keys.lock)
    target = next(s for s in redis_cluster.masters if s is not source)
    redis_cluster.begin_migration(slot, source, target)
    redis_cluster.move_keys(slot, source, target)
    lock.extend()  # ASKING
    redis_cluster.finish_migration(slot, target)
    lock.extend()  # MOVED
    lock.release()
    blind = Redlock("x", nodes=[redis_cluster.url().replace("://", "://blind:pw@")], ttl=5)
    with pytest.raises(NodeUnavailable, match="cluster"):
        blind.acquire(blocking=False)


# --------------------------------------------------------------------------- resharding


def test_a_slot_migrated_mid_hold_keeps_the_lock_through_ask_and_moved(redis_cluster):
    """IMPORTING/MIGRATING + MIGRATE (ASK), then SETSLOT NODE (MOVED): still held."""
    lost: list[LockLost] = []
    lock = Redlock("migrating", nodes=[redis_cluster.url()], ttl=1.5, on_lost=lost.append)
    assert lock.acquire(blocking=False)
    lease = lock.lease
    slot = slot_of(lock.keys.lock)
    source = redis_cluster.master_for(lock.keys.lock)
    target = next(s for s in redis_cluster.masters if s is not source)

    redis_cluster.begin_migration(slot, source, target)
    moved = redis_cluster.move_keys(slot, source, target)
    assert set(moved) == {lock.keys.lock, lock.keys.fence}
    lock.extend()  # the source answers ASK: ASKING + the script on the target
    assert target.commandstats().get("asking", 0) >= 1
    before = lease.deadline
    wait_for(lambda: lease.deadline > before, timeout=10, message="a renewal through ASK")

    redis_cluster.finish_migration(slot, target)
    lock.extend()  # the source now answers MOVED
    before = lease.deadline
    wait_for(lambda: lease.deadline > before, timeout=10, message="a renewal after MOVED")
    assert lock.owned() and not lost
    lock.release()
    with target.client() as conn:
        assert not conn.exists(lock.keys.lock)
        assert int(conn.get(lock.keys.fence)) == lock.fence
        assert_counter_expires(conn, lock.keys.fence, 1_500)  # its TTL moved with it
    again = Redlock("migrating", nodes=[redis_cluster.url()], ttl=5, auto_renew=False)
    assert again.acquire(blocking=False) and again.fence > lock.fence
    again.release()


# --------------------------------------------------------------------------- failures


def test_a_killed_master_fails_its_locks_closed_and_spares_the_others(redis_cluster):
    url = redis_cluster.url()
    names = names_on(redis_cluster, 2)
    victim, *others = redis_cluster.masters
    lost: list[LockLost] = []
    doomed = Redlock(names[victim.port][0], nodes=[url], ttl=1.5, on_lost=lost.append)
    assert doomed.acquire(blocking=False)
    healthy = [Redlock(names[s.port][0], nodes=[url], ttl=10, auto_renew=False) for s in others]
    for lock in healthy:
        assert lock.acquire(blocking=False)

    victim.kill()

    wait_for(lambda: lost, timeout=10, message="the lock on the dead master to be lost")
    with pytest.raises(LockLost):
        doomed.check()
    with pytest.raises(NodeUnavailable) as info:
        Redlock(names[victim.port][1], nodes=[url], ttl=5, auto_renew=False).try_acquire()
    assert f"master {victim.host}:{victim.port}" in str(info.value)
    for lock in healthy:
        lock.extend()
        assert lock.owned()
        lock.release()
    for server in others:
        fresh = Redlock(names[server.port][1], nodes=[url], ttl=5, auto_renew=False)
        assert fresh.acquire(blocking=False)
        fresh.release()


def test_a_hung_master_does_not_spend_the_budget_of_calls_to_the_others(redis_cluster, monkeypatch):
    """A paused (SIGSTOP) master answers nothing; locks on the others keep working.

    Its failure makes the node read the slot map again, and the hung master, first in
    slot order, is asked last: otherwise that read alone would spend every later call's
    budget.
    """
    monkeypatch.setattr(cluster_module, "MAP_RECHECK", 0.0)  # read the map on every call
    url = redis_cluster.url()
    victim = redis_cluster.slot_owner(0)
    names = names_on(redis_cluster, 1)
    locks = {p: Redlock(n[0], nodes=[url], ttl=10, auto_renew=False) for p, n in names.items()}
    for lock in locks.values():
        assert lock.acquire(blocking=False)
    victim.pause()
    try:
        with pytest.raises((LockLost, NodeUnavailable)):
            locks[victim.port].extend()
        for port, lock in locks.items():
            if port != victim.port:
                lock.extend()
                lock.extend()
                lock.release()
    finally:
        victim.resume()


def test_a_split_call_reports_the_dead_master_per_key(redis_cluster):
    """Keys on a dead master answer MasterUnavailable; the others answer normally."""
    url = redis_cluster.url()
    names = names_on(redis_cluster, 1)
    locks = {p: Redlock(n[0], nodes=[url], ttl=30, auto_renew=False) for p, n in names.items()}
    for lock in locks.values():
        assert lock.acquire(blocking=False)
    victim = redis_cluster.masters[0]
    victim.kill()
    keys = tuple(lock.keys.lock for lock in locks.values())
    args = tuple(a for lock in locks.values() for a in (lock.lease.token, 30_000, "x"))
    (reply,) = NodeSet.get([url], timeout=1.0).call([Call(RENEW_MANY, keys, args)])
    codes = dict(zip(locks, reply.values[0], strict=True))
    assert isinstance(codes.pop(victim.port), MasterUnavailable)
    assert list(codes.values()) == [1, 1]


def test_renewal_of_locks_on_healthy_masters_survives_a_dead_master(redis_cluster):
    """One renewal tick over locks on all masters, one of them dead: the others renew."""
    url = redis_cluster.url()
    names = names_on(redis_cluster, 1)
    victim = redis_cluster.masters[1]
    locks = [Redlock(n[0], nodes=[url], ttl=30, auto_renew=False) for n in names.values()]
    for lock in locks:
        assert lock.acquire(blocking=False)
    leases = [lock.lease for lock in locks]  # the dead master's lease is in the middle
    before = [lease.deadline for lease in leases]
    victim.kill()

    Renewer().renew(leases)

    renewed = [lease.deadline > old for lease, old in zip(leases, before, strict=True)]
    assert renewed == [True, False, True]
    assert all(lease.lost is None for lease in leases), "one failed renewal is retried"
    for lock in (locks[0], locks[2]):
        lock.release()


def test_a_lock_held_across_a_master_failover_follows_the_promoted_replica(tmp_path):
    """SIGKILL a master with an in-sync replica: the cluster promotes the replica, the
    node reads the new slot map, and the lock (replicated, as WAIT confirmed) is still
    held there: renewed through the new master, refused to others, released."""
    with RedisCluster(tmp_path / "failover", replicas=True) as cluster:
        url = cluster.url()
        lost: list[LockLost] = []
        lock = Redlock("failover", nodes=[url], ttl=10, min_replicas=1, on_lost=lost.append)
        assert lock.acquire(blocking=False)
        old = cluster.master_for(lock.keys.lock)
        replica = cluster.replicas[cluster.masters.index(old)]
        lease = lock.lease

        old.kill()
        wait_for(
            lambda: cluster.slot_owner(slot_of(lock.keys.lock)) is replica,
            timeout=20,
            message="the cluster to promote the replica",
        )
        before = lease.deadline
        wait_for(lambda: lease.deadline > before, timeout=10, message="a renewal on the new master")
        assert not lost and lock.owned()
        with pytest.raises(LockBusy):
            Redlock("failover", nodes=[url], ttl=10, auto_renew=False).try_acquire()
        lock.release()
        with replica.client() as conn:
            assert not conn.exists(lock.keys.lock)


# --------------------------------------------------------------------------- Celery, CLI


def test_a_locked_task_runs_with_a_cluster_url(
    cluster, celery_redis, inprocess_worker_factory, tmp_path
):
    """redlock_url = a cluster: the duplicate is skipped while the first holds the lock."""
    app = create_app(celery_redis.url, redlock_url=cluster.url())
    try:
        inprocess_worker_factory(app, pool="threads", concurrency=2)
        path = str(tmp_path / "runs")
        hold = app.tasks["tests.apps.locked.hold"]
        first = hold.delay("acct-1", path, "first", 1.5)
        wait_for((tmp_path / "runs").exists, timeout=10)
        second = hold.delay("acct-1", path, "second", 0)
        with pytest.raises(LockBusy):
            second.get(timeout=30, disable_sync_subtasks=False)
        result = first.get(timeout=30, disable_sync_subtasks=False)
        assert result["label"] == "first" and result["fence"] > CLOCK_FENCE_MIN
        assert exists(cluster, f"{result['key']}:fence")
        assert not exists(cluster, result["key"]), "released after the run"
    finally:
        close_app(app)


def test_runs_that_must_wait_go_back_on_the_queue_on_a_cluster(
    cluster, celery_redis, inprocess_worker_factory, tmp_path, caplog
):
    """A cluster keeps no parked runs (their keys would span slots): 7 runs of a 5/s key
    with requeue each run once, put back on the queue; nothing was parked, and no
    parking or publishing was tried (it failed across slots, logged as an error)."""
    app = make_rated_app(celery_redis.url, redlock_url=cluster.url())
    try:
        inprocess_worker_factory(app, pool="threads", concurrency=2)
        out = tmp_path / "runs"
        task = app.tasks["rated.exclusive"]
        results = [task.delay("k", str(out)) for _ in range(7)]
        assert [r.get(timeout=30) for r in results] == ["k"] * 7
        assert sorted(i for i, *_ in runs_of(out)) == sorted(r.id for r in results)
        parked = [
            key for server in cluster.masters for key in server.client().scan_iter(match="*parked*")
        ]
        assert parked == []
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert not errors, [r.getMessage() for r in errors]
    finally:
        close_app(app)


def test_ls_lists_locks_on_every_master(cluster, celery_redis, cli):
    names = names_on(cluster, 1)
    locks = [Redlock(n[0], nodes=[cluster.url()], ttl=30, auto_renew=False) for n in names.values()]
    for lock in locks:
        assert lock.acquire(blocking=False)

    result = cli(celery_redis.url, "ls", "--json", conf={"redlock_url": cluster.url()})

    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["nodes"] == [{"node": cluster.url(), "ok": True, "error": None}]
    assert sorted(item["key"] for item in data["locks"]) == sorted(lock.keys.lock for lock in locks)
    assert all(s.commandstats().get("scan", 0) >= 1 for s in cluster.masters)
    for lock in locks:
        lock.release()


def test_doctor_reports_each_master_of_a_cluster_as_one_lock_node(cluster, celery_redis):
    app = create_app(celery_redis.url, redlock_url=cluster.url())
    try:
        report = diagnose(app)
    finally:
        close_app(app)
    masters = [f for f in report.facts if f.lock_node == cluster.url()]
    assert len(masters) == 3 and all(f.error is None for f in masters)
    assert {f.info.get("tcp_port") for f in masters} == {str(s.port) for s in cluster.masters}
    assert any(f.code == "node-count" and "one lock node" in f.message for f in report.findings)


def test_a_lock_on_several_resources_is_refused_on_a_cluster(redis_cluster):
    """Resources hash to different slots: refused at construction, naming them."""
    with pytest.raises(ConfigurationError, match=r"several resources \(\['a', 'b'\]\)"):
        Redlock(["a", "b"], nodes=[redis_cluster.url()])
    Redlock("a", nodes=[redis_cluster.url()], limit=2)  # a share is one resource: fine
