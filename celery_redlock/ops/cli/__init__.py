"""``celery -A proj redlock ...``: list, inspect, release and check the app's locks.

Registered as a Celery sub-command through the ``celery.commands`` entry point (as
Flower registers ``celery flower``)::

    celery -A proj redlock ls [--task GLOB] [--stale] [--json]
    celery -A proj redlock inspect KEY [--json]
    celery -A proj redlock release KEY [--yes] [--force] [--json]
    celery -A proj redlock release --stale [--task GLOB] [--yes] [--json]
    celery -A proj redlock doctor [--json]
    celery -A proj redlock why TASK_ID [--json]
    celery -A proj redlock log KEY [--count N] [--follow] [--json]
    celery -A proj redlock web [--port 5557] [--address 127.0.0.1]
                               [--allow-release --basic-auth USER:PASSWORD]

The lock nodes are the app's: ``redlock_nodes``, else ``redlock_url``, else a
``redis://`` broker. Keys are found with ``SCAN ... TYPE hash`` (never ``KEYS``, which
blocks a server for as long as it takes to walk every key), read with the
``inspect.lua`` script, and released with ``release.lua`` and the exact token that
was read, so a lock re-acquired in the meantime is left alone. Every call has the
node timeout as its budget and no retries: a dead node costs one budget per round.

Whether a holder still runs is asked of the workers (``inspect().active()``, then
``stats()`` of those that answered, for their pids). A lock is **stale** only when it
names a task id and its holder is proven dead: the holder's process (the host and pid
the lock records) is gone on this host; or the holder's own worker (the answering
worker on that host whose main or pool process has that pid) does not have the task
active and runs no task in that process. Anything less is **unknown**: listed, never
released by ``--stale``, and released by ``release KEY`` only with ``--force``. A busy
solo worker cannot answer, and another worker on the same host says nothing about it.
A lock with no task id (a lock taken with ``Redlock`` in code, the beat leader lock)
is never stale.

A node that does not answer is never reported as holding no locks: with fewer than a
quorum answering, ``ls`` prints no "No locks held" (``--json``: ``"complete": false``
and ``"locks": null``), ``inspect`` says "unknown" (``"held": null``), and ``release``
releases nothing (``"error"``), all with exit status 69.

Exit status:

* 0: done (for ``doctor``: no error-level finding; for ``web``: stopped with Ctrl-C).
* 1: ``release`` refused (the holder runs, or whether it runs is unknown; for
  ``--stale``: some lock could not be classified) or was not confirmed; ``doctor``
  found an error; the ``redlock_*`` settings do not validate.
* 2: wrong usage (click).
* 69 (``EX_UNAVAILABLE``): fewer than a quorum of lock nodes answered; or workers had
  to be asked and none answered (for ``release --stale``: and some lock was refused
  for it), or the broker could not be reached; for ``doctor``,
  a node could not be asked at all.
"""

from __future__ import annotations

from typing import Any

import click
from celery.bin.base import handle_preload_options
from click_didyoumean import DYMGroup

from . import doctor, inspect, log, ls, release, web, why

__all__ = ["redlock"]


@click.group(name="redlock", cls=DYMGroup)
@click.pass_context
@handle_preload_options
def redlock(ctx: click.Context, **kwargs: Any) -> None:
    """Inspect, release, check and watch celery_redlock locks.

    The lock nodes are the app's (redlock_nodes, redlock_url, or a redis:// broker).
    """


# One module per sub-command, as in ``celery.bin``. They are attached here instead of
# decorated with ``@redlock.command``: a command module that imported the group from
# this package would import it half-initialised (this package imports them first).
redlock.add_command(ls.ls)
redlock.add_command(inspect.inspect)
redlock.add_command(release.release)
redlock.add_command(doctor.doctor)
redlock.add_command(why.why)
redlock.add_command(log.log)
redlock.add_command(web.web)
