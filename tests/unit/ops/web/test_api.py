"""The web dashboard's JSON views and release control, against a real redis-server.

Each view is read with the functions ``ls`` and ``inspect`` use, so these tests check
what the HTTP side adds: the routes, the envelope (a view without a quorum is null,
never empty), the auth rule of the release control and the page's files.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
import uuid

import pytest

from celery_redlock import Redlock
from celery_redlock.engine.keys import lock_keys
from celery_redlock.integration.beat import beat_holder, leader_name
from celery_redlock.integration.claims import claim
from celery_redlock.nodes import NodeSet
from celery_redlock.ops.web import Dashboard, make_server
from tests.apps.locked import create_app
from tests.harness import close_app, wait_for
from tests.harness.celery_workers import APP_URL_ENV
from tests.harness.servers import free_port
from tests.unit.ops.cli.helpers import HOST, backlog_on, lock_on, park_run

AUTH = "ops:s3cret"


@pytest.fixture
def app(redis_node):
    app = create_app(redis_node.url)
    yield app
    close_app(app)


def test_locks_view_lists_each_held_lock_with_its_holder(redis_node, app, dashboard):
    """/api/locks: key, task, task id, worker host, pid, age, TTL left and fence of a lock."""
    lock = lock_on(redis_node, "report:daily", task_id="task-1", task_name="proj.report")
    served = dashboard(app)

    data = served.get("/api/locks")

    assert data["complete"] is True and data["quorum"] == 1
    assert data["nodes"] == [{"node": redis_node.url, "ok": True, "error": None}]
    (item,) = data["locks"]
    assert item["key"] == "redlock:{report:daily}"
    assert (item["task_name"], item["task_id"], item["host"], item["pid"]) == (
        "proj.report", "task-1", HOST, os.getpid()
    )  # fmt: skip
    assert item["fence"] == lock.fence
    assert 20 < item["ttl"] <= 30 and 0 <= item["age"] < 10
    assert data["shares"] == []
    lock.release()
    assert served.get("/api/locks")["locks"] == []


def test_budgets_and_queued_views_show_the_budget_its_queue_and_parked_runs(
    redis_node, app, dashboard
):
    """/api/budgets: used/limit/next free/queued; /api/queued: each waiting run's place,
    and the runs parked until their turn."""
    backlog_on(redis_node.url, "api:acme", rate="2/m", queued=3)
    park_run(redis_node, "id-soon", "proj.call", "rate", "redlock:{api:acme}", 5000)
    served = dashboard(app)

    (budget,) = served.get("/api/budgets")["budgets"]
    queued = served.get("/api/queued")

    assert (budget["key"], budget["used"], budget["limit"], budget["rate"]) == (
        "redlock:{api:acme}", 2, 2, "2/m"
    )  # fmt: skip
    assert budget["queued"] == 3 and 0 < budget["next_free"] <= 61  # a window, give or take
    waiting = queued["waiting"]
    assert [(w["task_id"], w["place"], w["key"]) for w in waiting] == [
        (f"run-{n}", n + 1, "redlock:{api:acme}") for n in range(3)
    ]
    (parked,) = queued["parked"]
    assert (parked["task_id"], parked["task_name"], parked["waits_for"]) == (
        "id-soon", "proj.call", "its rate slot"
    )  # fmt: skip
    assert 4 < parked["due_in"] <= 5


def test_claims_view_lists_the_queued_copies(redis_node, app, dashboard):
    """/api/claims: the send-time claim of a lock_unique task's queued copy."""
    nodeset = NodeSet([redis_node.url], timeout=1)
    claim(nodeset, lock_keys("report:mon"), "copy-1", 600, task_name="proj.report")
    nodeset.close()

    (item,) = dashboard(app).get("/api/claims")["claims"]

    assert (item["key"], item["task_id"], item["task_name"]) == (
        "redlock:{report:mon}", "copy-1", "proj.report"
    )  # fmt: skip
    assert 590 < item["ttl"] <= 600


def test_leader_view_names_the_beat_that_holds_the_leader_lock(redis_node, app, dashboard):
    """/api/leader: free, then held by a beat of this app (its host and pid parsed back)."""
    served = dashboard(app)
    free = served.get("/api/leader")["leader"]
    assert (free["held"], free["holder"], free["beat"]) == (False, None, None)
    name = leader_name(app, None)
    assert free["key"] == lock_keys(name).lock

    with Redlock(name, nodes=[redis_node.url], ttl=30, task_name=beat_holder(app)) as lock:
        held = served.get("/api/leader")["leader"]

    assert held["held"] is True and held["holder"]["fence"] == lock.fence
    assert (held["beat"]["host"], held["beat"]["pid"]) == (HOST, str(os.getpid()))


