"""A freshly started process whose threads all wait at once: a cold start is not an outage.

Five hundred threads of a new process ask one healthy local node at once: each
opens a connection, loads the scripts and waits for its reply while the others hold
the interpreter. Replies come in time but are read late, past the node timeout. A
blocking acquisition treats a node as down only once it has had
:data:`~celery_redlock.nodes.ALIVE_GRACE` to answer this process and answered nothing
(``acquisition.Core._not_yet_down``); until then a failed attempt is retried, so none of them
reports ``NodeUnavailable`` (from outside, before: 50-58 of 500 on a quiet 2-core
machine; 424 of 500 with the machine loaded; with a node timeout of 20 ms and three
processes spinning, the code that only waited longer inside one request failed 2
runs of 3; it passes there now, but two full suites at once on two cores, a load
average near 8, made 97 of 500 fail at 20 ms, cause not yet established; 14
spinning processes beside one suite did not reproduce it).
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import textwrap
import time

import pytest

from celery_redlock import NodeUnavailable, Redlock
from celery_redlock.testing.servers import WaitTimeout
from tests.harness import wait_for

THREADS = 500

CHILD = textwrap.dedent(
    """
    import collections, sys, threading
    from celery_redlock import NodeUnavailable, Redlock

    url, threads = sys.argv[1], int(sys.argv[2])
    outcomes = collections.Counter()
    go = threading.Event()

    def work():
        lock = Redlock("cold", nodes=[url], ttl=10, node_timeout=0.1)
        go.wait()
        try:
            if lock.acquire(timeout=120):
                outcomes["acquired"] += 1
                lock.release()
            else:
                outcomes["timed out"] += 1
        except NodeUnavailable as exc:
            outcomes["unavailable"] += 1
            print(exc, file=sys.stderr)

    pool = [threading.Thread(target=work) for _ in range(threads)]
    for thread in pool:
        thread.start()
    print("started", flush=True)
    go.set()
    for thread in pool:
        thread.join()
    print(dict(outcomes), flush=True)
    """
)


@pytest.mark.timeout(300)
def test_five_hundred_threads_of_a_fresh_process_wait_without_an_outage(redis_node):
    """The lock is held while the threads start, so every one of them blocks on it at
    once: all 500 acquire it in turn, none reports the healthy node unavailable. A node
    timeout of 100 ms and a busy machine make the late reads certain (CI, before: 3
    of 500 reported it down)."""
    holder = Redlock("cold", nodes=[redis_node.url], ttl=30)
    assert holder.acquire()
    # The machine busy too (two processes spinning), as a worker host under load is:
    # the threads wait longer for the interpreter, the node answers as fast as ever.
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, redis_node.url, str(THREADS)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "started"
        client = redis_node.client()
        # Every thread's first try (a connect, the scripts, a refusal) happens while the
        # lock is held, all at once: held until they are all recorded as waiters, or
        # have failed (the child reports those).
        with contextlib.suppress(WaitTimeout):  # a thread that failed is never recorded
            wait_for(lambda: client.zcard(holder.keys.queue) >= THREADS, timeout=30)
        holder.release()
        out, err = child.communicate(timeout=240)
    finally:
        for process in (child, *burners):
            if process.poll() is None:
                process.kill()
                process.wait(10)
    assert out.strip() == str({"acquired": THREADS}), err[-2000:]


def test_a_blocking_acquisition_still_reports_a_node_that_stopped_answering(redis_factory):
    """The other side of the rule: a node that answered this process, then went silent
    (SIGSTOP) for longer than ALIVE_GRACE, is reported down by a blocking acquisition
    (``NodeUnavailable``), not waited for until the caller's timeout."""
    (server,) = redis_factory(1)
    lock = Redlock("silent", nodes=[server.url], ttl=10, node_timeout=0.05)
    assert lock.acquire()  # the node has answered this process
    lock.release()
    server.pause()
    try:
        started = time.monotonic()
        with pytest.raises(NodeUnavailable):
            lock.acquire(timeout=60)
        assert time.monotonic() - started < 30  # raised, not given up at the timeout
    finally:
        server.resume()


def test_a_blocking_acquisition_of_a_node_never_reached_reports_it(redis_factory):
    """A node that refuses every connection has never answered: reported down once the
    acquisition has given it ALIVE_GRACE, well before the caller's timeout."""
    (server,) = redis_factory(1)
    url = server.url
    server.stop()
    lock = Redlock("refused", nodes=[url], ttl=10, node_timeout=0.05)
    with pytest.raises(NodeUnavailable):
        lock.acquire(timeout=60)
    with pytest.raises(NodeUnavailable):  # and a non-blocking one at once
        lock.acquire(blocking=False)
