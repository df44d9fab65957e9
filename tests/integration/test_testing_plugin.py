"""The ``celery_redlock.testing`` pytest plugin, used as a project would use it.

Each test writes a small project (an app module and its tests) and runs pytest on it
in a subprocess, so that the plugin is found as a user's pytest finds it: through the
installed entry point, or by name with autoloading off.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from celery import Celery

from celery_redlock import ConfigurationError, LockedTask, lock_for
from celery_redlock.testing.servers import free_port
from tests.harness import close_app

#: The guide page whose examples this test runs verbatim.
TESTING_GUIDE = Path(__file__).resolve().parents[2] / "docs" / "guide" / "testing.md"

PROJECT = """
from celery import Celery
from celery_redlock import LockedTask

app = Celery("proj", broker="memory://", backend="cache+memory://")
app.conf.task_track_started = True


@app.task(base=LockedTask, bind=True, lock_args=("account_id",), shared=False)
def sync_account(self, account_id, full=False):
    return account_id, self.lock.key, self.lock.fence


@app.task(base=LockedTask, bind=True, lock_on_busy="raise", shared=False)
def strict(self, n):
    return n
"""

USER_TESTS = '''
import time

import pytest
from celery.exceptions import TimeoutError as CeleryTimeout

from celery_redlock import LockBusy, lock_for
from celery_redlock.testing import hold_task_lock

import proj


def test_apply_takes_the_real_lock(redlock_app, redlock_server):
    assert redlock_app is proj.app
    account, key, fence = proj.sync_account.apply((7,)).get()
    assert (account, key) == (7, lock_for(proj.sync_account, 7).key)
    assert redlock_server.client().exists(key) == 0  # released when the run ended
    assert proj.sync_account.apply((7,)).get()[2] > fence


def test_a_held_lock_skips_that_call_only(redlock_app):
    with hold_task_lock(proj.sync_account, 7, full=True):
        skipped = proj.sync_account.apply((7,))
        assert skipped.state == "FAILURE" and isinstance(skipped.result, LockBusy)
        assert proj.sync_account.apply((8,)).get()[0] == 8
    assert proj.sync_account.apply((7,)).get()[0] == 7


def test_eager_mode_takes_the_lock_too(redlock_app):
    redlock_app.conf.task_always_eager = True
    try:
        with hold_task_lock(proj.strict, 1):
            with pytest.raises(LockBusy):
                proj.strict.delay(1).get()
        assert proj.strict.delay(1).get() == 1
    finally:
        redlock_app.conf.task_always_eager = False


def test_hold_task_lock_does_not_wait(redlock_app):
    with hold_task_lock(proj.strict, 2):
        with pytest.raises(LockBusy):
            with hold_task_lock(proj.strict, 2):
                pass


@pytest.fixture(scope="session")
def celery_config(redlock_server):
    return {"broker_url": "memory://", "result_backend": "cache+memory://",
            "task_track_started": True, "redlock_url": redlock_server.url}


@pytest.fixture
def worker_tasks(celery_app):
    """The locked tasks, on celery.contrib.pytest's app (before its worker starts)."""
    from celery_redlock import LockedTask

    @celery_app.task(base=LockedTask, bind=True, lock_on_busy="skip", shared=False)
    def skipper(self, n):
        return n, self.lock.fence

    @celery_app.task(base=LockedTask, bind=True, lock_on_busy="wait", lock_wait_timeout=30,
                     shared=False)
    def patient(self, n):
        return n, self.lock.fence

    @celery_app.task(base=LockedTask, bind=True, lock_on_busy="retry",
                     lock_retry_countdown=0.5, max_retries=None, shared=False)
    def persistent(self, n):
        return n, self.request.retries

    return {"skip": skipper, "wait": patient, "retry": persistent}


def wait_state(result, state, timeout=10):
    deadline = time.monotonic() + timeout
    while result.state != state:
        assert time.monotonic() < deadline, f"{result.state} after {timeout}s"
        time.sleep(0.02)


def test_worker_skips_a_held_lock(redlock_app, worker_tasks, celery_worker):
    task = worker_tasks["skip"]
    with hold_task_lock(task, 3):
        with pytest.raises(LockBusy):
            task.delay(3).get(timeout=10)
    assert task.delay(3).get(timeout=10)[0] == 3


def test_worker_waits_for_a_held_lock(redlock_app, worker_tasks, celery_worker):
    task = worker_tasks["wait"]
    with hold_task_lock(task, 4) as held:
        result = task.delay(4)
        wait_state(result, "STARTED")
        with pytest.raises(CeleryTimeout):
            result.get(timeout=0.3)
    n, fence = result.get(timeout=10)
    assert n == 4 and fence > held.fence


def test_worker_retries_until_the_lock_is_free(redlock_app, worker_tasks, celery_worker):
    task = worker_tasks["retry"]
    with hold_task_lock(task, 5):
        result = task.delay(5)
        wait_state(result, "RETRY")
    assert result.get(timeout=10)[0] == 5
