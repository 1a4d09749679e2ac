"""The dynamic Medusa draft tree (``Medusa(tree="dynamic")``): a tree chosen anew each step
from the heads' probabilities of whole paths, as in EAGLE-2 (Li et al. 2024). Static trees,
fixed index paths chosen once, are in :mod:`.trees`.
"""

from __future__ import annotations

import torch

from accel.cpu import PackedLinear
from accel.strategy import DraftProposal

from .packed import LoadedHeads

__all__ = ["DYNAMIC_WIDTH", "DYNAMIC_BEAM", "dynamic_tree"]

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
    packed = loaded.packed
    device = h.device
    width, beam = min(n, DYNAMIC_WIDTH), min(n, DYNAMIC_BEAM)
    if not loaded.sequential:  # independent heads: one distribution per head, whatever the path
        head_tok, head_lp = packed.top_tokens(h, width, loaded.num_heads, lm, log_probs=True)
    paths = root.reshape(1, 1).to(device)  # [P, depth + 1] the paths expanded next, root first
    values = torch.zeros(1, device=device)  # [P] their log values
    ids = torch.zeros(1, dtype=torch.long, device=device)  # [P] their node ids (the root is 0)
    tokens, logv, parents = [], [], []
    count = 1
    for head in range(loaded.num_heads):
        if loaded.sequential:
            tok, lp = packed.top_tokens(head, h, embed[paths], width, lm, log_probs=True)  # [P, w]
        else:
            tok, lp = head_tok[head].expand(paths.shape[0], -1), head_lp[head].expand(paths.shape[0], -1)
        v = (values.unsqueeze(1) + lp).reshape(-1)
        t = tok.reshape(-1)
        tokens.append(t)
        logv.append(v)
        parents.append(ids.repeat_interleave(width))
        new_ids = torch.arange(count, count + v.numel(), device=device)
        count += v.numel()
        if head + 1 < loaded.num_heads:
            keep = torch.topk(v, min(beam, v.numel())).indices
            paths = torch.cat([paths[keep // width], t[keep].unsqueeze(1)], dim=1)
            values, ids = v[keep], new_ids[keep]
    chosen = torch.sort(torch.cat(logv), descending=True, stable=True).indices[:n]  # candidate i is node id i + 1
    position = torch.zeros(count, dtype=torch.long, device=device)
    position[chosen + 1] = torch.arange(1, chosen.numel() + 1, device=device)
    return DraftProposal(tokens=torch.cat(tokens)[chosen], parents=position[torch.cat(parents)[chosen]])