def test_task_view_tells_where_a_task_id_stands(redis_node, app, dashboard):
    """/api/task/<id>: what inspect TASK_ID shows; an id nobody names is not found."""
    holding = str(uuid.uuid4())
    lock = lock_on(redis_node, "proj:sync:2", task_id=holding, task_name="proj.sync")
    served = dashboard(app)

    story = served.get(f"/api/task/{holding}")["task"]
    unknown = served.get(f"/api/task/{uuid.uuid4()}")["task"]

    assert story["found"] is True and story["task_id"] == holding
    assert [h["key"] for h in story["holds"]] == ["redlock:{proj:sync:2}"]
    assert (story["claims"], story["parked"]) == ([], [])
    assert unknown["found"] is False and unknown["holds"] == []
    lock.release()


def test_views_are_null_not_empty_when_too_few_nodes_answer(redis_node, dashboard):
    """With one node of three answering nobody can tell what is held: every view says so
    (complete false, items null), as ls --json does, instead of "no locks"."""
    dead = [f"redis://127.0.0.1:{free_port()}/0" for _ in range(2)]
    app = create_app(redis_node.url, redlock_nodes=[redis_node.url, *dead])
    try:
        served = dashboard(app, node_timeout=0.2)
        for path, items in (
            ("/api/locks", "locks"),
            ("/api/budgets", "budgets"),
            ("/api/claims", "claims"),
            ("/api/queued", "waiting"),
            ("/api/leader", "leader"),
        ):
            data = served.get(path)
            assert data["complete"] is False and data[items] is None, (path, data)
            assert [n["ok"] for n in data["nodes"]] == [True, False, False]
    finally:
        close_app(app)


def test_without_allow_release_there_is_no_release_route(redis_node, app, dashboard):
    """The release path does not exist (404 for POST and GET) and meta says so."""
    lock = lock_on(redis_node, "report:daily")
    served = dashboard(app)

    assert served.request("POST", "/api/release", {"key": lock.key})[0] == 404
    assert served.request("GET", "/api/release")[0] == 404
    assert served.request("POST", "/api/locks", {})[0] == 405
    assert served.get("/api/meta")["allow_release"] is False
    assert served.get("/api/locks")["locks"][0]["key"] == lock.key, "still held"


def test_release_needs_basic_auth_and_releases_the_token_read(redis_node, app, dashboard):
    """With --allow-release every request needs the credentials (401 without, with a
    WWW-Authenticate challenge); a POST from another origin or not as JSON is refused;
    with them the lock is released as `release KEY` does (its token only)."""
    with pytest.raises(ValueError, match="basic auth"):
        make_server(Dashboard(app, None, None, allow_release=True), basic_auth=None)  # type: ignore[arg-type]
    lock = lock_on(redis_node, "report:daily")
    served = dashboard(app, allow_release=True, basic_auth=AUTH)

    status, _, headers = served.request("POST", "/api/release", {"key": lock.key})
    assert status == 401 and headers["WWW-Authenticate"].startswith("Basic ")
    assert served.request("POST", "/api/release", {"key": lock.key}, auth="ops:wrong")[0] == 401
    assert served.request("GET", "/api/locks")[0] == 401
    assert served.request("GET", "/")[0] == 401
    not_json = served.request(
        "POST", "/api/release", {"key": lock.key}, auth=AUTH, headers={"Content-Type": "text/plain"}
    )
    assert not_json[0] == 415
    elsewhere = {"Origin": "http://evil.example", "Host": served.url.removeprefix("http://")}
    assert (
        served.request("POST", "/api/release", {"key": lock.key}, auth=AUTH, headers=elsewhere)[0]
        == 403
    )
    assert served.request("POST", "/api/release", {"force": True}, auth=AUTH)[0] == 400
    assert served.get("/api/locks", auth=AUTH)["locks"][0]["key"] == lock.key, "all refused"
    assert served.get("/api/meta", auth=AUTH)["allow_release"] is True

    status, body, _ = served.request("POST", "/api/release", {"key": "report:daily"}, auth=AUTH)

    assert status == 200, body
    (released,) = body["released"]
    assert (released["key"], released["fence"], released["released_on"]) == (
        lock.key, lock.fence, 1
    )  # fmt: skip
    assert (body["refused"], body["error"]) == ([], None)
    assert not redis_node.client().exists(lock.key)
    again = served.request("POST", "/api/release", {"key": lock.key}, auth=AUTH)
    assert again[0] == 404 and "not held" in again[1]["error"]


