"""Configuration of the example app. ``EXAMPLE_REDIS_URL`` is set by the demo."""

import os

_redis = os.environ.get("EXAMPLE_REDIS_URL", "redis://localhost:6379").rstrip("/")

broker_url = f"{_redis}/1"
result_backend = f"{_redis}/2"
result_extended = True
task_serializer = result_serializer = "json"
broker_connection_retry_on_startup = True
worker_hijack_root_logger = True

# -- celery_redlock ---------------------------------------------------------------
redlock_url = f"{_redis}/0"
redlock_ttl = 1.5  # short, so the demo shows several renewals per task

# Configuration-only enablement: the report task has no lock in its code. Listing
# celery_redlock in imports is what loads the plugin in workers and beat.
imports = ["celery_redlock", "example_project.tasks"]
redlock_tasks = {"example_project.tasks.nightly_report": {"args": []}}

# High-availability beat (-S celery_redlock.beat:LeaderScheduler): several beats, one leader.
redlock_beat_ttl = float(os.environ.get("EXAMPLE_BEAT_TTL", "10"))

beat_schedule = {
    "heartbeat": {"task": "example_project.tasks.heartbeat", "schedule": 1.0},
    # Every second, but each run takes 2.5 s: overlapping runs are skipped.
    "refresh-exchange-rates": {"task": "example_project.tasks.refresh_rates", "schedule": 1.0},
}
