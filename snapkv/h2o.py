"""H2O (Zhang et al. 2023) heavy hitters from the prefill: keep what all prompt queries attend to."""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
from pydantic import Field, model_validator

from accel.strategy import register

from .base import ScoredCompressor
from .scoring import decode_votes, reduce_gqa, window_scores

__all__ = ["H2O"]


@register
class H2O(ScoredCompressor):
    """Heavy-hitter oracle, applied once at the end of the prefill.

    Score of a key = attention it receives from every prompt query (causal softmax weights,
    summed over all L queries), computed ``chunk`` queries at a time so no L x L matrix is
    held. Each KV head keeps its ``recent`` last positions plus the top-scored rest up to
    ``budget`` (the H2O paper splits the budget half heavy hitters, half recent, which is
    the default ``recent=None``). Needs all prompt queries: observation window = L.

    The accumulated score favours early positions (they are seen by more queries); that is
    H2O's own bias, kept on purpose as a baseline.

    During decoding (``decode_budget``) each head keeps its latest ``recent`` entries (half
    of ``decode_budget`` by default) and the rest of the budget goes to the entries that the
    row's latest ``decode_queries`` queries attend to most. The paper accumulates every
    query's attention from the start; accel scores with a window of recent queries, captured
    only before each eviction, so decoding pays nothing per token for it.
    """

    name: ClassVar[str] = "h2o"

    budget: int | None = Field(1024, gt=0)
    """Entries kept per KV head, recent ones included; None when ``ratio`` is set."""
    ratio: float | None = Field(None, gt=0, le=1)
    """Fraction of the prompt kept per KV head (0 < ratio <= 1), instead of ``budget``."""
    recent: int | None = Field(None, ge=0)
    """Trailing positions always kept; None: half the budget (rounded down)."""
    gqa: Literal["mean", "max", "sum"] = "mean"
    """How the scores of the query heads sharing one KV head are combined."""
    chunk: int = Field(256, gt=0)
    """Prompt queries scored at a time (peak memory [B, H_q, chunk, L] float32)."""
    decode_queries: int = Field(32, gt=0)
    """Latest queries whose attention scores the entries when a row is evicted during
    decoding (``decode_budget``); at most the recent entries kept."""

    @model_validator(mode="after")
    def _recent_fits_budget(self) -> H2O:
        if self.budget is not None and self.recent is not None and self.recent > self.budget:
            raise ValueError(f"recent ({self.recent}) must not exceed budget ({self.budget})")
        return self

    def observation_window(self, prompt_len: int) -> int:
        return prompt_len

    def decode_window(self) -> int:
        return self.decode_queries

    def decode_kept(self) -> tuple[int, int]:
        budget = self.decode_budget or 0
        return 0, budget // 2 if self.recent is None else min(self.recent, budget)

    def decode_score(self, layer_idx: int, queries: torch.Tensor | None, keys: torch.Tensor,
                     valid: torch.Tensor) -> torch.Tensor:
        """Attention the latest queries give each kept entry, summed and reduced over each
        query group: [1, H_kv, n] float32."""
        if queries is None:
            raise ValueError("H2O's eviction needs the latest queries")
        return reduce_gqa(decode_votes(queries, keys, valid), keys.shape[1], self.gqa)

    def always_kept(self, prompt_len: int, budget: int) -> tuple[int, int]:
        recent = budget // 2 if self.recent is None else min(self.recent, budget)
        return 0, min(recent, prompt_len)

    def score(self, layer_idx: int, queries: torch.Tensor | None, keys: torch.Tensor) -> torch.Tensor:
        """queries: [B, H_q, L, D] all prompt queries; keys [B, H_kv, L, D] -> [B, H_kv, L]."""
        if queries is None:
            raise ValueError("H2O needs the prompt queries")
        votes = window_scores(queries, keys, chunk=self.chunk)  # [B, H_q, L]
        return reduce_gqa(votes, keys.shape[1], self.gqa)
