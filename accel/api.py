"""``accel.generate``: the public entry point."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from . import adapter
from .engine import DEFAULT_MAX_DRAFT, Stats, decode, plan_strategies
from .strategy import Strategy, build_strategies

__all__ = ["generate", "GenerateResult"]


@dataclass
class GenerateResult:
    """What :func:`generate` returns.

    sequences: LongTensor [batch, prompt + new]; rows of different lengths are padded on
        the left (prompts) and on the right (finished early) with the pad id.
    text: the decoded new tokens per row when a tokenizer is known, else None.
    stats: timings, accepted tokens per verify step and KV bytes, summed over rows.
    """

    sequences: torch.Tensor
    text: list[str] | None
    stats: Stats


def _as_rows(inputs: Any, tokenizer: Any, attention_mask: torch.Tensor | None) -> list[torch.Tensor]:
    """Normalise the accepted input forms to a list of 1-D LongTensors (one per row)."""
    if isinstance(inputs, str) or (isinstance(inputs, (list, tuple)) and inputs and all(isinstance(x, str) for x in inputs)):
        if tokenizer is None:
            raise ValueError("a text prompt needs tokenizer=")
        texts = [inputs] if isinstance(inputs, str) else list(inputs)
        if any(not t for t in texts):
            raise ValueError("empty prompt: every prompt needs at least one token")
        return [torch.tensor(tokenizer(t).input_ids, dtype=torch.long) for t in texts]
    if isinstance(inputs, (list, tuple)) and inputs and all(isinstance(x, int) for x in inputs):
        inputs = torch.tensor([inputs], dtype=torch.long)
    if not isinstance(inputs, torch.Tensor):
        raise ValueError(f"inputs must be a LongTensor [batch, n], a str or a list of str; got {type(inputs).__name__}")
    if inputs.dtype not in (torch.long, torch.int32, torch.int64):
        raise ValueError(f"input_ids must hold integer token ids, got dtype {inputs.dtype}")
    if inputs.dim() == 1:
        inputs = inputs.unsqueeze(0)
    if inputs.dim() != 2:
        raise ValueError(f"input_ids must be [batch, n], got shape {tuple(inputs.shape)}")
    if inputs.shape[1] == 0 or inputs.shape[0] == 0:
        raise ValueError("empty prompt: input_ids has no tokens")
    rows = []
    for b in range(inputs.shape[0]):
        row = inputs[b].long()
        if attention_mask is not None:
            row = row[attention_mask[b].bool()]
        if row.numel() == 0:
            raise ValueError(f"empty prompt: row {b} has no unmasked tokens")
        rows.append(row)
    return rows


def _check_sampling(max_new_tokens: int, temperature: float, top_k: int | None, top_p: float | None) -> None:
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k is not None and top_k < 0:
        raise ValueError(f"top_k must be >= 0, got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


@torch.inference_mode()
def generate(
    model: Any,
    inputs: torch.Tensor | str | Sequence[str],
    strategies: Sequence[Strategy | str | dict] | None = (),
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | list[int] | None = None,
    tokenizer: Any = None,
    seed: int | None = None,
    attention_mask: torch.Tensor | None = None,
    max_draft_tokens: int | None = DEFAULT_MAX_DRAFT,
) -> GenerateResult:
    """Generate with prompt compression and/or speculative decoding on one shared cache.

    Args:
        model: a transformers causal LM (``AutoModelForCausalLM``).
        inputs: LongTensor [batch, n] (left padding allowed with ``attention_mask``), a
            prompt string, or a list of prompt strings (both need ``tokenizer``).
        strategies: strategy objects, ``"name:key=val"`` strings or mappings with a
            ``name`` key; ``[]`` is plain decoding, identical to ``model.generate`` greedy.
        max_new_tokens: tokens to generate per row at most.
        temperature: 0 for greedy; > 0 samples (losslessly with drafters unless a lossy
            acceptance rule is given). ``top_k`` / ``top_p`` as in transformers.
        eos_token_id: stop token(s); default the model's generation config.
        seed: seeds the sampler, so sampling is reproducible.
        max_draft_tokens: the most draft nodes verified in one pass (None: sized to the
            cache, see :func:`accel.engine.draft_budget`).

    Rows are decoded one after another (each with its own cache), so every row's output is
    exactly what it would be alone.
    """
    adapter.check_causal_lm(model)
    _check_sampling(max_new_tokens, temperature, top_k, top_p)
    plan = plan_strategies(build_strategies(strategies))
    rows = _as_rows(inputs, tokenizer, attention_mask)
    device = adapter.geometry(model).device
    eos = adapter.default_eos(model, tokenizer) if eos_token_id is None else (
        [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id))
    warp = adapter.make_warpers(temperature, top_k, top_p)
    generator = None
    if warp is not None or plan.rule is not None:
        generator = torch.Generator(device=device).manual_seed(seed if seed is not None else random.randrange(2**63))

    stats = Stats()
    outputs = []
    for row in rows:
        new, row_stats = decode(
            model, row.to(device).unsqueeze(0), plan, max_new_tokens=max_new_tokens, eos=eos, warp=warp,
            generator=generator, max_draft=max_draft_tokens,
        )
        stats.merge(row_stats)
        outputs.append((row.to(device), new))

    sequences = _pad(outputs, _pad_id(model, tokenizer, eos))
    text = None
    if tokenizer is not None:
        text = [tokenizer.decode(new.tolist(), skip_special_tokens=True) for _, new in outputs]
    return GenerateResult(sequences=sequences, text=text, stats=stats)


def _pad_id(model: Any, tokenizer: Any, eos: list[int]) -> int:
    for pad in (getattr(tokenizer, "pad_token_id", None), getattr(model.generation_config, "pad_token_id", None)):
        if pad is not None:
            return int(pad)
    return eos[0] if eos else 0


def _pad(outputs: list[tuple[torch.Tensor, torch.Tensor]], pad: int) -> torch.Tensor:
    if len(outputs) == 1:
        prompt, new = outputs[0]
        return torch.cat([prompt, new]).unsqueeze(0)
    n = max(p.numel() for p, _ in outputs)
    m = max(g.numel() for _, g in outputs)
    out = torch.full((len(outputs), n + m), pad, dtype=torch.long, device=outputs[0][0].device)
    for i, (p, g) in enumerate(outputs):
        out[i, n - p.numel() : n] = p
        out[i, n : n + g.numel()] = g
    return out
