"""Where a cross-process handoff's time goes (issue 27, P8): a diagnostic, not a target.

Run from the repository root::

    python -m benchmarks.trace_p8 --procs 2 --seconds 3

N processes x 1 thread take and release one lock with no hold, as P8 does, for
celery_redlock and python-redis-lock on one redis-server. Each process stamps its
acquisitions with ``time.perf_counter()`` (CLOCK_MONOTONIC on Linux: one clock for every
process of the host), so the merged stamps say how often the next holder is the process
that released (a "barge": no other process was woken) and how long the gap between two
holders of different processes is. For celery_redlock each process also stamps the steps
of its wake-up, by wrapping the listener's poll and dispatch and the waiter's wake-up:

- ``release returned -> listener woke``: the previous holder's release returned; this
  process's listener thread came back from its poll (the grant's PUBLISH arrived);
- ``listener woke -> dispatched``: the listener read and parsed the message;
- ``dispatched -> waiter running``: the hop from the listener thread to the waiting
  thread (a lock released, the GIL handed over);
- ``waiter running -> holding``: the waiter built and recorded its hold;
- ``holding -> released``: the whole release call (one script call).

The wrappers cost a few microseconds each: compare runs of this script with each other,
not with the benchmarks' figures.
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing
import os
import statistics
import time
from typing import Any

from tests.harness import RedisServer

STEPS = (
    ("relret", "poll", "release returned -> listener woke"),
    ("poll", "disp", "listener woke -> dispatched"),
    ("disp", "woke", "dispatched -> waiter running"),
    ("woke", "got", "waiter running -> holding"),
)


def _instrument(stamps: list[tuple[str, float]]) -> None:
    """Wrap the listener's poll and dispatch and the waiter's wake-up to stamp them."""
    from celery_redlock.engine import waiting

    clock = time.perf_counter
    readable, dispatch, wait = waiting.readable, waiting._Listener._dispatch, waiting.Wakeup.wait

    def stamped_readable(objects: Any, timeout: float | None) -> Any:
        ready = readable(objects, timeout)
        stamps.append(("poll", clock()))
        return ready

    def stamped_dispatch(self: Any, message: Any) -> None:
        stamps.append(("disp", clock()))
        dispatch(self, message)

    def stamped_wait(self: Any, timeout: float | None = None) -> bool:
        woke = wait(self, timeout)
        stamps.append(("woke", clock()))
        return woke

    waiting.readable = stamped_readable  # type: ignore[assignment]
    waiting._Listener._dispatch = stamped_dispatch  # type: ignore[method-assign]
    waiting.Wakeup.wait = stamped_wait  # type: ignore[method-assign]


def _process(kind: str, url: str, start_at: float, deadline: float, out: Any) -> None:
    stamps: list[tuple[str, float]] = []
    if kind == "celery_redlock":
        _instrument(stamps)
        from celery_redlock import Redlock

        lock: Any = Redlock("trace", nodes=[url], ttl=30)
    else:
        import redis
        import redis_lock

        lock = redis_lock.Lock(redis.Redis.from_url(url), "trace", expire=30)
    clock = time.perf_counter
    time.sleep(max(0.0, start_at - time.monotonic()))
    while time.monotonic() < deadline:
        if lock.acquire(timeout=5):
            stamps.append(("got", clock()))
            lock.release()
            stamps.append(("relret", clock()))
    out.put((os.getpid(), stamps))


def _us(values: list[float]) -> str:
    if not values:
        return "-"
    p50, mean = statistics.median(values) * 1e6, statistics.mean(values) * 1e6
    return f"p50 {p50:6.0f} us  mean {mean:6.0f} us"


def trace(kind: str, url: str, procs: int, seconds: float) -> None:
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    start_at = time.monotonic() + 2.0  # spawned interpreters start in about a second
    workers = [
        ctx.Process(target=_process, args=(kind, url, start_at, start_at + seconds, out))
        for _ in range(procs)
    ]
    for worker in workers:
        worker.start()
    results = [out.get(timeout=60 + seconds) for _ in workers]
    for worker in workers:
        worker.join(10)
    events = sorted((t, pid, what) for pid, stamps in results for what, t in stamps)
    holds = [(t, pid) for t, pid, what in events if what == "got"]
    pairs = list(itertools.pairwise(holds))
    barges = [b[0] - a[0] for a, b in pairs if a[1] == b[1]]
    handoffs = [b[0] - a[0] for a, b in pairs if a[1] != b[1]]
    print(
        f"{kind}, {procs} processes: {len(holds) / seconds:,.0f} acquisitions/s; next holder is "
        f"the releaser {len(barges) / max(1, len(pairs)):.0%} of the time"
    )
    print(f"  holder to holder, same process:   {_us(barges)}")
    print(f"  holder to holder, other process:  {_us(handoffs)}")
    if kind != "celery_redlock":
        return
    # Each wake-up of a process, from the other processes' last release before it.
    last: dict[tuple[int, str], float] = {}
    gaps: dict[str, list[float]] = {label: [] for *_, label in STEPS}
    releases: list[float] = []
    for t, pid, what in events:
        last[(pid, what)] = t
        if what == "relret" and (pid, "got") in last:
            releases.append(t - last[(pid, "got")])
        if what != "got":
            continue
        others = [last[(p, "relret")] for p, _ in results if p != pid and (p, "relret") in last]
        steps = [last.get((pid, what), 0.0) for what in ("poll", "disp", "woke")]
        chain = [max(others, default=0.0), *steps, t]
        if all(a < b for a, b in itertools.pairwise(chain)) and t - chain[0] < 0.01:
            for (*_, label), (a, b) in zip(STEPS, itertools.pairwise(chain), strict=True):
                gaps[label].append(b - a)
    for label, values in gaps.items():
        print(f"  {label:36s} {_us(values)}  ({len(values)} wake-ups)")
    print(f"  {'holding -> released':36s} {_us(releases)}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--procs", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--locks", default="celery_redlock,python-redis-lock")
    args = parser.parse_args(argv)
    with RedisServer() as server:
        for kind in args.locks.split(","):
            trace(kind, server.url, args.procs, args.seconds)


if __name__ == "__main__":
    main()
