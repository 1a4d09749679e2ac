"""The dynamic Medusa draft tree (``Medusa(tree="dynamic")``): a tree chosen anew each step
from the heads' probabilities of whole paths, as in EAGLE-2 (Li et al. 2024). Static trees,
fixed index paths chosen once, are in :mod:`.trees`.
"""

from __future__ import annotations

import torch

from accel.kernels.cpu import PackedLinear
from accel.strategy import DraftProposal

from .packed import LoadedHeads

__all__ = ["DYNAMIC_WIDTH", "DYNAMIC_BEAM", "dynamic_tree", "dynamic_trees"]

#: The dynamic tree (``Medusa(tree="dynamic")``) expands, at each depth, the DYNAMIC_BEAM most
#: probable nodes of the depth above, DYNAMIC_WIDTH children each (capped by the node budget).
DYNAMIC_WIDTH = 8
DYNAMIC_BEAM = 6


def dynamic_tree(loaded: LoadedHeads, h: torch.Tensor, root: torch.Tensor, n: int, lm: PackedLinear | None,
                 embed: torch.Tensor | None) -> DraftProposal:
    """A draft tree of ``n`` nodes chosen anew for this step, as EAGLE-2 does (Li et al.
    2024, "EAGLE-2: Faster Inference of Language Models with Dynamic Draft Trees").

    A node's value is the heads' probability of its whole path (the product of each head's
    probability of its token, given the path above it for sequential heads): an estimate of
    the chance that the verifier accepts the node. Depth by depth, the most valuable nodes
    are expanded, then the ``n`` most valuable nodes of all that were scored are verified.
    Where the heads are sure the tree runs deep, where they are not it spreads wide; a
    static tree spends the same shape on both. A value never grows down a path, so every
    chosen node's parent is chosen too (ties keep the shallower node first).

    h: [H] the verifier's hidden state; root: [1] the pending token; lm: the model's output
    layer in the head dtype (subset rows), None when the heads have their own; embed: [V, H]
    the model's input embeddings (sequential heads), else None.
    """
    return dynamic_trees(loaded, h.reshape(1, -1), root.reshape(1), [n], lm, embed)[0]


def dynamic_trees(loaded: LoadedHeads, h: torch.Tensor, roots: torch.Tensor, sizes: list[int],
                  lm: PackedLinear | None, embed: torch.Tensor | None) -> list[DraftProposal]:
    """:func:`dynamic_tree` for R rows of a batch at once: every head runs once over all
    rows' paths (one vocabulary projection of R x beam rows per depth instead of R of
    beam rows), then each row keeps its own ``sizes[r]`` most valuable nodes.

    h: [R, H] each row's hidden state; roots: [R] each row's pending token; sizes: R node
    counts (each >= 1). The expansion width and beam follow the largest size; a smaller
    row's n best nodes are the same either way (up to ties), since a node's value never
    exceeds its parent's. Returns one proposal per row.
    """
    packed = loaded.packed
    device = h.device
    rows = h.shape[0]
    most = max(sizes)
    width, beam = min(most, DYNAMIC_WIDTH), min(most, DYNAMIC_BEAM)
    # n nodes reach at most n deep (a node's parent is chosen before it): deeper heads need not run
    depth = min(loaded.num_heads, most)
    if not loaded.sequential:  # independent heads: one distribution per head and row, whatever the path
        head_tok, head_lp = packed.top_tokens(h, width, loaded.num_heads, lm, log_probs=True)  # [K, R, w]
    paths = roots.reshape(rows, 1, 1).to(device)  # [R, P, depth + 1] the paths expanded next, root first
    values = torch.zeros(rows, 1, device=device)  # [R, P] their log values
    ids = torch.zeros(rows, 1, dtype=torch.long, device=device)  # [R, P] their node ids (the root is 0)
    tokens, logv, parents = [], [], []
    count = 1
    for head in range(depth):
        if loaded.sequential:
            tok, lp = packed.top_tokens(head, h, embed[paths], width, lm, log_probs=True)  # [R, P, w]
        else:
            shape = (rows, paths.shape[1], width)
            tok, lp = head_tok[head].unsqueeze(1).expand(shape), head_lp[head].unsqueeze(1).expand(shape)
        v = (values.unsqueeze(-1) + lp).reshape(rows, -1)  # [R, P * w]
        t = tok.reshape(rows, -1)
        tokens.append(t)
        logv.append(v)
        parents.append(ids.repeat_interleave(width, dim=1))
        new_ids = torch.arange(count, count + v.shape[1], device=device)
        count += v.shape[1]
        if head + 1 < depth:
            keep = torch.topk(v, min(beam, v.shape[1]), dim=1).indices  # [R, beam]
            above = torch.gather(paths, 1, (keep // width).unsqueeze(-1).expand(-1, -1, paths.shape[2]))
            paths = torch.cat([above, torch.gather(t, 1, keep).unsqueeze(-1)], dim=2)
            values, ids = torch.gather(v, 1, keep), new_ids[keep]
    order = torch.sort(torch.cat(logv, dim=1), dim=1, descending=True, stable=True).indices  # candidate i: node i + 1
    all_tokens, all_parents = torch.cat(tokens, dim=1), torch.cat(parents, dim=1)
    out = []
    for r, n in enumerate(sizes):
        chosen = order[r, :n]
        position = torch.zeros(count, dtype=torch.long, device=device)
        position[chosen + 1] = torch.arange(1, chosen.numel() + 1, device=device)
        out.append(DraftProposal(tokens=all_tokens[r, chosen], parents=position[all_parents[r, chosen]]))
    return out
