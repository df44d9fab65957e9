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
* :class:`Board`: what the holders and the fault script share without a lock (the stop
  flag, and how many threads of each process hold the lock), so that a holder
  SIGSTOPped at any point cannot block anybody else on a shared semaphore.
* :class:`Auditor`: looks at the lock nodes directly (not through any fault proxy)
  while a section holds the lock, and notes every moment its token was on fewer
  than a quorum of them while its local lease was still valid.

The same code serves the quick tests (small counts) and the soak command.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import multiprocessing
import os
import queue
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

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
    #: A random extra hold, uniform in [0, hold_jitter] seconds, per section.
    hold_jitter: float = 0.0
    node_timeout: float | None = None
    #: Threads per process, each with its own lock object and ``iterations``.
    threads: int = 1
    #: Run the ``threads`` as asyncio tasks of one event loop, with ``AsyncRedlock``.
    aio: bool = False
    #: Each thread (task) takes a lock of its own (``<key>.<pid>.<n>``), not the shared one.
    distinct_keys: bool = False
    #: With more than 1, thread (task) ``n`` of every process takes ``<key>.<n % keys>``:
    #: each key contended by every process, more sections per second in all.
    keys: int = 1
    #: URLs of the lock's real nodes (not the proxies in ``urls``): audit them while held.
    audit: tuple[str, ...] = ()
    #: Seconds between two audits while a section holds the lock (with ``audit``).
    audit_every: float = 0.05


class Board:
    """What the holders and the test process share, with no lock to hold.

    A ``multiprocessing.Event`` or ``Array`` takes a semaphore shared by every process
    on each look; a process SIGSTOPped while it holds one would stop every other
    process at its next look, for as long as it stays stopped: the harness, not the
    lock, would then hold up the others. Plain shared integers are read and written
    whole, and each slot of :attr:`holding` is written by one process only (its
    threads agree through a lock of their own).
    """

    def __init__(self, ctx: Any, processes: int) -> None:
        self.halt = ctx.RawValue("i", 0)
        #: Per holder process: how many of its threads hold the lock right now (from
        #: ``acquire()`` returning True until ``release()`` returned).
        self.holding = ctx.RawArray("i", processes)

    def halted(self) -> bool:
        """True once the test process said stop."""
        return bool(self.halt.value)

    def stop(self) -> None:
        """Tell every holder to stop after its current section."""
        self.halt.value = 1


class Auditor:
    """A holder's direct look at the lock's real nodes while it holds the lock.

    One client per node, straight to the server (a fault proxy delays the lock's own
    requests, never the audit's). An audit reads the lease's deadline and token first,
    then asks every node whether the lock's key holds that token. When fewer than a
    quorum say so although the audit ended before the deadline read at its start (and
    the holder had not learned of a loss), the holder believed it held a lock that a
    quorum did not grant it: noted as ``below-quorum`` in the history.
    """

    #: Whether the key holds the token: any field of a hash, or a string's value (so the
    #: audit does not depend on which of the lock's fields keeps the token).
    HOLDS = """
local kind = redis.call('TYPE', KEYS[1])['ok']
if kind == 'hash' then
    for _, value in ipairs(redis.call('HVALS', KEYS[1])) do
        if value == ARGV[1] then return 1 end
    end
elseif kind == 'string' then
    if redis.call('GET', KEYS[1]) == ARGV[1] then return 1 end
end
return 0
"""

    def __init__(self, urls: Sequence[str], history: History) -> None:
        self.clients = [
            redis.Redis.from_url(url, socket_timeout=2.0, socket_connect_timeout=2.0)
            for url in urls
        ]
        self.quorum = len(urls) // 2 + 1
        self.history = history

    def audit(self, lock: Redlock | AsyncRedlock, stats: Counter[str]) -> bool:
        """One audit of ``lock``'s current hold; True if it found it below a quorum."""
        lease = lock.lease
        if lease is None or lease.lost is not None:
            return False
        deadline, token = lease.deadline, lease.token
        began = clock()
        if began >= deadline:
            return False
        holding = sum(client.eval(self.HOLDS, 1, lock.key, token) == 1 for client in self.clients)
        ended = clock()
        stats["audits"] += 1
        if holding >= self.quorum or ended >= deadline:
            return False
        stats["audits_below_quorum"] += 1
        self.history.note(
            "below-quorum",
            {
                "key": lock.key,
                "fence": lease.fence,
                "pid": os.getpid(),
                "nodes_holding": holding,
                "lease_left_ms": round(1000 * (deadline - ended), 1),
                "since_sent_ms": round(1000 * (ended - lease.sent_at), 1),
            },
        )
        return True


