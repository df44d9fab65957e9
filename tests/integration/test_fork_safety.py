"""Fork safety: a child forked while other threads are inside lock calls never hangs.

``fork()`` copies memory, not threads: a lock another thread held at that instant is
held in the child for ever. Prefork workers fork children while the main process's
threads work, so every lock of the package is reset in the child
(:mod:`celery_redlock.base.forksafe`). Each test here bounds every child's first call: the
parent waits for it with a deadline and kills it past that.
"""

from __future__ import annotations

import ast
import contextlib
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from celery_redlock import LockLost, LockNotOwned, NodeUnavailable, Redlock
from celery_redlock.base import forksafe
from celery_redlock.engine import renewal, waiting
from celery_redlock.nodes import NodeSet
from tests.harness.celery_workers import make_app
from tests.harness.servers import wait_for

PACKAGE = Path(__file__).resolve().parents[2] / "celery_redlock"

#: A child's first call may wait this long for a busy lock (acquire's own timeout) ...
CHILD_TIMEOUT = 2.0
#: ... and must have exited by this (generous: a loaded 2-core CI machine).
CHILD_DEADLINE = 30.0

# Forking a process with threads is what this file is about (Python >= 3.12 warns).
pytestmark = pytest.mark.filterwarnings(
    "ignore:This process .* is multi-threaded:DeprecationWarning"
)

LOCK_FACTORIES = ("Lock", "RLock", "Condition", "Semaphore", "BoundedSemaphore")


def test_every_module_that_makes_a_lock_resets_it_through_forksafe():
    """The one place: a module creating a threading lock registers with forksafe."""
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if "testing" in path.parts or path.name == "forksafe.py":
            continue
        tree = ast.parse(path.read_text())
        makes_lock = any(
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in LOCK_FACTORIES
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == "threading"
            for node in ast.walk(tree)
        )
        registers = any(
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "forksafe"
            and node.attr in ("track", "at_fork_in_child")
            for node in ast.walk(tree)
        )
        if makes_lock and not registers:
            offenders.append(str(path.relative_to(PACKAGE)))
    assert not offenders, f"locks not reset in a forked child: {offenders}"
    assert "register_at_fork" not in "".join(
        p.read_text() for p in PACKAGE.rglob("*.py") if p.name != "forksafe.py"
    ), "fork hooks go through celery_redlock.base.forksafe"


def _child_first_call(url: str, name: str) -> int:
    """What a forked child does first: take and release a lock, on the shared nodes."""
    began = time.monotonic()
    lock = Redlock(name, nodes=[url], ttl=5)
    if not lock.acquire(timeout=CHILD_TIMEOUT):
        return 2
    lock.release()
    return 0 if time.monotonic() - began < CHILD_DEADLINE else 3


def fork_and_bound(url: str, name: str, child: Callable[[], int] | None = None) -> int:
    """Fork a child that makes its first lock call (or runs ``child``); its exit code,
    or -1 if it had not exited by :data:`CHILD_DEADLINE` (then it is killed)."""
    pid = os.fork()
    if pid == 0:  # the child: never return into pytest
        code = 1
        try:
            code = child() if child is not None else _child_first_call(url, name)
        finally:
            os._exit(code)
    status: list[int] = []

    def exited() -> bool:
        done, code = os.waitpid(pid, os.WNOHANG)
        if done:
            status.append(code)
        return bool(done)

    try:
        wait_for(exited, timeout=CHILD_DEADLINE, interval=0.005)
    except AssertionError:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        return -1
    return os.waitstatus_to_exitcode(status[0])


@pytest.fixture
def url(redis_node) -> str:
    return redis_node.url


