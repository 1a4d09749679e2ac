"""FastGen (Ge et al. 2024, "Model Tells You What to Discard"): a policy per head, the
cheapest that keeps enough of the head's attention."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import torch
from pydantic import Field, model_validator

from accel.strategy import Selection, register

from .base import ScoredCompressor, selection_from_mask
from .scoring import decode_votes, head_ranks, reduce_gqa, window_scores

__all__ = ["FastGen", "POLICIES", "policy_masks", "choose_policies", "special_token_ids", "punctuation_token_ids"]

#: FastGen's policies, cheapest first; each keeps what the ones before it keep.
POLICIES = ("special", "punctuation", "frequency", "local", "full")


@register
class FastGen(ScoredCompressor):
    """Per-head policies chosen from each head's attention, in FastGen's order of cost:

    1. ``special``: the special tokens (``special_ids``, and the first position: the
       attention sink);
    2. ``punctuation``: those and the punctuation tokens (``punctuation_ids``);
    3. ``frequency``: those and the ``frequent`` fraction of entries the head attends to most;
    4. ``local``: those and the latest ``local`` fraction of entries;
    5. ``full``: every entry.

    Each head takes the first policy whose entries receive at least ``recovery`` of the
    attention its observation window gives (the last ``window`` prompt queries, as SnapKV's;
    the paper profiles with the whole prompt's attention). Every policy also keeps the latest
    ``window`` entries. Heads keep different counts: the cache holds them in the padded
    per-head layout (as :class:`AdaSnapKV`).

    Generated tokens: every ``decode_slack`` tokens (or, with ``decode_budget``, once a row
    holds ``decode_budget + decode_slack`` entries per head) each head's policy is chosen
    again with the latest ``window`` tokens' queries and applied to everything the row
    holds, generated tokens included (special and punctuation tokens by their ids); with
    ``decode_budget`` a head then keeps at most that many, the latest window first and then
    its policy's entries the queries attend to most. The paper decides per token at once;
    accel applies the policies every ``decode_slack`` tokens, so decoding pays nothing per
    token for them.

    ``special_ids`` and ``punctuation_ids`` are token ids of the model's tokenizer (see
    :func:`special_token_ids` and :func:`punctuation_token_ids`).
    """

    name: ClassVar[str] = "fastgen"

    recovery: float = Field(0.95, gt=0, le=1)
    """Fraction of a head's attention its policy must keep; each head gets the cheapest such policy."""
    window: int = Field(32, gt=0)
    """Latest queries that profile the heads (the prompt's last, then the latest tokens'); every policy keeps their entries."""
    frequent: float = Field(0.3, gt=0, lt=1)
    """Frequency policy: this fraction of a head's entries, those its window attends to most."""
    local: float = Field(0.3, gt=0, lt=1)
    """Locality policy: this fraction of a head's entries, the latest."""
    special_ids: tuple[int, ...] = ()
    """Token ids the special-token policy keeps (besides the first position)."""
    punctuation_ids: tuple[int, ...] = ()
    """Token ids the punctuation policy keeps."""
    gqa: Literal["mean", "max"] = "mean"
    """How the attention of the query heads sharing one KV head is combined."""

    @model_validator(mode="after")
    def _decode_budget_exceeds_window(self) -> FastGen:
        if self.decode_budget is not None and self.decode_budget <= self.window:
            raise ValueError(f"decode_budget ({self.decode_budget}) must be greater than window ({self.window}): "
                             "every policy keeps the latest window entries")
        return self

    def observation_window(self, prompt_len: int) -> int:
        return min(self.window, prompt_len)

    def decode_limit(self) -> tuple[int | None, int]:
        return self.decode_budget, self.decode_slack

    def decode_window(self) -> int:
        return self.window

    def select(self, layer_idx: int, queries: torch.Tensor | None, keys: torch.Tensor, values: torch.Tensor,
               tokens: torch.Tensor | None = None) -> Selection | None:
        """Each head's policy applied to the prompt: indices, valid [B, H_kv, K] (padded)."""
        if queries is None:
            raise ValueError("FastGen needs the observation-window queries")
        if tokens is None:
            raise ValueError("FastGen needs the prompt's token ids (special and punctuation policies)")
        bsz, h_kv, length = keys.shape[:3]
        votes = reduce_gqa(window_scores(queries, keys), h_kv, self.gqa)  # [B, H_kv, L]
        positions = torch.arange(length, device=keys.device).expand(bsz, h_kv, length)
        valid = torch.ones_like(positions, dtype=torch.bool)
        keep = self._keep(votes, valid, positions, tokens.to(keys.device).unsqueeze(1).expand(bsz, h_kv, length),
                          queries.shape[2])
        return None if bool(keep.all()) else selection_from_mask(keep)

    def evict(self, layer_idx: int, queries: torch.Tensor | None, keys: torch.Tensor, values: torch.Tensor,
              valid: torch.Tensor | None, positions: torch.Tensor | None = None,
              tokens: torch.Tensor | None = None) -> Selection | None:
        """Each head's policy, chosen again with the latest queries, applied to all it holds."""
        if queries is None or positions is None or tokens is None:
            raise ValueError("FastGen's eviction needs the latest queries, the entries' positions and the tokens")
        if valid is None:
            valid = torch.ones(keys.shape[:3], dtype=torch.bool, device=keys.device)
        votes = reduce_gqa(decode_votes(queries, keys, valid), keys.shape[1], self.gqa)
        keep = self._keep(votes, valid, positions, tokens.to(keys.device)[positions], queries.shape[2])
        if self.decode_budget is not None:
            keep = _cap(keep, votes, valid, queries.shape[2], self.decode_budget)
        return None if bool((keep == valid).all()) else selection_from_mask(keep)

    def _keep(self, votes: torch.Tensor, valid: torch.Tensor, positions: torch.Tensor, ids: torch.Tensor,
              window: int) -> torch.Tensor:
        masks = policy_masks(votes, valid, positions, ids, window, self.special_ids, self.punctuation_ids,
                             self.frequent, self.local)
        return choose_policies(votes, valid, masks, self.recovery)[1]


