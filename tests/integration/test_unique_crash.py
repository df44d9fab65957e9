"""What a send-time claim (``lock_unique="until_finished"``) does when the whole worker
running its copy is SIGKILLed, with ``acks_late`` and without: the words of
docs/failure-modes.md ("The copy's child is killed, or its whole worker"), tested.

The lease is 3 s (``redlock_ttl``): the dead worker's execution lock is gone well before
the second send, so only the claim can keep it from publishing a second copy.
"""

from __future__ import annotations

import pytest

from tests.apps.unique import make_late_unique_app, make_unique_app
from tests.harness import close_app, unique_nodename, wait_for
from tests.integration.test_unique import claim_holder


def _runs(out):
    return out.read_text().split() if out.exists() else []


def _lock_gone(server):
    return not server.client(db=0).exists("redlock:{item:k}")


@pytest.mark.slow
def test_acks_late_the_claim_outlives_the_dead_worker_and_the_redelivery_runs(
    celery_redis, worker_process_factory, tmp_path
):
    """acks_late: the whole worker is SIGKILLed while the copy runs. Its execution lock
    expires (3 s) and so does the claim's own life from the send (``lock_unique_ttl``,
    2 s), but the copy's start extended the claim by the broker's visibility timeout:
    a send then returns the same copy's AsyncResult and publishes nothing; the broker
    gives the message to another worker, the copy runs again there (the same copy: its
    body starts a second time), ends, and frees the claim; only then does a send publish
    a new copy. (Before: the claim ended with the lease, and that send published a
    second copy, which ran after the redelivered first.)"""
    app = make_late_unique_app(celery_redis.url)
    try:
        task = app.tasks["unique.until_finished.return"]
        gate, out = tmp_path / "gate", tmp_path / "runs"
        first = worker_process_factory(
            "tests.apps.unique:late", name=unique_nodename("late"), pool="prefork", concurrency=1
        )
        copy = task.delay("k", str(gate), str(out))
        wait_for(lambda: _runs(out) == [copy.id], timeout=30, message="the copy to run")
        first.kill()
        wait_for(lambda: _lock_gone(celery_redis), timeout=45, message="the lease to end")
        assert task.delay("k", str(gate), str(out)).id == copy.id, "no second copy"
        assert claim_holder(celery_redis, "k") == copy.id
        gate.touch()
        worker_process_factory(
            "tests.apps.unique:late", name=unique_nodename("late"), pool="prefork", concurrency=1
        )
        assert copy.get(timeout=60) == "k"
        assert _runs(out) == [copy.id, copy.id], "the redelivered copy ran; no other"
        wait_for(lambda: claim_holder(celery_redis, "k") is None, timeout=30)
        fresh = task.delay("k", "", str(out))
        assert fresh.id != copy.id and fresh.get(timeout=60) == "k"
    finally:
        close_app(app)


@pytest.mark.slow
def test_without_acks_late_the_lost_copys_claim_ends_after_lock_unique_ttl(
    celery_redis, worker_process_factory, tmp_path
):
    """Without acks_late the message was acknowledged as the copy started, so the copy
    dies with its worker; nothing is stored. Its claim stays until ``lock_unique_ttl``
    from the send (8 s here) or the dead worker's lease (3 s), whichever ends later: a
    send before then returns the lost copy's AsyncResult (it never finishes); a send
    after it publishes a new copy, which runs."""
    app = make_unique_app(celery_redis.url, redlock_unique_ttl=8.0, redlock_ttl=3.0)
    try:
        task = app.tasks["unique.until_finished.return"]
        gate, out = tmp_path / "gate", tmp_path / "runs"
        first = worker_process_factory("tests.apps.unique", pool="prefork", concurrency=1)
        copy = task.delay("k", str(gate), str(out))
        wait_for(lambda: _runs(out) == [copy.id], timeout=30, message="the copy to run")
        first.kill()
        assert task.delay("k", str(gate), str(out)).id == copy.id, "the claim still holds"
        gate.touch()
        worker_process_factory("tests.apps.unique", pool="prefork", concurrency=1)
        wait_for(
            lambda: claim_holder(celery_redis, "k") is None and _lock_gone(celery_redis),
            timeout=45,
            message="the claim's ttl and the dead worker's lease to end",
        )
        fresh = task.delay("k", "", str(out))
        assert fresh.id != copy.id and fresh.get(timeout=60) == "k"
        assert copy.state == "PENDING", "the lost copy never ran again"
        assert _runs(out) == [copy.id, fresh.id]
    finally:
        close_app(app)
