"""Descriptors numbered 1024 and up: ``select.select`` refuses them, and a process with
many files open (a web server, a busy worker) gets such numbers for every new socket.
Found by the full test suite, whose process reached descriptor 1114: every lock call
failed with ``ValueError: filedescriptor out of range in select()``."""

from __future__ import annotations

import contextlib
import os
import resource
import socket
import threading

from celery_redlock import Redlock
from celery_redlock.base.poll import readable
from tests.harness import wait_for

HIGH = 1100


@contextlib.contextmanager
def low_descriptors_taken():
    """Every descriptor below HIGH in use, so new sockets get numbers above it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < HIGH + 200:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, HIGH + 200), hard))
    taken = []
    try:
        fd = os.open(os.devnull, os.O_RDONLY)
        taken.append(fd)
        while fd < HIGH:
            fd = os.dup(taken[0])
            taken.append(fd)
        yield
    finally:
        for fd in taken:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_readable_says_what_select_says_for_any_descriptor_number():
    with low_descriptors_taken():
        a, b = socket.socketpair()
        try:
            assert a.fileno() > 1024
            assert readable([a], 0) == []
            b.send(b"x")
            assert readable([a, b.fileno()], 1.0) == [a]
            b.close()
            a.recv(1)
            assert readable([a], 1.0) == [a], "end of stream is readable"
        finally:
            a.close()
            b.close()


def test_a_lock_works_in_a_process_with_descriptors_above_1024(redis_node):
    """Acquire, a blocking waiter woken by the release (the listener), renewal (the
    renewer), release: every wait the library makes, on sockets numbered above 1024."""
    with low_descriptors_taken():
        holder = Redlock("many-fds", nodes=[redis_node.url], ttl=1.0)
        assert holder.acquire(blocking=False)
        got = []
        waiter = Redlock("many-fds", nodes=[redis_node.url], ttl=1.0)

        def wait_and_release():
            got.append(waiter.acquire(timeout=10))
            waiter.release()

        thread = threading.Thread(target=wait_and_release)
        thread.start()
        # The holder's lease is renewed at least once meanwhile (ttl 1 s: every ~0.33 s).
        renewed = holder.lease.deadline
        wait_for(lambda: holder.lease.deadline > renewed, timeout=5)
        holder.release()
        thread.join(10)
        assert got == [True]


def test_buffered_tells_a_reply_read_but_not_parsed_without_reading_the_socket(redis_node):
    """Two replies that arrive in one read: after the first is parsed, ``buffered``
    says the second is there (the socket says nothing: it was read); after the
    second, that nothing is. It asks the socket nothing: ``can_read(0)`` costs a read
    and two mode changes of the socket per reply (issue 27)."""
    import redis
    from redis._parsers import _RESP2Parser

    from celery_redlock.base.poll import buffered

    # redis-py's own parser (hiredis, where installed, is one buffered() cannot read).
    conn = redis.Connection(host=redis_node.host, port=redis_node.port, parser_class=_RESP2Parser)
    conn.connect()
    try:
        conn.send_packed_command(conn.pack_commands([("PING",), ("PING",)]))
        wait_for(lambda: readable([conn._sock], 0), timeout=5)
        wait_for(lambda: buffered(conn) or conn.can_read(0), timeout=5)
        assert conn.read_response() in (b"PONG", "PONG")
        if not buffered(conn):  # the second came in a later segment: wait for it
            wait_for(lambda: conn.can_read(0), timeout=5)
        assert buffered(conn) is True
        assert not readable([conn._sock], 0)  # in the buffer, not in the socket
        assert conn.read_response() in (b"PONG", "PONG")
        assert buffered(conn) is False
    finally:
        conn.disconnect()
    assert buffered(object()) is None  # a parser it does not know: the caller asks
