"""The pipe protocol between pool children and the worker's main process."""

from __future__ import annotations

import fcntl
import multiprocessing
import os
import select
import threading

import pytest

from celery_redlock import Redlock
from celery_redlock.integration import reaper as reaper_module
from celery_redlock.integration.reaper import Reaper, encode
from celery_redlock.nodes import NodeSet
from celery_redlock.testing.servers import wait_for


@pytest.fixture
def reaper():
    reaper = Reaper(nodeset=None)
    yield reaper
    close_fds(reaper)


def close_fds(reaper):
    for fd in [
        reaper.read_fd,
        reaper.write_fd,
        reaper.hello_r,
        reaper.hello_w,
        reaper._wake_r,
        reaper._wake_w,
        *reaper._pidfds.values(),
    ]:
        os.close(fd)


def test_any_name_key_and_task_id_round_trip_even_interleaved(reaper):
    """Newlines, spaces, non-ASCII, lone surrogates, keys longer than PIPE_BUF: all intact."""
    one, two = os.getpid(), os.getppid()
    long_key = "redlock:{" + "é\n " * select.PIPE_BUF + "}"
    odd = ("id with space\nand newline", "redlock:{odd\nname with spaces:ab}")
    first, second = encode(one, "+", "t1", long_key), encode(two, "+", *odd)
    assert len(first) > 1 and all(len(line) <= select.PIPE_BUF for line in first)
    # Another child's message between the parts of a long one.
    for line in [first[0], *second, *first[1:], *encode(two, "+", "t\ud800", "k")]:
        os.write(reaper.write_fd, line)
    reaper.on_pipe_readable()
    assert reaper._held[one] == {("t1", long_key)}
    assert reaper._held[two] == {odd, ("t\ud800", "k")}
    for line in encode(two, "-", *odd):
        os.write(reaper.write_fd, line)
    reaper.on_pipe_readable()
    assert reaper._held[two] == {("t\ud800", "k")}


def test_an_interrupted_message_does_not_spoil_the_next(reaper):
    """A child that could write only the first part of a message: its next one still parses."""
    pid = os.getpid()
    long_key = "k" * (2 * select.PIPE_BUF)
    os.write(reaper.write_fd, encode(pid, "+", "lost", long_key)[0])
    for line in encode(pid, "+", "t2", "short"):
        os.write(reaper.write_fd, line)
    reaper.on_pipe_readable()
    assert reaper._held[pid] == {("t2", "short")}


@pytest.fixture
def child_side(reaper, monkeypatch):
    """This process plays a pool child that announces on ``reaper``'s pipe."""
    monkeypatch.setattr(reaper_module, "_write_fd", reaper.write_fd)
    monkeypatch.setattr(reaper_module, "_pending", [])
    monkeypatch.setattr(reaper_module, "writes", 0)
    return reaper


def test_a_task_costs_its_child_one_write_and_the_main_process_no_wake_up(child_side):
    """A release waits for the next announcement: one write per task, not two; the
    main process reads on its timer, so what it sees after one read is the net state."""
    reaper = child_side
    for n in range(100):
        reaper_module.announce(f"t{n}", f"k{n}")
        reaper_module.forget(f"t{n}", f"k{n}")
    assert reaper_module.writes == 100
    reaper.on_pipe_readable()
    assert reaper.drains == 1
    assert reaper._held[os.getpid()] == {("t99", "k99")}, "only the last release is pending"
    reaper_module.flush()  # what worker_process_shutdown does
    assert reaper_module.writes == 101
    reaper.on_pipe_readable()
    assert reaper._held[os.getpid()] == set()


def test_what_a_full_pipe_refuses_waits_in_the_child_and_keeps_its_order(child_side):
    """A main process that does not read for a while: the child loses no announcement
    and never blocks; the lines go with its next write, in order."""
    reaper = child_side
    fcntl.fcntl(reaper.write_fd, fcntl.F_SETPIPE_SZ, 4096)
    key = "k" * 200
    sent = 0
    while not reaper_module._pending:
        reaper_module.announce(f"t{sent}", key)
        sent += 1
        assert sent < 1000, "the pipe never filled"
    reaper_module.forget("t0", key)
    reaper.on_pipe_readable()  # the main process reads at last
    reaper_module.announce("last", key)
    assert reaper_module._pending == []
    reaper.on_pipe_readable()
    expected = {(f"t{n}", key) for n in range(1, sent)} | {("last", key)}
    assert reaper._held[os.getpid()] == expected


def test_a_dead_childs_stale_announcement_never_frees_the_next_holder(child_side, redis_node):
    """The child released its lock but died before saying so: the main process asks
    the node to release it for that task id and pid, which the next holder is not."""
    reaper = child_side
    reaper.nodeset = NodeSet.get([redis_node.url], timeout=2.0)
    ours = Redlock("stale", nodes=[redis_node.url], ttl=30, task_id="t-child")
    assert ours.acquire(blocking=False)
    reaper_module.announce("t-child", ours.key)
    ours.release()
    reaper_module.forget("t-child", ours.key)  # pending: the child "dies" now
    theirs = Redlock("stale", nodes=[redis_node.url], ttl=30, task_id="t-next")
    assert theirs.acquire(blocking=False)
    reaper.on_child_exit(os.getpid())
    assert reaper.released == 0
    assert theirs.owned(), "the next holder's lock was released"
    theirs.release()
    # The control: a lock the dead child still held is released.
    ours = Redlock("stale", nodes=[redis_node.url], ttl=30, task_id="t-child")
    assert ours.acquire(blocking=False)
    reaper_module.announce("t-child", ours.key)
    reaper.on_child_exit(os.getpid())
    assert reaper.released == 1
    assert not ours.owned()
    ours.lease.released = True


def test_the_reaper_watches_from_its_own_thread_and_never_touches_the_hub(child_side):
    """Kombu before 5.7 polls the hub's poller in a blocking drain (mingle) and dies on
    an fd it does not know: the reaper registers nothing there. Its thread reads the
    pipe on its interval and stops with the worker."""
    reaper = child_side
    before = {t.name for t in threading.enumerate()}
    reaper.start()
    try:
        assert "celery_redlock-reaper" in {t.name for t in threading.enumerate()} - before
        reaper_module.announce("t1", "k1")
        wait_for(lambda: reaper._held.get(os.getpid()) == {("t1", "k1")}, timeout=10)
        assert reaper.drains >= 1
    finally:
        reaper.stop()
    assert not reaper._thread.is_alive()


def test_a_child_is_watched_from_its_hello_before_it_announces_anything(reaper):
    """A child killed right after taking its lock, before the main process read its
    announcement: it was watched since it started, so its exit is seen at once and the
    pipe read then (a redelivered copy must not find the lock busy for a drain interval)."""
    ctx = multiprocessing.get_context("fork")
    ready = ctx.Event()
    child = ctx.Process(target=_child_says_hello_and_waits, args=(reaper, ready))
    child.start()
    try:
        assert ready.wait(20)
        reaper.on_hello()
        assert child.pid in reaper._pidfds, "not watched from its hello"
        assert reaper.drains == 0
    finally:
        child.kill()
        child.join(20)
    ready_fds, _, _ = select.select([reaper._pidfds[child.pid]], [], [], 10)
    assert ready_fds, "its pidfd did not report the exit"
    reaper.on_child_exit(child.pid)
    assert reaper.drains == 1
    assert child.pid not in reaper._pidfds


def _child_says_hello_and_waits(reaper, ready):
    reaper.child_init()
    ready.set()
    threading.Event().wait(60)  # until killed
