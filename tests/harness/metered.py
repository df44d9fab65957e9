"""Make a prefork worker of ``tests.apps.metered`` record every kind of lock event.

Shared by tests/integration/test_grafana_queries.py and scripts/screenshot_metrics.py.
Each step waits until the worker's own ``/metrics`` shows its event (a condition with a
deadline, never a fixed sleep), so that the next step starts from a known state.
"""

from __future__ import annotations

import contextlib
import urllib.request
from pathlib import Path

from celery import Celery

from .servers import RedisServer, wait_for

#: The claim keys of a lock name, as tests/integration/test_unique.py reads them.
CLAIM = "redlock:{%s}:claim"
#: The key of a lock name (``lock_key="hold:{key}"`` is the lock name ``hold:KEY``).
LOCK = "redlock:{%s}"
#: Deadline of one step (a prefork worker on a loaded 2-core machine).
STEP_TIMEOUT = 30.0


def worker_samples(port: int) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """What the worker serves on ``port``: ``{(sample name, labels): value}``."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def worker_sample(port: int, name: str, **labels: str) -> float:
    """One sample's value on the worker's ``/metrics`` (0 when absent or unreachable)."""
    try:
        samples = worker_samples(port)
    except OSError:
        return 0.0
    return samples.get((name, frozenset(labels.items())), 0.0)


class Counted:
    """A ``with`` block whose exit waits until the worker's sample ``name{labels}`` went
    past its value at entry: the block makes the event, the exit waits for its count."""

    def __init__(self, port: int, name: str, **labels: str) -> None:
        self.port, self.name, self.labels = port, name, labels
        self.before = 0.0

    def __enter__(self) -> Counted:
        self.before = worker_sample(self.port, self.name, **self.labels)
        return self

    def __exit__(self, exc_type: object, *exc_info: object) -> None:
        if exc_type is None:
            wait_for(
                lambda: worker_sample(self.port, self.name, **self.labels) > self.before,
                timeout=STEP_TIMEOUT,
                interval=0.05,
                message=f"{self.name}{self.labels} > {self.before} on the worker's /metrics",
            )


def make_every_event(
    app: Celery, locks: RedisServer, port: int, worker: str, tag: str, gate: Path
) -> None:
    """Against a running metered worker (node name ``worker``) serving on ``port``, with
    ``locks`` its lock node, make each kind of event happen once more: a copy started
    after its send-time claim expired, an acquisition held and renewed, a busy refusal, a
    run deferred because its key is busy and one because of its rate, a duplicate send,
    renewal failures (``locks`` paused while a lock is held) and a lost lease (its key
    deleted). ``tag`` makes this round's keys and queue its own; ``gate`` is a path that
    does not exist yet."""
    tasks = app.tasks
    queue = f"metered-{tag}"
    with Counted(port, "redlock_claims_expired_total", task="metered.short_claim"):
        # Sent to a queue no worker reads yet: its 0.3 s claim expires there.
        tasks["metered.short_claim"].apply_async((tag,), queue=queue)
        pattern = (CLAIM % f"short:{tag}") + "*"
        client = locks.client(db=0)
        try:
            wait_for(
                lambda: not list(client.scan_iter(pattern)),
                timeout=STEP_TIMEOUT,
                interval=0.05,
                message="the send-time claim of metered.short_claim to expire",
            )
        finally:
            client.close()
        app.control.add_consumer(queue, destination=[worker], reply=True, timeout=STEP_TIMEOUT)
    key = f"hold-{tag}"
    with Counted(port, "redlock_acquisitions_total", task="metered.hold"):
        tasks["metered.hold"].delay(key, str(gate))  # holds until the gate, or lost
    with Counted(port, "redlock_busy_total", task="metered.hold"):
        tasks["metered.hold"].delay(key)  # skipped
    with Counted(port, "redlock_deferred_total", task="metered.requeue", reason="busy"):
        tasks["metered.requeue"].delay(key)  # back on the queue until the key is free
    with Counted(port, "redlock_deferred_total", task="metered.rated", reason="rate"):
        tasks["metered.rated"].delay(tag)
        tasks["metered.rated"].delay(tag)  # one start a minute: parked for its turn
    with Counted(port, "redlock_duplicates_total", task="metered.later"):
        tasks["metered.fanout"].delay(tag)  # sends metered.later twice from the worker
    with Counted(port, "redlock_renew_tick_seconds_count"):
        pass
    locks.pause()  # the held lock's renewals time out and are retried
    try:
        with Counted(port, "redlock_renew_failures_total", task="metered.hold"):
            pass
    finally:
        locks.resume()  # a retry renews it
    try:
        with Counted(port, "redlock_lost_total", task="metered.hold"):
            # Taken from under its holder: the next renewal finds the key gone.
            client = locks.client(db=0)
            try:
                client.delete(LOCK % f"hold:{key}")
            finally:
                client.close()
    finally:
        with contextlib.suppress(OSError):
            gate.touch()
