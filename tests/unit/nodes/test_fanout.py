"""fan_out: requests packed and sent at once, scripts loaded on the way, within one budget."""

from __future__ import annotations

import os
import time

import pytest
from redis.connection import Connection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from celery_redlock import Redlock
from celery_redlock.engine.keys import lock_keys
from celery_redlock.engine.scripts import INSPECT
from celery_redlock.nodes import Call, Node, fan_out, fanout
from celery_redlock.nodes.calls import bulk
from celery_redlock.nodes.fanout import _utf8, pack
from tests.harness.servers import WaitTimeout, wait_for

KEYS = lock_keys("job")


@pytest.mark.parametrize(
    "commands",
    [
        [("EVALSHA", "ab12", 2, "redlock:{é}", b"\x00\xff", "tok", 30_000, -1, 0)],
        [("SCRIPT", "LOAD", "x" * 10_000), ("ASKING",), ("WAIT", 1, 250)],
        [("SET", "k", 1.5)],  # a float: left to redis-py
    ],
)
def test_fast_packing_writes_what_redis_py_writes(commands):
    conn = Connection()
    assert b"".join(pack(conn, commands)) == b"".join(conn.pack_commands(commands))


def test_a_command_already_in_resp_is_sent_as_it_is():
    """Bytes among the commands go out unchanged; a command with an argument the fast
    packer does not take goes to redis-py alone, the others around it stay packed."""
    conn = Connection()
    ping = b"*1\r\n$4\r\nPING\r\n"
    commands = [("GET", "a"), ping, ("SET", "k", 1.5), ping]
    expected = b"".join(conn.pack_commands([("GET", "a"), ("PING",), ("SET", "k", 1.5), ("PING",)]))
    assert b"".join(pack(conn, commands)) == expected


def test_a_calls_resp_is_what_goes_to_a_utf8_node(redis_node):
    """``Call.resp`` replaces the packing of its keys and arguments (here on purpose
    not the same command, to see which was sent); other encodings pack the arguments."""
    node = Node(redis_node.url, timeout=1.0)
    call = Call(None, (), ("ECHO", "from args"), resp=bulk_command("ECHO", "from resp"))
    (reply,) = fan_out([node], [[call]], timeout=1.0)
    assert reply.values == ["from resp"]
    assert _utf8(Connection(encoding="UTF8"))
    assert not _utf8(Connection(encoding="latin-1"))


def bulk_command(*args):
    return b"*%d\r\n" % len(args) + bulk(*args)


@pytest.mark.smoke  # as every test of test_scripts.py, where it was
def test_a_reply_is_waited_for_before_the_first_read(redis_node, monkeypatch):
    """A request just sent has no reply yet: fan_out waits for its connection to be
    readable and reads the reply, without asking ``can_read`` (each ask is a read of
    the socket and two changes of its mode). Before, every call asked twice; then once,
    after the reply (issue 27, P1 and P8)."""
    node = Node(redis_node.url, timeout=1.0)
    fan_out([node], [[Call.command("PING")]], timeout=1.0)  # connected first
    asked: list[int] = []
    real = Connection.can_read

    def counted(self, timeout=0):
        asked.append(1)
        return real(self, timeout)

    monkeypatch.setattr(Connection, "can_read", counted)
    for _ in range(20):
        (reply,) = fan_out([node], [[Call.command("PING")]], timeout=1.0)
        assert reply.values == ["PONG"]
    assert asked == [], len(asked)
    node.close()


def test_a_request_is_written_without_asking_the_socket_first(redis_node, monkeypatch):
    """A request goes out in one write on the socket's descriptor, not through
    ``socket.sendall`` (which polls a socket that has a timeout before it sends: one
    system call per request, issue 27); a request larger than the socket's buffer
    still arrives whole (the rest goes through redis-py, which waits for room)."""
    node = Node(redis_node.url, timeout=5.0)
    fan_out([node], [[Call.command("PING")]], timeout=5.0)  # connected first
    writes: list[int] = []
    through_redis_py: list[int] = []
    real_write, real_send = os.write, Connection.send_packed_command

    def write(fd: int, data: bytes) -> int:
        writes.append(len(data))
        return real_write(fd, data)

    def send_packed_command(self, command, check_health=True):
        through_redis_py.append(sum(map(len, command)))
        return real_send(self, command, check_health)

    monkeypatch.setattr(fanout.os, "write", write)
    monkeypatch.setattr(Connection, "send_packed_command", send_packed_command)
    (reply,) = fan_out([node], [[Call.command("PING")]], timeout=5.0)
    assert reply.values == ["PONG"]
    assert len(writes) == 1 and not through_redis_py

    size = 16 << 20  # far more than a socket's buffer takes at once
    calls = [Call.command("SET", "big", "x" * size), Call.command("STRLEN", "big")]
    (reply,) = fan_out([node], [calls], timeout=5.0)
    assert reply.values == ["OK", size], reply.error
    assert len(writes) == 2 and writes[1] > size
    assert len(through_redis_py) == 1 and 0 < through_redis_py[0] < writes[1]
    node.close()


