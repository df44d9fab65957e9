"""The app module of a configuration-only setup: ``celery -A tests.apps.configonly``."""

from celery import Celery

app = Celery("configonly")
app.config_from_object("tests.apps.configonly_celeryconfig")
