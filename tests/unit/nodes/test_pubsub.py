"""Parsing what a subscriber receives, without redis-py's parser (issue 27, P8): whole
messages however the bytes are cut, several in one read, errors raised; and against a
real server, the shapes it sends."""

from __future__ import annotations

import socket
from types import SimpleNamespace

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from celery_redlock.base.poll import readable
from celery_redlock.nodes import Node
from celery_redlock.nodes.pubsub import PubSubReader
from tests.harness import wait_for

MESSAGE = b"*3\r\n$7\r\nmessage\r\n$11\r\nredlock:{a}\r\n$8\r\ntok 1234\r\n"
CONFIRM = b"*3\r\n$9\r\nsubscribe\r\n$11\r\nredlock:{a}\r\n:1\r\n"


@pytest.fixture
def pair():
    ours, theirs = socket.socketpair()
    conn = SimpleNamespace(_sock=ours, encoder=SimpleNamespace(encoding="utf-8"))
    yield PubSubReader(conn), theirs  # type: ignore[arg-type]  # what it reads of one
    ours.close()
    theirs.close()


def test_messages_cut_anywhere_come_out_whole_and_in_order(pair):
    reader, server = pair
    stream = CONFIRM + MESSAGE + MESSAGE.replace(b"tok 1234", b"abcdefgh")
    got = []
    for cut in range(1, len(stream), 7):  # every 7 bytes: inside lengths, data, CRLF
        server.sendall(stream[cut - 1 : cut + 6])
        wait_for(lambda: readable([reader._sock], 0), timeout=5)
        got += reader.read()
    assert got == [
        ["subscribe", "redlock:{a}", 1],
        ["message", "redlock:{a}", "tok 1234"],
        ["message", "redlock:{a}", "abcdefgh"],
    ]


def test_several_messages_in_one_read_and_resp3_pushes(pair):
    reader, server = pair
    server.sendall(
        MESSAGE + MESSAGE.replace(b"*3", b">3", 1) + b"*3\r\n$7\r\nmessage\r\n$1\r\nc\r\n$0\r\n\r\n"
    )
    wait_for(lambda: readable([reader._sock], 0), timeout=5)
    assert reader.read() == [
        ["message", "redlock:{a}", "tok 1234"],
        ["message", "redlock:{a}", "tok 1234"],
        ["message", "c", ""],
    ]


def test_an_error_reply_is_raised_and_a_closed_connection_said(pair):
    reader, server = pair
    server.sendall(b"-NOPERM no permissions to access one of the channels\r\n")
    wait_for(lambda: readable([reader._sock], 0), timeout=5)
    with pytest.raises(ResponseError, match="NOPERM"):
        reader.read()
    server.close()
    with pytest.raises(RedisConnectionError):
        reader.read()


def test_a_real_subscription_reads_as_redis_py_would(redis_node):
    node = Node(redis_node.url, timeout=1.0)
    conn = node.new_connection()
    conn.connect()
    client = redis_node.client()
    try:
        reader = PubSubReader(conn)
        conn.send_command("SUBSCRIBE", "redlock:{real}:released")
        client.publish("redlock:{real}:released", "token 42")
        got: list = []

        def two_read() -> bool:
            if readable([conn._sock], 0):
                got.extend(reader.read())
            return len(got) >= 2

        wait_for(two_read, timeout=5)
        assert got == [
            ["subscribe", "redlock:{real}:released", 1],
            ["message", "redlock:{real}:released", "token 42"],
        ]
    finally:
        client.close()
        conn.disconnect()
        node.close()
