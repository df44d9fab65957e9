"""``celery redlock ls``: the locks and shares held on the lock nodes, as a table or JSON."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import click
from celery.bin.base import CeleryCommand, CeleryOption
from celery.platforms import EX_UNAVAILABLE

from ..budgets import BudgetView, held_budgets
from ..claims import ClaimView, held_claims
from ..inventory import LockView, held_locks, nodes_status
from ..parked import WAITS_FOR, ParkedView, parked_runs
from ..shares import ShareView, held_shares
from ..workers import STALE, UNKNOWN, Workers, ask_workers, classify
from .base import check_quorum, common_options, no_worker_error, open_session
from .output import budget_used, duration, echo_json, holder, table, warn

__all__ = ["ls"]


@click.command(cls=CeleryCommand, name="ls")
@click.option(
    "--task",
    cls=CeleryOption,
    metavar="NAME_OR_GLOB",
    help_group="Filter Options",
    help="Only locks held by tasks whose name matches (fnmatch glob).",
)
@click.option(
    "--stale",
    cls=CeleryOption,
    is_flag=True,
    help_group="Filter Options",
    help="Only locks whose holder is proven dead (its process is gone on this host, or "
    "its own worker answered and does not run the task); the others are named on stderr.",
)
@click.option(
    "--verbose",
    "-v",
    cls=CeleryOption,
    is_flag=True,
    help_group="Output Options",
    help="Also list the runs waiting on the queue for each budget's key (QUEUED TASK ID: "
    "the key, when each is due, its place in line; the first 100 per key).",
)
@common_options(workers=True)
@click.pass_context
def ls(
    ctx: click.Context,
    /,
    task: str | None,
    stale: bool,
    verbose: bool,
    as_json: bool,
    node_timeout: float,
    timeout: float,
    **kwargs: Any,
) -> None:
    """List the locks, shares and queued copies on the lock nodes (SCAN, never KEYS).

    Shares (``lock_mode="shared"``, ``lock_limit``) are listed after the exclusive
    locks, then the send-time claims of ``lock_unique`` tasks (QUEUED KEY: the copy
    sent and not yet started, or not yet finished), then the rate budgets and the
    runs waiting on the queue for a key (BUDGET KEY: starts used of the budget in its
    window, the next free slot, runs queued; with ``--verbose``, QUEUED TASK ID: each
    waiting run, its key, when it is due and its place), then the runs parked until their turn
    (PARKED TASK ID: the task, what it waits for, its key, when a worker may publish
    it, how often one did); ``--stale`` applies to exclusive locks only (a share ends
    by itself within one TTL of its holder's death, a claim when its copy starts or
    within ``lock_unique_ttl``); budgets, which no task holds, are those of the keys
    the task's runs hold, share or are parked for with ``--task``, and left out with
    ``--stale``, as are parked runs.
    """
    session = open_session(ctx, node_timeout)
    try:
        locks, errors = held_locks(session.nodeset, session.prefix, task, timeout=node_timeout)
        shares: list[ShareView] = []
        claims: list[ClaimView] = []
        budgets: list[BudgetView] = []
        parked: list[ParkedView] = []
        if not stale:
            shares, share_errors = held_shares(
                session.nodeset, session.prefix, task, timeout=node_timeout
            )
            claims, claim_errors = held_claims(
                session.nodeset, session.prefix, task, timeout=node_timeout
            )
            parked, parked_errors = parked_runs(
                session.nodeset, session.prefix, task, timeout=node_timeout
            )
            budgets, budget_errors = held_budgets(
                session.nodeset, session.prefix, timeout=node_timeout
            )
            if task is not None:
                # No task holds a budget: with --task, the budgets of the keys the
                # task's runs hold, share or are parked for.
                used = {lock.key for lock in locks} | {share.key for share in shares}
                used |= {run.key for run in parked if run.key}
                budgets = [budget for budget in budgets if budget.key in used]
            for node, error in {
                **parked_errors,
                **budget_errors,
                **claim_errors,
                **share_errors,
            }.items():
                errors.setdefault(node, error)
    finally:
        session.close()
    code = check_quorum(ctx, session.nodeset, errors)
    # Fewer than a quorum answered: nobody can tell which locks are held. The locks
    # seen are still shown (each with its NO QUORUM), but never "No locks held".
    complete = not code
    now = time.time()
    states: dict[str, tuple[str, str]] | None = None
    workers: Workers | None = None
    unknown: list[LockView] = []
    if stale and not complete:
        locks = []  # no holder can be judged without its lock's quorum
    elif stale:
        workers = ask_workers(ctx.obj.app, timeout)
        states = {lock.key: classify(lock, workers) for lock in locks}
        if workers is None:
            ctx.obj.error(no_worker_error(timeout), fg="red")
            code = code or EX_UNAVAILABLE
        unknown = [lock for lock in locks if states[lock.key][0] == UNKNOWN]
        locks = [lock for lock in locks if states[lock.key][0] == STALE]
        _report_unknown(ctx, unknown, states)
    if as_json:
        echo_json(
            ctx,
            {
                "nodes": nodes_status(session.nodeset, errors),
                "quorum": session.nodeset.quorum,
                "complete": complete,
                "locks": _lock_items(locks, now, states) if complete else None,
                "shares": [share.as_dict(now) for share in shares] if complete else None,
                "claims": [claim.as_dict(now) for claim in claims] if complete else None,
                "budgets": [budget.as_dict() for budget in budgets] if complete else None,
                "parked": [run.as_dict() for run in parked] if complete else None,
                "unknown": _lock_items(unknown, now, states) if stale else None,
                "workers": None if not stale else (workers.as_dict() if workers else None),
            },
        )
    elif locks or shares or claims or budgets or parked:
        tables = [
            table(rows)
            for rows, present in (
                (_lock_rows(locks, now, states), locks),
                (_share_rows(shares, now), shares),
                (_claim_rows(claims, now), claims),
                (_budget_rows(budgets), budgets),
                (_waiting_rows(budgets), verbose and any(b.waiting for b in budgets)),
                (_parked_rows(parked), parked),
            )
            if present
        ]
        ctx.obj.echo("\n\n".join(tables))
    elif complete and not unknown:
        answered = len(session.nodeset) - len(errors)
        partial = f" ({answered} of {len(session.nodeset)} nodes answered)" if errors else ""
        ctx.obj.echo(("No stale locks" if stale else "No locks held") + partial + ".")
    ctx.exit(code)


def _lock_items(
    locks: Sequence[LockView], now: float, states: dict[str, tuple[str, str]] | None
) -> list[dict[str, Any]]:
    items = []
    for lock in locks:
        item = lock.as_dict(now)
        if states is not None:
            item["state"], item["reason"] = states[lock.key]
        items.append(item)
    return items


def _report_unknown(
    ctx: click.Context, unknown: Sequence[LockView], states: dict[str, tuple[str, str]]
) -> None:
    """Say on stderr which locks could be neither proven stale nor seen running."""
    if not unknown:
        return
    warn(ctx, f"{len(unknown)} lock(s) could not be classified (not released by --stale):")
    for lock in unknown:
        warn(ctx, f"  {lock.key}: {states[lock.key][1]}")


def _share_rows(shares: Sequence[ShareView], now: float) -> list[list[str]]:
    redlock = bool(shares) and shares[0].nodes > 1
    header = ["SHARED KEY", *_HOLDER_COLUMNS] + (["NODES"] if redlock else [])
    rows = [header]
    for share in shares:
        item = share.as_dict(now)
        row = _holder_cells(
            share.key,
            share.task_name,
            share.task_id,
            f"{item['host'] or '?'}:{item['pid'] or '?'}",
            item["age"],
            share.ttl,
            item["fence"],
        )
        rows.append(row + ([f"{share.held_on}/{share.nodes}"] if redlock else []))
    return rows


def _claim_rows(claims: Sequence[ClaimView], now: float) -> list[list[str]]:
    redlock = bool(claims) and claims[0].nodes > 1
    header = ["QUEUED KEY", "TASK", "TASK ID", "AGE", "TTL"] + (["NODES"] if redlock else [])
    rows = [header]
    for claim in claims:
        age = claim.age(now)
        row = [
            claim.key,
            claim.task_name or "-",
            claim.task_id,
            duration(None if age is None else max(age, 0.0)),
            duration(claim.ttl),
        ]
        rows.append(row + ([f"{claim.held_on}/{claim.nodes}"] if redlock else []))
    return rows


def _budget_rows(budgets: Sequence[BudgetView]) -> list[list[str]]:
    rows = [["BUDGET KEY", "USED", "NEXT FREE", "QUEUED"]]
    for budget in budgets:
        rows.append(
            [budget.key, budget_used(budget), duration(budget.next_free), str(budget.queued)]
        )
    return rows


def _waiting_rows(budgets: Sequence[BudgetView]) -> list[list[str]]:
    rows = [["QUEUED TASK ID", "KEY", "DUE IN", "PLACE"]]
    for budget in budgets:
        for place, (task_id, due_in) in enumerate(budget.waiting, 1):
            rows.append([task_id, budget.key, duration(max(due_in, 0.0)), str(place)])
    return rows


def _parked_rows(parked: Sequence[ParkedView]) -> list[list[str]]:
    rows = [["PARKED TASK ID", "TASK", "WAITS FOR", "KEY", "DUE IN", "TAKEN"]]
    for run in parked:
        rows.append(
            [
                run.task_id,
                run.task_name or "-",
                WAITS_FOR.get(run.kind, run.kind),
                run.key or "-",
                duration(max(run.due_in, 0.0)),
                str(run.taken),
            ]
        )
    return rows


#: The columns every row of ``ls`` has after its key.
_HOLDER_COLUMNS = ["TASK", "TASK ID", "HOLDER", "AGE", "TTL", "FENCE"]


def _holder_cells(
    key: str,
    task_name: str | None,
    task_id: str | None,
    address: str,
    age: float | None,
    ttl: float | None,
    fence: int | None,
) -> list[str]:
    """One ``ls`` row's key and holder columns, as printed."""
    return [
        key,
        task_name or "-",
        task_id or "-",
        address,
        duration(None if age is None else max(age, 0.0)),
        duration(ttl),
        str(fence) if fence is not None else "-",
    ]


def _nodes_cell(lock: LockView) -> str:
    quorum = "quorum" if lock.has_quorum else "NO QUORUM"
    return f"{lock.held_on}/{len(lock.views)} {quorum}"


def _lock_rows(
    locks: Sequence[LockView], now: float, states: dict[str, tuple[str, str]] | None
) -> list[list[str]]:
    redlock = bool(locks) and len(locks[0].views) > 1
    header = ["KEY", *_HOLDER_COLUMNS]
    header += ["NODES"] if redlock else []
    header += ["STATE"] if states is not None else []
    rows = [header]
    for lock in locks:
        row = _holder_cells(
            lock.key,
            lock.task_name,
            lock.task_id,
            holder(lock),
            lock.age(now),
            lock.ttl,
            lock.fence,
        )
        row += [_nodes_cell(lock)] if redlock else []
        row += [states[lock.key][0]] if states is not None else []
        rows.append(row)
    return rows
