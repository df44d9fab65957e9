"""The Grafana board's queries return data from a real Prometheus scraping a real worker.

Prometheus (Debian's ``prometheus``) scrapes a prefork ``celery worker`` that serves its
metrics (``redlock_metrics``, prometheus_client's multiprocess mode) every second; the
worker is made to record every kind of lock event; then every query of every panel of
``dashboards/grafana/celery_redlock.json`` (read from the file, so a new panel is
covered) must return a non-empty result through ``/api/v1/query``. Without the binary
the test skips, naming the package, and fails under ``CI=true``.
"""

from __future__ import annotations

import math
import time
from functools import partial

import pytest

from tests.apps.metered import make_metered_app
from tests.harness import close_app
from tests.harness.metered import make_every_event
from tests.harness.prometheus import (
    PrometheusServer,
    board_queries,
    load_board,
    require_prometheus,
    substitute,
    target_health,
    variable_queries,
)
from tests.harness.servers import free_port, wait_for

#: How long the queries may take to all return data once the events happened: a few
#: scrapes (1 s) so that each rate() window holds two samples of every new series.
QUERY_DEADLINE = 30.0


def empty_queries(prometheus, queries):
    """``{query: why}`` for each query that returns nothing now (or an error)."""
    empty = {}
    for query in queries:
        try:
            if not prometheus.query(substitute(query.expr)):
                empty[str(query)] = "empty result"
        except RuntimeError as exc:
            empty[str(query)] = str(exc)
    return empty


def flat_queries(prometheus, queries, start):
    """``{query: why}`` for each query that was never above zero since ``start``: a rate
    that never saw an increase, a quantile that was only NaN, a gauge always at 0."""
    flat = {}
    for query in queries:
        try:
            series = prometheus.query_range(substitute(query.expr), start, step="1s")
        except RuntimeError as exc:
            flat[str(query)] = str(exc)
            continue
        values = [float(value) for item in series for _, value in item["values"]]
        if not any(math.isfinite(value) and value > 0 for value in values):
            flat[str(query)] = f"never above 0: {sorted(set(values))[:5]}"
    return flat


def wait_for_queries(prometheus, queries, check, what):
    """Wait until ``check(prometheus, queries)`` finds nothing; fail listing what it found."""
    try:
        wait_for(lambda: not check(prometheus, queries), timeout=QUERY_DEADLINE, interval=0.5)
    except AssertionError:
        found = check(prometheus, queries)
        listing = "\n".join(f"  {query}\n    -> {why}" for query, why in found.items())
        pytest.fail(
            f"{len(found)} of {len(queries)} queries of the board {what}:\n{listing}\n"
            f"scrape targets:\n{target_health(prometheus)}"
        )


def test_every_query_of_the_grafana_board_returns_data_from_a_prefork_worker(
    redis_factory, worker_process_factory, tmp_path
):
    """Every panel's PromQL, and each variable's label_values, finds series once the
    worker acquired, renewed, was busy, deferred (busy and rate), sent a duplicate,
    started a copy after its claim expired, failed renewals and lost a lease; and each
    panel shows the second round of these events (a value above zero)."""
    binary = require_prometheus()  # a skip naming the package; under CI=true, a failure
    board = load_board()
    queries = board_queries(board)
    assert len(queries) >= 10, queries
    broker, locks = redis_factory(2)
    port = free_port()
    multiproc = tmp_path / "prometheus-multiproc"
    multiproc.mkdir()
    app = make_metered_app(broker.url, locks.url)
    prometheus = PrometheusServer([f"127.0.0.1:{port}"], tmp_path / "prometheus", binary=binary)
    try:
        prometheus.start()
        began = time.time()
        worker = worker_process_factory(
            "tests.apps.metered",
            pool="prefork",
            redis_url=broker.url,
            env={
                "METERED_LOCK_URL": locks.url,
                "METERED_METRICS_PORT": str(port),
                "PROMETHEUS_MULTIPROC_DIR": str(multiproc),
            },
        )
        # Round 1 creates every series; a counter's first increment comes with its
        # series, which rate() cannot see: round 2's events are what the panels show.
        make_every_event(app, locks, port, worker.nodename, "1", tmp_path / "gate-1")
        wait_for_queries(prometheus, queries, empty_queries, "returned nothing")
        make_every_event(app, locks, port, worker.nodename, "2", tmp_path / "gate-2")
        wait_for_queries(
            prometheus, queries, partial(flat_queries, start=began), "never showed an event"
        )
        assert not empty_queries(prometheus, queries)
        for name, selector, label in variable_queries(board):
            series = prometheus.query(substitute(selector or f'{{{label}!=""}}'))
            values = {item["metric"].get(label) for item in series} - {None}
            assert values, f"variable {name}: no {label} label on {selector}"
    finally:
        prometheus.stop()
        close_app(app)