def test_a_write_to_a_connection_the_server_closed_raises_a_connection_error(redis_node):
    """As redis-py's send: the connection is dropped and a ConnectionError raised
    (which fan_out turns into the node's failure)."""
    node = Node(redis_node.url, timeout=1.0)
    conn, _, _ = node.checkout()
    conn.send_command("CLIENT", "ID")
    client_id = conn.read_response()
    redis_node.client().client_kill_filter(_id=client_id)
    request = pack(conn, [("PING",)])[0]
    with pytest.raises(RedisConnectionError):
        wait_for(lambda: fanout.send(conn, request) and False, timeout=5.0)
    assert conn._sock is None
    node.close()


def test_scripts_go_by_evalsha_and_reload_after_a_flush(redis_node):
    """Calls use EVALSHA; after SCRIPT FLUSH one SCRIPT LOAD restores it for good."""
    node = Node(redis_node.url, timeout=1.0)
    call = [Call(INSPECT, KEYS[:2])]
    redis_node.reset_stats()
    fan_out([node], [call], timeout=1.0)
    stats = redis_node.commandstats()
    assert stats.get("script|load", stats.get("script")) == 1, "a new connection loads first"
    assert stats.get("evalsha") == 1, "so the first call does not hit NOSCRIPT"
    redis_node.client().script_flush()
    redis_node.reset_stats()
    for _ in range(3):
        (reply,) = fan_out([node], [call], timeout=1.0)
        assert reply.ok and reply.values[0] == [-2, 0]
    stats = redis_node.commandstats()
    assert stats.get("script|load", stats.get("script")) == 1, stats
    assert "eval" not in stats
    assert stats.get("evalsha") == 4, "three calls plus the one that answered NOSCRIPT"


def test_blackholed_node_does_not_push_acquire_past_its_budget(redis_factory, fault_proxy):
    """A node that accepts and never answers costs at most the node budget."""
    servers = redis_factory(3)
    proxy = fault_proxy(servers[0])
    urls = [proxy.url, servers[1].url, servers[2].url]
    lock = Redlock("job", nodes=urls, ttl=5, node_timeout=0.3)
    assert lock.acquire(blocking=False)  # warm: all three connections are open
    lock.release()
    proxy.blackhole()
    for _ in range(3):
        start = time.monotonic()
        assert lock.acquire(blocking=False)
        acquired_in = time.monotonic() - start
        # The quorum (two healthy nodes) decides: no waiting for the silent node.
        assert acquired_in < 0.3, f"acquire waited {acquired_in:.3f}s for a silent node"
        start = time.monotonic()
        lock.release()
        assert time.monotonic() - start < 0.3 + 0.5


def test_blackholed_fresh_connection_is_bounded(redis_factory, fault_proxy):
    """Connecting to a silent node for the first time is bounded by the budget too."""
    servers = redis_factory(3)
    proxy = fault_proxy(servers[0])
    proxy.blackhole()
    lock = Redlock(
        "job", nodes=[proxy.url, servers[1].url, servers[2].url], ttl=5, node_timeout=0.3
    )
    start = time.monotonic()
    assert lock.acquire(blocking=False)
    assert time.monotonic() - start < 0.3 + 0.5
    lock.release()


def test_a_node_that_always_answers_late_gets_its_scripts_back_after_a_flush(
    redis_factory, fault_proxy
):
    """Its script cache flushed, a node whose replies arrive after every vote is decided
    used to answer NOSCRIPT to each acquisition, unread (drained later and ignored),
    and never held the lock again; the drained NOSCRIPT now makes its next request
    load the scripts first."""
    servers = redis_factory(3)
    slow = fault_proxy(servers[2])
    lock = Redlock("job", nodes=[servers[0].url, servers[1].url, slow.url], ttl=10)
    with lock:
        pass  # every script this lock uses is loaded everywhere
    servers[2].client().script_flush()
    slow.delay(0.05)  # well within the budget, well after the two others answer
    late = servers[2].client()

    def held_on_the_slow_node() -> bool:
        try:
            return wait_for(lambda: late.exists(lock.key), timeout=1)
        except WaitTimeout:
            return False

    seen = []
    for _ in range(4):
        assert lock.acquire(blocking=False)  # decided by the two fast nodes
        seen.append(held_on_the_slow_node())
        lock.release()  # returns once a quorum confirmed; it runs on at the slow node
        wait_for(lambda: not late.exists(lock.key), timeout=2, message="released there too")
    assert seen[0] is False, "the flush did not take (the test proves nothing)"
    assert any(seen[1:]), f"the slow node never ran acquire.lua again: {seen}"


def test_a_pause_of_this_process_before_anything_is_sent_is_not_a_node_failure(
    redis_node, monkeypatch
):
    """The budget runs out before the first request goes out (a long garbage
    collection: 0.4 s with 30,000 locks held): nothing was asked of the node, so the
    call goes out with a new budget instead of failing as if Redis were down."""
    node = Node(redis_node.url, timeout=1.0)
    call = [Call(INSPECT, KEYS[:2])]
    fan_out([node], [call], timeout=1.0)  # warm: an idle connection to go first
    has_idle = Node.has_idle

    def paused(self):
        time.sleep(0.15)  # the process stops here for longer than the budget
        return has_idle(self)

    monkeypatch.setattr(Node, "has_idle", paused)
    [reply] = fan_out([node], [call], timeout=0.05)
    assert reply is not None and reply.error is None, reply


