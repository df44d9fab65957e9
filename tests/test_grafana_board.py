"""The Grafana board (dashboards/grafana/celery_redlock.json) is importable and asks only
for metrics the package exports, with their labels and the suffixes Prometheus sees.

Whether its queries return data is tests/integration/test_grafana_queries.py's (a real
Prometheus scraping a real worker).
"""

from __future__ import annotations

import re

import pytest

from celery_redlock.base import metrics
from tests.harness import prometheus
from tests.harness.prometheus import (
    board_panels,
    board_queries,
    load_board,
    substitute,
    variable_queries,
)

DATASOURCE = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
#: Labels Prometheus adds to every scraped series.
TARGET_LABELS = {"job", "instance"}
#: ``metric{labels}`` or a bare ``metric`` in PromQL (a name after ``by (``/``on (`` is
#: a label, which never starts with ``redlock_``).
SELECTOR = re.compile(r"\b(?P<name>redlock_\w+)(?:\{(?P<labels>[^}]*)\})?")
GROUPING = re.compile(r"\b(?:by|without)\s*\((?P<labels>[^)]*)\)")


@pytest.fixture(scope="module")
def board():
    return load_board()


@pytest.fixture
def exported(metrics_registry):
    """``{sample name: its labels}`` as prometheus_client exposes each metric (no
    ``_created``: the multiprocess mode of prefork workers has none)."""
    labels = {
        metric._name: set(metric._labelnames)
        for metric in metrics._metrics.values()  # the metrics enable() created
    }
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    names = {}
    for family in metrics_registry.collect():
        for suffix in suffixes[family.type]:
            extra = {"le"} if suffix == "_bucket" else set()
            names[family.name + suffix] = labels[family.name] | extra
    return names


def test_the_board_is_an_importable_grafana_9_board(board):
    """A datasource input (``${DS_PROMETHEUS}``), the schema of Grafana 9, a ``task``
    (and ``job``) variable whose "All" is a regular expression, unique panel ids."""
    inputs = {item["name"]: item for item in board["__inputs"]}
    assert inputs["DS_PROMETHEUS"]["type"] == "datasource"
    assert inputs["DS_PROMETHEUS"]["pluginId"] == "prometheus"
    assert board["schemaVersion"] >= 36, "Grafana 9.0's schema"
    grafana = [item for item in board["__requires"] if item["id"] == "grafana"]
    assert grafana and grafana[0]["version"].startswith("9.")
    variables = {item["name"]: item for item in board["templating"]["list"]}
    assert set(variables) >= {"job", "task"}
    for variable in variables.values():
        assert variable["datasource"] == DATASOURCE
        assert variable["includeAll"] and variable["allValue"] == ".*"
    assert [name for name, _, _ in variable_queries(board)] == list(variables)
    nested = [panel for row in board["panels"] for panel in row.get("panels") or []]
    ids = [panel["id"] for panel in board["panels"] + nested]
    assert len(ids) == len(set(ids)), "panel ids are unique"


def test_every_panel_has_the_datasource_and_queries(board):
    """Every panel (those in collapsed rows too) names the datasource input and has at
    least one target with an expression, each target the same datasource."""
    panels = list(board_panels(board))
    assert any(
        row.get("collapsed") and row["panels"] for row in board["panels"] if row["type"] == "row"
    ), "a collapsed row, whose panels are nested: the tests must find them"
    for panel in panels:
        assert panel["datasource"] == DATASOURCE, panel["title"]
        targets = panel.get("targets") or []
        assert targets and all(t.get("expr", "").strip() for t in targets), panel["title"]
        assert all(t.get("datasource", DATASOURCE) == DATASOURCE for t in targets)
        assert len({t["refId"] for t in targets}) == len(targets), panel["title"]


def test_every_metric_name_and_label_is_one_the_package_exports(board, exported):
    """Each ``redlock_*`` name is a sample prometheus_client exposes (``_total`` of a
    counter, ``_bucket``/``_sum``/``_count`` of a histogram, a gauge's own name); each
    label it is selected or grouped by exists on the metrics of its query; every metric
    the package exports has a panel."""
    texts = [query.expr for query in board_queries(board)]
    texts += [selector for _, selector, _ in variable_queries(board)]
    used = set()
    for text in texts:
        names = set()
        for match in SELECTOR.finditer(text):
            name = match["name"]
            assert name in exported, f"{name} is not exported (in: {text})"
            names.add(name)
            selected = {
                part.split("=")[0].rstrip("!~ ").strip()
                for part in (match["labels"] or "").split(",")
                if part.strip()
            }
            assert selected <= exported[name] | TARGET_LABELS, (name, selected)
        available = set().union(*(exported[name] for name in names)) | TARGET_LABELS
        for match in GROUPING.finditer(text):
            grouped = {label.strip() for label in match["labels"].split(",") if label.strip()}
            assert grouped <= available, (text, grouped - available)
        used |= names
    families = {re.sub(r"_(total|bucket|sum|count)$", "", name) for name in exported}
    covered = {re.sub(r"_(total|bucket|sum|count)$", "", name) for name in used}
    assert families <= covered, f"metrics without a panel: {sorted(families - covered)}"


def test_substitution_gives_prometheus_plain_promql():
    """``$task``, ``${job}``, ``[[task]]`` become ``.*`` (Grafana's "All"),
    ``$__rate_interval`` a duration; an unknown built-in is an error, not a silent pass."""
    expr = 'rate(x{task=~"$task", job=~"${job}", a=~"[[task]]"}[$__rate_interval])'
    assert substitute(expr) == 'rate(x{task=~".*", job=~".*", a=~".*"}[15s])'
    with pytest.raises(ValueError, match=r"__range"):
        substitute("increase(x[$__range])")


def test_without_prometheus_the_query_test_skips_naming_the_package_or_fails_in_ci(monkeypatch):
    """No binary: a skip whose reason names Debian's package; under CI=true, a failure."""
    monkeypatch.setattr(prometheus, "find_prometheus", lambda: None)
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="package 'prometheus'"):
        prometheus.require_prometheus()
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match=r"CI=true.*package 'prometheus'"):
        prometheus.require_prometheus()
