"""The moving parts of the reliability scenarios: servers, holder processes, outcomes.

* :class:`Lab` owns the real redis-server processes and fault proxies of a scenario,
  plus one *storage* server for the history, which no fault ever touches.
* :func:`holder` is the body of one contending OS process (spawned, not forked, so it
  shares nothing with the test process): take the lock, run a recorded critical
  section (fenced write, non-atomic counter increment), release, again; in one thread,
  or in ``threads`` threads with a lock object each (threads x processes, where
  in-process handoffs meet waiters of other processes); or, with ``aio``, as
  ``threads`` asyncio tasks of one event loop with an ``AsyncRedlock`` each (the
  section's blocking calls stall the loop while the other tasks wait in it).
* :func:`run_holders` starts ``processes`` of them, runs a fault script in the test
  process meanwhile, and returns an :class:`Outcome` with the checker's verdict.

The same code serves the quick tests (small counts) and the soak command.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import multiprocessing
import os
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from celery_redlock import AsyncRedlock, LockLost, NodeUnavailable, Redlock
from celery_redlock.engine.lease import clock
from tests.harness.faultproxy import FaultProxy
from tests.harness.history import History, Section, Violation, jain, service
from tests.harness.servers import RedisServer, wait_for

#: Seconds a run may take before the harness gives up on it (a hang is a failure).
RUN_TIMEOUT = 120.0


@dataclass
class Outcome:
    """What one scenario run did and what the checker found."""

    scenario: str
    acquisitions: int = 0
    faults: Counter[str] = field(default_factory=Counter)
    stats: Counter[str] = field(default_factory=Counter)
    violations: list[Violation] = field(default_factory=list)
    duration: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form, for the soak report."""
        return {
            "scenario": self.scenario,
            "acquisitions": self.acquisitions,
            "faults": dict(self.faults),
            "stats": dict(self.stats),
            "violations": [v.__dict__ for v in self.violations],
            "duration_s": round(self.duration, 3),
        }


class Lab:
    """Servers and proxies of scenarios, all closed by :meth:`close`."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self._servers: list[RedisServer] = []
        self._proxies: list[FaultProxy] = []
        self._storage: RedisServer | None = None
        self._runs = itertools.count()

    def servers(self, n: int, *extra_args: str) -> list[RedisServer]:
        """Start ``n`` fresh, independent redis-server processes."""
        started = []
        for _ in range(n):
            server = RedisServer(extra_args, data_dir=self.root / f"redis-{len(self._servers)}")
            self._servers.append(server)
            started.append(server.start())
        return started

    def proxies(self, servers: Sequence[RedisServer]) -> list[FaultProxy]:
        """A fault proxy in front of each server."""
        made = []
        for server in servers:
            assert server.port is not None
            proxy = FaultProxy(server.host, server.port, password=server.password)
            self._proxies.append(proxy)
            made.append(proxy)
        return made

    def lock_servers(self) -> list[RedisServer]:
        """Every server started so far, but the history's storage."""
        return [s for s in self._servers if s is not self._storage]

    def history(self, name: str) -> History:
        """A fresh history namespace on the lab's storage server."""
        if self._storage is None:
            (self._storage,) = self.servers(1)
        return History(self._storage.url, run=f"{name}-{next(self._runs)}")

    def close(self) -> None:
        """Close every proxy and server (each one, even if another fails)."""
        for thing in [*self._proxies, *self._servers]:
            with contextlib.suppress(Exception):
                thing.close()
        self._proxies.clear()
        self._servers.clear()
        self._storage = None


@dataclass(frozen=True)
class Spec:
    """What each holder process does."""

    key: str
    urls: tuple[str, ...]
    history: History
    ttl: float = 2.0
    iterations: int = 50
    #: Pause between the counter's GET and SET: the window a second holder would hit.
    pause: float = 0.001
    #: Extra time spent inside the section (lets renewals and faults happen).
    hold: float = 0.0
    node_timeout: float | None = None
    #: Threads per process, each with its own lock object and ``iterations``.
    threads: int = 1
    #: Run the ``threads`` as asyncio tasks of one event loop, with ``AsyncRedlock``.
    aio: bool = False


