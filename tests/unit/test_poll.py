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
from celery_redlock.poll import readable
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
