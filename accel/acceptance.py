"""Acceptance rules: which path of a verified draft tree to keep, and the token after it.

Every rule reads the verifier's output for the tree, ``[N+1, V]``, row j being the
next-token distribution after the root..j path, and returns an :class:`Acceptance`.

Which rule is exact when:

- :func:`greedy_accept` (temperature 0) is exact: the emitted tokens are, token for token,
  what greedy decoding produces from the same cache, whatever the drafts are.
- :func:`sample_accept` is lossless speculative sampling (Leviathan et al. 2023; Chen et al.
  2023) extended to trees by recursive rejection over siblings (SpecInfer, Miao et al.
  2024): every emitted token is distributed exactly as the target ``p`` given the emitted
  prefix, provided the siblings below any node were drawn independently of each other
  given their path, each from the distribution recorded for it: a point mass for a
  deterministic draft (any number of distinct deterministic siblings is exact), or its
  ``tree.probs`` row for a sampled one (several sampled siblings must be independent draws,
  e.g. i.i.d. samples from q; top-k or deduplicated samples are NOT independent and bias
  the output). A single chain is always exact.
- ``speculative.TypicalAcceptance`` (Medusa's typical acceptance) is LOSSY: it trades the
  target distribution for longer accepted paths. Opt in by name ("typical").

All random draws come from the ``generator`` passed in (uniforms drawn on the generator's
device), so a seeded generator gives reproducible results.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from .tree import DraftTree

__all__ = ["Acceptance", "greedy_accept", "greedy_path", "sample_accept", "check_rows", "draw_from"]


@dataclass
class Acceptance:
    """The outcome of one verify step.

    path: node indices from the root, root included (``path[0] == 0``), each the child of
        the previous one; the KV entries the cache commits.
    next_token: the bonus / correction token emitted after the path's last node (it
        becomes the next root).
    accepted: accepted draft tokens, ``len(path) - 1`` (filled in when omitted).
    """

    path: list[int]
    next_token: int
    accepted: int = -1

    def __post_init__(self) -> None:
        if not self.path or self.path[0] != 0:
            raise ValueError(f"Acceptance.path must start at the root (node 0), got {self.path}")
        if self.accepted < 0:
            self.accepted = len(self.path) - 1
        elif self.accepted != len(self.path) - 1:
            raise ValueError(f"Acceptance.accepted={self.accepted} but the path holds {len(self.path) - 1} drafts")

    def emitted(self, tree: DraftTree) -> list[int]:
        """The tokens this step adds to the sequence: accepted drafts then ``next_token``."""
        return [tree.token_list[j] for j in self.path[1:]] + [self.next_token]


def check_rows(tree: DraftTree, scores: torch.Tensor, what: str) -> None:
    if scores.dim() != 2 or scores.shape[0] != tree.num_nodes:
        raise ValueError(f"{what} must have shape [N+1={tree.num_nodes}, V], got {tuple(scores.shape)}")


def _uniform(generator: torch.Generator | None) -> float:
    """One U[0, 1) draw from ``generator`` (on its own device), or torch's default CPU one."""
    device = generator.device if generator is not None else "cpu"
    return float(torch.rand((), generator=generator, device=device))


def _draw(weights: torch.Tensor, generator: torch.Generator | None) -> int | None:
    """Sample an index proportionally to non-negative ``weights`` [V] by inverse CDF.

    Returns None if the weights have no usable mass (all zero, or not finite).
    """
    cdf = weights.float().cumsum(0)
    u = _uniform(generator)
    idx_t = torch.searchsorted(cdf, cdf[-1:] * u, right=True)
    total, idx = torch.cat([cdf[-1:].double(), idx_t.double()]).tolist()  # one device sync
    if not math.isfinite(total) or total <= 0.0:
        return None
    idx = int(idx)
    if idx >= cdf.numel():  # u * total rounded up to total: the last token with mass
        idx = int(torch.nonzero(weights > 0).max())
    return idx


def draw_from(residual: torch.Tensor | None, p: torch.Tensor, generator: torch.Generator | None, node: int) -> int:
    """Sample from ``residual``; if it lost all its mass to rounding, fall back to ``p``."""
    idx = _draw(residual, generator) if residual is not None else None
    if idx is None:
        idx = _draw(p.clamp(min=0), generator)
    if idx is None:
        raise ValueError(f"target probabilities at node {node} have no positive finite mass")
    return idx


# --------------------------------------------------------------------------- greedy


def greedy_accept(tree: DraftTree, logits: torch.Tensor) -> Acceptance:
    """Longest path that greedy decoding would produce, plus greedy's next token.

    tree: the verified DraftTree (N+1 nodes). logits: [N+1, V] (or probs: any monotone
    scores), row j the verifier's output after node j. From the root, while some child of
    the current node j carries ``argmax(logits[j])`` (``torch.argmax``: first maximum on
    ties, as in plain greedy decoding), move to that child (the first such child if several
    carry the same token); ``next_token = argmax`` at the final node. Exact.
    """
    check_rows(tree, logits, "logits")
    return greedy_path(tree, logits.argmax(dim=-1).tolist())  # one device sync


