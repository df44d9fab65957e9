"""The example Celery app: ``celery -A example_project.app worker``."""

from celery import Celery

app = Celery("example_project")
app.config_from_object("example_project.celeryconfig")
