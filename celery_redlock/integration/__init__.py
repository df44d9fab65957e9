"""The Celery layer: what makes a Celery task hold a lock, and everything it needs.

Configuration: ``settings`` (every ``redlock_*`` setting and per-task ``lock_*``
option in one table of :class:`~celery_redlock.integration.settings.Option`). The task:
``task`` (``LockedTask``, ``lock_for``), ``names`` (lock names from a call's
arguments), ``policies`` (what a busy, duplicate or lost lock does), ``abort`` (stopping
a body whose lock is lost). Before and around a run: ``unique`` and ``claims`` (send-time
claims), ``budgets`` (``lock_rate``), ``parking`` (runs that wait, parked in Redis),
``queued`` (runs waiting on the queue, for the CLI), ``wakeups`` (a requeued copy
started by its key's release). Processes: ``worker`` (the signal receivers), ``reaper``
(the locks of a pool child that died), ``beat`` (the leader schedulers) and
``config_only`` (locking tasks by configuration alone). It builds on
:mod:`celery_redlock.engine`, which knows nothing of Celery.
"""
