"""The decode loop as small functions: prefill, propose, verify, accept, commit.

One request decodes one sequence (batch row). Each verify step feeds the *root* (the
pending token: sampled last step, its KV not yet computed) plus a draft tree below it in one
forward pass over the shared cache, accepts the longest path the verifier agrees with, keeps
only that path's KV entries, and samples the bonus token, which becomes the next root.
Plain decoding is the same loop with a root-only tree.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from . import adapter
from .acceptance import Acceptance, greedy_accept, sample_accept
from .cache import SharedCache
from .tree import DraftTree, merge_proposals, tree_attention_bias, tree_position_ids
from .strategy import DraftContext, Drafter, PromptCompressor, Strategy

__all__ = ["Stats", "Plan", "plan_strategies", "prefill", "propose", "verify", "accept", "commit", "decode"]

# Largest draft tree verified in one pass, by cache size, unless the caller sets one. Measured
# on the default model, 2-core CPU, float32, weights prepacked (benchmarks/verify_cost.py):
# relative to a plain step, verifying 1-7 drafts costs ~1.2x at 512 cached entries and
# 1.2-1.45x at 4K; 15 drafts ~1.5x at 512 but ~1.8x at 4K and ~2.2x at 7.7K (attention over
# the cache for many query rows is what grows). A compressed cache therefore affords wider trees.
DEFAULT_MAX_DRAFT: int | None = None


def draft_budget(cached_entries: int) -> int:
    """Draft nodes worth verifying in one pass over ``cached_entries`` stored entries."""
    return 15 if cached_entries < 2048 else 7


@dataclass
class Stats:
    """Measurements of one generate call (summed over batch rows)."""

    prompt_tokens: int = 0
    new_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    verify_steps: int = 0
    drafted_tokens: int = 0  # draft nodes sent to the verifier
    accepted_tokens: int = 0  # draft tokens accepted (bonus tokens excluded)
    decode_tokens: int = 0  # tokens emitted by the verify steps (after the prefill's first one)
    kv_bytes_full: int = 0  # what an uncompressed cache would hold for the same tokens
    kv_bytes_kept: int = 0  # what the shared cache holds
    accepted_per_step: list[int] = field(default_factory=list)  # accepted drafts, per step

    @property
    def mean_accepted(self) -> float:
        """Tokens emitted per verify step, bonus token included (1.0 for plain decoding)."""
        return (self.accepted_tokens + self.verify_steps) / self.verify_steps if self.verify_steps else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s else 0.0

    @property
    def kv_compression(self) -> float:
        return self.kv_bytes_full / self.kv_bytes_kept if self.kv_bytes_kept else 1.0

    def merge(self, other: "Stats") -> None:
        for name in ("prompt_tokens", "new_tokens", "prefill_s", "decode_s", "verify_steps", "drafted_tokens",
                     "accepted_tokens", "decode_tokens", "kv_bytes_full", "kv_bytes_kept"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.accepted_per_step.extend(other.accepted_per_step)

    def as_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k != "accepted_per_step"}
        d.update(mean_accepted=self.mean_accepted, decode_tokens_per_s=self.decode_tokens_per_s)
        return d

    def summary(self) -> str:
        return (
            f"prompt {self.prompt_tokens} tok | new {self.new_tokens} tok | prefill {self.prefill_s:.2f}s | "
            f"decode {self.decode_s:.2f}s ({self.decode_tokens_per_s:.1f} tok/s) | steps {self.verify_steps} | "
            f"accepted/step {self.mean_accepted:.2f} | KV {self.kv_bytes_kept / 2**20:.1f}/"
            f"{self.kv_bytes_full / 2**20:.1f} MiB"
        )


@dataclass(frozen=True)
class Plan:
    """The strategies of one call, sorted by capability."""

    compressor: PromptCompressor | None
    drafters: tuple[Drafter, ...]
    rule: Strategy | None  # an AcceptanceRule, or None for greedy / lossless sampling

    @property
    def needs_hidden(self) -> bool:
        return any(d.needs_hidden for d in self.drafters)


def plan_strategies(strategies: list[Strategy]) -> Plan:
    compressors = [s for s in strategies if s.compresses_prompt]
    rules = [s for s in strategies if s.accepts]
    if len(compressors) > 1:
        raise ValueError(f"at most one prompt compressor per call, got {[s.name for s in compressors]}")
    if len(rules) > 1:
        raise ValueError(f"at most one acceptance rule per call, got {[s.name for s in rules]}")
    drafters = tuple(s for s in strategies if s.drafts)
    return Plan(compressors[0] if compressors else None, drafters, rules[0] if rules else None)


# --------------------------------------------------------------------------- the steps


def prefill(model, cache: SharedCache, prompt: torch.Tensor, compressor: PromptCompressor | None) -> torch.Tensor:
    """Run the prompt [1, n] through the model, filling (and compressing) the cache.

    Returns the final hidden state at the last prompt position, [1, H].
    """
    n = prompt.shape[1]
    positions = torch.arange(n, device=prompt.device).unsqueeze(0)
    window = compressor.observation_window(n) if compressor is not None else 0
    queries: dict[int, torch.Tensor] = {}

    if compressor is not None:

        def hook(layer_idx: int, keys: torch.Tensor, values: torch.Tensor):
            sel = compressor.select(layer_idx, queries.pop(layer_idx, None), keys, values)
            return None if sel is None else (sel.indices, sel.valid)

        cache.prefill_hook = hook
    try:
        with adapter.capture_window_queries(model, cache, window, queries):
            hidden = adapter.backbone_forward(model, prompt, positions, cache)
    finally:
        cache.prefill_hook = None
    cache.commit(keep=None, advance=n)
    return hidden[:, -1]


def propose(plan: Plan, states: list[Any], ctx: DraftContext) -> tuple[DraftTree, torch.Tensor | None]:
    """Ask every drafter for a tree and merge them below the root.

    Returns the tree and, per draft node, the index of the drafter that proposed it (None
    when nothing was proposed).
    """
    root = int(ctx.tokens[-1])
    if not plan.drafters:
        return DraftTree.root_only(root), None
    proposals = [d.propose(s, ctx) for d, s in zip(plan.drafters, states)]
    if len(proposals) == 1:
        prop = proposals[0]
        if prop is None or len(prop) == 0:
            return DraftTree.root_only(root), None
        return DraftTree.from_proposal(root, prop), torch.zeros(len(prop), dtype=torch.long)
    merged = merge_proposals(proposals, ctx.max_tokens)
    if merged is None:
        return DraftTree.root_only(root), None
    return DraftTree.from_proposal(root, merged.proposal), merged.source


def verify(model, cache: SharedCache, tree: DraftTree, dtype: torch.dtype) -> torch.Tensor:
    """One forward pass over [root + draft nodes] on top of the cache.

    Returns final hidden states [N+1, H]; the N+1 new entries stay uncommitted.
    """
    ids = tree.tokens.unsqueeze(0)
    if len(tree.tokens) == 1:
        positions = torch.tensor([[cache.logical_length]], device=ids.device)
        mask = None
    else:
        positions = tree_position_ids(tree, cache.logical_length)
        mask = tree_attention_bias(tree, cache.physical_length(0), dtype).to(ids.device)
    return adapter.backbone_forward(model, ids, positions.to(ids.device), cache, mask)[0]


def accept(
    tree: DraftTree,
    logits: torch.Tensor,
    warp: Callable[[torch.Tensor], torch.Tensor] | None,
    rule: Strategy | None,
    generator: torch.Generator | None,
) -> Acceptance:
    """Choose the accepted path and the bonus token. logits: [N+1, V] float32."""
    if warp is None and rule is None:
        if len(tree.tokens) == 1:
            return Acceptance(path=[0], next_token=int(logits[0].argmax()), accepted=0)
        return greedy_accept(tree, logits)
    probs = torch.softmax(warp(logits) if warp is not None else logits, dim=-1)
    if rule is not None:
        return rule.accept(tree, probs, generator)
    if len(tree.tokens) == 1:
        return Acceptance(path=[0], next_token=int(torch.multinomial(probs[0], 1, generator=generator)), accepted=0)
    return sample_accept(tree, probs, generator)


def commit(cache: SharedCache, acc: Acceptance) -> None:
    """Keep the accepted path's entries (root included) and advance the logical length."""
    cache.commit(acc.path)


