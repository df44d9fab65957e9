"""Where a handoff's time goes (issue 27, P8 and P6f): a diagnostic, not a target.

Run from the repository root::

    python -m benchmarks.trace_p8 --procs 2 --seconds 3            # P8's shape
    python -m benchmarks.trace_p8 --procs 1 --threads 8 --fair     # P6f's shape

Processes x threads take and release one lock with no hold, for celery_redlock and
python-redis-lock on one redis-server. Each thread stamps its acquisitions with
``time.perf_counter()`` (CLOCK_MONOTONIC on Linux: one clock for every process of the
host), so the merged stamps say how often the next holder is the one that released (no
other was woken) and how long the gap between two different holders is. For
celery_redlock each process also stamps the steps of a wake-up, by wrapping the
listener's poll and dispatch and the waiter's wake-up:

- ``release returned -> next holder``: the previous holder's release returned; the
  next holds the lock (every handoff);
- ``release returned -> reader woke``: this process's reader of the pub/sub connection
  came back from its poll (the grant's PUBLISH arrived): the listener thread, or the
  waiting thread itself when it is the process's only waiter (``_Listener.read_for``);
- ``reader woke -> dispatched``: the reader read and parsed the message;
- ``dispatched -> waiter running``: the hop from the listener thread to the waiting
  thread (a lock released, the GIL handed over), or, for a waiter that read the
  message itself, the end of its read;
- ``waiter running -> holding``: the waiter built and recorded its hold;
- ``holding -> released``: the whole release call (one script call).

The reader's steps are counted for the handoffs that went through the pub/sub
connection: a grant to a thread of the releasing process is woken by the releasing
thread itself.

The wrappers cost a few microseconds each: compare runs of this script with each other,
not with the benchmarks' figures.
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing
import os
import statistics
import threading
import time
from typing import Any

from tests.harness import RedisServer

STEPS = (
    ("relret", "poll", "release returned -> reader woke"),
    ("poll", "disp", "reader woke -> dispatched"),
    ("disp", "woke", "dispatched -> waiter running"),
    ("woke", "got", "waiter running -> holding"),
)


def _instrument(stamps: list[tuple[str, float, int]]) -> None:
    """Wrap the listener's poll and dispatch and the waiter's wake-up to stamp them."""
    from celery_redlock.engine import waiting

    clock, me = time.perf_counter, threading.get_ident
    readable, dispatch, wait = waiting.readable, waiting._Listener._dispatch, waiting.Wakeup.wait

    def stamped_readable(objects: Any, timeout: float | None) -> Any:
        ready = readable(objects, timeout)
        stamps.append(("poll", clock(), 0))  # the reader's: one at a time per process
        return ready

    def stamped_dispatch(self: Any, message: Any) -> None:
        stamps.append(("disp", clock(), 0))
        dispatch(self, message)

    def stamped_wait(self: Any, timeout: float | None = None) -> bool:
        woke = wait(self, timeout)
        stamps.append(("woke", clock(), me()))
        return woke

    waiting.readable = stamped_readable  # type: ignore[assignment]
    waiting._Listener._dispatch = stamped_dispatch  # type: ignore[method-assign]
    waiting.Wakeup.wait = stamped_wait  # type: ignore[method-assign]


def _process(
    kind: str, url: str, threads: int, fair: bool, start_at: float, deadline: float, out: Any
) -> None:
    stamps: list[tuple[str, float, int]] = []
    if kind == "celery_redlock":
        _instrument(stamps)
    clock, me = time.perf_counter, threading.get_ident

    def contend() -> None:
        if kind == "celery_redlock":
            from celery_redlock import Redlock

            lock: Any = Redlock("trace", nodes=[url], ttl=30, fair=fair)
        else:
            import redis
            import redis_lock

            lock = redis_lock.Lock(redis.Redis.from_url(url), "trace", expire=30)
        time.sleep(max(0.0, start_at - time.monotonic()))
        while time.monotonic() < deadline:
            if lock.acquire(timeout=5):
                stamps.append(("got", clock(), me()))
                lock.release()
                stamps.append(("relret", clock(), me()))

    workers = [threading.Thread(target=contend) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    out.put((os.getpid(), stamps))


def _us(values: list[float]) -> str:
    if not values:
        return "-"
    p50, mean = statistics.median(values) * 1e6, statistics.mean(values) * 1e6
    return f"p50 {p50:6.0f} us  mean {mean:6.0f} us"


def trace(kind: str, url: str, procs: int, threads: int, fair: bool, seconds: float) -> None:
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    start_at = time.monotonic() + 2.0  # spawned interpreters start in about a second
    args = (kind, url, threads, fair, start_at, start_at + seconds, out)
    workers = [ctx.Process(target=_process, args=args) for _ in range(procs)]
    for worker in workers:
        worker.start()
    results = [out.get(timeout=60 + seconds) for _ in workers]
    for worker in workers:
        worker.join(10)
    # (time, process, thread (0: the listener's), what)
    events = sorted((t, pid, tid, what) for pid, stamps in results for what, t, tid in stamps)
    holds = [(t, (pid, tid)) for t, pid, tid, what in events if what == "got"]
    pairs = list(itertools.pairwise(holds))
    again = [b[0] - a[0] for a, b in pairs if a[1] == b[1]]
    handoffs = [b[0] - a[0] for a, b in pairs if a[1] != b[1]]
    shape = f"{procs} process(es) x {threads} thread(s){', fair' if fair else ''}"
    print(
        f"{kind}, {shape}: {len(holds) / seconds:,.0f} acquisitions/s; the next holder is "
        f"the one that released {len(again) / max(1, len(pairs)):.0%} of the time"
    )
    print(f"  holder to holder, the same one:   {_us(again)}")
    print(f"  holder to holder, another one:    {_us(handoffs)}")
    if kind != "celery_redlock":
        return
    # Each wake-up, from the other holders' last release before it; the listener's
    # steps where it carried the wake-up (none when the releaser woke a thread of its
    # own process itself).
    last: dict[tuple[int, int, str], float] = {}
    gaps: dict[str, list[float]] = {label: [] for *_, label in STEPS}
    to_next: list[float] = []
    releases: list[float] = []
    for t, pid, tid, what in events:
        last[(pid, tid, what)] = t
        if what == "relret" and (pid, tid, "got") in last:
            releases.append(t - last[(pid, tid, "got")])
        if what != "got":
            continue
        others = [v for (p, h, w), v in last.items() if w == "relret" and (p, h) != (pid, tid)]
        released = max(others, default=0.0)
        if not 0 < t - released < 0.01:
            continue
        to_next.append(t - released)
        steps = [last.get((pid, 0, "poll"), 0.0), last.get((pid, 0, "disp"), 0.0)]
        chain = [released, *steps, last.get((pid, tid, "woke"), 0.0), t]
        if all(a < b for a, b in itertools.pairwise(chain)):
            for (*_, label), (a, b) in zip(STEPS, itertools.pairwise(chain), strict=True):
                gaps[label].append(b - a)
    print(f"  {'release returned -> next holder':36s} {_us(to_next)}  ({len(to_next)})")
    for label, values in gaps.items():
        print(f"  {label:36s} {_us(values)}  ({len(values)} read from pub/sub)")
    print(f"  {'holding -> released':36s} {_us(releases)}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--procs", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="threads per process")
    parser.add_argument("--fair", action="store_true", help="celery_redlock with fair=True")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--locks", default="celery_redlock,python-redis-lock")
    args = parser.parse_args(argv)
    with RedisServer() as server:
        for kind in args.locks.split(","):
            trace(kind, server.url, args.procs, args.threads, args.fair, args.seconds)


if __name__ == "__main__":
    main()
