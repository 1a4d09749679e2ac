"""Scoring pieces of SnapKV: observation-window votes, 1-D pooling, GQA reduction, top-k.

Pure functions on tensors, no state. Shapes use B batch, H_q query heads, H_kv KV heads
(H_q = H_kv * G, query head h reads KV head h // G as in transformers' ``repeat_kv``),
w window queries, L prompt keys, P = L - w prefix positions, D head dim.

The SnapKV recipe (Li et al. 2024) per layer and KV head:

1. every window query (the last w prompt queries) attends causally over the whole prompt;
   the softmax weights it gives each key are summed over the w queries (the "votes");
2. the votes for the prefix (positions 0..P-1, the window excluded) are smoothed with a
   1-D pooling of odd ``kernel`` so the neighbours of a hit survive with it;
3. the top ``budget - w`` prefix positions are kept, plus the whole window.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F

__all__ = [
    "window_scores",
    "pool_scores",
    "reduce_gqa",
    "select_topk",
    "prefix_scores",
    "snapkv_indices",
    "decode_votes",
    "head_ranks",
]

Pooling = Literal["max", "avg"]
GqaReduce = Literal["mean", "max", "sum"]


def window_scores(
    queries: torch.Tensor,
    keys: torch.Tensor,
    *,
    scale: float | None = None,
    chunk: int | None = None,
) -> torch.Tensor:
    """Attention each key receives from the trailing prompt queries, summed over them.

    queries: [B, H_q, w, D] the last w prompt queries (post-RoPE); window query i sits at
        prompt position L - w + i and sees keys 0..L - w + i (causal mask inside the window).
    keys: [B, H_kv, L, D] the layer's prompt keys (post-RoPE), w <= L.
    scale: logit scale, default 1 / sqrt(D) (the model's own scaling).
    chunk: process at most this many queries at a time (None: all w at once). Peak extra
        memory is [B, H_q, chunk, L] float32; passing all L prompt queries with a chunk
        gives H2O's accumulated attention without ever holding an L x L matrix.
    returns: [B, H_q, L] float32, sum over the window queries of softmax(q k^T * scale).
        Each query's row sums to 1, so the scores of one head sum to w.

    GQA is handled by viewing the queries as [B, H_kv, G, w, D]; keys are never repeated.
    """
    bsz, h_q, w, dim = queries.shape
    h_kv, length = keys.shape[1], keys.shape[2]
    if h_q % h_kv:
        raise ValueError(f"query heads ({h_q}) must be a multiple of KV heads ({h_kv})")
    if w > length:
        raise ValueError(f"window ({w}) is longer than the prompt ({length})")
    groups = h_q // h_kv
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    q = queries.float().reshape(bsz, h_kv, groups, w, dim)  # [B, H_kv, G, w, D]
    k = keys.float().unsqueeze(2)  # [B, H_kv, 1, L, D]
    kpos = torch.arange(length, device=keys.device)  # [L]
    out = torch.zeros(bsz, h_kv, groups, length, dtype=torch.float32, device=keys.device)
    step = max(1, w if chunk is None else int(chunk))
    for start in range(0, w, step):
        stop = min(w, start + step)
        logits = q[..., start:stop, :] @ k.transpose(-1, -2) * scale  # [B, H_kv, G, c, L]
        qpos = torch.arange(length - w + start, length - w + stop, device=keys.device)  # [c]
        future = kpos[None, :] > qpos[:, None]  # [c, L]
        logits.masked_fill_(future, float("-inf"))
        out += logits.softmax(dim=-1).sum(dim=-2)
    return out.reshape(bsz, h_q, length)


def pool_scores(scores: torch.Tensor, kernel: int, pooling: Pooling = "max") -> torch.Tensor:
    """1-D pooling along the last dim, stride 1, same length (padding ``kernel // 2``).

    scores: [..., L'] float. kernel: odd and >= 1 (1 is the identity).
    pooling: "max" (padding never wins) or "avg" (a plain mean of the ``kernel`` slots,
        the zero padding counted, so the first and last ``kernel // 2`` positions are
        damped, as in the SnapKV paper's average-pooling option).
    returns: [..., L'] same dtype.
    """
    if kernel < 1 or kernel % 2 == 0:
        raise ValueError(f"kernel must be an odd positive int, got {kernel}")
    if pooling not in ("max", "avg"):
        raise ValueError(f"pooling must be 'max' or 'avg', got {pooling!r}")
    if kernel == 1 or scores.shape[-1] == 0:
        return scores
    flat = scores.reshape(-1, 1, scores.shape[-1])  # [N, 1, L']
    pool = F.max_pool1d if pooling == "max" else F.avg_pool1d
    return pool(flat, kernel_size=kernel, stride=1, padding=kernel // 2).reshape(scores.shape)


def reduce_gqa(scores: torch.Tensor, num_kv_heads: int, how: GqaReduce = "mean") -> torch.Tensor:
    """Combine the scores of the G query heads that share a KV head.

    scores: [B, H_q, L'] with H_q = num_kv_heads * G, query head h -> KV head h // G.
    how: "mean", "max" or "sum" over the G heads of a group.
    returns: [B, H_kv, L'].
    """
    bsz, h_q, length = scores.shape
    if h_q % num_kv_heads:
        raise ValueError(f"query heads ({h_q}) must be a multiple of KV heads ({num_kv_heads})")
    grouped = scores.reshape(bsz, num_kv_heads, h_q // num_kv_heads, length)  # [B, H_kv, G, L']
    if how == "mean":
        return grouped.mean(dim=2)
    if how == "max":
        return grouped.amax(dim=2)
    if how == "sum":
        return grouped.sum(dim=2)
    raise ValueError(f"gqa reduction must be 'mean', 'max' or 'sum', got {how!r}")


def select_topk(scores: torch.Tensor, keep: int) -> torch.Tensor:
    """Positions of the ``keep`` highest scores per row, ascending.

    scores: [B, H_kv, L']. keep: 0 <= keep <= L'.
    returns: LongTensor [B, H_kv, keep], sorted ascending along the last dim.
    """
    if not 0 <= keep <= scores.shape[-1]:
        raise ValueError(f"keep ({keep}) must be in 0..{scores.shape[-1]}")
    top = scores.topk(keep, dim=-1, sorted=False).indices
    return top.sort(dim=-1).values


def prefix_scores(
    queries: torch.Tensor,
    keys: torch.Tensor,
    kernel: int,
    pooling: Pooling = "max",
    gqa: GqaReduce = "mean",
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """SnapKV's per-KV-head importance of the prefix (the prompt before the window).

    queries: [B, H_q, w, D] the window queries; keys: [B, H_kv, L, D], w <= L.
    returns: [B, H_kv, L - w] float32.

    Order: window votes -> restrict to the prefix -> pool per QUERY head -> reduce the G
    query heads of each KV head (``gqa``). Pooling before the reduction keeps every query
    head's own neighbourhoods; with "max" pooling and "max" reduction the order does not
    matter (the two maxima commute), with "mean"/"sum" it does.
    """
    w, length = queries.shape[-2], keys.shape[-2]
    votes = window_scores(queries, keys, scale=scale)[..., : length - w]  # [B, H_q, P]
    return reduce_gqa(pool_scores(votes, kernel, pooling), keys.shape[1], gqa)  # [B, H_kv, P]


def snapkv_indices(
    queries: torch.Tensor,
    keys: torch.Tensor,
    budget: int,
    window: int,
    kernel: int,
    pooling: Pooling = "max",
    gqa: GqaReduce = "mean",
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """The SnapKV selection: kept prompt positions per KV head, window included.

    queries: [B, H_q, >= window, D]; only the last ``window`` rows are used.
    keys: [B, H_kv, L, D]. budget: kept entries per KV head, window included, > window.
    returns: LongTensor [B, H_kv, min(budget, L)] ascending: the top ``budget - window``
        prefix positions by :func:`prefix_scores`, then positions L - window .. L - 1.
        When L <= budget every position is returned.
    """
    bsz, h_kv, length = keys.shape[0], keys.shape[1], keys.shape[2]
    if queries.shape[-2] < window:
        raise ValueError(f"need {window} window queries, got {queries.shape[-2]}")
    if budget <= window:
        raise ValueError(f"budget ({budget}) must be greater than window ({window})")
    if length <= budget:
        return torch.arange(length, device=keys.device).expand(bsz, h_kv, length)
    scores = prefix_scores(queries[..., -window:, :], keys, kernel, pooling, gqa, scale=scale)
    top = select_topk(scores, budget - window)  # [B, H_kv, budget - w], all < L - w
    tail = torch.arange(length - window, length, device=keys.device).expand(bsz, h_kv, window)
    return torch.cat([top, tail], dim=-1)


def head_ranks(valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank of each entry among its head's valid entries, and each head's count.

    valid: BoolTensor [B, H_kv, n]. returns (ranks [B, H_kv, n] long, 1-based for valid
    entries (0 before the first), counts [B, H_kv, 1] long).
    """
    ranks = valid.long().cumsum(-1)
    return ranks, ranks[..., -1:]


def decode_votes(
    queries: torch.Tensor,
    keys: torch.Tensor,
    valid: torch.Tensor | None = None,
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """Attention each kept entry receives from a row's latest w queries during decoding.

    queries: [B, H_q, w, D] the latest w tokens' queries, oldest first; their entries are
        the last w valid entries of every KV head, so query i sees the entries of its head up
        to rank ``count - w + i + 1`` (causal inside the window, as :func:`window_scores`).
    keys: [B, H_kv, n, D] the row's kept entries; valid: [B, H_kv, n] or None (all valid).
    returns: [B, H_q, n] float32, the softmax weights summed over the w queries; padding
        scores 0.
    """
    bsz, h_q, w, dim = queries.shape
    h_kv, n = keys.shape[1], keys.shape[2]
    if h_q % h_kv:
        raise ValueError(f"query heads ({h_q}) must be a multiple of KV heads ({h_kv})")
    if valid is None:
        valid = torch.ones((bsz, h_kv, n), dtype=torch.bool, device=keys.device)
    ranks, counts = head_ranks(valid)
    if bool((counts < w).any()):
        raise ValueError(f"{w} window queries but a head keeps only {int(counts.min())} entries")
    groups = h_q // h_kv
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    q = queries.float().reshape(bsz, h_kv, groups, w, dim)
    logits = q @ keys.float().unsqueeze(2).transpose(-1, -2) * scale  # [B, H_kv, G, w, n]
    limit = counts - w + 1 + torch.arange(w, device=keys.device)  # [B, H_kv, w]: highest rank query i sees
    seen = valid.unsqueeze(2) & (ranks.unsqueeze(2) <= limit.unsqueeze(-1))  # [B, H_kv, w, n]
    logits = logits.masked_fill(~seen.unsqueeze(2), float("-inf"))
    return logits.softmax(dim=-1).sum(dim=-2).reshape(bsz, h_q, n)
