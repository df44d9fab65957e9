"""A small app that shows what celery_redlock does; run ``python -m example_project``."""
