"""The reliability scenarios on locks, each one function returning a checked :class:`Outcome`.

Quick tests call them with small counts; ``python -m tests.reliability.soak`` calls
them again and again with larger ones. Every scenario runs real redis-server
processes; contention, node faults, network faults and the process pause use real
OS processes as holders. An expectation that does not hold raises AssertionError.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import random
import signal
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any
from unittest import mock

from celery_redlock import LockLost, NodeUnavailable, Redlock
from celery_redlock.engine import handoff
from celery_redlock.engine.keys import YIELD_MARK
from celery_redlock.engine.lease import clock
from tests.harness.history import History, Section, Violation
from tests.harness.servers import wait_for
from tests.reliability.workload import Lab, Outcome, Progress, lease_deadline, run_holders

#: A lease short enough that expiries happen within a quick test.
TTL = 1.0


def contention(lab: Lab, nodes: int, processes: int = 8, iterations: int = 25) -> Outcome:
    """``processes`` OS processes take one lock ``iterations`` times each."""
    servers = lab.servers(nodes)
    return run_holders(
        f"contention-{nodes}", lab, [s.url for s in servers], processes, iterations=iterations
    )


#: Sections of one process in a row while a thread of another waits, at most: its turn
#: (TURN.handoffs handoffs, so one more hold), three times: a waiter that misses a
#: reservation (woken later than TURN.reserve_ms on a loaded machine, or a split vote
#: on several nodes, whose undo frees the reserved lock there) waits for one more
#: turn, which may begin before the one it missed has ended.
MAX_RUN = 3 * (handoff.TURN.handoffs + 1)


def mixed(
    lab: Lab,
    nodes: int,
    processes: int = 3,
    threads: int = 3,
    iterations: int = 20,
    *,
    aio: bool = False,
) -> Outcome:
    """``processes`` OS processes of ``threads`` threads each take one lock ``iterations``
    times per thread: in-process handoffs meet waiters of other processes. Besides
    the safety checks, no process may keep the lock among its threads while another
    process waits (at most :data:`MAX_RUN` of its sections in a row), and the
    processes' shares are reported as Jain's index. ``aio``: asyncio tasks with
    ``AsyncRedlock`` instead of threads."""
    servers = lab.servers(nodes)
    urls = [s.url for s in servers]
    return run_holders(
        f"mixed-{'aio-' if aio else ''}{nodes}",
        lab,
        urls,
        processes,
        threads=threads,
        iterations=iterations,
        max_run=MAX_RUN,
        aio=aio,
    )


def node_kill(lab: Lab, nodes: int, down: int, processes: int = 4, rounds: int = 1) -> Outcome:
    """SIGKILL ``down`` of ``nodes`` mid-run; the lock keeps working; restart after one TTL.

    The restart is delayed by the longest lease, as Redlock prescribes for nodes without
    fsync-always persistence: by then every lock the node forgot has expired anyway.
    """
    servers = lab.servers(nodes)

    def script(progress: Progress) -> None:
        for _ in range(rounds):
            progress.advance(5)
            for server in servers[:down]:
                server.kill()
                progress.fault("node-sigkill")
            progress.advance(10)  # a minority down: the lock still works
            time.sleep(TTL)  # the delayed restart itself, not a wait for a condition
            for server in servers[:down]:
                server.start()
                progress.fault("node-restart-delayed")
            progress.advance(5)

    urls = [s.url for s in servers]
    return run_holders(f"node-kill-{down}-of-{nodes}", lab, urls, processes, faults=script, ttl=TTL)


def majority_down(lab: Lab, nodes: int = 3, down: int = 2) -> Outcome:
    """A holder learns of the loss before its deadline; nobody acquires (fail closed)."""
    outcome = Outcome(f"majority-down-{down}-of-{nodes}")
    servers = lab.servers(nodes)
    urls = [s.url for s in servers]
    holder = Redlock("majority", nodes=urls, ttl=TTL)
    assert holder.acquire(blocking=False)
    deadline = lease_deadline(holder)
    for server in servers[:down]:
        server.kill()
        outcome.faults["node-sigkill"] += 1

    def lost() -> bool:
        try:
            holder.check()
        except LockLost:
            return True
        return False

    wait_for(lost, timeout=10 * TTL, message="the holder to learn of the loss")
    learned = clock()
    outcome.stats["lost_before_deadline"] += learned < deadline
    assert holder.lease is not None and holder.lease.lost is not None
    contender = Redlock("majority", nodes=urls, ttl=TTL)
    for blocking in (False, True):
        try:
            contender.acquire(blocking=blocking, timeout=TTL)
        except NodeUnavailable:
            outcome.stats["fail_closed"] += 1
        else:
            raise AssertionError("acquired with a majority of nodes down")
    holder.release()
    for server in servers[:down]:
        server.start()
    return outcome


def restart_without_persistence(lab: Lab, *, delayed: bool) -> Outcome:
    """A Redlock node restarted empty: granted twice if at once, safe if delayed.

    Three nodes without persistence. A acquires while node 3 is down, so only nodes 1
    and 2 hold its key. Node 2 is then SIGKILLed and restarted empty. B asks: node 1
    refuses (A's key), nodes 2 and 3 have never heard of A and grant it: a quorum.
    With the restart delayed by one lease, A's lease has ended before node 2 is back.
    A does not renew here, so its lease stays valid for the whole window; with the
    watchdog on, A learns of the loss at its next renewal, which narrows the window to
    one renewal interval but does not close it.
    """
    outcome = Outcome(f"restart-without-persistence-{'delayed' if delayed else 'immediate'}")
    ttl = 3.0
    servers = lab.servers(3)
    urls = [s.url for s in servers]
    history = lab.history(outcome.scenario)
    a = Redlock("restart", nodes=urls, ttl=ttl, auto_renew=False)
    b = Redlock("restart", nodes=urls, ttl=ttl, auto_renew=False)
    servers[2].kill()
    assert a.acquire(blocking=False), "A is granted by nodes 1 and 2"
    a_start = clock()
    a_fence = a.fence
    history.write("restart", a_fence, "A")
    servers[2].start()
    servers[1].kill()
    outcome.faults["node-sigkill"] += 1
    if delayed:
        time.sleep(ttl)  # the delayed restart
    servers[1].start()
    outcome.faults["node-restart-delayed" if delayed else "node-restart-immediate"] += 1
    # The first call on a connection the restart broke fails (no hidden retries): ask
    # again for a moment, as a blocking acquirer would.
    granted = _granted_within(b, 1.0)
    a_lost = None
    try:
        a.check()
    except LockLost:
        a_lost = clock()
    if granted:
        b_start = clock()
        outcome.stats["b_granted"] += 1
        outcome.stats["b_write_accepted"] += history.write("restart", b.fence, "B")
        history.record(Section("restart", b.fence, b_start, clock(), 2, lease_deadline(b), id="B"))
        outcome.stats["b_fence_above_a"] += b.fence > a_fence
    history.record(
        Section("restart", a_fence, a_start, clock(), 1, lease_deadline(a), a_lost, id="A")
    )
    for lock in (a, b):
        if lock.lease is not None and not lock.lease.released:
            lock.release()
    outcome.acquisitions = 1 + bool(granted)
    outcome.violations = history.check()
    return outcome


def _granted_within(lock: Redlock, seconds: float) -> bool:
    """Try to acquire without blocking until granted or ``seconds`` passed."""
    give_up = time.monotonic() + seconds
    while True:
        try:
            if lock.acquire(blocking=False):
                return True
        except NodeUnavailable:
            pass
        if time.monotonic() >= give_up:
            return False
        time.sleep(0.02)


def network(lab: Lab, processes: int = 4, rounds: int = 1, **spec: Any) -> Outcome:
    """Delay and blackhole one node, then a majority, through fault proxies.

    ``spec``: more of the holders' :class:`~tests.reliability.workload.Spec` (``aio``,
    ``threads``)."""
    servers = lab.servers(3)
    proxies = lab.proxies(servers)

    def inject(progress: Progress, kind: str, targets: list, action: Any) -> None:
        for proxy in targets:
            action(proxy)
        progress.fault(kind)

    def restore(targets: list) -> None:
        for proxy in targets:
            proxy.restore()

    def script(progress: Progress) -> None:
        one, majority = proxies[:1], proxies[:2]
        for _ in range(rounds):
            progress.advance(5)
            for kind, targets, action in (
                ("delay-one", one, lambda p: p.delay(0.05)),
                ("blackhole-one", one, lambda p: p.blackhole()),
                ("delay-majority", majority, lambda p: p.delay(0.02)),
            ):
                inject(progress, kind, targets, action)
                progress.advance(5)  # the lock keeps working
                restore(targets)
            before = progress.sections()
            inject(progress, "blackhole-majority", majority, lambda p: p.blackhole())
            time.sleep(2 * TTL)  # how long the majority stays cut off
            progress.outcome.stats["sections_in_majority_blackhole"] += progress.sections() - before
            restore(majority)
            progress.advance(5)  # and works again once the network heals

    name = "network-aio" if spec.get("aio") else "network"
    urls = [p.url for p in proxies]
    return run_holders(name, lab, urls, processes, faults=script, ttl=TTL, **spec)


def _paused_holder(
    urls: list[str], history: History, holding: Any, resume: Any, results: Any
) -> None:
    """Take the lock, write, then idle until told to resume (SIGSTOPped meanwhile)."""
    lock = Redlock("pause", nodes=urls, ttl=TTL)
    report: dict[str, Any] = {"pid": os.getpid()}
    assert lock.acquire(timeout=10)
    start = clock()
    report["fence"] = lock.fence
    report["first_write"] = history.write("pause", lock.fence, "paused")
    holding.set()
    while not resume.is_set():
        resume.wait(0.01)  # SIGSTOP lands here; after SIGCONT the loop ends
    lost_at = None
    try:
        lock.check()
    except LockLost as exc:
        lost_at = clock()
        report["lost"] = exc.reason
    # A holder that ignored the loss: the register must refuse its write.
    report["late_write"] = history.write("pause", lock.fence, "paused")
    history.record(
        Section(
            "pause",
            lock.fence,
            start,
            clock(),
            os.getpid(),
            lease_deadline(lock),
            lost_at,
            id="paused",
        )
    )
    lock.release()
    results.put(report)


def process_pause(lab: Lab, nodes: int = 1) -> Outcome:
    """SIGSTOP a holder past its lease; the next holder gets in; the paused one is fenced."""
    outcome = Outcome(f"process-pause-{nodes}")
    servers = lab.servers(nodes)
    urls = [s.url for s in servers]
    history = lab.history(outcome.scenario)
    ctx = multiprocessing.get_context("spawn")
    holding, resume, results = ctx.Event(), ctx.Event(), ctx.Queue()
    proc = ctx.Process(
        target=_paused_holder, args=(urls, history, holding, resume, results), daemon=True
    )
    proc.start()
    try:
        assert holding.wait(60), "the holder process never took the lock"
        os.kill(proc.pid, signal.SIGSTOP)
        outcome.faults["process-sigstop"] += 1
        nxt = Redlock("pause", nodes=urls, ttl=TTL)
        assert nxt.acquire(timeout=10 * TTL), "the next holder was let in after the lease"
        start = clock()
        outcome.stats["next_write_accepted"] += history.write("pause", nxt.fence, "next")
        history.record(
            Section("pause", nxt.fence, start, clock(), os.getpid(), lease_deadline(nxt), id="next")
        )
        nxt.release()
        # SIGCONT first: the stopped process may hold the event's internal lock.
        os.kill(proc.pid, signal.SIGCONT)
        outcome.faults["process-sigcont"] += 1
        resume.set()
        try:
            report = results.get(timeout=60)
        except queue.Empty:
            raise AssertionError("the paused holder did not report") from None
        proc.join(30)
    finally:
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.join(5)
    assert report["first_write"], "the first holder's write was accepted"
    assert "lost" in report, "check() raised LockLost after SIGCONT"
    assert not report["late_write"], "the resumed holder's write was refused"
    assert nxt.fence is not None and nxt.fence > report["fence"]
    outcome.stats.update({"paused_check_raised": 1, "paused_write_refused": 1})
    outcome.acquisitions = 2
    outcome.violations = history.check()
    return outcome


def wall_clock_jump(lab: Lab, renewals: int = 4) -> Outcome:
    """The wall clock jumps an hour either way while a lease is held and renewed.

    Only ``time.time`` is patched (it is what NTP or an operator steps); the lease
    clock is CLOCK_BOOTTIME and must not care.
    """
    outcome = Outcome("wall-clock-jump")
    (server,) = lab.servers(1)
    history = lab.history(outcome.scenario)
    real_time = time.time
    offset = [0.0]
    # What is tested is the clock, not how fast a reply comes: a lease and a node
    # budget that a loaded machine does not spend (TTL's 0.1 s budget it did).
    ttl, budget = 4.0, 1.0
    holder = Redlock("clock", nodes=[server.url], ttl=ttl, node_timeout=budget)
    contender = Redlock("clock", nodes=[server.url], ttl=ttl, node_timeout=budget)
    stats: Counter[str] = Counter()
    with mock.patch("time.time", lambda: real_time() + offset[0]):
        assert holder.acquire(blocking=False)
        start = clock()
        history.write("clock", holder.fence, "holder")
        renew_interval = holder.timing.renew_interval
        for i in range(renewals):
            offset[0] = 3600.0 if i % 2 == 0 else -3600.0
            outcome.faults["wall-clock-jump"] += 1
            until = start + (i + 1) * renew_interval
            wait_for(
                lambda until=until: clock() >= until,
                timeout=10 * ttl,
                message="the next renewal period",
            )
            holder.check()  # raises LockLost if the jump had broken the lease
            assert holder.remaining() > 0
            assert not contender.acquire(blocking=False), "the lease held through the jump"
            stats["checks_passed"] += 1
        history.record(
            Section("clock", holder.fence, start, clock(), 1, lease_deadline(holder), id="holder")
        )
        holder.release()
        assert contender.acquire(blocking=False)
        start = clock()
        history.write("clock", contender.fence, "contender")
        history.record(
            Section(
                "clock",
                contender.fence,
                start,
                clock(),
                2,
                lease_deadline(contender),
                id="contender",
            )
        )
        contender.release()
    outcome.stats.update(stats)
    outcome.acquisitions = 2
    outcome.violations = history.check()
    return outcome


# -- issue 37: frozen waiters, moving slow nodes, one slow or blackholed node ----------

#: How long the others may find the lock unusable while a waiter is frozen (issue 37,
#: DESIGN "a minority does not set the pace"), as a share of the lease: a grant or a
#: reservation that the frozen waiter does not take up passes on within one renewal
#: interval (a third of the lease, the longest a release reserves the lock for a named
#: waiter), plus wake-ups on a loaded machine. Without a bound, the lease of a grant
#: nobody takes up (the whole ttl, or longer if renewed) would be the bound.
FREEZE_GAP_SHARE = 0.5


def frozen_waiters(
    lab: Lab,
    processes: int = 4,
    threads: int = 4,
    *,
    ttl: float = 2.0,
    freezes: int = 8,
    freeze_for: float = 2.5,
    between: tuple[float, float] = (2.0, 3.0),
    hold_max: float = 0.002,
) -> Outcome:
    """SIGSTOP a process that only *waits* for the lock, past the lease; SIGCONT; again.

    ``processes`` x ``threads`` contend for one key on one node (renewal on, sections
    of 1 to ``1 + hold_max * 1000`` ms). ``freezes`` times, a process none of whose
    threads holds the lock (the holders say so on a shared board; one that turns out to
    hold it once stopped is resumed at once and another one is picked) is stopped for
    ``freeze_for`` leases, then resumed, and the run goes on for ``between`` leases
    (drawn uniformly) before the next freeze.

    Safety: the history and the fenced register as ever. A resumed waiter that returns
    from ``acquire()`` with a grant made before it was frozen (its lease counted from a
    send it slept through, its fence older than one issued since) shows as an overlap,
    and ``fence_regressions`` counts valid sections whose fence is below that of a
    section that started before them. Service: per freeze, the longest time the lock
    went unused while the other processes waited (from the freeze, between their
    sections, up to the resume): ``freeze_gap_max_ms``; above
    :data:`FREEZE_GAP_SHARE` of the lease it is a ``held-up`` violation.
    """
    servers = lab.servers(1)
    windows: list[tuple[int, float, float]] = []
    histories: list[History] = []
    rng = random.Random()

    def holder_pids() -> set[str]:
        """The pids of the holders the node's lock hashes name (not reservations)."""
        client = servers[0].client()
        locks = [key for key in client.scan_iter("redlock:{*}") if key.endswith("}")]
        fields = [client.hmget(key, "token", "pid") for key in locks]
        return {pid for token, pid in fields if pid and token != YIELD_MARK}

    def freeze_one(progress: Progress) -> tuple[int, int]:
        """Stop a process that holds nothing; its index and pid."""

        def stopped_waiter() -> tuple[int, int] | None:
            idle = [i for i in range(len(progress.pids)) if progress.holding(i) == 0]
            if not idle:
                return None
            index = rng.choice(idle)
            pid = progress.pids[index]
            os.kill(pid, signal.SIGSTOP)
            # The board lags a grant by a moment (a thread handed the lock over in its
            # process has not woken yet, a reply is on its way): let the requests it
            # sent land, then ask the node too.
            time.sleep(0.02)
            if progress.holding(index) == 0 and str(pid) not in holder_pids():
                return index, pid
            os.kill(pid, signal.SIGCONT)  # it took the lock meanwhile
            progress.outcome.stats["freezes_retried"] += 1
            return None

        return wait_for(stopped_waiter, timeout=30, interval=0.001, message="a waiting process")

    def script(progress: Progress) -> None:
        histories.append(progress.history)
        progress.advance(20)
        for _ in range(freezes):
            _index, pid = freeze_one(progress)
            frozen_at = clock()
            progress.fault("waiter-sigstop")
            try:
                time.sleep(freeze_for * ttl)  # the freeze itself
            finally:
                os.kill(pid, signal.SIGCONT)
            windows.append((pid, frozen_at, clock()))
            time.sleep(rng.uniform(*between) * ttl)  # the run goes on between freezes
        progress.advance(20)  # and the lock still works

    outcome = run_holders(
        f"frozen-waiters-{processes}x{threads}",
        lab,
        [s.url for s in servers],
        processes,
        threads=threads,
        faults=script,
        ttl=ttl,
        hold_jitter=hold_max,
    )
    sections = histories[0].sections()
    gaps = [freeze_gap(sections, *window) for window in windows]
    bound = FREEZE_GAP_SHARE * ttl
    outcome.stats["freezes"] = len(windows)
    outcome.stats["freeze_gap_max_ms"] = round(1000 * max(gaps, default=0.0))
    outcome.stats["freeze_gap_median_ms"] = round(1000 * sorted(gaps)[len(gaps) // 2])
    outcome.stats["freeze_gap_bound_ms"] = round(1000 * bound)
    outcome.stats["fence_regressions"] = fence_regressions(sections)
    outcome.violations += [
        Violation(
            "held-up",
            outcome.scenario,
            f"freeze {n} of pid {pid}: the lock went unused for {gap:.3f}s while the "
            f"other processes waited (bound {bound:.3f}s)",
        )
        for n, ((pid, _a, _b), gap) in enumerate(zip(windows, gaps, strict=True))
        if gap > bound
    ]
    return outcome


def freeze_gap(sections: Sequence[Section], pid: int, frozen: float, resumed: float) -> float:
    """The longest time in [``frozen``, ``resumed``] when no process but ``pid`` ran a
    section (from the freeze to the first section that starts after it, between two
    sections, from the last one's end to the resume). The other processes' threads
    wait all along in these scenarios (holds of milliseconds, no think time), so this
    is how long the lock stayed unusable for them."""
    others = sorted(
        (s for s in sections if s.process != pid and s.end > frozen and s.start < resumed),
        key=lambda s: s.start,
    )
    longest, cursor = 0.0, frozen
    for section in others:
        longest = max(longest, section.start - cursor)
        cursor = max(cursor, section.end)
    return max(longest, resumed - cursor)


def fence_regressions(sections: Sequence[Section]) -> int:
    """Valid sections whose fence is below the largest fence of one that started earlier
    (per key): an acquisition handed an old fence (DESIGN: fences only grow)."""
    count = 0
    largest: dict[str, int] = {}
    for section in sorted(sections, key=lambda s: s.start):
        if section.valid_end <= section.start:
            continue  # never valid: its fence protects nothing
        if section.fence < largest.get(section.key, -1):
            count += 1
        largest[section.key] = max(section.fence, largest.get(section.key, -1))
    return count


def moving_slow_nodes(
    lab: Lab,
    processes: int = 3,
    threads: int = 4,
    *,
    keys: int = 4,
    aio: bool = False,
    seconds: float = 30.0,
    hold: float = 0.5,
    ttl: float = 2.0,
    node_timeout: float = 0.1,
    every: tuple[float, float] = (0.2, 0.6),
    delays: tuple[float, float] = (0.03, 0.3),
) -> Outcome:
    """Three nodes behind fault proxies; which one or two are slow changes all the time.

    Every ``every`` seconds (drawn uniformly), one or two of the three proxies (drawn)
    delay each chunk by ``delays`` seconds (drawn per proxy; a round trip takes twice
    that), the others forward at once; for ``seconds``. ``node_timeout`` is shorter than
    most delays, so votes are often split, undone, and decided without a slow node, and
    requests of an attempt reach a node after the next attempt's. Holders (``processes``
    x ``threads`` threads, or asyncio tasks with ``aio``) hold for ``hold`` seconds;
    thread ``n`` of each process takes key ``n % keys`` (each key contended by every
    process, and ``keys`` times the sections a single key would allow).

    While it holds, each holder audits the real nodes (not through the proxies: see
    :class:`~tests.reliability.workload.Auditor`) right after the grant and every 50
    ms: its token must be on a quorum (2 of 3) whenever its local lease is valid. A
    hold found below the quorum is a ``below-quorum`` violation (the stats count them:
    ``sections_below_quorum`` of ``audited_sections``), besides the history's checks.
    """
    servers = lab.servers(3)
    proxies = lab.proxies(servers)
    histories: list[History] = []
    rng = random.Random()

    def script(progress: Progress) -> None:
        histories.append(progress.history)
        progress.advance(3)
        until = time.monotonic() + seconds
        try:
            while time.monotonic() < until:
                slow = rng.sample(proxies, rng.choice((1, 2)))
                for proxy in proxies:
                    if proxy in slow:
                        proxy.delay(rng.uniform(*delays))
                    else:
                        proxy.restore()
                progress.fault(f"slow-{len(slow)}")
                time.sleep(rng.uniform(*every))  # the fault schedule
        finally:
            for proxy in proxies:
                proxy.restore()
        progress.advance(3)  # the lock works once the network heals

    outcome = run_holders(
        f"moving-slow-nodes{'-aio' if aio else ''}",
        lab,
        [p.url for p in proxies],
        processes,
        threads=threads,
        aio=aio,
        faults=script,
        ttl=ttl,
        hold=hold,
        keys=keys,
        node_timeout=node_timeout,
        audit=tuple(s.url for s in servers),
        audit_every=0.05,
    )
    notes = histories[0].notes("below-quorum")
    outcome.violations += [
        Violation(
            "below-quorum",
            note["key"],
            f"fence {note['fence']} (pid {note['pid']}) was on {note['nodes_holding']} of 3 "
            f"nodes with {note['lease_left_ms']} ms of its local lease left, "
            f"{note['since_sent_ms']} ms after its request was sent",
        )
        for note in notes
    ]
    outcome.stats["fence_regressions"] = fence_regressions(histories[0].sections())
    return outcome


#: Kinds of fault :func:`slow_node` puts on one node of three.
NODE_FAULTS = ("none", "slow", "blackhole")


def slow_node(
    lab: Lab,
    fault: str = "slow",
    *,
    aio: bool = False,
    distinct_keys: bool = False,
    workers: int = 4,
    seconds: float = 3.0,
    slow: float = 0.2,
    ttl: float = 2.0,
) -> Outcome:
    """One node of three slow (``slow`` seconds added to each round trip) or blackholed
    (connections accepted, nothing answered) for the whole run, or none (``"none"``:
    the fault-free run to compare with).

    One process of ``workers`` threads (``Redlock``) or asyncio tasks (``AsyncRedlock``,
    ``aio``) takes one key, or a key each (``distinct_keys``), for ``seconds``; every
    node behind a fault proxy, in both runs. The history and the fenced register check
    safety; ``stats["acquired"]`` is the count to compare (``benchmarks/bench_slow_node.py``
    compares the rates). ``stats["pace_bound"]``: the most acquisitions the run could
    make if each one waited once for the faulty node (its round trip, or the node
    budget when that is shorter), per independent chain of acquisitions (one per key).
    """
    if fault not in NODE_FAULTS:
        raise ValueError(f"fault must be one of {NODE_FAULTS}, not {fault!r}")
    servers = lab.servers(3)
    proxies = lab.proxies(servers)
    if fault == "slow":
        proxies[0].delay(slow / 2)  # each way: a round trip takes `slow` longer
    elif fault == "blackhole":
        proxies[0].blackhole()

    def script(progress: Progress) -> None:
        if fault != "none":
            progress.fault(f"node-{fault}")
        time.sleep(seconds)  # how long the run lasts, with the fault on all along

    keys = "distinct" if distinct_keys else "one"
    outcome = run_holders(
        f"slow-node-{fault}-{'aio' if aio else 'threads'}-{keys}-key",
        lab,
        [p.url for p in proxies],
        1,
        threads=workers,
        aio=aio,
        distinct_keys=distinct_keys,
        faults=script,
        ttl=ttl,
        pause=0.0,
    )
    budget = min(0.25, ttl / 10)  # the documented default node_timeout
    wait = min(slow, budget) if fault == "slow" else budget
    chains = workers if distinct_keys else 1
    outcome.stats["window_ms"] = round(1000 * seconds)
    outcome.stats["pace_bound"] = int(chains * seconds / wait)
    return outcome
