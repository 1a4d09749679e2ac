"""StreamingLLM (Xiao et al. 2023) as a prompt compressor: attention sinks + recent tokens."""

from __future__ import annotations

from typing import ClassVar

import torch
from pydantic import Field, model_validator

from accel.strategy import register

from .base import ScoredCompressor

__all__ = ["StreamingLLM"]


@register
class StreamingLLM(ScoredCompressor):
    """Keep the first ``sink`` prompt positions (attention sinks) and the last ``recent``.

    Budget per KV head is ``sink + recent``; prompts no longer than that are untouched. The
    choice ignores attention altogether, so no queries are captured (observation window 0).
    A baseline for SnapKV at the same budget: the default 4 + 508 = 512 entries.

    During decoding (``decode_budget``) a row keeps its first ``sink`` entries and its latest
    ``decode_budget - sink``: the rolling cache of the StreamingLLM paper, evicted once every
    ``decode_slack`` tokens.
    """

    name: ClassVar[str] = "streaming_llm"

    sink: int = Field(4, ge=0)
    """Leading prompt positions always kept (the attention sinks)."""
    recent: int = Field(508, ge=0)
    """Trailing prompt positions always kept."""

    @model_validator(mode="after")
    def _keeps_something(self) -> StreamingLLM:
        if self.sink + self.recent == 0:
            raise ValueError("recent: sink + recent must be positive (sink=0, recent=0)")
        if self.decode_budget is not None and self.decode_budget <= self.sink:
            raise ValueError(f"decode_budget ({self.decode_budget}) must be greater than sink ({self.sink}): "
                             "it keeps the sinks and the latest decode_budget - sink entries")
        return self

    def observation_window(self, prompt_len: int) -> int:
        return 0

    def decode_kept(self) -> tuple[int, int]:
        budget = self.decode_budget or 0
        return min(self.sink, budget), max(budget - self.sink, 0)

    def budget_for(self, prompt_len: int) -> int:
        return self.sink + self.recent

    def always_kept(self, prompt_len: int, budget: int) -> tuple[int, int]:
        return self.sink, self.recent

    def score(self, layer_idx: int, queries: torch.Tensor | None, keys: torch.Tensor) -> torch.Tensor:
        """No preference beyond the always-kept ends: zeros [B, H_kv, L] (never consulted)."""
        return keys.new_zeros(keys.shape[:3], dtype=torch.float32)