def policy_masks(votes: torch.Tensor, valid: torch.Tensor, positions: torch.Tensor, ids: torch.Tensor, window: int,
                 special_ids: tuple[int, ...], punctuation_ids: tuple[int, ...], frequent: float,
                 local: float) -> torch.Tensor:
    """What each of :data:`POLICIES` keeps, per head: BoolTensor [P, B, H_kv, n].

    votes: [B, H_kv, n] the attention each entry receives; valid: [B, H_kv, n] (False:
    padding); positions, ids: [B, H_kv, n] each entry's sequence position and token id.
    Every policy keeps each head's latest ``window`` valid entries; each keeps what the one
    before it keeps.
    """
    ranks, counts = head_ranks(valid)
    latest = valid & (ranks > counts - window)
    special = latest | (positions == 0)
    if special_ids:
        special |= torch.isin(ids, torch.tensor(special_ids, device=ids.device))
    punctuation = special.clone()
    if punctuation_ids:
        punctuation |= torch.isin(ids, torch.tensor(punctuation_ids, device=ids.device))
    # the top ceil(frequent * count) entries of each head by votes
    order = votes.masked_fill(~valid, float("-inf")).argsort(dim=-1, descending=True, stable=True)
    top = torch.arange(votes.shape[-1], device=votes.device) < torch.ceil(frequent * counts)
    heavy = torch.zeros_like(valid).scatter_(-1, order, top.expand_as(order))
    frequency = punctuation | heavy
    recent = frequency | (ranks > counts - torch.ceil(local * counts))
    return torch.stack([special, punctuation, frequency, recent, torch.ones_like(valid)]) & valid


def choose_policies(votes: torch.Tensor, valid: torch.Tensor, masks: torch.Tensor, recovery: float
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each head's cheapest policy keeping at least ``recovery`` of its attention.

    votes, valid: [B, H_kv, n]; masks: [P, B, H_kv, n] (:func:`policy_masks`, the last
    policy keeps everything). Returns (the chosen policy per head [B, H_kv] as an index into
    :data:`POLICIES`, what the heads keep [B, H_kv, n]).
    """
    mass = votes.float().masked_fill(~valid, 0.0)
    total = mass.sum(-1).clamp(min=1e-30)  # [B, H]
    kept = (mass.unsqueeze(0) * masks).sum(-1) / total  # [P, B, H]
    enough = kept >= recovery * (1 - 1e-6)
    enough[-1] = True
    choice = enough.float().argmax(dim=0)  # first policy that is enough
    keep = masks.gather(0, choice[None, ..., None].expand(1, *masks.shape[1:]))[0]
    return choice, keep


def _cap(keep: torch.Tensor, votes: torch.Tensor, valid: torch.Tensor, window: int, budget: int) -> torch.Tensor:
    """At most ``budget`` entries per head of ``keep``: the latest ``window``, then by votes."""
    ranks, counts = head_ranks(valid)
    scores = votes.float().masked_fill(valid & (ranks > counts - window), float("inf"))
    scores = scores.masked_fill(~keep, float("-inf"))
    top = scores.topk(min(budget, scores.shape[-1]), dim=-1).indices
    capped = torch.zeros_like(keep).scatter_(-1, top, True)
    return capped & keep


def special_token_ids(tokenizer: Any) -> tuple[int, ...]:
    """The ids of a tokenizer's special tokens (``all_special_ids``), for ``special_ids``."""
    return tuple(sorted(int(i) for i in getattr(tokenizer, "all_special_ids", []) or []))


def punctuation_token_ids(tokenizer: Any, marks: str = ".,;:!?\n") -> tuple[int, ...]:
    """The ids of tokens that decode to punctuation only (any of ``marks``, spaces aside),
    for ``punctuation_ids``."""
    out = []
    for i in range(int(getattr(tokenizer, "vocab_size", 0) or len(tokenizer))):
        text = tokenizer.decode([i])
        stripped = text.strip(" ")
        if stripped and all(c in marks for c in stripped):
            out.append(i)
    return tuple(out)
