"""The common tier of prompt compressors: score every position, keep the top ones.

A subclass implements :meth:`ScoredCompressor.score` (``[B, H_kv, L]``, higher = keep) and
says which positions are always kept (:meth:`ScoredCompressor.always_kept`: the first few,
the last few); this base does the budget arithmetic, the no-op case, the top-k, the
ascending sort and builds the :class:`~accel.strategy.Selection`. A method that needs more
(adaptive per-head budgets) overrides :meth:`ScoredCompressor.choose`, or
:meth:`~accel.strategy.PromptCompressor.select` itself.

Budget fields. A subclass that declares the fields ``budget: int | None`` and
``ratio: float | None`` gets them validated here: exactly one is set. ``budget`` is the
number of entries kept per KV head, always-kept entries (the window) included; ``ratio``
keeps ``round(ratio * L)`` of an L-token prompt instead. Passing ``ratio`` alone clears the
default budget (``SnapKV(ratio=0.25)`` is enough); passing both is an error.

Eviction during decoding. ``decode_budget`` (None: off) bounds each row's cache as the
generation grows: once a row holds ``decode_budget + decode_slack`` entries per KV head it
is evicted back to ``decode_budget`` (:meth:`ScoredCompressor.evict`), so eviction runs once
every ``decode_slack`` tokens, at logical lengths fixed by the committed sequence (see
:mod:`accel.maintenance`). Each head keeps its :meth:`ScoredCompressor.decode_kept` entries
(the latest ones, sinks) and the top-scored rest by :meth:`ScoredCompressor.decode_score`.
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import ConfigDict, Field, model_validator

from accel.strategy import PromptCompressor, Selection

from .scoring import head_ranks, select_topk

__all__ = ["ScoredCompressor"]


class ScoredCompressor(PromptCompressor):
    """Per-KV-head top-k over ``score()``, plus always-kept first/last positions."""

    model_config = ConfigDict(use_attribute_docstrings=True)

    decode_budget: int | None = Field(None, gt=0)
    """Entries kept per KV head during decoding (evicted as the generation grows); None: only
    the prompt is compressed and the cache grows with every generated token."""
    decode_slack: int = Field(64, gt=0)
    """Entries a row grows past ``decode_budget`` before it is evicted back to it: eviction
    runs once every ``decode_slack`` tokens, never per token."""

    # ------------------------------------------------------------------ validation

    @classmethod
    def _has_budget_fields(cls) -> bool:
        return "budget" in cls.model_fields and "ratio" in cls.model_fields

    @model_validator(mode="before")
    @classmethod
    def _ratio_clears_default_budget(cls, data: Any) -> Any:
        # `SnapKV(ratio=0.25)`: a ratio given without a budget replaces the default budget.
        if cls._has_budget_fields() and isinstance(data, dict):
            if data.get("ratio") is not None and "budget" not in data:
                data = {**data, "budget": None}
        return data

    @model_validator(mode="after")
    def _exactly_one_of_budget_ratio(self) -> ScoredCompressor:
        if self._has_budget_fields():
            budget, ratio = getattr(self, "budget"), getattr(self, "ratio")
            if budget is None and ratio is None:
                raise ValueError(
                    "budget: set either budget (entries kept per KV head) or ratio "
                    "(fraction of the prompt kept); both are None"
                )
            if budget is not None and ratio is not None:
                raise ValueError(
                    f"ratio: set either budget or ratio, not both (budget={budget}, ratio={ratio})"
                )
        return self

    @model_validator(mode="after")
    def _decode_budget_holds_what_is_always_kept(self) -> ScoredCompressor:
        if self.decode_budget is not None:
            first, last = self.decode_kept()
            if first + last > self.decode_budget:
                raise ValueError(f"decode_budget ({self.decode_budget}) must hold the {first + last} entries "
                                 f"eviction always keeps per KV head")
            if self.decode_window() > last:
                raise ValueError(f"decode_budget ({self.decode_budget}) keeps {last} latest entries, fewer than "
                                 f"the {self.decode_window()} latest queries that score eviction")
        return self

    # ------------------------------------------------------------------ hooks

    def budget_for(self, prompt_len: int) -> int:
        """Entries kept per KV head for an L-token prompt, before the always-kept floor.

        Default: the ``budget`` field, or ``round(ratio * L)`` (at least 1).
        """
        budget = getattr(self, "budget", None)
        if budget is not None:
            return int(budget)
        ratio = getattr(self, "ratio", None)
        if ratio is None:
            raise NotImplementedError(f"{type(self).__name__} declares no budget; override budget_for")
        return max(1, round(ratio * prompt_len))

    def always_kept(self, prompt_len: int, budget: int) -> tuple[int, int]:
        """(first, last): positions 0..first-1 and L-last..L-1 are kept whatever the scores.

        ``budget`` is :meth:`budget_for`; when first + last exceeds it, the budget is raised
        to first + last (the always-kept entries are never dropped). Default: (0, 0).
        """
        return 0, 0

    def score(self, layer_idx: int, queries: torch.Tensor | None, keys: torch.Tensor) -> torch.Tensor:
        """Importance of each prompt position per KV head, higher = keep.

        queries: [B, H_q, w, D] with w = ``observation_window(L)``, or None when w == 0.
        keys: [B, H_kv, L, D]. returns: [B, H_kv, L] (always-kept positions are ignored).
        """
        raise NotImplementedError

    # ------------------------------------------------------------------ selection

    def select(
        self, layer_idx: int, queries: torch.Tensor | None, keys: torch.Tensor, values: torch.Tensor,
        tokens: torch.Tensor | None = None,
    ) -> Selection | None:
        """Keep ``budget`` entries per KV head: the always-kept ones plus the top-scored rest.

        keys, values: [B, H_kv, L, D]. returns None (keep all) when L <= budget, else a
        :class:`Selection` with indices [B, H_kv, budget] ascending.
        """
        bsz, h_kv, length = keys.shape[0], keys.shape[1], keys.shape[2]
        budget = self.budget_for(length)
        first, last = self.always_kept(length, budget)
        budget = max(budget, first + last)
        if length <= budget:
            return None
        if budget == first + last:  # nothing left to choose: no scores needed
            return Selection(_ends(bsz, h_kv, length, first, last, keys.device))
        scores = self.score(layer_idx, queries, keys)
        if tuple(scores.shape) != (bsz, h_kv, length):
            raise ValueError(
                f"{type(self).__name__}.score returned {tuple(scores.shape)}, "
                f"expected {(bsz, h_kv, length)}"
            )
        return self.choose(scores, budget, first, last)

    def choose(self, scores: torch.Tensor, budget: int, first: int, last: int) -> Selection:
        """Uniform per-head budget: first + top (budget - first - last) + last, ascending.

        scores: [B, H_kv, L]; first + last < budget < L. returns indices [B, H_kv, budget].
        """
        bsz, h_kv, length = scores.shape
        picked = select_topk(scores[..., first : length - last], budget - first - last) + first
        head = torch.arange(first, device=scores.device).expand(bsz, h_kv, first)
        tail = torch.arange(length - last, length, device=scores.device).expand(bsz, h_kv, last)
        return Selection(torch.cat([head, picked, tail], dim=-1))


    # ------------------------------------------------------------------ eviction during decoding

    def decode_limit(self) -> tuple[int, int] | None:
        return None if self.decode_budget is None else (self.decode_budget, self.decode_slack)

    def decode_kept(self) -> tuple[int, int]:
        """(first, last): each head's first ``first`` and latest ``last`` valid entries are
        kept whatever the scores when a row is evicted. Default: (0, :meth:`decode_window`)."""
        return 0, self.decode_window()

    def decode_score(self, layer_idx: int, queries: torch.Tensor | None, keys: torch.Tensor,
                     valid: torch.Tensor) -> torch.Tensor:
        """Importance of each kept entry at eviction time, higher = keep.

        queries: [1, H_q, w, D] the row's latest queries (None when the window is 0); keys
        [1, H_kv, n, D]; valid [1, H_kv, n]. returns [1, H_kv, n] (pinned and padding entries
        are overridden). Default: no preference (only the pinned entries are meaningful).
        """
        return keys.new_zeros(keys.shape[:3], dtype=torch.float32)

    def evict(self, layer_idx: int, queries: torch.Tensor | None, keys: torch.Tensor, values: torch.Tensor,
              valid: torch.Tensor | None, positions: torch.Tensor | None = None,
              tokens: torch.Tensor | None = None) -> Selection | None:
        """Keep ``decode_budget`` entries per KV head: the pinned ones (:meth:`decode_kept`)
        plus the top-scored rest (:meth:`decode_score`); None when nothing would be dropped."""
        budget = self.decode_budget
        if budget is None:
            return None
        if valid is None:
            valid = torch.ones(keys.shape[:3], dtype=torch.bool, device=keys.device)
        first, last = self.decode_kept()
        ranks, counts = head_ranks(valid)
        pinned = valid & ((ranks <= first) | (ranks > counts - last))
        if budget > first + last:
            scores = self.decode_score(layer_idx, queries, keys, valid).float()
        else:
            scores = torch.zeros(keys.shape[:3], dtype=torch.float32, device=keys.device)
        scores = scores.masked_fill(~valid, float("-inf")).masked_fill(pinned, float("inf"))
        keep = self.decode_choose(scores, budget) & valid
        if bool((keep == valid).all()):
            return None
        return selection_from_mask(keep)

    def decode_choose(self, scores: torch.Tensor, budget: int) -> torch.Tensor:
        """Which entries each head keeps: scores [B, H_kv, n] (+inf pinned, -inf padding) ->
        BoolTensor [B, H_kv, n]. Default: each head's top ``budget``."""
        top = scores.topk(min(budget, scores.shape[-1]), dim=-1).indices
        keep = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
        return keep.scatter_(-1, top, True) & (scores > float("-inf"))


def selection_from_mask(keep: torch.Tensor) -> Selection:
    """A :class:`Selection` of the entries marked in ``keep`` [B, H_kv, n]: indices ascending
    per head, heads padded to the largest count by repeating their last index (``valid``
    marks the real ones; None when every head keeps as many)."""
    n = keep.shape[-1]
    width = max(int(keep.sum(-1).max()), 1)
    pos = torch.where(keep, torch.arange(n, device=keep.device), n)
    indices = pos.sort(dim=-1).values[..., :width]
    valid = indices < n
    last = indices.gather(-1, (valid.sum(-1, keepdim=True) - 1).clamp(min=0)).clamp(max=n - 1)
    indices = torch.where(valid, indices, last)
    return Selection(indices, None if bool(valid.all()) else valid)


def _ends(bsz: int, h_kv: int, length: int, first: int, last: int, device: torch.device) -> torch.Tensor:
    """LongTensor [B, H_kv, first + last]: positions 0..first-1 then L-last..L-1."""
    pos = torch.cat([torch.arange(first), torch.arange(length - last, length)]).to(device)
    return pos.expand(bsz, h_kv, first + last).contiguous()
