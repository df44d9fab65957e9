"""Mutual exclusion under contention from separate processes, one node and Redlock."""

from __future__ import annotations

import itertools
import multiprocessing
import os
import time
from pathlib import Path

import pytest

from celery_redlock import Redlock

PROCESSES = 4
ITERATIONS = 500


def contend(urls: list[str], iterations: int, counter: str, start, results) -> None:
    """Take the lock ``iterations`` times; record each critical section as data."""
    lock = Redlock("mutex", nodes=urls, ttl=10)
    sections = []
    start.wait(30)
    for _ in range(iterations):
        assert lock.acquire(timeout=120)
        begin = time.monotonic_ns()  # CLOCK_MONOTONIC: one clock for every process
        # A read-modify-write that loses updates if two sections ever overlap.
        path = Path(counter)
        path.write_text(str(int(path.read_text()) + 1))
        end = time.monotonic_ns()
        fence = lock.fence
        lock.release()
        sections.append((begin, end, fence, os.getpid()))
    results.put(sections)


@pytest.mark.parametrize("n_nodes", [1, 5])
def test_no_two_critical_sections_overlap(redis_factory, tmp_path, n_nodes):
    """4 processes x 500 acquisitions: no overlap, no lost update, fences grow in order."""
    servers = redis_factory(n_nodes)
    counter = tmp_path / "counter"
    counter.write_text("0")
    ctx = multiprocessing.get_context("spawn")
    start, results = ctx.Event(), ctx.Queue()
    procs = [
        ctx.Process(
            target=contend,
            args=([s.url for s in servers], ITERATIONS, str(counter), start, results),
        )
        for _ in range(PROCESSES)
    ]
    for proc in procs:
        proc.start()
    start.set()
    sections = []
    for _ in procs:
        sections.extend(results.get(timeout=300))
    for proc in procs:
        proc.join(30)
        assert proc.exitcode == 0
    assert len(sections) == PROCESSES * ITERATIONS, "every acquisition was recorded"
    assert len({pid for *_, pid in sections}) == PROCESSES
    assert int(counter.read_text()) == PROCESSES * ITERATIONS, "an update was lost"
    sections.sort()
    overlaps = [(a, b) for a, b in itertools.pairwise(sections) if b[0] < a[1]]
    assert overlaps == []
    fences = [fence for _, _, fence, _ in sections]
    assert all(b > a for a, b in itertools.pairwise(fences)), (
        "fences must strictly increase in acquisition order"
    )
