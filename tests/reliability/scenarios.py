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
import signal
import time
from collections import Counter
from typing import Any
from unittest import mock

from celery_redlock import LockLost, NodeUnavailable, Redlock
from celery_redlock.engine import handoff
from celery_redlock.engine.lease import clock
from tests.harness.history import History, Section
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
