"""Prompt lookup drafting: continue the current n-gram the way it continued before.

The last ``n`` tokens (``max_ngram`` down to ``min_ngram``) are searched for in the prompt
and the text generated so far; each earlier occurrence proposes the tokens that followed it.
Several distinct continuations become branches of one draft tree, with shared prefixes
merged, so the verifier checks them all in one pass. The best branch -- the match whose
agreement with the text reaches furthest back, then the most recent -- gets the full
length; the other branches share what is left of the node budget.

On the 2-core CPU with prepacked weights (``accel.prepack``), verifying 1-7 drafts costs
about 1.2x a plain decode step at 512 cached tokens and 15 drafts 1.5x
(``benchmarks/verify_cost.py``), so ``num_tokens`` defaults to 15, the engine's tree budget
below 2K cached tokens (7 above). A draft pays only if it gains more than the extra cost:
weak evidence (a match of fewer than ``max_ngram`` tokens) is therefore drafted only while
the recent acceptance (an exponential average of accepted tokens per draft) stays above
``min_gain``; with a full ``max_ngram`` match it always drafts.

With ``adaptive=True`` the draft length follows the acceptance history, in the spirit of
transformers' heuristic schedule and DISCO: a draft of which nothing was accepted halves
the next one, a fully accepted one restores ``num_tokens``, a partly accepted one leaves
the length as it is (partial acceptance is the normal case when copying: the copy runs
until the text departs from its source). It is off by default: with prepacked weights a
verify pass is cheap enough here that a fixed 15-token draft was faster on the copy-heavy
``long_doc`` documents (74.0 vs 71.3 tok/s; transformers' prompt lookup 60.0) and tied on
chat prompts (35.4 vs 35.3 tok/s), measured in one ``accel bench`` run on both cores (the
command is in docs/BENCHMARKS.md, "Why prompt lookup's draft length is fixed by default").
Turn it on where verifying is dear.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from pydantic import Field, model_validator

from accel.strategy import DraftContext, DraftProposal, Drafter, register
from accel.tree import merge_proposals

__all__ = ["PromptLookup", "find_continuations"]


def find_continuations(
    tokens: torch.Tensor, max_ngram: int, min_ngram: int, length: int, branches: int, reach: int = 64
) -> list[tuple[int, torch.Tensor]]:
    """Continuations of the sequence's final n-gram found earlier in ``tokens`` [L].

    Longer n-grams are tried first. Within one n, the match whose agreement with the end of
    the sequence reaches furthest back (up to ``reach`` tokens) comes first, then the most
    recent: when the model is copying a passage, the passage's source agrees with the text
    copied so far for many tokens, while the other places where the same n-gram occurs agree
    for n tokens only. Returns at most ``branches`` pairs (n, continuation): the matched
    n-gram length and a distinct LongTensor of 1..``length`` tokens.
    """
    found: list[tuple[int, torch.Tensor]] = []
    seen: set[tuple[int, ...]] = set()
    total = tokens.numel()
    for n in range(min(max_ngram, total - 1), min_ngram - 1, -1):
        tail = tokens[total - n :]
        windows = tokens[: total - 1].unfold(0, n, 1)  # [L-n, n], excludes the tail itself
        starts = torch.nonzero((windows == tail).all(dim=1)).flatten() + n
        if starts.numel() == 0:
            continue
        for start in _rank_by_agreement(tokens, starts, n, reach).tolist():
            cont = tokens[start : start + length]
            key = tuple(cont.tolist())
            if not key or key in seen:
                continue
            seen.add(key)
            found.append((n, cont))
            if len(found) >= branches:
                return found
    return found


def _rank_by_agreement(tokens: torch.Tensor, starts: torch.Tensor, n: int, reach: int) -> torch.Tensor:
    """``starts`` (positions just after an n-gram equal to the sequence's last n tokens),
    ordered by how many tokens before them agree with the end of the sequence (at most
    ``reach``), most first; ties most recent first."""
    total = tokens.numel()
    agree = torch.full_like(starts, n)
    alive = torch.ones_like(starts, dtype=torch.bool)
    for k in range(n, min(reach, total)):
        pos = starts - 1 - k
        alive &= pos >= 0
        if not alive.any():
            break
        same = tokens[pos.clamp(min=0)] == tokens[total - 1 - k]
        alive &= same
        agree += alive.long()
    return starts[torch.argsort(agree * (total + 1) + starts, descending=True)]


@dataclass
class _State:
    length: int  # current draft length
    gain: float  # exponential average of accepted tokens per draft


@register
class PromptLookup(Drafter):
    """Drafts from n-gram matches in the prompt and the generated text (no extra model).

    Lossless: drafts are only proposals; the verifier decides. Best on copy-heavy tasks
    (editing, extraction, summarising or quoting a document, code).
    """

    name: ClassVar[str] = "prompt_lookup"

    max_ngram: int = Field(3, ge=1, description="longest n-gram matched against the history")
    min_ngram: int = Field(1, ge=1, description="shortest n-gram tried when longer ones do not match")
    num_tokens: int = Field(15, ge=1, description="longest draft branch (tokens)")
    branches: int = Field(4, ge=1, description="distinct continuations verified together as tree branches")
    adaptive: bool = Field(False, description="adapt the draft length to the acceptance history")
    min_gain: float = Field(
        0.5, ge=0, description="weak (shorter than max_ngram) matches are drafted only while recent drafts "
        "gained at least this many accepted tokens each; 0 always drafts"
    )

    @model_validator(mode="after")
    def _check(self) -> "PromptLookup":
        if self.min_ngram > self.max_ngram:
            raise ValueError(f"min_ngram ({self.min_ngram}) must be <= max_ngram ({self.max_ngram})")
        return self

    def start(self, model, prompt: torch.Tensor) -> _State:
        return _State(length=self.num_tokens, gain=1.0)

    def propose(self, state: _State, ctx: DraftContext) -> DraftProposal | None:
        length = min(state.length, ctx.max_tokens)
        if length <= 0:
            return None
        found = find_continuations(ctx.tokens, self.max_ngram, self.min_ngram, length, self.branches)
        if not found or (found[0][0] < self.max_ngram and state.gain < self.min_gain):
            return None
        # the best match drafts `length` tokens; the others share the rest of the budget
        rest = max(1, (ctx.max_tokens - length) // max(1, len(found) - 1))
        chains = [
            DraftProposal(tokens=c[: length if i == 0 else rest], parents=torch.arange(min(c.numel(), length if i == 0 else rest)))
            for i, (_, c) in enumerate(found)
        ]
        if len(chains) == 1:
            return chains[0]
        merged = merge_proposals(chains, ctx.max_tokens)
        return merged.proposal if merged is not None else None

    def feedback(self, state: _State, proposed: int, accepted: int) -> None:
        if proposed == 0:
            return
        state.gain = 0.7 * state.gain + 0.3 * accepted
        if not self.adaptive:
            return
        if accepted == 0:
            state.length = max(1, state.length // 2)
        elif accepted >= state.length:
            state.length = self.num_tokens
