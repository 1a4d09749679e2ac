"""Ada-KV (Feng et al. 2024) on SnapKV: adaptive per-head budgets from one global top-k."""

from __future__ import annotations

from typing import ClassVar

import torch
from pydantic import Field

from accel.strategy import Selection, register

from .snapkv import SnapKV

__all__ = ["AdaSnapKV"]


@register
class AdaSnapKV(SnapKV):
    """SnapKV scores with head-wise adaptive budgets (Ada-SnapKV).

    In each layer the total kept is the same as SnapKV's, ``budget * H_kv`` per batch row,
    but the prefix part is shared out by one top-k over the pooled prefix scores of all KV
    heads together: a head with concentrated attention gives budget to a head whose
    attention is spread. Safeguard: each head first keeps its own top
    ``floor(alpha * (budget - window))`` prefix positions; the rest of the prefix budget
    goes to the global top-k. Every head keeps its whole window. ``alpha=1`` is SnapKV.

    Rows are padded to the largest per-head count: ``Selection.valid`` marks the real
    entries, padding repeats the row's last valid index (so indices stay ascending).

    During decoding (``decode_budget``) the same sharing runs on SnapKV's decode-time scores
    (:meth:`SnapKV.decode_score`): a row keeps ``decode_budget * H_kv`` entries per layer in
    all, each head its latest ``window`` plus its own top ``floor(alpha * (decode_budget -
    window))``, the rest by one top-k over all heads. ``decode_budget`` bounds the entries
    per KV head on average; one head may hold more.
    """

    name: ClassVar[str] = "ada_snapkv"

    alpha: float = Field(0.2, ge=0, le=1)
    """Fraction of the per-head prefix budget each head keeps whatever the others score."""

    def choose(self, scores: torch.Tensor, budget: int, first: int, last: int) -> Selection:
        """scores: [B, H_kv, L] -> indices, valid: [B, H_kv, Kmax]; each batch row keeps
        exactly ``budget * H_kv`` valid entries, each head at least first + floor + last."""
        bsz, h_kv, length = scores.shape
        prefix = scores[..., first : length - last]  # [B, H, P]
        span = prefix.shape[-1]
        per_head = budget - first - last  # uniform prefix budget, < P
        floor = int(self.alpha * per_head)
        order = prefix.argsort(dim=-1, descending=True, stable=True)  # [B, H, P]
        ranked = prefix.gather(-1, order)  # [B, H, P] descending per head
        # Global top-k over what the floors leave: flat index -> head = idx // (P - floor).
        shared = h_kv * (per_head - floor)
        rest = ranked[..., floor:].reshape(bsz, h_kv * (span - floor))
        won = rest.topk(shared, dim=-1, sorted=False).indices // (span - floor)  # [B, shared]
        counts = torch.full((bsz, h_kv), floor, dtype=torch.long, device=scores.device)
        counts.scatter_add_(1, won, torch.ones_like(won))  # [B, H], sums to H * per_head
        # Each head keeps its top counts[b, h] prefix positions (ranked order is by score).
        width = int(counts.max())
        cols = torch.arange(width, device=scores.device)
        keep = cols < counts[..., None]  # [B, H, width]
        sentinel = torch.full_like(order[..., :width], length)
        picked = torch.where(keep, order[..., :width] + first, sentinel)
        ends = torch.cat([torch.arange(first), torch.arange(length - last, length)]).to(scores.device)
        rows = torch.cat([picked, ends.expand(bsz, h_kv, first + last)], dim=-1)
        indices = rows.sort(dim=-1).values  # valid ascending, then sentinels
        valid = indices < length
        last_valid = indices.gather(-1, (valid.sum(-1, keepdim=True) - 1).clamp(min=0))
        indices = torch.where(valid, indices, last_valid)
        return Selection(indices, valid)

    def decode_choose(self, scores: torch.Tensor, budget: int) -> torch.Tensor:
        """scores [B, H_kv, n] (+inf pinned, -inf padding) -> keep [B, H_kv, n]: the pinned
        entries, each head's top ``floor`` candidates, then one top-k over all heads' other
        candidates for the rest of ``budget * H_kv``."""
        bsz, h_kv, n = scores.shape
        first, last = self.decode_kept()
        per_head = budget - first - last
        floor = int(self.alpha * per_head)
        pinned = scores == float("inf")
        ranked, order = scores.masked_fill(pinned, float("-inf")).sort(dim=-1, descending=True, stable=True)
        finite = ranked > float("-inf")  # candidates, best first per head
        own = finite & (torch.arange(n, device=scores.device) < floor)  # [B, H, n] in ranked order
        rest = ranked.masked_fill(own, float("-inf")).reshape(bsz, h_kv * n)
        chosen = own.reshape(bsz, h_kv * n).clone()
        for b in range(bsz):
            k = min(h_kv * per_head - int(own[b].sum()), int((rest[b] > float("-inf")).sum()))
            if k > 0:
                chosen[b, rest[b].topk(k).indices] = True
        keep = torch.zeros_like(pinned).scatter_(-1, order, chosen.reshape(bsz, h_kv, n))
        return keep | pinned