def greedy_path(tree: DraftTree, top: list[int]) -> Acceptance:
    """:func:`greedy_accept` given ``top[j] = argmax(logits[j])`` for every node j."""
    node, path = 0, [0]
    while True:
        t = top[node]
        nxt = next((c for c in tree.children[node] if tree.token_list[c] == t), None)
        if nxt is None:
            return Acceptance(path=path, next_token=int(t))
        node = nxt
        path.append(node)


# --------------------------------------------------------------------------- sampling


def sample_accept(tree: DraftTree, probs: torch.Tensor, generator: torch.Generator | None = None) -> Acceptance:
    """Lossless speculative sampling over a draft tree (recursive rejection over siblings).

    tree: DraftTree; ``tree.probs`` [N+1, V] holds the draft distribution q of each sampled
        node, or is None (every draft is a point mass on its token).
    probs: [N+1, V], the target distribution p (after temperature / top-k / top-p), row j
        after node j.
    generator: source of every random draw (None: torch's default CPU generator).

    At node j the residual starts as r = p[j]. Its children c are tried in node order: with
    x = token(c), accept with probability min(1, r(x) / q_c(x)); on acceptance move to c and
    start again from p[c]; on rejection r <- normalize(max(r - q_c, 0)) (for a point mass:
    r(x) <- 0, renormalized) and try the next sibling. If every child is rejected,
    ``next_token ~ r``; at an accepted leaf, ``next_token ~ p[leaf]``. If rounding empties
    the residual, the draw falls back to p[j]; NaNs are never produced.

    Exact (each emitted token ~ p given the emitted prefix) when siblings are independent
    draws given their path, each from its recorded q: always for a chain, for any number of
    distinct point-mass siblings, and for sampled siblings that are independent (e.g.
    i.i.d.) samples. See the module docstring.
    """
    check_rows(tree, probs, "probs")
    q_all = tree.probs
    if q_all is not None:
        check_rows(tree, q_all, "tree.probs")
        if q_all.shape[1] != probs.shape[1]:
            raise ValueError(f"tree.probs has V={q_all.shape[1]} but probs V={probs.shape[1]}")
    node, path = 0, [0]
    while True:
        kids = tree.children[node]
        p = probs[node]
        if not kids:
            return Acceptance(path=path, next_token=draw_from(None, p, generator, node))
        if q_all is None:
            nxt, residual = _reject_point_masses(tree, kids, p, generator)
        else:
            nxt, residual = _reject_sampled(tree, kids, p, q_all, generator)
        if nxt is None:
            return Acceptance(path=path, next_token=draw_from(residual, p, generator, node))
        node = nxt
        path.append(node)


def _reject_point_masses(
    tree: DraftTree, kids: list[int], p: torch.Tensor, generator: torch.Generator | None
) -> tuple[int | None, torch.Tensor | None]:
    """Recursive rejection over point-mass siblings using scalars only (one device sync).

    With q_c = one-hot(x_c), r after rejecting x_1..x_k is p with those tokens zeroed and
    renormalized, so r(x) = p(x) / (mass of p minus the rejected tokens' mass).
    Returns (accepted child, None) or (None, unnormalized residual [V]).
    """
    toks = [tree.token_list[c] for c in kids]
    index = torch.tensor(toks, dtype=torch.long, device=p.device)
    pf = p.float().clamp(min=0)
    vals = torch.cat([pf.sum().reshape(1), pf.index_select(0, index)]).tolist()
    mass, pvals = vals[0], vals[1:]
    rejected: set[int] = set()
    for c, x, px in zip(kids, toks, pvals):
        if x in rejected or mass <= 0.0:
            continue  # residual is 0 at x: acceptance probability 0, nothing changes
        accept_prob = min(1.0, max(px, 0.0) / mass)
        if _uniform(generator) < accept_prob:
            return c, None
        rejected.add(x)
        mass -= max(px, 0.0)
    residual = pf  # a fresh tensor (clamp copies)
    residual[torch.tensor(sorted(rejected), dtype=torch.long, device=p.device)] = 0.0
    return None, residual


def _reject_sampled(
    tree: DraftTree, kids: list[int], p: torch.Tensor, q_all: torch.Tensor, generator: torch.Generator | None
) -> tuple[int | None, torch.Tensor | None]:
    """Recursive rejection over siblings with full draft distributions q_c = tree.probs[c].

    Returns (accepted child, None) or (None, residual [V]) where the residual may be None if
    rounding emptied it (the caller then falls back to p).
    """
    r = p.float().clamp(min=0)
    r = r / r.sum().clamp_min(torch.finfo(r.dtype).tiny)
    for c in kids:
        x = tree.token_list[c]
        q = q_all[c].float().clamp(min=0)
        q = q / q.sum().clamp_min(torch.finfo(q.dtype).tiny)
        rx, qx = torch.stack([r[x], q[x]]).tolist()
        if qx > 0.0:
            accept_prob = min(1.0, rx / qx)
        else:  # a token its own q calls impossible: the ratio is +inf unless r(x) is 0 too
            accept_prob = 1.0 if rx > 0.0 else 0.0
        if _uniform(generator) < accept_prob:
            return c, None
        r = (r - q).clamp(min=0)
        total = float(r.sum())
        if not total > 0.0:  # rounding emptied the residual: fall back to p (see docstring)
            return None, None
        r = r / total
    return None, r
