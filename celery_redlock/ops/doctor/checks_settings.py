"""Checks of the app's settings and of its tasks' lock options: pure functions of them.

Settings that cannot work at all are refused by
:func:`celery_redlock.integration.settings.from_conf` (:func:`invalid_settings` reports that);
these checks find the ones that validate but are risky, and the task options a
worker would refuse. They read :class:`~celery_redlock.integration.settings.Settings` and the
:class:`~.facts.TaskLocking` values :func:`~.collect.task_locking` resolved, never
the Celery app.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from ...integration.settings import Settings
from .facts import LeaseInUse, TaskLocking
from .report import ERROR, OK, WARN, Finding

__all__ = ["check_settings", "invalid_settings", "leases"]

# -- message templates: problem, consequence, fix ----------------------------------

FAIL_OPEN_MESSAGE = (
    "redlock_fail_open is True: when Redis cannot be reached, locked tasks run without "
    "their lock, so an outage is exactly when two runs can overlap. Fix: leave it False "
    "unless running twice is harmless for every locked task."
)
DRIFT_ZERO_MESSAGE = (
    "redlock_drift_factor is 0: leases assume the clocks of this host and of Redis run at "
    "exactly the same rate, so a holder may trust its lease a little after Redis expired "
    "it. Fix: keep the default 0.01."
)
RENEW_SLACK_MESSAGE = (
    "{where}renews every {interval}s for a {ttl}s lease: a renewal delayed by more than "
    "{slack:.3f}s (a GC pause, a starved thread, a slow node) loses the lock. Fix: renew "
    "every ttl/3 (the default: leave the renew interval unset)."
)
ON_LOST_IGNORE_MESSAGE = (
    "task {task} has on_lost='ignore': after losing its lock it keeps running while "
    "another run may hold the lock. Fix: on_lost='abort' (the default), or pass "
    "self.lock.fence to the storage so that it rejects the late writer."
)
WAIT_LIMIT_MESSAGE = (
    "task {task} waits up to {wait}s for a busy lock (on_busy='wait'), but its "
    "{limit_name} is {limit}s: it can be {what} while still waiting. Fix: "
    "lock_wait_timeout below the time limit, or on_busy='retry'."
)
INVALID_TASK_MESSAGE = (
    "{source}: {error}. A worker that loads it refuses to start. Fix the option named."
)
UNMATCHED_MESSAGE = (
    "redlock_tasks pattern {pattern!r} matches no task registered here: a typo leaves the "
    "tasks it meant unlocked. (Tasks in modules this command did not import are not "
    "seen: list them in the app's imports or include.)"
)

INVALID_SETTINGS_MESSAGE = (
    "{error}. Workers with this configuration refuse to start; nothing else was checked."
)


def invalid_settings(error: str) -> Finding:
    """The one finding when the ``redlock_*`` settings do not validate (``error``)."""
    return Finding(ERROR, "invalid-settings", INVALID_SETTINGS_MESSAGE.format(error=error))


def leases(settings: Settings, tasks: Iterable[TaskLocking]) -> list[LeaseInUse]:
    """Every lease length in use: the default, beat's, each task's, each pattern's."""
    found = [
        LeaseInUse("redlock_ttl", settings.ttl),
        LeaseInUse("redlock_beat_ttl", settings.beat_ttl),
    ]
    for pattern, options in (settings.tasks or {}).items():
        ttl = options.get("ttl")
        if isinstance(ttl, (int, float)) and not isinstance(ttl, bool) and ttl > 0:
            found.append(LeaseInUse(f"redlock_tasks[{pattern!r}]", float(ttl)))
    found += [LeaseInUse(f"task {t.name}", t.ttl) for t in tasks if t.ttl and t.error is None]
    return found


def _renew_slack(where: str, ttl: float, interval: float | None) -> Finding | None:
    interval = ttl / 3 if interval is None else interval
    if interval <= ttl / 2:
        return None
    return Finding(
        WARN,
        "renew-slack",
        RENEW_SLACK_MESSAGE.format(
            where=where, interval=f"{interval:g}", ttl=f"{ttl:g}", slack=ttl - interval
        ),
    )


def check_settings(
    settings: Settings, tasks: Sequence[TaskLocking], unmatched: Sequence[str] = ()
) -> list[Finding]:
    """Settings that validate but are risky, and task options that do not validate.

    What is reported (settings that cannot work at all are already refused by
    :func:`celery_redlock.integration.settings.from_conf` and never get here):

    * ``redlock_fail_open``: tasks run unlocked during an outage.
    * ``redlock_drift_factor = 0``: no allowance for clock rate differences.
    * a renewal interval above half the lease (global or per task): little room
      for one late renewal.
    * ``on_lost="ignore"`` on a task: it runs on without the lock.
    * ``on_busy="wait"`` with a wait timeout at or above the task's soft or hard time
      limit: the wait itself can be killed.
    * task options a worker would refuse, and ``redlock_tasks`` patterns matching
      nothing.
    """
    findings: list[Finding] = []
    if settings.fail_open:
        findings.append(Finding(WARN, "fail-open", FAIL_OPEN_MESSAGE))
    if settings.drift_factor == 0:
        findings.append(Finding(WARN, "drift-factor-zero", DRIFT_ZERO_MESSAGE))
    slack = _renew_slack("redlock_renew_interval: ", settings.ttl, settings.renew_interval)
    if slack is not None:
        findings.append(slack)
    for task in tasks:
        if task.error is not None:
            findings.append(
                Finding(
                    ERROR,
                    "invalid-task-options",
                    INVALID_TASK_MESSAGE.format(source=task.source, error=task.error),
                )
            )
            continue
        default = settings.timing
        inherited = (task.ttl, task.renew_interval) == (default.ttl, default.renew_interval)
        if task.ttl is not None and not inherited:  # the global check covers inherited ones
            slack = _renew_slack(f"task {task.name} ", task.ttl, task.renew_interval)
            if slack is not None:
                findings.append(slack)
        if task.on_lost == "ignore":
            findings.append(
                Finding(WARN, "on-lost-ignore", ON_LOST_IGNORE_MESSAGE.format(task=task.name))
            )
        if task.on_busy == "wait" and task.wait_timeout is not None:
            for limit_name, limit, what in (
                ("soft_time_limit", task.soft_time_limit, "interrupted (SoftTimeLimitExceeded)"),
                ("time_limit", task.time_limit, "killed"),
            ):
                if limit and task.wait_timeout >= limit:
                    findings.append(
                        Finding(
                            WARN,
                            "wait-exceeds-limit",
                            WAIT_LIMIT_MESSAGE.format(
                                task=task.name,
                                wait=f"{task.wait_timeout:g}",
                                limit_name=limit_name,
                                limit=f"{limit:g}",
                                what=what,
                            ),
                        )
                    )
                    break
    findings += [
        Finding(WARN, "unmatched-pattern", UNMATCHED_MESSAGE.format(pattern=p)) for p in unmatched
    ]
    if not findings:
        locked = len(tasks)
        findings.append(
            Finding(OK, "settings", f"settings and the lock options of {locked} task(s) are sound")
        )
    return findings