def test_page_and_its_files_come_from_the_package_with_a_strict_policy(app, dashboard):
    """/ and /static/app.js, app.css are served (no CDN: the page loads nothing else);
    no other file of the package can be read through the server."""
    served = dashboard(app)

    status, page, headers = served.request("GET", "/")
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    assert '<script src="/static/app.js"' in page and "http" not in page.split("<body>")[0]
    assert "default-src 'none'" in headers["Content-Security-Policy"]
    assert headers["X-Frame-Options"] == "DENY"
    for path in ("/static/app.js", "/static/app.css"):
        assert served.request("GET", path)[0] == 200
    for path in ("/static/server.py", "/static/../server.py", "/static/", "/api/nope"):
        assert served.request("GET", path)[0] == 404, path


def test_allow_release_without_basic_auth_is_refused_at_start(redis_node, cli):
    """`redlock web --allow-release` alone exits 2 and says why; a malformed --basic-auth too."""
    alone = cli(redis_node.url, "web", "--allow-release")
    assert alone.exit_code == 2
    assert "--allow-release needs --basic-auth USER:PASSWORD" in alone.stderr
    bad = cli(redis_node.url, "web", "--allow-release", "--basic-auth", "nopassword")
    assert bad.exit_code == 2 and "USER:PASSWORD" in bad.stderr


def test_the_command_serves_the_apps_locks(redis_node, tmp_path):
    """`celery -A app redlock web --port 0` says where it listens, on 127.0.0.1, and
    serves the app's locks there until stopped."""
    lock = lock_on(redis_node, "report:daily")
    env = {**os.environ, APP_URL_ENV: redis_node.url}
    command = [sys.executable, "-m", "celery", "-A", "tests.apps.cli_app", "redlock", "web"]
    process = subprocess.Popen(
        [*command, "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        text=True,
    )
    try:
        line = process.stdout.readline()  # type: ignore[union-attr]
        assert "on http://127.0.0.1:" in line and "release off" in line, line
        url = line.split(" on ", 1)[1].split("/ ", 1)[0]

        def locks():
            with urllib.request.urlopen(url + "/api/locks", timeout=5) as response:
                return json.loads(response.read())["locks"]

        assert [item["key"] for item in wait_for(locks, timeout=10)] == [lock.key]
    finally:
        process.terminate()
        process.wait(timeout=10)
        process.stdout.close()  # type: ignore[union-attr]


def test_event_views_tell_a_keys_history_and_a_task_ids_story(redis_node, app, dashboard):
    """/api/events (the feed), /api/log/<key> and /api/why/<task id>: the events as
    ``log`` and ``why`` read them, each with its lock key, time and words."""
    from celery_redlock.integration import events

    nodeset = NodeSet([redis_node.url], timeout=1.0)
    for event, fields in (("acquired", {"fence": 3, "waited_ms": 0}), ("released", {"held_ms": 9})):
        events.record(app, nodeset, event, ("redlock:{api:acme}",), "proj.t", "t-1", **fields)
    events.record(app, nodeset, "busy", ("redlock:{other}",), "proj.t", "t-2", then="skip")
    assert events.flush()
    nodeset.close()
    served = dashboard(app)

    recent = served.get("/api/events")["events"]
    assert [(e["e"], e["key"]) for e in recent] == [
        ("acquired", "redlock:{api:acme}"), ("released", "redlock:{api:acme}"),
        ("busy", "redlock:{other}"),
    ]  # fmt: skip
    log = served.get("/api/log/" + urllib.request.quote("redlock:{api:acme}", safe=""))
    assert log["key"] == "redlock:{api:acme}" and [e["id"] for e in log["events"]] == ["t-1"] * 2
    assert log["events"][1]["text"].startswith("released api:acme after 0.009s")
    assert served.get("/api/log/api:acme")["events"] == log["events"], "a name works too"
    why = served.get("/api/why/t-2")
    assert why["summary"].startswith("t-2: skipped at ") and why["complete"] is True
    assert [e["e"] for e in why["events"]] == ["busy"]
