"""Where one task id stands on the lock nodes: the locks it holds, its claims, its parked run.

What ``celery redlock inspect TASK_ID`` prints and the web dashboard's search shows
(``/api/task/<task id>``), read once here with the same functions ``ls`` lists them
with. Reading takes no lock and changes nothing.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from ..nodes import NodeSet
from .claims import held_claims
from .inventory import held_locks
from .parked import parked_runs

__all__ = ["TaskStory", "is_task_id", "task_story"]


def is_task_id(text: str) -> bool:
    """Whether ``text`` reads as a Celery task id (a UUID in its usual 36-character form)."""
    try:
        return len(text) == 36 and str(uuid.UUID(text)) == text.lower()
    except ValueError:
        return False


@dataclass
class TaskStory:
    """What the nodes hold for one task id, each item in its ``ls --json`` form.

    ``errors`` names the nodes that did not answer: what they hold is not shown.
    """

    task_id: str
    holds: list[dict[str, Any]] = field(default_factory=list)
    claims: list[dict[str, Any]] = field(default_factory=list)
    parked: list[dict[str, Any]] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)

    @property
    def found(self) -> bool:
        """The task holds a lock, claims a name or has a run parked."""
        return bool(self.holds or self.claims or self.parked)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form (``inspect TASK_ID --json``): task_id, holds, claims, parked, errors."""
        return {
            "task_id": self.task_id,
            "holds": self.holds,
            "claims": self.claims,
            "parked": self.parked,
            "errors": self.errors,
        }


def task_story(
    nodeset: NodeSet, prefix: str, task_id: str, *, timeout: float | None = None
) -> TaskStory:
    """The locks ``task_id`` holds, the lock names its queued copy claims, its parked run."""
    now = time.time()
    locks, errors = held_locks(nodeset, prefix, None, timeout=timeout)
    claims, claim_errors = held_claims(nodeset, prefix, timeout=timeout)
    parked, parked_errors = parked_runs(nodeset, prefix, timeout=timeout)
    return TaskStory(
        task_id,
        holds=[lock.as_dict(now) for lock in locks if lock.task_id == task_id],
        claims=[claim.as_dict(now) for claim in claims if claim.task_id == task_id],
        parked=[run.as_dict() for run in parked if run.task_id == task_id],
        errors={**errors, **claim_errors, **parked_errors},
    )
