"""Quick mode of the Celery scenario (see :mod:`tests.reliability.celery_scenario`).

Covered elsewhere and not repeated here: Redis down at task start fails closed
(``tests/integration/test_task.py::test_redis_down_fails_closed``), a redelivery after the
holder died (``test_redelivery_after_the_holder_died_still_runs``), the hard time limit
(``tests/integration/test_processes.py::test_hard_time_limit_kill_releases_the_lock``).
"""

from __future__ import annotations

import time

from tests.apps.locked import create_app
from tests.harness import close_app, lock_keys, wait_for
from tests.reliability.celery_scenario import TTL, celery_faults


def test_celery_workers_under_kills_and_a_renewal_cut(lab, tmp_path):
    """Contention, duplicate task id, child and worker SIGKILL, renewal cut: no violation."""
    outcome = celery_faults(lab, tmp_path / "logs", tasks=10)
    assert outcome.violations == [], outcome.as_dict()
    assert outcome.stats["tasks_succeeded"] == 12
    # The task id sent twice did not overlap itself (the checker); that its body ran
    # once is the test below.
    # The parent frees a killed child's 30 s lease itself, long before it could expire.
    assert outcome.stats["child_kill_release_ms"] < 10_000
    assert outcome.stats["child_kill_result_WorkerLostError"] == 1
    # The cut task was stopped, and before its lease deadline.
    assert outcome.stats["cut_task_aborted"] == 1
    assert outcome.stats["cut_lost_before_deadline"] == 1
    # A dead worker's lock expires within one lease (plus the polling of this test).
    assert outcome.stats["worker_kill_release_ms"] < TTL * 1000 + 500
    assert outcome.stats["ran_after_worker_kill"] == 1


def test_a_task_id_delivered_twice_while_the_lock_is_busy_runs_once(
    celery_redis, inprocess_worker_factory, tmp_path, monkeypatch
):
    """Both deliveries wait behind a third task; the first runs, the second must not.

    The lock is released as the body ends, before Celery stores the result: storing
    dup-id's result is slowed by 0.5 s here, so the second delivery takes the key
    while no result is stored yet (before: it ran the body again; the full suite hit
    that window once in three runs)."""
    app = create_app(celery_redis.url)
    backend = type(app.backend)  # each thread has its own backend object
    store_result = backend.store_result

    def slow_store(self, task_id, *args, **kwargs):
        if task_id == "dup-id":
            time.sleep(0.5)  # the gap between the release and the stored result, widened
        return store_result(self, task_id, *args, **kwargs)

    monkeypatch.setattr(backend, "store_result", slow_store)
    try:
        inprocess_worker_factory(app, pool="threads", concurrency=3)
        task = app.tasks["tests.apps.locked.hold_wait"]
        path = tmp_path / "runs"
        blocker = task.delay("dup", str(path), "blocker", 1.0)
        wait_for(path.exists, timeout=30, message="the blocker's body")
        copies = [task.apply_async(("dup", str(path), "dup", 0), task_id="dup-id") for _ in "ab"]
        blocker.get(timeout=30)
        copies[0].get(timeout=30)
        wait_for(lambda: not lock_keys(celery_redis), timeout=30)
        starts = [line for line in path.read_text().splitlines() if line.startswith("start dup")]
        assert len(starts) == 1, f"the body of task id dup-id ran {len(starts)} times"
    finally:
        close_app(app)