class _PausedClock:
    """``time`` for the fan-out, whose monotonic clock jumps by ``pause`` at will."""

    def __init__(self):
        self.pause = 0.0

    def monotonic(self):
        return time.monotonic() + self.pause

    def __getattr__(self, name):
        return getattr(time, name)


def test_a_pause_while_a_pooled_connection_is_checked_out_is_not_a_node_failure(
    redis_node, monkeypatch
):
    """A full collection landing in the checkout of an idle pooled connection (seen
    holding 100,000 locks) used up the budget before the request went out, and the
    acquisition failed as if Redis were down: the call goes out with a new budget."""
    node = Node(redis_node.url, timeout=1.0)
    call = [Call(INSPECT, KEYS[:2])]
    fan_out([node], [call], timeout=1.0)  # warm: the checkout below opens nothing
    clock = _PausedClock()
    monkeypatch.setattr(fanout, "time", clock)
    checkout = Node.checkout

    def paused(self, *args, **kwargs):
        conn, fresh, owed = checkout(self, *args, **kwargs)
        clock.pause += 0.15  # the process stops here for longer than the budget
        return conn, fresh, owed

    monkeypatch.setattr(Node, "checkout", paused)
    [reply] = fan_out([node], [call], timeout=0.05)
    assert reply is not None and reply.error is None, reply
    [reply] = fan_out([node], [call], timeout=0.05)
    assert reply is not None and reply.error is None, "every call gets its one new budget"


def test_a_pause_while_the_request_is_packed_is_not_a_node_failure(redis_node, monkeypatch):
    """A full collection set off by packing the request (its allocations; holding
    50,000 locks, the renewal benchmark's acquisitions failed so) ends after the
    budget: the request goes out late and the node gets the budget from there, instead
    of one look at the socket right after the write and a report that Redis is down.
    The node takes 10 ms to answer, so that look cannot find the reply there."""
    node = Node(redis_node.url, timeout=1.0)
    call = [Call.command("DEBUG", "SLEEP", "0.01")]
    fan_out([node], [call], timeout=1.0)  # warm: the checkout below opens nothing
    clock = _PausedClock()
    monkeypatch.setattr(fanout, "time", clock)
    packer = fanout.pack

    def paused(*args, **kwargs):
        clock.pause += 0.15  # the process stops here for longer than the budget
        return packer(*args, **kwargs)

    monkeypatch.setattr(fanout, "pack", paused)
    [reply] = fan_out([node], [call], timeout=0.05)
    assert reply is not None and reply.error is None, reply


def test_a_connect_that_spent_the_budget_gets_no_second_one(redis_node, monkeypatch):
    """A budget spent connecting (a slow node, not a pause of this process) is not
    given again when the request is written late: the node times out as before."""
    node = Node(redis_node.url, timeout=1.0)
    call = [Call.command("DEBUG", "SLEEP", "0.01")]
    fan_out([node], [call], timeout=1.0)
    clock = _PausedClock()
    monkeypatch.setattr(fanout, "time", clock)
    checkout = Node.checkout

    def slow_connect(self, *args, **kwargs):
        conn, _fresh, owed = checkout(self, *args, **kwargs)
        clock.pause += 0.15  # as if the connect had taken longer than the budget
        return conn, True, owed

    monkeypatch.setattr(Node, "checkout", slow_connect)
    [reply] = fan_out([node], [call], timeout=0.05)
    assert reply is not None and isinstance(reply.error, RedisTimeoutError), reply


def test_a_reply_in_before_a_slow_connect_spent_the_budget_is_read(redis_node, monkeypatch):
    """A node's connect that takes the whole budget (a partitioned node: its connect is
    made last and may take what is left) leaves the replies of the others in their
    sockets: they are read, not counted as missing. Found by the partition test (a
    minority cut off made a try raise NodeUnavailable) after replies stopped being
    asked for with can_read(0) before each read."""
    healthy = Node(redis_node.url, timeout=0.5)
    fan_out([healthy], [[Call.command("PING")]], timeout=0.5)  # an idle connection: first
    cut_off = Node("redis://127.0.0.1:1/0", timeout=0.5)

    def slow_connect(connect_timeout=None):
        until = time.monotonic() + (connect_timeout or 0.5)
        wait_for(lambda: time.monotonic() >= until, timeout=5)
        raise RedisTimeoutError("Timeout connecting to server")

    monkeypatch.setattr(cut_off, "checkout", slow_connect)
    ok, failed = fan_out(
        [healthy, cut_off], [[Call.command("PING")], [Call.command("PING")]], timeout=0.5
    )
    assert ok is not None and ok.ok and ok.values == ["PONG"], ok
    assert failed is not None and not failed.ok
    healthy.close()
    cut_off.close()
