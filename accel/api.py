"""``accel.generate``: the public entry point."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch

from . import adapter
from .runahead import PrefillRanks, check_prefill_ranks, shared_ranks
from .engine import DEFAULT_MAX_DRAFT, Plan, Row, Stats, batch_steps, plan_strategies, run_batch
from .strategy import Strategy, build_strategies
from .text import TextStream

__all__ = ["generate", "stream", "GenerateResult", "StreamDelta"]


@dataclass
class GenerateResult:
    """What :func:`generate` returns.

    sequences: LongTensor [batch, prompt + new]; rows of different lengths are padded on
        the left (prompts) and on the right (finished early) with the pad id.
    text: the decoded new tokens per row when a tokenizer is known, else None.
    stats: the call's figures: wall-clock prefill / decode seconds, tokens, verify steps,
        accepted tokens and KV bytes summed over rows (aggregate tok/s = decode_tokens / decode_s).
    row_stats: each row's own Stats (its steps, acceptance, KV bytes, first-token and total
        latency).
    """

    sequences: torch.Tensor
    text: list[str] | None
    stats: Stats
    row_stats: list[Stats] = field(default_factory=list)


@dataclass
class StreamDelta:
    """Tokens one row accepted in one step (:func:`stream`)."""

    row: int
    tokens: list[int]
    text: str | None
    finished: bool
    finish_reason: str | None


def _one_row(row: Any, b: int) -> torch.Tensor:
    """One prompt of a list of rows as a 1-D LongTensor (row ``b``, for the error)."""
    if isinstance(row, (list, tuple)):
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in row):
            raise ValueError(f"inputs[{b}] must hold integer token ids")
        row = torch.tensor(row, dtype=torch.long)
    if row.dtype not in (torch.long, torch.int32, torch.int64):
        raise ValueError(f"inputs[{b}] must hold integer token ids, got dtype {row.dtype}")
    if row.dim() == 2 and row.shape[0] == 1:
        row = row[0]
    if row.dim() != 1:
        raise ValueError(f"inputs[{b}] must be one row of token ids [n], got shape {tuple(row.shape)}")
    if row.numel() == 0:
        raise ValueError(f"empty prompt: inputs[{b}] has no tokens")
    return row.long()


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
    if isinstance(inputs, (list, tuple)) and inputs and all(isinstance(x, (torch.Tensor, list, tuple)) for x in inputs):
        if attention_mask is not None:
            raise ValueError("attention_mask is for a padded LongTensor [batch, n]; a list of rows needs none")
        return [_one_row(x, b) for b, x in enumerate(inputs)]
    if not isinstance(inputs, torch.Tensor):
        raise ValueError("inputs must be a LongTensor [batch, n], a list of token-id rows (1-D tensors or lists of "
                         f"ints, any lengths), a str or a list of str; got {type(inputs).__name__}")
    if inputs.dtype not in (torch.long, torch.int32, torch.int64):
        raise ValueError(f"input_ids must hold integer token ids, got dtype {inputs.dtype}")
    if inputs.dim() == 1:
        inputs = inputs.unsqueeze(0)
    if inputs.dim() != 2:
        raise ValueError(f"input_ids must be [batch, n], got shape {tuple(inputs.shape)}")
    if inputs.shape[1] == 0 or inputs.shape[0] == 0:
        raise ValueError("empty prompt: input_ids has no tokens")
    if attention_mask is not None and tuple(attention_mask.shape) != tuple(inputs.shape):
        raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, input_ids {tuple(inputs.shape)}: "
                         "they must match")
    rows = []
    for b in range(inputs.shape[0]):
        row = inputs[b].long()
        if attention_mask is not None:
            row = row[attention_mask[b].bool()]
        if row.numel() == 0:
            raise ValueError(f"empty prompt: row {b} has no unmasked tokens")
        rows.append(row)
    return rows


def check_sampling(max_new_tokens: Any, temperature: float, top_k: int | None, top_p: float | None) -> None:
    """Raise a ValueError naming the argument unless the sampling settings make sense."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or temperature < 0:
        raise ValueError(f"temperature must be a number >= 0, got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0):
        raise ValueError(f"top_k must be an integer >= 0, got {top_k!r}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


def check_prefill_chunk(prefill_chunk: Any) -> None:
    """Raise a ValueError naming ``prefill_chunk`` unless it is None or an integer >= 1."""
    if prefill_chunk is not None and (isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int)
                                      or prefill_chunk < 1):
        raise ValueError(f"prefill_chunk must be an integer >= 1 (prompt tokens per prefill forward) or None, "
                         f"got {prefill_chunk!r}")


def check_context(model: Any, prompt_len: int, max_new_tokens: int, where: str = "prompt") -> None:
    """Raise a ValueError when ``prompt_len + max_new_tokens`` exceeds the model's context."""
    limit = adapter.context_length(model)
    if limit is not None and prompt_len + max_new_tokens > limit:
        raise ValueError(
            f"{where} has {prompt_len} tokens and max_new_tokens={max_new_tokens}: {prompt_len + max_new_tokens} "
            f"exceeds the model's context of {limit} tokens"
        )


def make_rows(model: Any, rows: list[torch.Tensor], plan: Plan, *, max_new_tokens: int, temperature: float,
              top_k: int | None, top_p: float | None, eos: list[int], seed: int | None) -> list[Row]:
    """One :class:`~accel.engine.Row` per prompt; row i samples from its own generator,
    seeded ``seed + i`` (so a row samples what it would sample alone with that seed)."""
    device = adapter.geometry(model).device
    warp = adapter.make_warpers(temperature, top_k, top_p)
    out = []
    for i, row in enumerate(rows):
        check_context(model, int(row.numel()), max_new_tokens, where=f"prompt {i}" if len(rows) > 1 else "the prompt")
        generator = None
        if warp is not None:
            row_seed = seed + i if seed is not None else random.randrange(2**63)
            generator = torch.Generator(device=device).manual_seed(row_seed)
        out.append(Row(prompt=row.to(device), plan=plan, max_new_tokens=max_new_tokens, eos=frozenset(eos),
                       warp=warp, generator=generator))
    return out


def _prepare(model, inputs, strategies, max_new_tokens, temperature, top_k, top_p, eos_token_id, tokenizer, seed,
             attention_mask, prefill_chunk, prefill_ranks):
    adapter.check_causal_lm(model)
    check_sampling(max_new_tokens, temperature, top_k, top_p)
    check_prefill_chunk(prefill_chunk)
    check_prefill_ranks(prefill_ranks)
    if prefill_ranks is not None and prefill_chunk is not None:
        raise ValueError("prefill_chunk and prefill_ranks: a prefill is either chunked here or run over ranks; "
                         "give one of them")
    if isinstance(prefill_ranks, PrefillRanks) and prefill_ranks.model is not model:
        raise ValueError("prefill_ranks: a PrefillRanks runs the model it was started with, not this one")
    plan = plan_strategies(build_strategies(strategies))
    plan.check(model)
    rows = _as_rows(inputs, tokenizer, attention_mask)
    eos = adapter.default_eos(model, tokenizer) if eos_token_id is None else (
        [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id))
    rows = make_rows(model, rows, plan, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                     top_p=top_p, eos=eos, seed=seed)
    ranks = shared_ranks(model, prefill_ranks) if isinstance(prefill_ranks, int) and prefill_ranks > 1 else (
        prefill_ranks if isinstance(prefill_ranks, PrefillRanks) else None)
    return rows, eos, ranks


@torch.inference_mode()
def generate(
    model: Any,
    inputs: torch.Tensor | Sequence[torch.Tensor] | str | Sequence[str],
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
    prefill_chunk: int | None = None,
    prefill_ranks: int | PrefillRanks | None = None,
) -> GenerateResult:
    """Generate with prompt compression and/or speculative decoding on one shared cache.

    Args:
        model: a transformers causal LM (``AutoModelForCausalLM``).
        inputs: LongTensor [batch, n] (left padding allowed with ``attention_mask``), a list
            of token-id rows of any lengths (1-D LongTensors or lists of ints), a prompt
            string, or a list of prompt strings (both need ``tokenizer``).
        strategies: strategy objects, ``"name:key=val"`` strings or mappings with a
            ``name`` key; ``[]`` is plain decoding, identical to ``model.generate`` greedy.
        max_new_tokens: tokens to generate per row at most.
        temperature: 0 for greedy; > 0 samples (losslessly with drafters unless a lossy
            acceptance rule is given). ``top_k`` / ``top_p`` as in transformers.
        eos_token_id: stop token(s); default the model's generation config.
        seed: seeds the sampler, so sampling is reproducible (row i uses ``seed + i``).
        max_draft_tokens: the most draft nodes a row verifies in one pass (None: up to
            ``accel.engine.MAX_DRAFT_PER_ROW``). Within that limit each step's drafts are
            sized from the measured cost table and each row's acceptance so far
            (:func:`accel.engine.draft_budgets`).
        prefill_chunk: prompt tokens per prefill forward (None: the whole prompt in one).
            Activation memory then follows the chunk, not the prompt; the cache, the
            compressors' selection and the output are those of one forward (within float
            tolerance; see docs/LONG_CONTEXT.md).
        prefill_ranks: run each prompt's prefill over this many processes (KV-Runahead,
            :mod:`accel.runahead`; None or 1: this one alone), each on an equal share of
            torch's threads; the helper processes start on first use (a few seconds) and
            are kept for later calls with the same model. Or a
            :class:`~accel.runahead.PrefillRanks` of your own. The cache, the compressors'
            selection and the output are those of a prefill in one process (within float
            tolerance; see docs/LONG_CONTEXT.md).

    All rows are decoded together, one verify forward per step for the whole batch (each
    row with its own cache entries, positions and draft tree), and every row's output is
    what it would be alone. ``result.row_stats`` has each row's own figures.
    """
    rows, eos, ranks = _prepare(model, inputs, strategies, max_new_tokens, temperature, top_k, top_p, eos_token_id,
                                tokenizer, seed, attention_mask, prefill_chunk, prefill_ranks)
    stats = run_batch(model, rows, max_draft=max_draft_tokens, prefill_chunk=prefill_chunk, prefill_ranks=ranks)
    outputs = [(r.prompt, r.prompt.new_tensor(r.generated)) for r in rows]
    sequences = _pad(outputs, pad_id(model, tokenizer, eos))
    text = None
    if tokenizer is not None:
        text = [tokenizer.decode(r.generated, skip_special_tokens=True) for r in rows]
    return GenerateResult(sequences=sequences, text=text, stats=stats, row_stats=[r.stats for r in rows])


def stream(
    model: Any,
    inputs: torch.Tensor | Sequence[torch.Tensor] | str | Sequence[str],
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
    prefill_chunk: int | None = None,
    prefill_ranks: int | PrefillRanks | None = None,
) -> Iterator[StreamDelta]:
    """:func:`generate`, yielding each row's newly accepted tokens as they are accepted.

    Yields :class:`StreamDelta` (row index, new token ids, their text when ``tokenizer`` is
    given, and whether the row finished). The arguments are those of :func:`generate`; the
    work runs in the calling thread, between the yields.
    """
    rows, _, ranks = _prepare(model, inputs, strategies, max_new_tokens, temperature, top_k, top_p, eos_token_id,
                              tokenizer, seed, attention_mask, prefill_chunk, prefill_ranks)
    index = {id(r): i for i, r in enumerate(rows)}
    texts = [TextStream(tokenizer) if tokenizer is not None else None for _ in rows]
    for pairs in batch_steps(model, rows, max_draft=max_draft_tokens, prefill_chunk=prefill_chunk,
                             prefill_ranks=ranks):
        for row, new in pairs:
            i = index[id(row)]
            if new or row.done:
                text = texts[i].push(new, final=row.done) if texts[i] is not None else None
                yield StreamDelta(i, list(new), text, row.done, row.finish_reason)


def pad_id(model: Any, tokenizer: Any, eos: list[int]) -> int:
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
