"""Prompt lookup drafting: continue the current n-gram the way it continued before.

The last ``n`` tokens (``max_ngram`` down to ``min_ngram``) are searched for in the prompt
and the text generated so far; each earlier occurrence proposes the tokens that followed it.
Several distinct continuations (most recent match first) become branches of one draft tree,
with shared prefixes merged, so the verifier checks them all in one pass.

Draft length adapts to the acceptance history, in the spirit of transformers' heuristic
schedule and DISCO: a fully accepted draft lengthens the next one by 2, a rejected one
shortens it by 1, between 1 and ``num_tokens``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from pydantic import Field, model_validator

from accel.strategy import DraftContext, DraftProposal, Drafter, register

from .tree import merge_proposals

__all__ = ["PromptLookup", "find_continuations"]


def find_continuations(tokens: torch.Tensor, max_ngram: int, min_ngram: int, length: int, branches: int) -> list[torch.Tensor]:
    """Continuations of the sequence's final n-gram found earlier in ``tokens`` [L].

    Longer n-grams are tried first; within one n, the most recent match first. Returns at
    most ``branches`` distinct LongTensors of 1..``length`` tokens each.
    """
    found: list[torch.Tensor] = []
    seen: set[tuple[int, ...]] = set()
    total = tokens.numel()
    for n in range(min(max_ngram, total - 1), min_ngram - 1, -1):
        tail = tokens[total - n :]
        windows = tokens[: total - 1].unfold(0, n, 1)  # [L-n, n], excludes the tail itself
        starts = torch.nonzero((windows == tail).all(dim=1)).flatten() + n
        for start in starts.flip(0).tolist():
            cont = tokens[start : start + length]
            key = tuple(cont.tolist())
            if not key or key in seen:
                continue
            seen.add(key)
            found.append(cont)
            if len(found) >= branches:
                return found
    return found


@dataclass
class _State:
    length: int


@register
class PromptLookup(Drafter):
    """Drafts from n-gram matches in the prompt and the generated text (no extra model).

    Lossless: drafts are only proposals; the verifier decides. Best on copy-heavy tasks
    (editing, extraction, summarising or quoting a document, code).
    """

    name: ClassVar[str] = "prompt_lookup"

    max_ngram: int = Field(3, ge=1, description="longest n-gram matched against the history")
    min_ngram: int = Field(1, ge=1, description="shortest n-gram tried when longer ones do not match")
    num_tokens: int = Field(8, ge=1, description="longest draft branch (tokens)")
    branches: int = Field(4, ge=1, description="distinct continuations verified together as tree branches")
    adaptive: bool = Field(True, description="adapt the draft length to the acceptance history")

    @model_validator(mode="after")
    def _check(self) -> "PromptLookup":
        if self.min_ngram > self.max_ngram:
            raise ValueError(f"min_ngram ({self.min_ngram}) must be <= max_ngram ({self.max_ngram})")
        return self

    def start(self, model, prompt: torch.Tensor) -> _State:
        return _State(length=self.num_tokens)

    def propose(self, state: _State, ctx: DraftContext) -> DraftProposal | None:
        length = min(state.length, ctx.max_tokens)
        if length <= 0:
            return None
        conts = find_continuations(ctx.tokens, self.max_ngram, self.min_ngram, length, self.branches)
        if not conts:
            return None
        chains = [
            DraftProposal(tokens=c, parents=torch.arange(c.numel(), dtype=torch.long)) for c in conts
        ]
        if len(chains) == 1:
            return chains[0]
        merged = merge_proposals(chains, ctx.max_tokens)
        return merged.proposal if merged is not None else None

    def feedback(self, state: _State, proposed: int, accepted: int) -> None:
        if not self.adaptive or proposed == 0:
            return
        if accepted >= state.length:
            state.length = min(self.num_tokens, state.length + 2)
        else:
            state.length = max(1, state.length - 1)
