"""The pipe protocol between pool children and the worker's main process."""

from __future__ import annotations

import os
import select

import pytest

from celery_redlock.reaper import Reaper, encode


@pytest.fixture
def reaper():
    reaper = Reaper(nodeset=None)
    yield reaper
    for fd in [
        reaper.read_fd,
        reaper.write_fd,
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
