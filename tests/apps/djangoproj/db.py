"""django-celery-beat's database, for the tests: ``python -m tests.apps.djangoproj.db CMD``.

``setup``: migrate, and schedule ``stamp`` every second (a ``PeriodicTask`` row).
``standby``: a ``DatabaseLeaderScheduler`` that is not the leader (another holder has
its leader lock) ticks while ``stamp`` is due, and closes; prints, as JSON, what it
sent and what the database says of ``stamp`` afterwards.
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta

import django

from tests.apps.djangoproj.celery import app

django.setup()

from django.core.management import call_command  # noqa: E402 (after django.setup())
from django.utils import timezone  # noqa: E402
from django_celery_beat.models import IntervalSchedule, PeriodicTask  # noqa: E402

from celery_redlock import Redlock  # noqa: E402
from celery_redlock.integration.beat import DatabaseLeaderScheduler, leader_name  # noqa: E402

TASK = "tests.apps.djangoproj.celery.stamp"


def setup() -> None:
    call_command("migrate", verbosity=0)
    every, _ = IntervalSchedule.objects.get_or_create(every=1, period=IntervalSchedule.SECONDS)
    PeriodicTask.objects.update_or_create(
        name="stamp", defaults={"task": TASK, "interval": every, "args": '["stamp"]'}
    )


def standby() -> None:
    long_ago = timezone.now() - timedelta(hours=1)
    PeriodicTask.objects.filter(name="stamp").update(last_run_at=long_ago, total_run_count=0)
    leader = Redlock(
        leader_name(app, app.conf.get("redlock_beat_name")), nodes=[app.conf.redlock_url], ttl=30
    )
    leader.try_acquire()  # another beat leads
    scheduler = DatabaseLeaderScheduler(app=app, lazy=False)
    sent = []
    scheduler.apply_async = lambda entry, *args, **kwargs: sent.append(entry.name)
    for _ in range(3):
        scheduler.tick()
    leading = scheduler.leading
    scheduler.close()
    leader.release()
    row = PeriodicTask.objects.get(name="stamp")
    print(
        json.dumps(
            {
                "leading": leading,
                "sent": sent,
                "total_run_count": row.total_run_count,
                "last_run_at_moved": row.last_run_at != long_ago,
            }
        )
    )


if __name__ == "__main__":
    {"setup": setup, "standby": standby}[sys.argv[1]]()
