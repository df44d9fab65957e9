"""A minimal Django project: celery_redlock configured through Django settings.

``settings`` holds every Celery and celery_redlock setting under the ``CELERY_``
namespace, as a Django project keeps them; ``celery`` is the project's Celery app
(``celery -A tests.apps.djangoproj.celery worker|beat``); ``db`` prepares the SQLite
database of django-celery-beat and checks what a standby beat writes to it.
"""
