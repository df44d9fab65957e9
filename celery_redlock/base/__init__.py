"""The basics every layer uses, knowing nothing of locks, Redis or Celery.

``forksafe`` resets what a forked child must not share (locks, pools, registries),
``poll`` waits on any number of descriptors (poll(2), not select), and ``metrics``
records the Prometheus metrics when ``redlock_metrics`` turns them on. The package's
exceptions are the other basic; they stay at :mod:`celery_redlock.exceptions`, the
path users import them from and the one Celery records with a failed task's result.
"""