# --------------------------------------------------------------------------- the loop


def decode(
    model,
    prompt: torch.Tensor,
    plan: Plan,
    *,
    max_new_tokens: int,
    eos: list[int],
    warp: Callable[[torch.Tensor], torch.Tensor] | None,
    generator: torch.Generator | None,
    max_draft: int | None = DEFAULT_MAX_DRAFT,
) -> tuple[torch.Tensor, Stats]:
    """Generate up to ``max_new_tokens`` after ``prompt`` [1, n]. Returns (new tokens [m], stats)."""
    geo = adapter.geometry(model)
    stats = Stats(prompt_tokens=prompt.shape[1])
    if max_new_tokens == 0:
        return prompt.new_empty((0,)), stats
    with adapter.packed_gqa_attention(model):
        return _decode(model, prompt, plan, geo, stats, max_new_tokens, eos, warp, generator, max_draft)


def _decode(model, prompt, plan, geo, stats, max_new_tokens, eos, warp, generator, max_draft):
    cache = SharedCache(geo.num_layers)
    eos_set = set(eos)

    t0 = time.perf_counter()
    hidden = prefill(model, cache, prompt, plan.compressor)
    acc = accept(DraftTree.root_only(-1), adapter.output_logits(model, hidden), warp, plan.rule, generator)
    generated = [acc.next_token]
    stats.prefill_s = time.perf_counter() - t0

    tokens = torch.cat([prompt[0], prompt.new_tensor(generated)])
    states = [d.start(model, prompt[0]) for d in plan.drafters]
    last_hidden = hidden[0] if plan.needs_hidden else None

    t1 = time.perf_counter()
    masks = adapter.per_layer_masks(model, cache) if cache.ragged else contextlib.nullcontext()
    with masks:
        while len(generated) < max_new_tokens and generated[-1] not in eos_set:
            budget = max_draft if max_draft is not None else draft_budget(cache.physical_length(0))
            ctx = DraftContext(tokens=tokens, hidden=last_hidden, max_tokens=budget)
            tree, source = propose(plan, states, ctx)
            hidden = verify(model, cache, tree, geo.dtype)
            acc = accept(tree, adapter.output_logits(model, hidden), warp, plan.rule, generator)
            commit(cache, acc)

            new = acc.emitted(tree)
            for i, t in enumerate(new):
                if t in eos_set:
                    new = new[: i + 1]
                    break
            new = new[: max_new_tokens - len(generated)]
            generated.extend(new)
            stats.decode_tokens += len(new)
            tokens = torch.cat([tokens, tokens.new_tensor(new)])

            stats.verify_steps += 1
            stats.drafted_tokens += len(tree.tokens) - 1
            stats.accepted_tokens += acc.accepted
            stats.accepted_per_step.append(acc.accepted)
            if plan.drafters:
                _feedback(plan, states, source, acc)
            if last_hidden is not None:
                last_hidden = hidden[acc.path[-1]]
    stats.decode_s = time.perf_counter() - t1

    stats.new_tokens = len(generated)
    stats.kv_bytes_full = geo.entry_bytes() * cache.logical_length
    stats.kv_bytes_kept = cache.kept_bytes()
    return prompt.new_tensor(generated), stats


def _feedback(plan: Plan, states: list[Any], source: torch.Tensor | None, acc: Acceptance) -> None:
    if source is None:
        for d, s in zip(plan.drafters, states):
            d.feedback(s, 0, 0)
        return
    path_sources = [int(source[j - 1]) for j in acc.path[1:]]
    for i, (d, s) in enumerate(zip(plan.drafters, states)):
        d.feedback(s, int((source == i).sum()), sum(1 for src in path_sources if src == i))
