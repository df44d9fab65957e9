"""The Celery scenario: real ``celery worker`` processes under kills and a cut network.

Two prefork workers (concurrency 2) share one broker and one lock node; worker B
reaches the lock node through a fault proxy and alone consumes the ``cut`` queue, so
faults can be aimed at it; worker A alone consumes ``direct``. Every task body is a
recorded critical section (:mod:`tests.apps.reliable`), and the whole run is checked at
the end.

Phases, in order:

1. contention: ``tasks`` sections on one resource, plus one task id sent twice;
2. SIGKILL of the prefork child holding a 30 s lease: time until its parent frees it;
3. renewal cut: worker B's proxy blackholed while its task runs: the task must fail
   with LockLost before its lease deadline, and worker A's task gets the lock next;
4. SIGKILL of worker B (whole process group) while it holds a 1 s lease: time until
   the lock is free, then worker A runs a task on that resource.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from celery_redlock import LockLost
from celery_redlock.engine.keys import lock_keys
from celery_redlock.integration.names import task_lock_name
from tests.apps.reliable import create_app
from tests.harness.celery_workers import WorkerProcess, close_app, redis_url_with_db
from tests.harness.servers import wait_for
from tests.reliability.workload import Lab, Outcome

RESULT_TIMEOUT = 60
TTL = 1.0


def lock_key(task, resource: str) -> str:
    """The Redis key of ``task``'s lock on ``resource``."""
    name = task_lock_name(task.name, task.run, (resource,), {}, lock_args=("resource",))
    return lock_keys(name).lock


def holder(server, key: str) -> int | None:
    """The pid holding ``key`` on ``server``, if anyone does."""
    pid = server.client().hget(key, "pid")
    return int(pid) if pid else None


def celery_faults(lab: Lab, log_dir: Path, tasks: int = 10) -> Outcome:
    """Run the four phases; the outcome carries release times and the checker's verdict."""
    outcome = Outcome("celery")
    (server,) = lab.servers(1)
    (proxy,) = lab.proxies([server])
    history = lab.history("celery")
    direct = redis_url_with_db(server.url, 0)
    env = {
        "REDLOCK_REL_STORAGE_URL": history.url,
        "REDLOCK_REL_RUN": history.run,
        "REDLOCK_TEST_TTL": str(TTL),
    }
    common = {"redis_url": server.url, "concurrency": 2, "log_dir": log_dir}
    worker_a = WorkerProcess(
        "tests.apps.reliable",
        env={**env, "REDLOCK_REL_LOCK_URL": direct},
        extra_args=("-Q", "celery,direct"),
        **common,
    )
    worker_b = WorkerProcess(
        "tests.apps.reliable",
        env={**env, "REDLOCK_REL_LOCK_URL": proxy.url},
        extra_args=("-Q", "celery,cut"),
        **common,
    )
    app = create_app(server.url, direct)
    section = app.tasks["tests.apps.reliable.section"]
    long_section = app.tasks["tests.apps.reliable.long_section"]
    began = time.monotonic()
    try:
        worker_a.start()
        worker_b.start()

        # 1. contention, and one task id delivered twice
        results = [section.delay("shared", 0.02) for _ in range(tasks)]
        results += [section.apply_async(("shared", 0.3), task_id="same-id") for _ in range(2)]
        for result in results:
            result.get(timeout=RESULT_TIMEOUT)
        outcome.stats["tasks_succeeded"] += len(results)
        # The second delivery of same-id may still be parked; it must not run the body.
        shared = lock_key(section, "shared")
        wait_for(lambda: not server.client().exists(shared), timeout=30, message="shared free")

        # 2. a prefork child SIGKILLed while it holds a 30 s lease
        doomed = long_section.delay("child", 60)
        key = lock_key(long_section, "child")
        child = wait_for(lambda: holder(server, key), timeout=30, message="the child's lock")
        os.kill(child, signal.SIGKILL)
        outcome.faults["child-sigkill"] += 1
        killed = time.monotonic()
        wait_for(lambda: not server.client().exists(key), timeout=30, interval=0.005)
        outcome.stats["child_kill_release_ms"] = round((time.monotonic() - killed) * 1000)
        try:
            doomed.get(timeout=RESULT_TIMEOUT)
        except Exception as exc:  # WorkerLostError: the task says it died
            outcome.stats[f"child_kill_result_{type(exc).__name__}"] += 1
        section.delay("child", 0).get(timeout=RESULT_TIMEOUT)

        # 3. renewal cut under a running task on worker B. The cut waits for the body
        # (its counter increment), not for the lock in Redis: a cut between the
        # acquire script and its reply reaching the child fails the acquisition closed
        # (NodeUnavailable), which is right but not what this phase is about.
        ran = history.read_counter("cut")
        cut = section.apply_async(("cut", 30), queue="cut")
        wait_for(lambda: history.read_counter("cut") > ran, timeout=30, message="worker B's body")
        proxy.blackhole()
        outcome.faults["renewal-blackhole"] += 1
        after = section.apply_async(("cut", 0), queue="direct")  # A: waits, then runs
        try:
            cut.get(timeout=RESULT_TIMEOUT)
        except LockLost:
            outcome.stats["cut_task_aborted"] += 1
        after.get(timeout=RESULT_TIMEOUT)
        proxy.restore()

        # 4. worker B SIGKILLed (with its children) while it holds a 1 s lease
        section.apply_async(("whole", 60), queue="cut")
        key = lock_key(section, "whole")
        wait_for(lambda: holder(server, key), timeout=30, message="worker B's lock")
        worker_b.kill()
        outcome.faults["worker-sigkill"] += 1
        killed = time.monotonic()
        wait_for(lambda: not server.client().exists(key), timeout=10 * TTL, interval=0.005)
        outcome.stats["worker_kill_release_ms"] = round((time.monotonic() - killed) * 1000)
        section.delay("whole", 0).get(timeout=RESULT_TIMEOUT)
        outcome.stats["ran_after_worker_kill"] += 1
    finally:
        for worker in (worker_b, worker_a):
            worker.stop()
        close_app(app)
    outcome.duration = time.monotonic() - began
    sections = history.sections()
    outcome.acquisitions = len(sections)
    outcome.stats["shared_sections"] = sum(s.key == "shared" for s in sections)
    cut_sections = [s for s in sections if s.key == "cut" and s.lost_at is not None]
    outcome.stats["cut_lost_before_deadline"] = sum(s.lost_at < s.valid_until for s in cut_sections)
    outcome.violations = history.check()
    return outcome