def test_importing_the_package_imports_the_codec_a_first_host_lookup_would():
    """A fresh interpreter that imports celery_redlock has the ``idna`` codec imported:
    no thread of a worker can be the first to import it (``socket.getaddrinfo`` does,
    for a host name) while the main process forks, which left a prefork child hung on
    that import's lock (CI: a child that never ran a task)."""
    code = "import sys, celery_redlock; print('encodings.idna' in sys.modules)"
    found = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True
    )
    assert found.stdout.strip() == "True", found.stderr


def test_a_forked_child_knows_its_own_process_id(url):
    """``forksafe.pid()`` is read once per process: a forked child reads its own, before
    it makes any lock call (holds, leases and process channels are keyed by it)."""
    parent = forksafe.pid()
    assert parent == os.getpid()

    def child() -> int:
        if forksafe.pid() != os.getpid() or forksafe.pid() == parent:
            return 6
        return _child_first_call(url, "pid:child")

    assert fork_and_bound(url, "", child=child) == 0


def test_an_acquire_and_release_ask_the_kernel_for_the_process_id_only_for_sockets(
    url, monkeypatch
):
    """``os.getpid()`` is a system call each time (expensive under a sandbox such as
    gVisor); an acquire and a release asked it 12 times. Now only the connection pool
    asks, once per call, before it hands out a socket (issue 27)."""
    lock = Redlock("pid:count", nodes=[url], ttl=30)
    assert lock.acquire()
    lock.release()
    asked: list[int] = []
    real = os.getpid

    def counted() -> int:
        asked.append(1)
        return real()

    monkeypatch.setattr(os, "getpid", counted)
    assert lock.acquire()
    lock.release()
    monkeypatch.undo()
    assert len(asked) <= 2, len(asked)


def _held_by_another_thread(get_lock: Callable[[], threading.Lock]) -> Iterator[None]:
    """Hold ``get_lock()`` in a thread (not the forking one) until the block ends."""
    taken, done = threading.Event(), threading.Event()

    def hold() -> None:
        with get_lock():
            taken.set()
            done.wait(60)

    thread = threading.Thread(target=hold, daemon=True)
    thread.start()
    assert taken.wait(10)
    try:
        yield
    finally:
        done.set()
        thread.join(10)


def _node(url: str):
    (node,) = NodeSet.get([url], timeout=0.5).nodes
    return node


HELD_AT_FORK: dict[str, Callable[[str], threading.Lock]] = {
    "a node's connection pool": lambda url: _node(url)._lock,
    "the NodeSet registry": lambda url: NodeSet._registry_lock,
    "the renewer registry": lambda url: renewal._renewer_lock,
    "the renewer's start": lambda url: renewal.get_renewer()._start_lock,
    "the listener registry": lambda url: waiting._listeners_lock,
}


@pytest.mark.smoke
@pytest.mark.parametrize("what", sorted(HELD_AT_FORK))
def test_a_lock_held_by_another_thread_at_fork_does_not_hang_the_child(url, what):
    """Deterministic: the lock is held on purpose while the main thread forks."""
    with Redlock("warm", nodes=[url], ttl=5):  # nodes, pools and the renewer exist
        pass
    lock = HELD_AT_FORK[what](url)
    held = _held_by_another_thread(lambda: lock)
    next(held)
    try:
        assert fork_and_bound(url, f"child:{what}") == 0, f"{what} held at fork hung the child"
    finally:
        next(held, None)


def _release_inherited_then_first_call(url: str, inherited: Redlock) -> int:
    try:
        inherited.release()  # the parent's lock: refused, not hung, not released
    except Exception as exc:
        if "forked child" not in str(exc):
            return 4
    else:
        return 5
    return _child_first_call(url, "inherited:child")


def test_a_lease_held_by_a_thread_at_fork_does_not_hang_the_childs_release(url):
    """A lock object inherited by the child, whose lease's own lock was held at fork:
    the child's release is refused at once and its own first call goes through."""
    inherited = Redlock("inherited", nodes=[url], ttl=5)
    assert inherited.acquire(blocking=False)
    held = _held_by_another_thread(lambda: inherited.lease._lock)
    next(held)
    try:
        code = fork_and_bound(
            url, "", child=lambda: _release_inherited_then_first_call(url, inherited)
        )
    finally:
        next(held, None)
    assert code == 0
    assert inherited.owned(), "the child released its parent's lock"
    inherited.release()