'''


@pytest.fixture
def project(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makepyfile(proj=PROJECT, test_user=USER_TESTS)
    return pytester


def test_a_project_tests_its_locked_tasks_with_the_plugin(project):
    """Autoloaded by its entry point; celery.contrib.pytest's solo worker too."""
    result = project.runpytest_subprocess("-p", "celery.contrib.pytest", timeout=240)
    result.assert_outcomes(passed=7)


@pytest.mark.smoke
def test_the_plugin_can_be_opted_into_and_out_of(project, monkeypatch):
    """By name with autoloading off; `-p no:` removes it (its fixtures with it)."""
    for autoload in ("on", "off"):
        if autoload == "off":
            monkeypatch.setenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", "1")
        result = project.runpytest_subprocess(
            "-p", "celery_redlock.testing", "-k", "apply_takes or skips_that or eager", timeout=120
        )
        result.assert_outcomes(passed=3)
    monkeypatch.delenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD")
    result = project.runpytest_subprocess(
        "-p", "no:celery_redlock.testing", "-k", "apply_takes", timeout=120
    )
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*fixture 'redlock_app' not found*"])


# A project as a user writes it: its app's broker and result backend are its own
# servers (nowhere running in its tests), its tasks are `@app.task`.
README_PROJECT_APP = """
from celery import Celery

app = Celery("proj", broker="redis://127.0.0.1:{port}/0", backend="redis://127.0.0.1:{port}/1")
app.conf.redis_socket_connect_timeout = app.conf.broker_connection_timeout = 1
"""

README_PROJECT_TASKS = """
from celery_redlock import LockedTask

from .celery import app


@app.task(base=LockedTask, bind=True, lock_args=("account_id",))
def sync_account(self, account_id, full=False):
    return account_id
"""


def guide_test_files() -> dict[str, str]:
    """The ``python`` blocks of the testing guide that start with ``# <path>``, by path."""
    text = TESTING_GUIDE.read_text()
    blocks = re.findall(r"```python\n(# (\S+\.py)[^\n]*\n.*?)```", text, re.S)
    return {path: body for body, path in blocks}


def test_the_testing_guide_example_runs_for_a_project_whose_services_are_down(pytester):
    """The testing guide's examples, verbatim, on a project whose broker and backend are down.

    The eager test (``apply()`` stores no result: a skip is ``LockBusy``, not the
    backend's ``ConnectionError``) and the worker test (the guide's ``celery_app``
    override makes ``@app.task`` tasks reach celery.contrib.pytest's worker).
    """
    files = guide_test_files()
    assert set(files) == {"tests/conftest.py", "tests/test_sync.py", "tests/test_worker.py"}
    pytester.makepyfile(
        **{
            "proj/__init__": "",
            "proj/celery": README_PROJECT_APP.format(port=free_port()),
            "proj/tasks": README_PROJECT_TASKS,
            "tests/__init__": "",
            "tests/test_sync": files.pop("tests/test_sync.py"),
        }
    )
    # The eager test alone: the project's own (unreachable) broker and result backend.
    result = pytester.runpytest_subprocess("tests", timeout=240)
    result.assert_outcomes(passed=1)
    # With the conftest: celery.contrib.pytest's worker runs the project's app.
    pytester.makepyfile(**{path.removesuffix(".py"): body for path, body in files.items()})
    result = pytester.runpytest_subprocess("-p", "celery.contrib.pytest", "tests", timeout=240)
    result.assert_outcomes(passed=2)


def test_the_plugin_is_inert_until_a_fixture_is_requested(pytester):
    """Loaded but unused: no server started, no fixture set up."""
    pytester.makepyfile(test_plain="def test_nothing():\n    assert True\n")
    result = pytester.runpytest_subprocess("--setup-show", timeout=120)
    result.assert_outcomes(passed=1)
    assert "redlock_" not in result.stdout.str()


def test_lock_for_is_each_tasks_own_lock_before_the_app_is_finalized():
    """`@app.task` returns proxies until finalize: options must not leak across them."""
    app = Celery("lock_for", broker="memory://", set_as_current=False)
    app.conf.redlock_url = "redis://127.0.0.1:1/0"
    try:

        @app.task(base=LockedTask, bind=True, lock_args=("a",), shared=False)
        def first(self, a, b):
            return a

        @app.task(base=LockedTask, bind=True, lock_key="thing:{b}", shared=False)
        def second(self, a, b):
            return b

        assert lock_for(first, 1, 2).key != lock_for(first, 2, 2).key
        assert lock_for(first, 1, 2).key == lock_for(first, 1, 3).key
        assert lock_for(second, 1, 2).key == lock_for(second, 9, b=2).key
        assert "thing:2" in lock_for(second, 1, 2).key

        @app.task(shared=False)
        def plain(x):
            return x

        with pytest.raises(ConfigurationError, match="takes no lock"):
            lock_for(plain, 1)
        with pytest.raises(TypeError):
            lock_for(first, 1, 2, 3)
    finally:
        close_app(app)
