"""Drafting for a batch of rows, one step: every row's drafters propose (rows with equal
drafters together, through :meth:`~accel.strategy.Drafter.propose_batch` where it is
overridden), a row's proposals are merged into its draft tree (:func:`merge_tree`), and after
verification each drafter hears what was accepted (:func:`drafter_feedback`). A drafter's
failure is its row's, never the batch's. How many nodes each row may draft is
:func:`accel.engine.draft_budgets`; the verify step is :mod:`accel.steps`.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import torch

from .acceptance import Acceptance
from .strategy import DraftContext, DraftProposal, Drafter, Plan
from .tree import DraftTree, merge_proposals

__all__ = ["merge_tree", "start_rows", "draft_rows", "drafter_feedback"]


def merge_tree(proposals: list[DraftProposal | None], ctx: DraftContext) -> tuple[DraftTree, torch.Tensor | None]:
    """One row's drafters' ``proposals`` (in plan order) merged below the root into at most
    ``ctx.max_tokens`` nodes: the tree and each node's drafter index (None: no drafts)."""
    root = int(ctx.tokens[-1])
    device = ctx.tokens.device
    if len(proposals) == 1:
        prop = proposals[0]
        if prop is None or len(prop) == 0:
            return DraftTree.root_only(root, device=device), None
        return DraftTree.from_proposal(root, prop), torch.zeros(len(prop), dtype=torch.long)
    merged = merge_proposals(proposals, ctx.max_tokens)
    if merged is None:
        return DraftTree.root_only(root, device=device), None
    return DraftTree.from_proposal(root, merged.proposal), merged.source


def _groups(plans: Sequence[Plan], depth: int, members: Sequence[int]) -> list[tuple[Any, list[int]]]:
    """The rows of ``members`` with an ``depth``-th drafter, grouped by equal drafters."""
    groups: list[tuple[Any, list[int]]] = []
    for b in members:
        if len(plans[b].drafters) <= depth:
            continue
        drafter = plans[b].drafters[depth]
        group = next((g for g in groups if _same_drafter(g[0], drafter)), None)
        if group is None:
            groups.append((drafter, [b]))
        else:
            group[1].append(b)
    return groups


def start_rows(model, plans: Sequence[Plan], prompts: Sequence[torch.Tensor]) -> list[list[Any]]:
    """Every admitted row's drafter states (:meth:`Drafter.start`), rows of equal drafters
    started together through :meth:`Drafter.start_batch`."""
    states: list[list[Any]] = [[None] * len(p.drafters) for p in plans]
    for i in range(max((len(p.drafters) for p in plans), default=0)):
        for drafter, members in _groups(plans, i, range(len(plans))):
            if len(members) > 1:
                got = drafter.start_batch(model, [prompts[b] for b in members])
            else:
                got = [drafter.start(model, prompts[members[0]])]
            for b, state in zip(members, got):
                states[b][i] = state
    return states


def draft_rows(plans: Sequence[Plan], states: Sequence[list[Any]], ctxs: Sequence[DraftContext]
               ) -> tuple[list[tuple[DraftTree, torch.Tensor | None]], list[float], list[BaseException | None]]:
    """Every row's draft tree for one batched step.

    Rows whose i-th drafters are equal (same strategy and settings, as when a batch shares
    its strategies) draft together through :meth:`Drafter.propose_batch` where the drafter
    overrides it, so a drafter whose work batches pays once per step, not once per row; others
    propose row by row. A batched call that fails is retried row by row (an override must leave
    the states as they were when it raises), so one request's failure stays that request's.

    Returns per row (tree, drafter index per node or None), the seconds its drafting took
    (a group's time split evenly over its rows) and the error it raised (None if none).
    """
    rows = len(plans)
    proposals: list[list[DraftProposal | None]] = [[None] * len(p.drafters) for p in plans]
    seconds = [0.0] * rows
    errors: list[BaseException | None] = [None] * rows
    depth = max((len(p.drafters) for p in plans), default=0)
    for i in range(depth):
        for drafter, members in _groups(plans, i, [b for b in range(rows) if ctxs[b].max_tokens > 0]):
            t0 = time.perf_counter()
            got = None
            if len(members) > 1 and type(drafter).propose_batch is not Drafter.propose_batch:
                try:
                    got = drafter.propose_batch([states[b][i] for b in members], [ctxs[b] for b in members])
                    if len(got) != len(members):
                        raise RuntimeError(f"{type(drafter).__name__}.propose_batch returned {len(got)} "
                                           f"proposals for {len(members)} rows")
                except Exception:  # find the row that fails, row by row; the others draft on
                    got = None
            if got is None:
                got = []
                for b in members:
                    try:
                        got.append(drafter.propose(states[b][i], ctxs[b]))
                    except Exception as err:
                        errors[b] = errors[b] or err
                        got.append(None)
            share = (time.perf_counter() - t0) / len(members)
            for b, prop in zip(members, got):
                proposals[b][i] = prop
                seconds[b] += share
    trees = []
    for b in range(rows):
        tree = None
        if plans[b].drafters and ctxs[b].max_tokens > 0 and errors[b] is None:
            try:  # a malformed proposal is that row's error too
                tree = merge_tree(proposals[b], ctxs[b])
            except Exception as err:
                errors[b] = err
        if tree is None:
            tree = (DraftTree.root_only(int(ctxs[b].tokens[-1]), device=ctxs[b].tokens.device), None)
        trees.append(tree)
    return trees, seconds, errors


def _same_drafter(a: Any, b: Any) -> bool:
    """Whether two rows' drafters may draft together: the same object, or equal settings of
    the same class (a drafter whose fields cannot be compared, e.g. tensors, drafts alone)."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - a field without a truth value: treat as different
        return False


def drafter_feedback(plan: Plan, states: list[Any], source: torch.Tensor | None, acc: Acceptance) -> None:
    """Tell each drafter of a row how many of this step's nodes were its own and how many of
    those the accepted path holds (``source``: each node's drafter index, None: no drafts)."""
    if source is None:
        for d, s in zip(plan.drafters, states):
            d.feedback(s, 0, 0)
        return
    path_sources = [int(source[j - 1]) for j in acc.path[1:]]
    for i, (d, s) in enumerate(zip(plan.drafters, states)):
        d.feedback(s, int((source == i).sum()), sum(1 for src in path_sources if src == i))
