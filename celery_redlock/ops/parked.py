"""The runs parked on the lock nodes, waiting their turn (``ls``: PARKED).

A run refused by its rate budget, put back because its key was busy, or whose nodes did
not answer when it started waits parked on one lock node until a worker's publisher
takes it (:mod:`celery_redlock.integration.parking`): its task id, due time (node
clock) and record (the task, why it waits, its key, the message) under
``<prefix>parked``, or, for a run waiting for its key's release, in its key's line.
Reading them takes no lock and changes nothing.
"""

from __future__ import annotations

import fnmatch
import json
from dataclasses import dataclass
from typing import Any

from ..engine.keys import lock_name_of, parked_keys
from ..nodes import Call, NodeSet
from .inventory import answers

__all__ = ["ParkedView", "parked_runs"]

#: Why a parked run waits, by its record's kind, as ``ls`` words it.
WAITS_FOR = {"rate": "its rate slot", "busy": "its key's release", "later": "a retry"}


@dataclass(frozen=True)
class ParkedView:
    """One parked run: which task, why it waits, for which key, and when it is due."""

    task_id: str
    task_name: str | None
    kind: str  #: ``rate``, ``busy`` or ``later`` (see :data:`WAITS_FOR`)
    key: str | None  #: its lock key
    name: str | None  #: its lock name
    due_in: float  #: seconds until a publisher may take it (negative: overdue)
    taken: int  #: how often a publisher took it (its copy published, not started yet)
    node: str  #: the node it is parked on

    def as_dict(self) -> dict[str, Any]:
        """The JSON of ``ls --json``'s ``parked`` list (``waits_for``: ``kind`` in words)."""
        return {
            "task_id": self.task_id,
            "task_name": self.task_name,
            "kind": self.kind,
            "waits_for": WAITS_FOR.get(self.kind, self.kind),
            "key": self.key,
            "name": self.name,
            "due_in": round(self.due_in, 3),
            "taken": self.taken,
            "node": self.node,
        }


def parked_runs(
    nodeset: NodeSet, prefix: str, task: str | None = None, *, timeout: float | None = None
) -> tuple[list[ParkedView], dict[str, str]]:
    """Every run parked on the nodes, soonest due first; errors per node.

    A run is parked on one node (the first that answered its parking), so the nodes'
    lists are joined, not voted on. ``task`` keeps the runs of task names matching
    that glob.
    """
    keys = parked_keys(prefix)
    calls = [
        Call.command("TIME"),
        Call.command("ZRANGE", keys.due, 0, -1, "WITHSCORES"),
        Call.command("HGETALL", keys.runs),
        Call.command("HGETALL", keys.taken),
        Call.command("ZRANGE", keys.lines, 0, -1, "WITHSCORES"),
    ]
    runs: list[ParkedView] = []
    answered, errors = answers(nodeset, calls, timeout)
    names = sorted({line for _, values in answered for line in values[4][::2]})
    members = [Call.command("ZRANGE", name, 0, -1, "WITHSCORES") for name in names]
    in_lines = dict(answers(nodeset, members, timeout)[0]) if names else {}
    for node, (clock, due, record_pairs, taken_pairs, lines) in answered:
        now_ms = int(clock[0]) * 1000 + int(clock[1]) // 1000
        records = dict(zip(record_pairs[::2], record_pairs[1::2], strict=True))
        taken = dict(zip(taken_pairs[::2], taken_pairs[1::2], strict=True))
        # A run waiting in a line is looked at no earlier than its line is.
        looks = dict(zip(lines[::2], map(float, lines[1::2]), strict=True))
        scores = list(zip(due[::2], map(float, due[1::2]), strict=True))
        for name, line in zip(names, in_lines.get(node, [[]] * len(names)), strict=True):
            look = looks.get(name, 0.0)
            scores += [
                (i, max(float(at), look)) for i, at in zip(line[::2], line[1::2], strict=True)
            ]
        for task_id, score in scores:
            text = records.get(task_id)
            if text is None:
                continue  # its record is gone (a copy started): the next take drops it
            due_in = (score - now_ms) / 1000
            view = _view(task_id, text, due_in, taken, node, prefix)
            if task is None or fnmatch.fnmatchcase(view.task_name or "", task):
                runs.append(view)
    runs.sort(key=lambda run: run.due_in)
    return runs, errors


def _view(
    task_id: str, text: str, due_in: float, taken: dict[str, str], node: str, prefix: str
) -> ParkedView:
    """A parked run from its record (``park()``'s JSON)."""
    record = json.loads(text)
    key = record.get("lock")
    return ParkedView(
        task_id=task_id,
        task_name=record.get("task"),
        kind=str(record.get("kind", "later")),
        key=key,
        name=lock_name_of(key, prefix) if key else None,
        due_in=due_in,
        taken=int(taken.get(task_id, 0)),
        node=node,
    )