class _Body:
    """One recorded critical section, in steps: :meth:`steps` yields each pause of the
    hold, for its driver to sleep (a thread) or await (an asyncio task)."""

    def __init__(
        self,
        lock: Redlock | AsyncRedlock,
        history: History,
        key: str,
        stats: Counter[str],
        asked: float | None,
        audit_every: float = 0.05,
    ) -> None:
        self.lock, self.history, self.key, self.stats = lock, history, key, stats
        self.asked, self.audit_every = asked, max(0.001, audit_every)
        self.sid = history.new_section_id()
        self.start = clock()
        self.fence = lock.fence
        self.lost_at: float | None = None
        self.increments = 0

    def steps(self, pause: float, hold: float, auditor: Auditor | None) -> Iterator[float]:
        """Write, increment, hold (audited); a LockLost anywhere ends the section.

        ``lock.check()`` comes before every write, as a correct task does; a lease lost
        in between is caught by the lease's own margin, or else by the checker.
        """
        lock, history, key, stats = self.lock, self.history, self.key, self.stats
        below = False
        try:
            if auditor is not None:
                below |= auditor.audit(lock, stats)  # right after the grant
            lock.check()
            stats["writes" if history.write(key, self.fence, self.sid) else "writes_refused"] += 1
            value = history.read_counter(key)
            time.sleep(pause)
            lock.check()
            history.set_counter(key, value + 1)
            self.increments = 1
            left = hold
            while left > 0:
                piece = left if auditor is None else min(left, self.audit_every)
                yield piece
                left -= piece
                if auditor is not None:
                    below |= auditor.audit(lock, stats)
                lock.check()
        except LockLost:
            self.lost_at = clock()
            stats["lost"] += 1
        if auditor is not None:
            stats["audited_sections"] += 1
            stats["sections_below_quorum"] += below

    def section(self) -> Section:
        """The section as recorded (its end is now)."""
        return Section(
            self.key,
            self.fence,
            self.start,
            clock(),
            os.getpid(),
            lease_deadline(self.lock),
            self.lost_at,
            self.increments,
            self.sid,
            self.asked,
        )


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
    auditor: Auditor | None = None,
    audit_every: float = 0.05,
) -> None:
    """One recorded critical section; the lock is held on entry (and released if asked).

    ``asked``: when the holder called ``acquire()`` for it (for the service check).
    An ``AsyncRedlock`` is released by its caller (``release=False``), in its loop.
    ``auditor``: audit the hold on the real nodes right after the grant and every
    ``audit_every`` seconds of the hold.

    ``lock.check()`` comes before every write, as a correct task does; a lease lost in
    between is caught by the lease's own margin, or else by the checker. A LockLost
    raised anywhere in the body (the Celery abort) ends the section and is recorded.
    """
    body = _Body(lock, history, key, stats, asked, audit_every)
    steps = body.steps(pause, hold, auditor)
    for piece in steps:
        try:
            time.sleep(piece)
        except LockLost as lost:
            # The Celery abort lands in the hold, here, outside the body's steps: hand
            # it to them, which record the loss and end the section.
            with contextlib.suppress(StopIteration):
                steps.throw(lost)
            break
    section = body.section()
    if release:
        assert isinstance(lock, Redlock)
        try:
            lock.release()
        except NodeUnavailable:
            stats["release_failed"] += 1
    history.record(section)


async def run_section_async(
    lock: AsyncRedlock,
    spec: Spec,
    key: str,
    stats: Counter[str],
    asked: float | None,
    auditor: Auditor | None,
) -> None:
    """:func:`run_section` for an asyncio task: the hold is awaited (the loop's other
    tasks wait for the lock meanwhile); the GET/SET pause and the audits still block
    the loop, as a synchronous call in a coroutine would. Released here."""
    body = _Body(lock, spec.history, key, stats, asked, spec.audit_every)
    for piece in body.steps(spec.pause, _hold(spec), auditor):
        await asyncio.sleep(piece)
    section = body.section()
    try:
        await lock.release()
    except NodeUnavailable:
        stats["release_failed"] += 1
    spec.history.record(section)


def _hold(spec: Spec) -> float:
    """This section's hold: ``spec.hold`` plus its random part."""
    return spec.hold + (random.uniform(0.0, spec.hold_jitter) if spec.hold_jitter else 0.0)


def lease_deadline(lock: Redlock | AsyncRedlock) -> float:
    """The last lease deadline the holder knew (confirmed by a quorum).

    Read from the lease itself: ``remaining()`` says 0 once the loss is known, but the
    checker needs when the lease really ended, even for a holder paused past it.
    """
    lease = lock.lease  # the harness's one look inside: the public API hides it on loss
    return lease.deadline if lease is not None else clock()


def _key_of(spec: Spec, n: int) -> str:
    """The key thread (task) ``n`` of this process takes."""
    if spec.distinct_keys:
        return f"{spec.key}.{os.getpid()}.{n}"
    return f"{spec.key}.{n % spec.keys}" if spec.keys > 1 else spec.key


class _Marks:
    """This process's slot of :attr:`Board.holding`, counted by its threads."""

    def __init__(self, board: Board, index: int) -> None:
        self.board, self.index = board, index
        self._lock = threading.Lock()  # this process's own: a SIGSTOP blocks nobody else

    def add(self, n: int) -> None:
        with self._lock:
            self.board.holding[self.index] += n