def run_section(
    lock: Redlock | AsyncRedlock,
    history: History,
    key: str,
    stats: Counter,
    *,
    pause: float = 0.001,
    hold: float = 0.0,
    release: bool = True,
    asked: float | None = None,
) -> None:
    """One recorded critical section; the lock is held on entry (and released if asked).

    ``asked``: when the holder called ``acquire()`` for it (for the service check).
    An ``AsyncRedlock`` is released by its caller (``release=False``), in its loop.

    ``lock.check()`` comes before every write, as a correct task does; a lease lost in
    between is caught by the lease's own margin, or else by the checker. A LockLost
    raised anywhere in the body (the Celery abort) ends the section and is recorded.
    """
    sid = history.new_section_id()
    start = clock()
    fence = lock.fence
    lost_at = None
    increments = 0
    try:
        lock.check()
        stats["writes" if history.write(key, fence, sid) else "writes_refused"] += 1
        value = history.read_counter(key)
        time.sleep(pause)
        lock.check()
        history.set_counter(key, value + 1)
        increments = 1
        if hold:
            time.sleep(hold)
            lock.check()
    except LockLost:
        lost_at = clock()
        stats["lost"] += 1
    end = clock()
    valid_until = lease_deadline(lock)
    if release:
        assert isinstance(lock, Redlock)
        try:
            lock.release()
        except NodeUnavailable:
            stats["release_failed"] += 1
    history.record(
        Section(key, fence, start, end, os.getpid(), valid_until, lost_at, increments, sid, asked)
    )


def lease_deadline(lock: Redlock | AsyncRedlock) -> float:
    """The last lease deadline the holder knew (confirmed by a quorum).

    Read from the lease itself: ``remaining()`` says 0 once the loss is known, but the
    checker needs when the lease really ended, even for a holder paused past it.
    """
    lease = lock.lease  # the harness's one look inside: the public API hides it on loss
    return lease.deadline if lease is not None else clock()


def holder(spec: Spec, ready: Any, start: Any, stop: Any, results: Any) -> None:
    """Body of one contending process: up to ``spec.iterations`` sections per thread, or
    until stop; the threads' stats summed. Each thread says ``ready`` before it waits
    for ``start``."""
    stats: list[Counter[str]] = [Counter() for _ in range(spec.threads)]
    if spec.aio:
        try:
            asyncio.run(_holder_async(spec, ready, start, stop, stats))
        finally:
            results.put((os.getpid(), dict(sum(stats, Counter()))))
        return
    threads = [
        threading.Thread(target=contend, args=(spec, ready, start, stop, counts))
        for counts in stats
    ]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        results.put((os.getpid(), dict(sum(stats, Counter()))))


def counted(acquired: bool | None, stats: Counter[str]) -> bool:
    """Count one ``acquire()``: held, timed out busy, or ``None`` for NodeUnavailable
    (fail closed: no section without the lock). True when the lock is held."""
    stats[{True: "acquired", False: "busy_timeouts", None: "unavailable"}[acquired]] += 1
    return acquired is True


def contend(spec: Spec, ready: Any, start: Any, stop: Any, stats: Counter[str]) -> None:
    """One thread of a holder process: take the lock, run a section, release, again."""
    lock = Redlock(spec.key, nodes=list(spec.urls), ttl=spec.ttl, node_timeout=spec.node_timeout)
    ready.release()
    start.wait(60)
    asked = None
    while stats["acquired"] < spec.iterations and not stop.is_set():
        asked = clock() if asked is None else asked  # a timed-out wait goes on waiting
        try:
            acquired: bool | None = lock.acquire(timeout=min(1.0, spec.ttl))
        except NodeUnavailable:
            acquired = None
        if not counted(acquired, stats):
            if acquired is None:
                asked = None
                stop.wait(0.05)  # back off; a stop ends the wait at once
            continue
        run_section(
            lock, spec.history, spec.key, stats, pause=spec.pause, hold=spec.hold, asked=asked
        )
        asked = None


async def _holder_async(
    spec: Spec, ready: Any, start: Any, stop: Any, stats: list[Counter[str]]
) -> None:
    """An asyncio holder process: one task per ``stats``, each with an ``AsyncRedlock``."""
    locks = [
        AsyncRedlock(spec.key, nodes=list(spec.urls), ttl=spec.ttl, node_timeout=spec.node_timeout)
        for _ in stats
    ]
    for _ in locks:
        ready.release()
    start.wait(60)  # blocks the loop, before any task runs
    await asyncio.gather(
        *(
            contend_async(lock, spec, stop, counts)
            for lock, counts in zip(locks, stats, strict=True)
        )
    )


