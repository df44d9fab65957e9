"""The dashboard in a real headless Chromium, with a lock held by a task a real worker runs.

The worker is the suite's in-process worker (threads pool), so the task's body can
block on an event of this test until the test lets it finish. Every wait is on a
condition with a deadline; "within 2 s" is the dashboard's promise (it polls every
second).
"""

from __future__ import annotations

import os
import threading

import pytest

from celery_redlock import LockedTask
from tests.apps.locked import create_app
from tests.harness import close_app, wait_for
from tests.unit.ops.cli.helpers import HOST, lock_on
from tests.unit.ops.web.conftest import basic

AUTH = "ops:s3cret"

#: Selenium's locator strategies (``By.*``), named here so that this module imports
#: without selenium: the ``browser`` fixture then skips (or fails in CI) saying why.
CSS, ID, TAG = "css selector", "id", "tag name"

#: How soon the page must show a change of the lock state.
SHOWN_WITHIN = 2.0


@pytest.fixture
def gate():
    """The event the blocked task's body waits on; set at the end so no body outlives it."""
    event = threading.Event()
    yield event
    event.set()


@pytest.fixture
def app(celery_redis, gate):
    """An app whose task ``tests.web.blocked`` holds its lock until ``gate`` is set."""
    app = create_app(celery_redis.url)

    @app.task(
        base=LockedTask, bind=True, shared=False, name="tests.web.blocked", lock_args=("account",)
    )
    def blocked(self, account):
        gate.wait(60)
        return self.lock.fence

    yield app
    close_app(app)


def rows(browser, key, panel="locks"):
    """The page's rows of lock ``key`` in ``panel`` (locks: the locks held)."""
    return browser.find_elements(CSS, f'[data-panel="{panel}"] tr[data-key="{key}"]')


def running_lock(app, celery_redis):
    """Start ``blocked("acct-7")`` and wait until its lock is taken; (result, lock key)."""
    result = app.tasks["tests.web.blocked"].delay("acct-7")
    locks = celery_redis.client(db=0)

    def taken():
        keys = locks.scan_iter("redlock:{tests.web.blocked:*}", _type="hash")
        return next((k for k in keys if locks.hget(k, "task_id") == result.id), None)

    return result, wait_for(taken, timeout=15, message="the task's lock")


def test_a_running_tasks_lock_shows_with_its_holder_and_goes_when_it_ends(
    app, celery_redis, gate, inprocess_worker_factory, dashboard, browser
):
    """A lock a running task holds appears within 2 s with its task, task id, worker host
    and pid; searching its task id shows what the task holds; the page has no release
    control; when the task ends, the lock disappears within 2 s, the task id's story
    says it started and ended, and the key's history (recent events, and the history
    its link opens) shows its acquisition and release."""
    inprocess_worker_factory(app, pool="threads", concurrency=2)
    served = dashboard(app)
    browser.get(served.url)
    wait_for(lambda: "live" in browser.find_element(ID, "status").text, timeout=10)

    result, key = running_lock(app, celery_redis)

    (row,) = wait_for(lambda: rows(browser, key), timeout=SHOWN_WITHIN, interval=0.05)
    text = row.text
    for expected in ("tests.web.blocked", result.id, HOST, str(os.getpid())):
        assert expected in text, (expected, text)
    assert row.get_attribute("data-task-id") == result.id
    assert browser.find_elements(CSS, "button.release") == []
    assert "Release" not in browser.find_element(TAG, "body").text

    search = browser.find_element(ID, "task-search")
    search.send_keys(result.id)
    browser.find_element(CSS, "#search button[type=submit]").click()
    story = browser.find_element(ID, "task-result")
    wait_for(lambda: f"holds {key}" in story.text, timeout=SHOWN_WITHIN, interval=0.05)
    assert result.id in story.text

    gate.set()
    assert result.get(timeout=15) is not None
    wait_for(lambda: not rows(browser, key), timeout=SHOWN_WITHIN, interval=0.05)
    wait_for(lambda: "Not on the lock nodes" in story.text, timeout=SHOWN_WITHIN, interval=0.05)
    assert "No locks held." in browser.find_element(CSS, "[data-panel=locks]").text
    # The event log: the task id's story (why), the key's history after its release.
    wait_for(lambda: "ended" in story.text, timeout=SHOWN_WITHIN, interval=0.05)
    assert f"{result.id}: started " in story.text and f"released {key[9:-1]}" in story.text
    events = wait_for(
        lambda: len(rows(browser, key, "events")) == 2 and rows(browser, key, "events"),
        timeout=SHOWN_WITHIN,
        interval=0.05,
    )
    assert [row.get_attribute("data-event") for row in events] == ["released", "acquired"]
    events[0].find_element(CSS, "a.key-link").click()
    history = browser.find_element(ID, "key-history")
    wait_for(lambda: "released" in history.text, timeout=SHOWN_WITHIN, interval=0.05)
    assert key in history.text and "acquired" in history.text and result.id in history.text


def test_release_with_basic_auth_frees_a_running_tasks_lock_and_the_page_shows_it(
    app, celery_redis, gate, inprocess_worker_factory, dashboard, browser
):
    """With --allow-release: POST /api/release without auth is 401; with auth a running
    holder is refused (409, as `release KEY` without --force) and released with force;
    the page, which has the release button, shows the lock gone. The button releases a
    lock held outside tasks after the page asks for confirmation."""
    inprocess_worker_factory(app, pool="threads", concurrency=2)
    served = dashboard(app, allow_release=True, basic_auth=AUTH)
    # Every request of the page carries the credentials, as a browser does once the
    # user has typed them at the basic-auth prompt.
    browser.execute_cdp_cmd("Network.enable", {})
    browser.execute_cdp_cmd(
        "Network.setExtraHTTPHeaders", {"headers": {"Authorization": basic(AUTH)}}
    )
    browser.get(served.url)
    result, key = running_lock(app, celery_redis)
    (row,) = wait_for(lambda: rows(browser, key), timeout=SHOWN_WITHIN, interval=0.05)
    assert row.find_elements(CSS, "button.release")

    assert served.request("POST", "/api/release", {"key": key})[0] == 401
    status, body, _ = served.request("POST", "/api/release", {"key": key}, auth=AUTH)
    assert status == 409, body
    (refusal,) = body["refused"]
    assert refusal["state"] == "active" and result.id in refusal["reason"]
    assert rows(browser, key), "still held after the refusal"

    status, body, _ = served.request("POST", "/api/release", {"key": key, "force": True}, auth=AUTH)

    assert status == 200, body
    assert body["released"][0]["released_on"] == 1
    wait_for(lambda: not rows(browser, key), timeout=SHOWN_WITHIN, interval=0.05)

    other = lock_on(celery_redis, "report:daily", ttl=30)
    wait_for(lambda: rows(browser, other.key), timeout=SHOWN_WITHIN, interval=0.05)
    rows(browser, other.key)[0].find_element(CSS, "button.release").click()
    confirm = wait_for(lambda: _alert(browser), timeout=5)
    assert f"Release {other.key}?" in confirm.text
    confirm.accept()
    wait_for(lambda: not rows(browser, other.key), timeout=SHOWN_WITHIN, interval=0.05)
    assert "Released" in browser.find_element(ID, "message").text
    assert not celery_redis.client(db=0).exists(other.key)


def _alert(browser):
    """The page's open dialog (confirm), or None."""
    from selenium.common.exceptions import NoAlertPresentException

    try:
        return browser.switch_to.alert
    except NoAlertPresentException:
        return None
