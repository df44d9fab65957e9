"""The example's tasks: an account sync, a nightly report, and a periodic job."""

import time

from celery.utils.log import get_task_logger

from celery_redlock import LockedTask
from example_project.app import app

logger = get_task_logger(__name__)


@app.task(base=LockedTask, bind=True, lock_args=("account_id",))
def sync_account(self, account_id, seconds=1.0):
    """Sync one account. Two syncs of the same account never run at once."""
    logger.info("sync_account(%s) running with fencing token %s", account_id, self.lock.fence)
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.25)  # the work; a lost lock interrupts it with LockLost
    return {"account": account_id, "fence": self.lock.fence}


@app.task
def nightly_report(day):
    """Locked by configuration alone (redlock_tasks in celeryconfig.py)."""
    time.sleep(2)
    return f"report for {day}"


@app.task(base=LockedTask, bind=True, lock_args=())
def refresh_rates(self):
    """A periodic job slower than its schedule: it must never overlap itself."""
    logger.info("refresh_rates running, fencing token %s", self.lock.fence)
    started = time.time()
    time.sleep(2.5)
    return {"fence": self.lock.fence, "started": started, "ended": time.time()}


@app.task
def heartbeat():
    """A quick periodic task: one per second, sent by whichever beat leads."""
    return time.time()
