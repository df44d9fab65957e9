"""Who leads the app's beats: the ``LeaderScheduler`` lock, read as ``inspect`` reads a lock.

The leader lock is an exclusive lock like any other (``redlock:{beat:<name>}``), so it
is read with :func:`~celery_redlock.ops.inventory.read_locks`; its holder's
``task_name`` is the beat's own description (app, host, pid, broker), parsed back
with :func:`~celery_redlock.integration.beat.parse_beat_holder`. ``doctor`` judges
the same lock against this app's broker (:mod:`celery_redlock.ops.doctor`).
"""

from __future__ import annotations

import time
from typing import Any

from ..engine.keys import lock_keys
from ..integration.settings import Settings
from ..nodes import NodeSet
from .inventory import has_quorum, read_locks

__all__ = ["read_leader"]


def read_leader(
    app: Any, settings: Settings, nodeset: NodeSet, *, timeout: float | None = None
) -> tuple[dict[str, Any], dict[str, str]]:
    """The app's beat leader lock, JSON-ready; and the nodes that did not answer.

    Returns:
        ``({"key", "name", "held", "holder", "beat"}, errors)``: ``held`` is None when
        too few nodes answered to tell; ``holder`` is the lock in its ``ls --json`` form
        (None when free); ``beat`` is ``{"app", "host", "pid", "broker"}`` of the beat
        that holds it (None when free, or held by something else than a beat of this
        version).
    """
    # Imported here: the beat module imports Celery's scheduler, which nothing else
    # of a read needs (doctor does the same).
    from ..integration.beat import leader_name, parse_beat_holder  # noqa: PLC0415

    key = lock_keys(leader_name(app, settings.beat_name), settings.key_prefix).lock
    (lock,) = read_locks(nodeset, [key], settings.key_prefix, timeout=timeout)
    errors = {v.node: v.error for v in lock.views if v.error is not None}
    held: bool | None = True if lock.held else (False if has_quorum(nodeset, errors) else None)
    return {
        "key": lock.key,
        "name": lock.name,
        "held": held,
        "holder": lock.as_dict(time.time()) if lock.held else None,
        "beat": parse_beat_holder(lock.task_name) if lock.held else None,
    }, errors
