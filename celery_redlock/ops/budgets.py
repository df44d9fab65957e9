"""The rate budgets on the lock nodes, and the runs waiting on the queue for each key.

A budget (``lock_rate``, :class:`~celery_redlock.RateLimit`) is a log of starts,
``<lock key>:rate``, with the budget it is kept under beside it, ``<lock key>:budget``
(``N/WINDOW_MS``, written by each admission); the runs put back on the queue for a key
(by their budget, or by ``lock_on_busy="requeue"``) are ``<lock key>:queued``, task id
-> due time (see :mod:`celery_redlock.engine.keys`). ``ls``, ``inspect`` and ``doctor``
read them with ``budget_read.lua``, which writes nothing.

With several nodes each says what it logged; a key's view is what a majority agrees
on, as the admission judges it (:func:`celery_redlock.engine.rate.judge`): the starts
and the queued runs the ``quorum``-th busiest node counts, and the wait until a
``quorum`` of nodes would admit a start.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..engine.keys import QUEUED_GRACE, keys_of, lock_name_of
from ..engine.rate import UNITS, Budget
from ..engine.scripts import BUDGET_READ
from ..nodes import NodeSet
from .inventory import reply_error, resolve_key, scan_lock_keys

__all__ = ["BudgetView", "NodeBudget", "held_budgets", "read_budgets"]

#: Keys read per round trip.
READ_CHUNK = 500

#: Waiting runs listed per key (``ls --verbose``, ``--json``): the first, soonest due.
WAITING_SHOWN = 100


@dataclass(frozen=True)
class NodeBudget:
    """What one node says of a key's budget and queue (``budget_read.lua``).

    ``budget`` is None when the node records none (no start for one window, or an
    older version's log); ``wait`` is then None too.
    """

    budget: Budget | None
    used: int
    wait: float | None
    queued: int
    #: The first runs waiting, soonest due first: (task id, seconds until due).
    waiting: tuple[tuple[str, float], ...] = ()


@dataclass
class BudgetView:
    """One key's budget and queued runs across the nodes that answered."""

    key: str  #: the lock key
    name: str
    views: list[NodeBudget] = field(default_factory=list)
    quorum_size: int = 1

    @property
    def budget(self) -> Budget | None:
        """The budget most nodes record (None: none records one)."""
        found = Counter(v.budget for v in self.views if v.budget is not None)
        return found.most_common(1)[0][0] if found else None

    def _majority(self, values: Sequence[float], *, largest: bool) -> float | None:
        """The value ``quorum_size`` nodes reach: the quorum-th largest (or smallest)."""
        if not values:
            return None
        ranked = sorted(values, reverse=largest)
        return ranked[min(self.quorum_size, len(ranked)) - 1]

    @property
    def used(self) -> int | None:
        """Starts in the current window (None: no node records a budget)."""
        counted = [v.used for v in self.views if v.budget is not None]
        value = self._majority(counted, largest=True)
        return None if value is None else int(value)

    @property
    def next_free(self) -> float | None:
        """Seconds until a start would be admitted (0: now; None: no budget recorded)."""
        waits = [v.wait for v in self.views if v.wait is not None]
        return self._majority(waits, largest=False)

    @property
    def queued(self) -> int:
        """Runs waiting on the queue for the key."""
        return int(self._majority([v.queued for v in self.views], largest=True) or 0)

    @property
    def waiting(self) -> list[tuple[str, float]]:
        """The runs waiting for the key that the nodes listed, soonest due first.

        (task id, seconds until due: negative for a run due and not started yet), each
        with the earliest due any node records; their place in line is their order.
        """
        due: dict[str, float] = {}
        for view in self.views:
            for task_id, due_in in view.waiting:
                due[task_id] = min(due_in, due.get(task_id, due_in))
        return sorted(due.items(), key=lambda item: item[1])

    @property
    def seen(self) -> bool:
        """Some node records a budget, a start or a queued run for the key."""
        return any(v.budget is not None or v.used or v.queued for v in self.views)

    @property
    def drain(self) -> float | None:
        """Seconds the budget takes to start every queued run (None: no budget)."""
        budget = self.budget
        return None if budget is None else self.queued / budget.limit * budget.window

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form: key, name, rate, limit, window, used, next_free, queued, drain.

        And ``waiting``: the runs the nodes listed (task id, seconds until due, place).
        """
        budget, next_free, drain = self.budget, self.next_free, self.drain
        return {
            "key": self.key,
            "name": self.name,
            "rate": None if budget is None else _rate_text(budget),
            "limit": None if budget is None else budget.limit,
            "window": None if budget is None else budget.window,
            "used": self.used,
            "next_free": None if next_free is None else round(next_free, 3),
            "queued": self.queued,
            "drain": None if drain is None else round(drain, 3),
            "nodes": len(self.views),
            "waiting": [
                {"task_id": task_id, "due_in": round(due_in, 3), "place": place}
                for place, (task_id, due_in) in enumerate(self.waiting, 1)
            ],
        }


def _rate_text(budget: Budget) -> str:
    """``5/s`` for the windows ``lock_rate`` writes, else ``N/<window in ms>ms``."""
    if budget.window in UNITS.values():
        return str(budget)
    return f"{budget.limit}/{budget.window_ms}ms"


def _parse(value: Any) -> NodeBudget:
    """A ``budget_read.lua`` reply as a :class:`NodeBudget`."""
    text, used, wait_ms, queued, waiting = value
    limit, _, window_ms = str(text).partition("/")
    budget = Budget(int(limit), int(window_ms) / 1000) if text else None
    return NodeBudget(
        budget,
        int(used),
        None if budget is None else int(wait_ms) / 1000,
        int(queued),
        tuple((str(waiting[i]), int(waiting[i + 1]) / 1000) for i in range(0, len(waiting), 2)),
    )


def read_budgets(
    nodeset: NodeSet, keys: Sequence[str], prefix: str, *, timeout: float | None = None
) -> tuple[list[BudgetView], dict[str, str]]:
    """The budget and queued runs of each lock key in ``keys``, on every node.

    Returns:
        (one view per key, in order; {node url: error} for the nodes that failed).
    """
    views = {
        key: BudgetView(key, lock_name_of(key, prefix), quorum_size=nodeset.quorum) for key in keys
    }
    errors: dict[str, str] = {}
    grace = round(QUEUED_GRACE * 1000)
    for start in range(0, len(keys), READ_CHUNK):
        chunk = keys[start : start + READ_CHUNK]
        calls = [BUDGET_READ.on(keys_of(key), grace_ms=grace, most=WAITING_SHOWN) for key in chunk]
        for node, reply in zip(nodeset.nodes, nodeset.call(calls, timeout=timeout), strict=True):
            error = reply_error(reply)
            if error is not None:
                errors.setdefault(node.safe_url, error)
                continue
            for key, value in zip(chunk, reply.values, strict=True):  # type: ignore[union-attr]
                views[key].views.append(_parse(value))
    return list(views.values()), errors


def held_budgets(
    nodeset: NodeSet, prefix: str, *, timeout: float | None = None
) -> tuple[list[BudgetView], dict[str, str]]:
    """Every key with a log of starts or runs waiting on the queue; and failed nodes.

    Found with SCAN (never KEYS): the logs (``:rate``) and the queues (``:queued``),
    sorted sets both. A key whose log and queue emptied since the scan is left out.
    """
    found: set[str] = set()
    errors: dict[str, str] = {}
    for field_name in ("rate", "queued"):
        keys, scan_errors = scan_lock_keys(
            nodeset, prefix, timeout=timeout, field=field_name, key_type="zset"
        )
        found.update(resolve_key(key, prefix) for key in keys)
        for node, error in scan_errors.items():
            errors.setdefault(node, error)
    views, read_errors = read_budgets(nodeset, sorted(found), prefix, timeout=timeout)
    for node, error in read_errors.items():
        errors.setdefault(node, error)
    return [view for view in views if view.seen], errors