async def contend_async(lock: AsyncRedlock, spec: Spec, stop: Any, stats: Counter[str]) -> None:
    """One task of an asyncio holder: :func:`contend`, awaited."""
    asked = None
    while stats["acquired"] < spec.iterations and not stop.is_set():
        asked = clock() if asked is None else asked  # a timed-out wait goes on waiting
        try:
            acquired: bool | None = await lock.acquire(timeout=min(1.0, spec.ttl))
        except NodeUnavailable:
            acquired = None
        if not counted(acquired, stats):
            if acquired is None:
                asked = None
                await asyncio.sleep(0.05)
            continue
        run_section(
            lock,
            spec.history,
            spec.key,
            stats,
            pause=spec.pause,
            hold=spec.hold,
            release=False,
            asked=asked,
        )
        try:
            await lock.release()
        except NodeUnavailable:
            stats["release_failed"] += 1
        asked = None


FaultScript = Callable[["Progress"], None]


class Progress:
    """What the fault script sees of a run: sections recorded so far, and waiting on it."""

    def __init__(self, history: History, outcome: Outcome) -> None:
        self.history = history
        self.outcome = outcome

    def sections(self) -> int:
        """Sections recorded so far."""
        return self.history.count()

    def advance(self, more: int = 5, timeout: float = 60.0) -> None:
        """Wait until ``more`` sections were recorded (the lock works)."""
        target = self.sections() + more
        wait_for(lambda: self.sections() >= target, timeout=timeout, interval=0.02)

    def fault(self, kind: str) -> None:
        """Count a fault injected, by kind."""
        self.outcome.faults[kind] += 1


def run_holders(
    scenario: str,
    lab: Lab,
    urls: Sequence[str],
    processes: int,
    *,
    faults: FaultScript | None = None,
    max_run: int | None = None,
    **spec: Any,
) -> Outcome:
    """Run ``processes`` holders on ``urls`` (and ``faults`` meanwhile); check the history.

    Without a fault script, each holder runs its iterations; with one, holders run until
    the script returns (unless ``iterations`` says otherwise). ``max_run``: also check
    service across processes (see :func:`tests.harness.history.check`), and report
    Jain's index across processes (``stats["jain_processes_x1000"]``).
    """
    if faults is not None:
        spec.setdefault("iterations", 1_000_000)
    history = lab.history(scenario)
    outcome = Outcome(scenario)
    spec_ = Spec(key=scenario, urls=tuple(urls), history=history, **spec)
    ctx = multiprocessing.get_context("spawn")
    ready, start, stop, results = ctx.Semaphore(0), ctx.Event(), ctx.Event(), ctx.Queue()
    procs = [
        ctx.Process(target=holder, args=(spec_, ready, start, stop, results), daemon=True)
        for _ in range(processes)
    ]
    began = time.monotonic()
    for proc in procs:
        proc.start()
    try:
        # Every thread imported and built its lock before any starts: spawned processes
        # start seconds apart on a loaded machine, and a late one used to find the
        # others nearly done (Jain over the moments all wanted the lock: 0.33, from a
        # window of a few sections, in a full run beside a soak).
        for _ in range(processes * spec_.threads):
            if not ready.acquire(timeout=60):
                break  # a holder that never became ready fails below, not here
        start.set()
        if faults is not None:
            faults(Progress(history, outcome))
            stop.set()
        deadline = time.monotonic() + RUN_TIMEOUT
        for _ in procs:
            try:
                _pid, stats = results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"{scenario}: a holder process did not finish") from None
            outcome.stats.update(stats)
        for proc in procs:
            proc.join(30)
            assert proc.exitcode == 0, f"{scenario}: holder exited with {proc.exitcode}"
    finally:
        stop.set()
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(5)
    outcome.duration = time.monotonic() - began
    outcome.acquisitions = outcome.stats["acquired"]
    outcome.violations = history.check(max_run)
    if max_run is not None:
        served = service(history.sections(), contended=True).get(spec_.key, {})
        outcome.stats["jain_processes_x1000"] = round(1000 * jain(served.values()))
    return outcome
