"""``lock_on_busy="requeue"``: a run put back because its key was busy starts when the
key is released, not when its backoff ends (:mod:`celery_redlock.integration.wakeups`).

The holder runs 4 s under a 30 s lease; the busy runs' backoff doubles from 0.25 s
(with jitter), so without the wake-up each would start up to seconds after the key
freed. With it, each starts within a fraction of a second of the previous run's end,
in an in-process worker (threads) and in a prefork ``celery worker`` process (where
the copies wait in the main process's timer and the bodies run in pool children).
"""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from tests.apps.wake import make_wake_app
from tests.harness import close_app
from tests.integration.test_rate import get, most_at_once, runs_of

#: The longest a waiting copy may start after the previous run ended: the release's
#: announcement, the worker's next look at its timer (0.05 s), the pool's dispatch.
PROMPT = 1.0
HOLD = 4.0


@pytest.fixture
def app(celery_redis):
    app = make_wake_app(celery_redis.url)
    yield app
    close_app(app)


def _gaps(runs):
    """Seconds from each run's end to the next run's start, in start order."""
    runs = sorted(runs, key=lambda run: run[2])
    return [later[2] - earlier[3] for earlier, later in itertools.pairwise(runs)]


@pytest.mark.smoke  # it reads Celery's ETA timer entries: checked on the lowest and newest
@pytest.mark.parametrize("pool", ["threads", "prefork"])
def test_a_busy_runs_copy_starts_when_the_key_is_released(
    pool, app, inprocess_worker_factory, worker_process_factory, tmp_path
):
    if pool == "prefork":
        worker_process_factory("tests.apps.wake", pool="prefork", concurrency=2)
    else:
        inprocess_worker_factory(app, pool="threads", concurrency=2)
    out = tmp_path / "runs"
    task = app.tasks["wake.export"]
    results = [task.delay("t", str(out), HOLD) for _ in range(3)]
    assert [get(r, timeout=90) for r in results] == ["t"] * 3
    runs = runs_of(out)
    assert Counter(i for i, *_ in runs) == Counter(r.id for r in results), "each ran once"
    assert most_at_once(runs) == 1, "one at a time"
    gaps = _gaps(runs)
    assert all(gap < PROMPT for gap in gaps), f"a waiting copy started late: gaps {gaps}"
    for result in results:
        assert app.backend.get_task_meta(result.id).get("retries", 0) == 0
