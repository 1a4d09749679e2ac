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
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from pydantic import ConfigDict, model_validator

from accel.strategy import PromptCompressor, Selection

from .scoring import select_topk

__all__ = ["ScoredCompressor"]


class ScoredCompressor(PromptCompressor):
    """Per-KV-head top-k over ``score()``, plus always-kept first/last positions."""

    model_config = ConfigDict(use_attribute_docstrings=True)

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
        self, layer_idx: int, queries: torch.Tensor | None, keys: torch.Tensor, values: torch.Tensor
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


def _ends(bsz: int, h_kv: int, length: int, first: int, last: int, device: torch.device) -> torch.Tensor:
    """LongTensor [B, H_kv, first + last]: positions 0..first-1 then L-last..L-1."""
    pos = torch.cat([torch.arange(first), torch.arange(length - last, length)]).to(device)
    return pos.expand(bsz, h_kv, first + last).contiguous()
