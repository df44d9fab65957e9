"""Optional Prometheus metrics (``pip install celery_redlock[metrics]``).

Off by default, and then free: ``prometheus_client`` is not even imported, and every
instrumented spot costs one check of :data:`enabled`. Turn them on with
``redlock_metrics = True``; the worker then serves them on ``redlock_metrics_port`` if
set (see the README for the prefork multiprocess setup).

=================================  =========  =========================================
metric                             type       labels / meaning
=================================  =========  =========================================
``redlock_acquisitions_total``     counter    ``task``: locks taken
``redlock_busy_total``             counter    ``task``: attempts refused, lock held
``redlock_released_total``         counter    ``task``: locks released
``redlock_lost_total``             counter    ``task``: leases lost while held
``redlock_renew_failures_total``   counter    ``task``: renewals not confirmed (retried)
``redlock_duplicates_total``       counter    ``task``: sends that published nothing, a copy
                                              of the key being queued (``lock_unique``)
``redlock_claims_expired_total``   counter    ``task``: copies whose send-time claim was
                                              gone when they started (``lock_unique_ttl``)
``redlock_deferred_total``         counter    ``task``, ``reason``: runs put back on the queue
                                              to wait for their turn: ``rate``
                                              (``lock_rate``), ``busy``
                                              (``lock_on_busy="requeue"``)
``redlock_acquire_seconds``        histogram  ``task``: time to acquire (successful)
``redlock_hold_seconds``           histogram  ``task``: acquisition to release
``redlock_renew_tick_seconds``     histogram  one renewer tick, all its locks
``redlock_renew_lag_seconds``      histogram  how late a tick ran after it was due
``redlock_locks_held``             gauge      locks held now (summed over processes)
=================================  =========  =========================================

``task`` is the task name, or ``-`` for a ``Redlock`` used outside a task.
"""

from __future__ import annotations

from typing import Any

__all__ = ["enable", "enabled"]

#: True once :func:`enable` ran; instrumented code checks it before anything else.
enabled = False

_metrics: dict[str, Any] = {}

_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0)
_HOLD_BUCKETS = (0.01, 0.1, 1.0, 5.0, 15.0, 60.0, 300.0, 1800.0, 7200.0)


def enable(registry: Any = None) -> None:
    """Create the metrics (once) and start recording. ``registry`` is for tests."""
    global enabled  # noqa: PLW0603
    if enabled:
        return
    from prometheus_client import REGISTRY, Counter, Gauge, Histogram  # noqa: PLC0415

    registry = REGISTRY if registry is None else registry
    for name, doc in (
        ("acquisitions", "Locks taken"),
        ("busy", "Acquisition attempts refused because the lock was held"),
        ("released", "Locks released"),
        ("lost", "Leases lost while held"),
        ("renew_failures", "Renewals not confirmed by a quorum (retried)"),
        ("duplicates", "Sends that published nothing: a copy of the key was queued"),
        ("claims_expired", "Copies whose send-time claim had expired when they started"),
    ):
        _metrics[name] = Counter(f"redlock_{name}", doc, ["task"], registry=registry)
    _metrics["deferred"] = Counter(
        "redlock_deferred",
        "Runs put back on the queue to wait for their turn (rate budget, busy key)",
        ["task", "reason"],
        registry=registry,
    )
    _metrics["acquire"] = Histogram(
        "redlock_acquire_seconds",
        "Time to acquire a lock",
        ["task"],
        buckets=_LATENCY_BUCKETS,
        registry=registry,
    )
    _metrics["hold"] = Histogram(
        "redlock_hold_seconds",
        "Time from acquisition to release",
        ["task"],
        buckets=_HOLD_BUCKETS,
        registry=registry,
    )
    _metrics["tick"] = Histogram(
        "redlock_renew_tick_seconds",
        "Duration of one renewer tick",
        buckets=_LATENCY_BUCKETS,
        registry=registry,
    )
    _metrics["lag"] = Histogram(
        "redlock_renew_lag_seconds",
        "How late a renewer tick ran after it was due",
        buckets=_LATENCY_BUCKETS,
        registry=registry,
    )
    _metrics["held"] = Gauge(
        "redlock_locks_held", "Locks held now", multiprocess_mode="livesum", registry=registry
    )
    enabled = True


def _task(task: str | None) -> str:
    return task or "-"


def acquired(task: str | None, seconds: float) -> None:
    """A lock was taken after ``seconds`` of trying."""
    label = _task(task)
    _metrics["acquisitions"].labels(label).inc()
    _metrics["acquire"].labels(label).observe(seconds)
    _metrics["held"].inc()


def busy(task: str | None) -> None:
    """An attempt found the lock held."""
    _metrics["busy"].labels(_task(task)).inc()


def released(task: str | None, held_for: float) -> None:
    """A held lock was released after ``held_for`` seconds."""
    label = _task(task)
    _metrics["released"].labels(label).inc()
    _metrics["hold"].labels(label).observe(held_for)
    _metrics["held"].dec()


def lost(task: str | None) -> None:
    """A held lease was lost."""
    _metrics["lost"].labels(_task(task)).inc()
    _metrics["held"].dec()


def renew_failed(task: str | None) -> None:
    """A renewal was not confirmed and will be retried."""
    _metrics["renew_failures"].labels(_task(task)).inc()


def duplicate(task: str | None) -> None:
    """A send found a copy of its key queued and published nothing."""
    _metrics["duplicates"].labels(_task(task)).inc()


def deferred(task: str | None, reason: str) -> None:
    """A run went back on the queue to wait: ``rate`` (its budget) or ``busy`` (its key)."""
    _metrics["deferred"].labels(_task(task), reason).inc()


def claim_expired(task: str | None) -> None:
    """A copy started, or ended, after its send-time claim had expired."""
    _metrics["claims_expired"].labels(_task(task)).inc()


def tick(seconds: float, lag: float) -> None:
    """A renewer tick took ``seconds`` and started ``lag`` seconds after it was due."""
    _metrics["tick"].observe(seconds)
    _metrics["lag"].observe(max(0.0, lag))


def serve(port: int) -> None:
    """Serve /metrics on ``port``; with ``PROMETHEUS_MULTIPROC_DIR`` set, for all processes."""
    import os  # noqa: PLC0415

    from prometheus_client import CollectorRegistry, start_http_server  # noqa: PLC0415

    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess  # noqa: PLC0415

        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        start_http_server(port, registry=registry)
    else:
        start_http_server(port)


def process_died(pid: int) -> None:
    """Forget a dead pool process's live gauges (prefork multiprocess mode)."""
    import os  # noqa: PLC0415

    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess  # noqa: PLC0415

        multiprocess.mark_process_dead(pid)
