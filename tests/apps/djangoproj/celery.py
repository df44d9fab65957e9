"""The project's Celery app, configured from Django's settings as Django projects do."""

from __future__ import annotations

import os
import time
from pathlib import Path

from celery import Celery

from tests.apps.stamps import beat_run, write

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.apps.djangoproj.settings")

app = Celery("djangoproj")
app.config_from_object("django.conf:settings", namespace="CELERY")


@app.task(bind=True, shared=False)
def stamp(self, label):
    """Record one dispatch of ``label`` with the run the leader claimed."""
    write(f"{label} {time.time():.6f} {beat_run(self)}")


@app.task(shared=False)
def hold(directory):
    """Say it started, then run until the test creates ``release`` (locked by settings)."""
    Path(directory, "started").touch()
    deadline = time.monotonic() + 60
    while not Path(directory, "release").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    return "held"
