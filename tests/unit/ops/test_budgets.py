"""A key's budget and queue as a majority of the lock nodes sees them (crafted replies)."""

from __future__ import annotations

from celery_redlock.engine.rate import Budget
from celery_redlock.ops.budgets import BudgetView, NodeBudget


def test_three_nodes_agree_as_the_admission_would():
    """Used and queued: what the second busiest node counts (a majority has at least
    that); the next free slot: when a second node would admit; the budget most nodes
    record. A node that forgot the budget (restarted) does not count for used."""
    budget = Budget(5, 60.0)
    view = BudgetView(
        "redlock:{api}",
        "api",
        [
            NodeBudget(budget, used=5, wait=12.0, queued=4),
            NodeBudget(budget, used=4, wait=0.0, queued=3),
            NodeBudget(None, used=0, wait=None, queued=0),
        ],
        quorum_size=2,
    )
    assert view.budget == budget
    assert (view.used, view.next_free, view.queued) == (4, 12.0, 3)
    assert view.drain == 36.0, "3 runs at 5 a minute"
    item = view.as_dict()
    assert (item["rate"], item["limit"], item["window"], item["nodes"]) == ("5/m", 5, 60.0, 3)


def test_a_key_with_runs_queued_and_no_budget_has_no_use_to_show():
    view = BudgetView("redlock:{x}", "x", [NodeBudget(None, used=0, wait=None, queued=2)])
    assert (view.budget, view.used, view.next_free, view.drain) == (None, None, None, None)
    assert view.queued == 2 and view.seen
    assert not BudgetView("redlock:{y}", "y", [NodeBudget(None, 0, None, 0)]).seen
    odd = BudgetView("redlock:{z}", "z", [NodeBudget(Budget(3, 2.5), 1, 0.0, 0)])
    assert odd.as_dict()["rate"] == "3/2500ms", "a window lock_rate does not write"