def test_children_forked_while_threads_are_inside_every_kind_of_lock_call(url):
    """Threads contend (waiting, handoff), renew, extend and open node sets while the
    main thread forks children: each child's first lock call returns within bounds."""
    stop = threading.Event()
    errors: list[BaseException] = []

    def release_anyway(lock: Redlock) -> None:
        with contextlib.suppress(NodeUnavailable, LockLost, LockNotOwned):
            lock.release()

    def loop(body: Callable[[random.Random], None]) -> Callable[[], None]:
        def run() -> None:
            rng = random.Random()
            try:
                while not stop.is_set():
                    # A loaded machine's slow reply is not what this test is about.
                    with contextlib.suppress(NodeUnavailable, LockLost):
                        body(rng)
            except BaseException as exc:  # pragma: no cover - reported below
                errors.append(exc)

        return run

    def contend(rng: random.Random) -> None:  # blocking waits, pub/sub, handoff
        lock = Redlock("fork:hot", nodes=[url], ttl=1)
        if lock.acquire(timeout=1):
            try:
                time.sleep(rng.random() / 1000)  # a critical section's work
            finally:
                release_anyway(lock)

    def renew_and_extend(rng: random.Random) -> None:  # the renewer; extend
        lock = Redlock(f"fork:renewed:{rng.random()}", nodes=[url], ttl=1.0)
        if lock.acquire(blocking=False):
            try:
                deadline = time.monotonic() + 0.5
                while time.monotonic() < deadline:
                    lock.extend()
            finally:
                # An extend() that failed on a loaded machine must not leave the lock
                # to the collector (a ResourceWarning, which fails the run).
                release_anyway(lock)

    def node_sets(rng: random.Random) -> None:  # the registry
        NodeSet.get([url], timeout=round(rng.uniform(0.1, 2.0), 2))

    bodies = [contend, contend, contend, renew_and_extend, node_sets]
    threads = [threading.Thread(target=loop(b), daemon=True) for b in bodies]
    for thread in threads:
        thread.start()
    try:
        codes = [fork_and_bound(url, f"fork:child:{n}") for n in range(40)]
    finally:
        stop.set()
        for thread in threads:
            thread.join(30)
    assert not errors, errors
    hung = codes.count(-1)
    assert hung == 0 and set(codes) == {0}, f"{hung} of {len(codes)} children hung: {codes}"


@pytest.mark.smoke
def test_a_default_prefork_worker_replaces_children_while_its_threads_take_locks(
    celery_redis, worker_process_factory
):
    """The worker users run: Celery's defaults (mingle, gossip, heartbeat on; they
    killed the worker at start on kombu < 5.7), ``-c 2``, a fresh child per task
    (``max_tasks_per_child=1``) forked while the main process's threads hold and
    release locks on the same nodes. Every task runs, in many children, and the
    worker stops cleanly."""
    worker = worker_process_factory(
        "tests.apps.forking", concurrency=2, extra_args=["--max-tasks-per-child=1"]
    )
    assert "mingle: " in worker.log_text(), "mingle did not run: not Celery's default worker"
    app = make_app(celery_redis.url)
    try:
        results = [app.send_task("tests.apps.forking.pid_of", args=(f"r{n}",)) for n in range(30)]
        pids = [r.get(timeout=CHILD_DEADLINE * 2) for r in results]
    finally:
        app.close()
    assert len(set(pids)) >= 15, f"children were not replaced: {sorted(set(pids))}"
    assert worker.stop() == 0, worker.log_tail()
    assert "Unrecoverable" not in worker.log_text()
