"""Prometheus metrics: absent unless enabled, and counting what happens when enabled."""

from __future__ import annotations

import subprocess
import sys

import pytest
from prometheus_client import CollectorRegistry

from celery_redlock import LockLost, Redlock
from celery_redlock.base import metrics
from celery_redlock.engine.lease import clock
from celery_redlock.engine.renewal import get_renewer
from tests.harness import wait_for


@pytest.fixture
def registry(metrics_registry):
    return metrics_registry


def value(registry, name, **labels):
    return registry.get_sample_value(name, labels) or 0.0


def test_metrics_are_off_and_free_by_default():
    """Importing the package does not import prometheus_client or enable anything."""
    probe = (
        "import sys, celery_redlock; "
        "assert 'prometheus_client' not in sys.modules; "
        "assert celery_redlock.base.metrics.enabled is False; print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ok"


@pytest.mark.smoke
def test_acquire_busy_release_lost_and_renewal_are_counted(redis_node, registry):
    """Each lock event moves its counter; the held gauge follows; ticks are timed."""
    lock = Redlock("job", nodes=[redis_node.url], ttl=1.2, task_name="proj.sync")
    other = Redlock("job", nodes=[redis_node.url], ttl=1.2)
    assert lock.acquire()
    assert not other.acquire(blocking=False)
    assert value(registry, "redlock_acquisitions_total", task="proj.sync") == 1
    assert value(registry, "redlock_busy_total", task="-") == 1
    assert value(registry, "redlock_locks_held") == 1
    assert value(registry, "redlock_acquire_seconds_count", task="proj.sync") == 1
    wait_for(lambda: value(registry, "redlock_renew_tick_seconds_count") >= 1, timeout=5)
    lock.release()
    assert value(registry, "redlock_released_total", task="proj.sync") == 1
    assert value(registry, "redlock_hold_seconds_count", task="proj.sync") == 1
    assert value(registry, "redlock_locks_held") == 0

    lost = []
    victim = Redlock(
        "job2", nodes=[redis_node.url], ttl=1.2, task_name="proj.sync", on_lost=lost.append
    )
    assert victim.acquire()
    redis_node.client().delete(victim.key)
    wait_for(lambda: lost, timeout=5)
    assert isinstance(lost[0], LockLost)
    assert value(registry, "redlock_lost_total", task="proj.sync") == 1
    assert value(registry, "redlock_locks_held") == 0
    victim.release()
    assert value(registry, "redlock_released_total", task="proj.sync") == 1, "a lost lock"


def test_a_lock_an_earlier_test_left_held_does_not_move_the_metrics(redis_node, drain_renewer):
    """A lease left renewing by an earlier test was lost once the next test flushed its
    server, and its loss decremented that test's gauge (-2.0 seen). The harness drains
    the renewer between tests: such a lease is never renewed or reported again."""
    lost = []
    left = Redlock("left-held", nodes=[redis_node.url], ttl=0.6, on_lost=lost.append)
    assert left.acquire()
    drain_renewer(get_renewer())  # the end of the "earlier test"
    registry = CollectorRegistry()
    metrics._metrics.clear()
    metrics.enabled = False
    metrics.enable(registry)
    try:
        redis_node.client().flushall()
        ticks = get_renewer().ticks
        deadline = left.lease.deadline
        wait_for(lambda: clock() > deadline + 0.3, timeout=5, message="the lease's deadline")
        assert not lost
        assert get_renewer().ticks == ticks, "nothing left to renew"
        assert value(registry, "redlock_locks_held") == 0
        assert value(registry, "redlock_lost_total", task="-") == 0
    finally:
        metrics.enabled = False
        metrics._metrics.clear()
