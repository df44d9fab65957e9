"""The runs waiting on the queue for a key: ``redlock:{NAME}:queued`` on the lock nodes.

A run of a task that goes back on the queue to wait for its key (refused by its rate
budget, or put back by ``lock_on_busy="requeue"`` because the key was busy) is written
there, task id -> when it is due again (ms on the node's clock), so that ``celery
redlock ls``, ``inspect`` and ``doctor`` can say how many runs wait for a key. The
entry leaves when the run starts; a run deferred again replaces its entry. Entries
due more than :data:`~celery_redlock.engine.keys.QUEUED_GRACE` ago (a run purged or
revoked on the queue never starts) are not counted and are dropped, and the key
expires that long after its latest due.

Runs refused by their budget are recorded by ``rate.lua`` in the admission itself
(:func:`celery_redlock.engine.rate.rate_calls`); this module writes the others, with
one ``note_queued.lua`` call per deferral and one per start of a deferred run. What is
written here is seen, never relied on: a node that does not answer is skipped.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from ..engine.keys import QUEUED_GRACE, LockKeys
from ..engine.scripts import NOTE_QUEUED, NOTE_STARTED
from ..nodes import NodeSet

__all__ = ["note_queued", "note_started"]

logger = logging.getLogger("celery_redlock.lock")


def note_queued(nodeset: NodeSet, keys: LockKeys, task_id: str, delay: float) -> None:
    """Record on every node that run ``task_id`` waits on the queue for ``keys``.

    It is due again in ``delay`` seconds (from the node's clock as it records it).
    """
    _note(nodeset, (keys,), task_id, str(max(0, round(delay * 1000))))


def note_started(nodeset: NodeSet, resources: Sequence[LockKeys], task_id: str) -> None:
    """Remove run ``task_id`` from the runs waiting for each of ``resources``: it starts."""
    _note(nodeset, resources, task_id, "")


def _note(nodeset: NodeSet, resources: Sequence[LockKeys], task_id: str, delay: str) -> None:
    keys = tuple(resource.queued for resource in resources)
    grace = round(QUEUED_GRACE * 1000)
    call = (
        NOTE_STARTED.call(queued=keys, task_id=task_id)
        if delay == ""
        else NOTE_QUEUED.call(queued=keys, task_id=task_id, delay_ms=delay, grace_ms=grace)
    )
    for reply in nodeset.call([call]):
        failed = None if reply is None else reply.error or reply.values[0]
        if isinstance(failed, BaseException):
            logger.debug("Run %s not noted as queued on a lock node: %r", task_id, failed)