def holder(spec: Spec, ready: Any, start: Any, board: Board, index: int, results: Any) -> None:
    """Body of one contending process (``index`` of the run): up to ``spec.iterations``
    sections per thread, or until the board says stop; the threads' stats summed.
    Each thread says ``ready`` before it waits for ``start``."""
    stats: list[Counter[str]] = [Counter() for _ in range(spec.threads)]
    marks = _Marks(board, index)
    auditor = Auditor(spec.audit, spec.history) if spec.audit else None
    if spec.aio:
        try:
            asyncio.run(_holder_async(spec, ready, start, board, marks, auditor, stats))
        finally:
            results.put((os.getpid(), dict(sum(stats, Counter()))))
        return
    threads = [
        threading.Thread(
            target=contend, args=(spec, ready, start, board, counts, n, marks, auditor)
        )
        for n, counts in enumerate(stats)
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


#: Back-off after a NodeUnavailable (a pause of the workload, not a wait for an event).
BACKOFF = 0.05


def contend(
    spec: Spec,
    ready: Any,
    start: Any,
    board: Board,
    stats: Counter[str],
    n: int = 0,
    marks: _Marks | None = None,
    auditor: Auditor | None = None,
) -> None:
    """One thread of a holder process: take the lock, run a section, release, again."""
    key = _key_of(spec, n)
    lock = Redlock(key, nodes=list(spec.urls), ttl=spec.ttl, node_timeout=spec.node_timeout)
    ready.release()
    start.wait(60)
    asked = None
    while stats["acquired"] < spec.iterations and not board.halted():
        asked = clock() if asked is None else asked  # a timed-out wait goes on waiting
        try:
            acquired: bool | None = lock.acquire(timeout=min(1.0, spec.ttl))
        except NodeUnavailable:
            acquired = None
        if not counted(acquired, stats):
            if acquired is None:
                asked = None
                time.sleep(BACKOFF)
            continue
        if marks is not None:
            marks.add(1)
        try:
            run_section(
                lock,
                spec.history,
                key,
                stats,
                pause=spec.pause,
                hold=_hold(spec),
                asked=asked,
                auditor=auditor,
                audit_every=spec.audit_every,
            )
        finally:
            if marks is not None:
                marks.add(-1)
        asked = None


async def _holder_async(
    spec: Spec,
    ready: Any,
    start: Any,
    board: Board,
    marks: _Marks,
    auditor: Auditor | None,
    stats: list[Counter[str]],
) -> None:
    """An asyncio holder process: one task per ``stats``, each with an ``AsyncRedlock``."""
    keys = [_key_of(spec, n) for n in range(len(stats))]
    locks = [
        AsyncRedlock(key, nodes=list(spec.urls), ttl=spec.ttl, node_timeout=spec.node_timeout)
        for key in keys
    ]
    for _ in locks:
        ready.release()
    start.wait(60)  # blocks the loop, before any task runs
    await asyncio.gather(
        *(
            contend_async(lock, spec, board, counts, marks, auditor, key)
            for lock, counts, key in zip(locks, stats, keys, strict=True)
        )
    )


async def contend_async(
    lock: AsyncRedlock,
    spec: Spec,
    board: Board,
    stats: Counter[str],
    marks: _Marks | None = None,
    auditor: Auditor | None = None,
    key: str | None = None,
) -> None:
    """One task of an asyncio holder: :func:`contend`, awaited."""
    key = spec.key if key is None else key
    asked = None
    while stats["acquired"] < spec.iterations and not board.halted():
        asked = clock() if asked is None else asked  # a timed-out wait goes on waiting
        try:
            acquired: bool | None = await lock.acquire(timeout=min(1.0, spec.ttl))
        except NodeUnavailable:
            acquired = None
        if not counted(acquired, stats):
            if acquired is None:
                asked = None
                await asyncio.sleep(BACKOFF)
            continue
        if marks is not None:
            marks.add(1)
        try:
            await run_section_async(lock, spec, key, stats, asked, auditor)
        finally:
            if marks is not None:
                marks.add(-1)
        asked = None


FaultScript = Callable[["Progress"], None]


class Progress:
    """What the fault script sees of a run: sections recorded so far, and waiting on it;
    the holder processes' pids and how many of each one's threads hold the lock."""

    def __init__(
        self,
        history: History,
        outcome: Outcome,
        pids: Sequence[int] = (),
        board: Board | None = None,
    ) -> None:
        self.history = history
        self.outcome = outcome
        self.pids = list(pids)
        self.board = board

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

    def holding(self, index: int) -> int:
        """How many threads of holder process ``index`` hold the lock right now."""
        assert self.board is not None
        return int(self.board.holding[index])


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
    ready, start, results = ctx.Semaphore(0), ctx.Event(), ctx.Queue()
    board = Board(ctx, processes)
    procs = [
        ctx.Process(target=holder, args=(spec_, ready, start, board, i, results), daemon=True)
        for i in range(processes)
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
            pids = [proc.pid for proc in procs if proc.pid is not None]
            faults(Progress(history, outcome, pids, board))
            board.stop()
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
        board.stop()
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
