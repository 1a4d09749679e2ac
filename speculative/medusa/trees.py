"""Static Medusa draft trees: which top-k candidates of which head a verify step checks.

A tree is a list of index PATHS, the notation of the Medusa paper (Cai et al. 2024): a path
``(i0, i1, ..., id)`` is the node reached by taking head 1's rank-``i0`` token, then head 2's
rank-``i1`` token below it, and so on (rank 0 = the head's top token). Every path's parent
(the path minus its last index) must be in the tree too. The root (the pending token, which
the base model's own head chose) is implicit.

    paths [(0,), (1,), (0, 0)]   with head tops  head 1: [a, b, ...], head 2: [c, ...]
    ->  root ─┬─ a (node 1) ── c (node 3)        tokens  [a, b, c]
              └─ b (node 2)                       parents [0, 0, 1]

:func:`build_tree` grows a tree for a node budget from measured per-head accuracies, as the
paper describes: the expected number of accepted tokens of a tree is the sum, over its
nodes, of the product of the per-depth accuracies along the node's path, and the greedy
choice adds the path with the highest such product, one node at a time.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch

__all__ = [
    "TreePath",
    "TREES",
    "MC_SIM_7B_63",
    "TreeArrays",
    "TreeLevel",
    "build_tree",
    "check_paths",
    "expected_acceptance",
    "rank_accuracies",
    "tree_arrays",
    "tree_levels",
    "truncate_paths",
]

#: One node of a tree as its index path (see above): ranks of heads 1, 2, ... from the root.
TreePath = tuple[int, ...]

#: The 63-node sparse tree the Medusa authors tuned on Vicuna-7B and released with the paper
#: (``mc_sim_7b_63``; Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration Framework
#: with Multiple Decoding Heads"). Data only: paths in the authors' priority order, 4 deep.
MC_SIM_7B_63: tuple[TreePath, ...] = (
    (0,), (0, 0), (1,), (0, 1), (2,), (0, 0, 0), (1, 0), (0, 2), (3,), (0, 3), (4,), (0, 4),
    (2, 0), (0, 5), (0, 0, 1), (5,), (0, 6), (6,), (0, 7), (0, 1, 0), (1, 1), (7,), (0, 8),
    (0, 0, 2), (3, 0), (0, 9), (8,), (9,), (1, 0, 0), (0, 2, 0), (1, 2), (0, 0, 3), (4, 0),
    (2, 1), (0, 0, 4), (0, 0, 5), (0, 0, 0, 0), (0, 1, 1), (0, 0, 6), (0, 3, 0), (5, 0),
    (1, 3), (0, 0, 7), (0, 0, 8), (0, 0, 9), (6, 0), (0, 4, 0), (1, 4), (7, 0), (0, 1, 2),
    (2, 0, 0), (3, 1), (2, 2), (8, 0), (0, 5, 0), (1, 5), (1, 0, 1), (0, 2, 1), (9, 0),
    (0, 6, 0), (0, 0, 0, 1), (1, 6), (0, 7, 0),
)

#: Named trees. ``chain``: each head's top token in a line (as deep as there are heads).
TREES: dict[str, tuple[TreePath, ...]] = {
    "mc_sim_7b_63": MC_SIM_7B_63,
    "chain": ((0,), (0, 0), (0, 0, 0), (0, 0, 0, 0), (0, 0, 0, 0, 0)),
}


def check_paths(paths: Iterable[Sequence[int]], what: str = "tree") -> tuple[TreePath, ...]:
    """Validate index paths and return them as tuples, in the given order.

    Each path must be non-empty, hold ranks >= 0, appear once, and have its parent (the path
    minus its last index) earlier in the list. Raises ValueError naming the offending path.
    """
    out: list[TreePath] = []
    seen: set[TreePath] = set()
    for raw in paths:
        path = tuple(int(i) for i in raw)
        if not path:
            raise ValueError(f"{what}: empty path (the root is implicit; list only draft nodes)")
        if any(i < 0 for i in path):
            raise ValueError(f"{what}: path {list(path)} has a negative rank")
        if path in seen:
            raise ValueError(f"{what}: path {list(path)} appears twice")
        if len(path) > 1 and path[:-1] not in seen:
            raise ValueError(f"{what}: path {list(path)} comes before (or without) its parent {list(path[:-1])}")
        seen.add(path)
        out.append(path)
    return tuple(out)


def truncate_paths(paths: Sequence[TreePath], max_nodes: int, max_depth: int | None = None) -> tuple[TreePath, ...]:
    """The first ``max_nodes`` paths no deeper than ``max_depth`` whose parent was kept.

    Paths are taken in order, so a priority-ordered tree truncates to its best sub-tree.
    """
    kept: list[TreePath] = []
    keep: set[TreePath] = set()
    for path in paths:
        if len(kept) >= max_nodes:
            break
        if max_depth is not None and len(path) > max_depth:
            continue
        if len(path) > 1 and path[:-1] not in keep:
            continue
        kept.append(path)
        keep.add(path)
    return tuple(kept)


def rank_accuracies(topk_accuracy: Sequence[Sequence[float]]) -> list[list[float]]:
    """Per-rank accuracies from cumulative top-k accuracies.

    topk_accuracy[k][i]: fraction of positions where head k's target is among its top i+1
    tokens. Returns a[k][i]: the fraction where it is exactly the rank-i token.
    """
    out = []
    for row in topk_accuracy:
        prev, ranks = 0.0, []
        for cum in row:
            ranks.append(max(0.0, float(cum) - prev))
            prev = max(prev, float(cum))
        out.append(ranks)
    return out


def expected_acceptance(paths: Iterable[TreePath], accuracies: Sequence[Sequence[float]]) -> float:
    """Expected accepted drafts per step (bonus excluded) under independent heads:
    the sum over nodes of the product of ``accuracies[depth][rank]`` along the path."""
    total = 0.0
    for path in paths:
        p = 1.0
        for depth, rank in enumerate(path):
            row = accuracies[depth] if depth < len(accuracies) else ()
            p *= row[rank] if rank < len(row) else 0.0
        total += p
    return total


def build_tree(accuracies: Sequence[Sequence[float]], max_nodes: int) -> tuple[TreePath, ...]:
    """The tree of at most ``max_nodes`` nodes that greedily maximises expected acceptance.

    accuracies: [K][topk] per-rank accuracies, ``accuracies[k][i]`` the probability that head
        k+1's rank-i token is the right one (see :func:`rank_accuracies`); K bounds the depth.
    Returns paths in the order they were added (best first, parents before children), so
    any prefix is the greedy tree of that size. Ties go to the shallower, then smaller path.
    """
    depth_max = len(accuracies)
    if max_nodes <= 0 or depth_max == 0:
        return ()
    heap: list[tuple[float, int, TreePath]] = []

    def push_children(parent: TreePath, value: float) -> None:
        depth = len(parent)
        if depth >= depth_max:
            return
        for rank, acc in enumerate(accuracies[depth]):
            child = parent + (rank,)
            heapq.heappush(heap, (-value * float(acc), len(child), child))

    push_children((), 1.0)
    out: list[TreePath] = []
    while heap and len(out) < max_nodes:
        neg, _, path = heapq.heappop(heap)
        out.append(path)
        push_children(path, -neg)
    return tuple(out)


@dataclass(frozen=True)
class TreeArrays:
    """A tree of N paths laid out for :class:`accel.strategy.DraftProposal`.

    head: LongTensor [N], which head (0-based, = depth - 1) supplies each node's token.
    rank: LongTensor [N], which of that head's top tokens it is.
    parents: LongTensor [N], parent node of each node (0 = root, i = the i-th path).
    """

    head: torch.Tensor
    rank: torch.Tensor
    parents: torch.Tensor

    def tokens(self, top: torch.Tensor) -> torch.Tensor:
        """Draft tokens [N] from per-head top tokens ``top`` [K, topk]."""
        return top[self.head, self.rank]


def tree_arrays(paths: Sequence[TreePath], device: torch.device | str | None = None) -> TreeArrays:
    """Node arrays of ``paths`` (validated, in order: node i+1 is ``paths[i]``)."""
    paths = check_paths(paths)
    index = {p: i + 1 for i, p in enumerate(paths)}
    parents = [index[p[:-1]] if len(p) > 1 else 0 for p in paths]
    return TreeArrays(
        head=torch.tensor([len(p) - 1 for p in paths], dtype=torch.long, device=device),
        rank=torch.tensor([p[-1] for p in paths], dtype=torch.long, device=device),
        parents=torch.tensor(parents, dtype=torch.long, device=device),
    )


@dataclass(frozen=True)
class TreeLevel:
    """One depth of a tree, for heads that read the path they extend (Hydra-style heads).

    Positions count the root as 0 and ``paths[i]`` as i + 1.

    head: which head (0-based, = depth - 1) drafts this level's nodes.
    ancestry: LongTensor [P, head + 1], for each of the P nodes expanded here (the parents
        of this level's nodes), the positions of the tokens on its path: the root first,
        the node itself last.
    topk: how many of the head's top tokens the level needs (its largest rank + 1).
    nodes: LongTensor [C], positions of this level's nodes.
    row: LongTensor [C], which expanded node (row of ``ancestry``) each one extends.
    rank: LongTensor [C], which of that row's top tokens it is.
    """

    head: int
    ancestry: torch.Tensor
    topk: int
    nodes: torch.Tensor
    row: torch.Tensor
    rank: torch.Tensor


def tree_levels(paths: Sequence[TreePath], device: torch.device | str | None = None) -> tuple[TreeLevel, ...]:
    """The levels of ``paths`` (validated), shallowest first: drafting level d needs only
    the tokens of the levels above it."""
    paths = check_paths(paths)
    index = {p: i + 1 for i, p in enumerate(paths)}
    levels = []
    for depth in range(1, max((len(p) for p in paths), default=0) + 1):
        here = [p for p in paths if len(p) == depth]
        parents = list(dict.fromkeys(p[:-1] for p in here))
        row = {parent: r for r, parent in enumerate(parents)}
        ancestry = [[0] + [index[parent[:j]] for j in range(1, depth)] for parent in parents]
        levels.append(TreeLevel(
            head=depth - 1,
            ancestry=torch.tensor(ancestry, dtype=torch.long, device=device).reshape(len(parents), depth),
            topk=max(p[-1] for p in here) + 1,
            nodes=torch.tensor([index[p] for p in here], dtype=torch.long, device=device),
            row=torch.tensor([row[p[:-1]] for p in here], dtype=torch.long, device=device),
            rank=torch.tensor([p[-1] for p in here], dtype=torch.long, device=device),
        ))
    return tuple(levels)
