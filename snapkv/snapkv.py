"""SnapKV (Li et al. 2024): keep what the observation window attends to, plus the window."""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import Field, field_validator, model_validator

from accel.strategy import register

from .base import ScoredCompressor
from .scoring import decode_votes, pool_scores, prefix_scores, reduce_gqa

__all__ = ["SnapKV"]


@register
class SnapKV(ScoredCompressor):
    """SnapKV prompt compression, one selection per KV head and layer.

    The last ``window`` prompt queries vote (summed causal softmax weights) for the prefix
    positions; the votes are pooled per query head with an odd ``kernel`` so the
    neighbours of a hit survive with it, reduced over each KV head's query group (``gqa``),
    and the top ``budget - window`` prefix positions are kept together with the whole
    window (see :func:`snapkv.scoring.prefix_scores`).

    The paper's configuration is ``SnapKV(budget=..., window=32, kernel=7, pooling="max")``.
    On multi-head attention (H_q == H_kv) ``gqa`` is irrelevant and that reproduces the
    paper exactly; with grouped-query attention the query heads of a group are combined
    into one selection per KV head (the cache stores KV heads, not query heads).

    Defaults come from the needle experiment (benchmarks/needle_sweep.py and
    configs/needle.yaml, on the default model): a pass key is one token per digit, and the
    paper's kernel 7 keeps only some digits of the fact, so SnapKV(budget=512, kernel=7) and
    even budget 1024 lose 4K-token needles that kernel 15 or 31 keep at budget 512.
    ``kernel=15`` keeps the whole fact and its neighbours; ``gqa="max"`` keeps an entry any
    query head of the group needs.

    Budget: exactly one of ``budget`` (entries per KV head, window included) and ``ratio``
    (fraction of the prompt). ``SnapKV(ratio=0.25)`` alone is fine; with neither given the
    default budget of 1024 applies. Under ``ratio`` the budget never drops below the window.

    During decoding (``decode_budget``) the same recipe runs on what a row keeps: the queries
    of its latest ``window`` tokens (captured as they are decoded, the prompt's own window
    to begin with) vote over its kept entries, the votes are pooled and reduced alike, and
    each head keeps those latest ``window`` entries plus the top ``decode_budget - window``.
    """

    name: ClassVar[str] = "snapkv"

    budget: int | None = Field(1024, gt=0)
    """Entries kept per KV head, the observation window included; None when ``ratio`` is set."""
    ratio: float | None = Field(None, gt=0, le=1)
    """Fraction of the prompt kept per KV head (0 < ratio <= 1), instead of ``budget``."""
    window: int = Field(32, gt=0)
    """Observation window: the last ``window`` prompt queries vote, and are always kept."""
    kernel: int = Field(15, gt=0)
    """Odd width of the 1-D pooling over the votes (1: no pooling; the paper uses 7)."""
    pooling: Literal["max", "avg"] = "max"
    """Pooling of the votes: "max" (the paper's choice) or "avg"."""
    gqa: Literal["mean", "max", "sum"] = "max"
    """How the pooled votes of the query heads sharing one KV head are combined."""

    @field_validator("kernel")
    @classmethod
    def _kernel_is_odd(cls, kernel: int) -> int:
        if kernel % 2 == 0:
            raise ValueError(f"kernel must be odd so pooling keeps the length, got {kernel}")
        return kernel

    @model_validator(mode="after")
    def _budget_exceeds_window(self) -> SnapKV:
        if self.budget is not None and self.budget <= self.window:
            raise ValueError(
                f"budget ({self.budget}) must be greater than window ({self.window}): "
                "the budget includes the window"
            )
        return self

    @model_validator(mode="after")
    def _decode_budget_exceeds_window(self) -> SnapKV:
        if self.decode_budget is not None and self.decode_budget <= self.window:
            raise ValueError(
                f"decode_budget ({self.decode_budget}) must be greater than window ({self.window}): "
                "the budget includes the latest window entries"
            )
        return self

    def decode_window(self) -> int:
        return self.window

    def decode_score(self, layer_idx: int, queries: torch.Tensor | None, keys: torch.Tensor,
                     valid: torch.Tensor) -> torch.Tensor:
        """The latest ``window`` queries' votes over the kept entries, pooled and reduced:
        [1, H_kv, n] float32."""
        if queries is None:
            raise ValueError("SnapKV's eviction needs the latest queries")
        votes = decode_votes(queries, keys, valid)  # [1, H_q, n]
        return reduce_gqa(pool_scores(votes, self.kernel, self.pooling), keys.shape[1], self.gqa)

    def observation_window(self, prompt_len: int) -> int:
        return min(self.window, prompt_len)

    def always_kept(self, prompt_len: int, budget: int) -> tuple[int, int]:
        return 0, self.observation_window(prompt_len)

    def score(self, layer_idx: int, queries: torch.Tensor | None, keys: torch.Tensor) -> torch.Tensor:
        """Pooled, GQA-reduced window votes of the prefix; the window scores +inf.

        queries: [B, H_q, w, D]; keys: [B, H_kv, L, D]. returns: [B, H_kv, L] float32.
        """
        if queries is None:
            raise ValueError("SnapKV needs the observation-window queries")
        w = self.observation_window(keys.shape[-2])
        prefix = prefix_scores(queries[..., -w:, :], keys, self.kernel, self.pooling, self.gqa)
        return F.pad(prefix, (0, w), value=float("inf"))
