"""Draft-model speculative sampling (Leviathan et al. 2023; Chen et al. 2023, "Accelerating
Large Language Model Decoding with Speculative Sampling").

A small model of the same vocabulary drafts ``num_tokens`` tokens one after another; the
target verifies them in one pass. Greedy (``ctx.warp is None``): each draft is the draft
model's argmax, a point mass, and greedy acceptance keeps the output exact. Sampling: each
draft x_j is drawn from q_j = ``softmax(warp(draft logits))`` and q_j is recorded in
``DraftProposal.probs``, so the engine's rejection rule (:func:`accel.acceptance.sample_accept`:
accept with min(1, p(x)/q(x)), else resample from norm(max(p - q, 0))) is Chen et al.'s
lossless speculative sampling: every emitted token is distributed as the target's p.

The draft model keeps its own :class:`~accel.cache.SharedCache` in the per-request state
(optionally compressed by ``compress``, e.g. SnapKV); the verifier's cache is untouched.
Each step first brings the draft cache in line with the sequence: the entries of the draft
tokens the verifier accepted are kept (``commit(keep=...)``), the others dropped, and the
tokens the draft has not seen (the bonus token, and the last draft when all were accepted)
are fed before drafting on.

Drafts only propose, so their weights may be coarser than the target's: ``quantize="int8"``
drafts with an int8 copy of the draft model's linear layers (:mod:`accel.quant`), which on a
CPU roughly halves a draft step (bound by reading weights); ``"auto"``, the default, does so
where calibration measured it faster. Output stays exact either way.

Dynamic lookahead (``stop_below``, in the spirit of DISCO, Mamou et al. 2024, and of
transformers' ``assistant_confidence_threshold``): drafting stops after a draft whose
probability under the draft model (q_j(x_j); softmax of the raw logits when greedy) is
below the threshold, since later drafts are then unlikely to be accepted. The defaults,
up to 8 drafts and ``stop_below=0.3``, come from measurement on the Qwen2.5-Coder 0.5B / 1.5B
pair (``docs/BENCHMARKS.md``: 2.23x / 1.92x / 1.47x greedy decoding on code completion /
editing / chat, against 1.92x / 1.92x / 1.33x for a fixed 5 and 2.13x / 1.85x / 1.44x for a
fixed 8, with stop_below=0.6 about the same as 0.3). The engine's cost table may cut a draft
shorter still (:func:`accel.engine.draft_budgets`).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
from pydantic import ConfigDict, Field, field_serializer, field_validator

from accel import adapter, calibrate
from accel.acceptance import draw_from
from accel.cache import SharedCache
from accel.engine import prefill, verify
from accel.models import load_shared
from accel.quant import int8_copy
from accel.tree import DraftTree
from accel.strategy import DraftContext, DraftProposal, Drafter, PromptCompressor, Strategy, build_strategy, register

__all__ = ["DraftModel", "fit_vocab", "check_vocabularies"]


# --------------------------------------------------------------------------- shared models

# Tokenizers of in-memory models, by their checkpoint folder (for the vocabulary check).
# Draft models named by a strategy are loaded once per process by accel.models.load_shared.
_TOKENIZERS: dict[str, Any] = {}
_LOCK = threading.Lock()


def _tokenizer_of(model: Any) -> Any:
    """The tokenizer saved beside an in-memory model's checkpoint, or None."""
    from accel.models import _has_tokenizer_files

    path = getattr(model, "name_or_path", "") or ""
    if not path or not Path(path).is_dir() or not _has_tokenizer_files(Path(path)):
        return None
    key = str(Path(path).resolve())
    with _LOCK:
        if key not in _TOKENIZERS:
            from transformers import AutoTokenizer

            try:
                _TOKENIZERS[key] = AutoTokenizer.from_pretrained(key, local_files_only=True)
            except (OSError, ValueError):
                _TOKENIZERS[key] = None
        return _TOKENIZERS[key]


def _vocab_size(model: Any) -> int:
    return int(model.config.get_text_config(decoder=True).vocab_size)


def check_vocabularies(target: Any, draft: Any, target_tokenizer: Any = None, draft_tokenizer: Any = None,
                       samples: int = 512) -> None:
    """Raise ValueError unless ``draft`` speaks ``target``'s vocabulary.

    With both tokenizers known (given, or saved beside the models' checkpoints): same number
    of tokens and the same token strings on ``samples`` ids spread over the vocabulary plus
    its last 64 ids (the padded logits widths may then differ). Without them: the configs'
    vocabulary sizes must be equal.
    """
    target_tokenizer = target_tokenizer if target_tokenizer is not None else _tokenizer_of(target)
    draft_tokenizer = draft_tokenizer if draft_tokenizer is not None else _tokenizer_of(draft)
    vt, vd = _vocab_size(target), _vocab_size(draft)
    names = f"the draft model ({type(draft).__name__}, vocab_size={vd}) and the target ({type(target).__name__}, vocab_size={vt})"
    if target_tokenizer is None or draft_tokenizer is None:
        if vt != vd:
            raise ValueError(f"{names} have different vocabularies; a draft model must share the target's tokenizer")
        return
    nt, nd = len(target_tokenizer), len(draft_tokenizer)
    if nt != nd:
        raise ValueError(f"{names} have tokenizers of {nd} and {nt} tokens; a draft model must share the target's tokenizer")
    if nd > min(vt, vd):
        raise ValueError(f"{names}: the tokenizer has {nd} tokens, more than a model's logits cover")
    ids = sorted(set(torch.linspace(0, nt - 1, min(samples, nt)).long().tolist()) | set(range(max(0, nt - 64), nt)))
    a = target_tokenizer.convert_ids_to_tokens(ids)
    b = draft_tokenizer.convert_ids_to_tokens(ids)
    for i, x, y in zip(ids, a, b):
        if x != y:
            raise ValueError(f"{names} have different tokenizers: token {i} is {x!r} for the target but {y!r} "
                             f"for the draft; a draft model must share the target's tokenizer")


def fit_vocab(logits: torch.Tensor, width: int) -> torch.Tensor:
    """Draft logits [..., V_d] cut or padded (with -inf) to the target's width [..., width].

    The two models may pad their output layers to different widths beyond the shared
    tokenizer; ids past the tokenizer are never real tokens.
    """
    v = logits.shape[-1]
    if v == width:
        return logits
    if v > width:
        return logits[..., :width]
    pad = logits.new_full((*logits.shape[:-1], width - v), float("-inf"))
    return torch.cat([logits, pad], dim=-1)


# --------------------------------------------------------------------------- per request


@dataclass
class _State:
    """One request's draft model state.

    tokens: LongTensor [L], the sequence behind the draft cache's committed entries
        (L == cache.logical_length), on the target's device.
    pending: tokens of the entries appended since the last commit, in order: the first
        fed token of the last draft step, then every draft but the last.
    """

    model: Any
    cache: SharedCache | None
    tokens: torch.Tensor
    width: int  # the target's logits width
    pending: list[int] = field(default_factory=list)


@register
class DraftModel(Drafter):
    """A small model of the same vocabulary drafts a chain of ``num_tokens`` tokens.

    Lossless: greedy output is exactly the target's greedy output, and sampling draws every
    token from the target's distribution (Chen et al.'s rejection over the recorded q).

    ``model`` is a loaded causal LM, or a name / path for :func:`accel.load_model`
    (``"qwen2.5-coder-0.5b-instruct"``, a checkpoint folder, ...) loaded on first use, once
    per process, in the target's dtype and device. ``spec()`` of a strategy holding a loaded
    model names it by its ``name_or_path``.
    """

    model_config = ConfigDict(arbitrary_types_allowed=True)

    name: ClassVar[str] = "draft_model"

    model: Any = Field(description="the draft model: a loaded causal LM, or a name or path for accel.load_model")
    num_tokens: int = Field(8, ge=1, description="draft tokens per step at most (the engine's budget may cut it)")
    compress: PromptCompressor | None = Field(
        None, description="prompt compressor for the draft model's own cache (a strategy, a mapping or a spec string)"
    )
    stop_below: float | None = Field(
        0.3, gt=0, lt=1, description="stop drafting after a draft whose draft probability is below this (None: never)"
    )
    quantize: Literal["auto", "int8", "none"] = Field(
        "auto", description="the draft model's linear weights: int8, none (as loaded), or auto (int8 where "
        "calibration measured a step faster with it on this machine; none with ACCEL_CALIBRATION=off)"
    )

    @field_validator("model", mode="before")
    @classmethod
    def _check_model(cls, value: Any) -> Any:
        if isinstance(value, os.PathLike):
            value = os.fspath(value)
        if isinstance(value, str):
            from accel.models import PACKAGED_MODELS

            if not value:
                raise ValueError("needs a model name or path")
            known = value == "default" or value.lower() in PACKAGED_MODELS or Path(value).expanduser().exists()
            if not known and (value.startswith((".", "/", "~")) or value.count("/") != 1):
                raise ValueError(
                    f"{value!r} is neither a named model ('default', {', '.join(PACKAGED_MODELS)}), an existing "
                    "path, nor a hub id (org/name) of the local Hugging Face cache"
                )
            return value
        adapter.check_causal_lm(value)
        return value

    @field_validator("compress", mode="before")
    @classmethod
    def _build_compressor(cls, value: Any) -> Any:
        if value is None:
            return None
        if isinstance(value, (str, dict)):
            value = build_strategy(value, where="compress: ")
        if not isinstance(value, Strategy) or not value.compresses_prompt:
            what = getattr(value, "name", None) or type(value).__name__
            raise ValueError(f"needs a prompt compressor (snapkv, ada_snapkv, streaming_llm, h2o), got {what!r}")
        return value

    @field_serializer("model")
    def _dump_model(self, value: Any) -> str:
        if isinstance(value, str):
            return value
        return getattr(value, "name_or_path", "") or f"<{type(value).__name__}>"

    @field_serializer("compress")
    def _dump_compress(self, value: Any) -> Any:
        return None if value is None else value.spec()

    def __repr_args__(self):
        for key, value in super().__repr_args__():
            yield key, (self._dump_model(value) if key == "model" else value)

    # ------------------------------------------------------------------ models

    def resolve(self, target: Any) -> tuple[Any, Any]:
        """``(draft model as it drafts, its tokenizer or None)``: a named model is loaded in
        the target's dtype on its device, then given int8 weights per ``quantize`` (a copy;
        the loaded model is untouched)."""
        if isinstance(self.model, str):
            param = next(target.parameters())
            draft, tokenizer = load_shared(self.model, param.dtype, param.device)
        else:
            draft, tokenizer = self.model, None
        if self.quantize == "int8" or (self.quantize == "auto" and calibrate.prefer_int8(draft)):
            try:
                draft = int8_copy(draft)
            except ValueError as err:
                raise ValueError(f"draft_model quantize='int8': {err}") from None
        return draft, tokenizer

    def check(self, model: Any) -> None:
        """Before the prefill: load the draft model and refuse one whose vocabulary is not the
        target's (ValueError)."""
        draft, tokenizer = self.resolve(model)
        check_vocabularies(model, draft, draft_tokenizer=tokenizer)

    # ------------------------------------------------------------------ drafting

    @torch.inference_mode()
    def start(self, model: Any, prompt: torch.Tensor) -> _State:
        self.check(model)
        draft, _ = self.resolve(model)
        state = _State(draft, None, prompt[:0], _vocab_size(model))
        self._prefill(state, prompt)
        return state

    def _prefill(self, state: _State, tokens: torch.Tensor) -> None:
        """A fresh draft cache holding ``tokens`` [n] (compressed if configured)."""
        geo = adapter.geometry(state.model)
        state.cache = SharedCache(geo.num_layers)
        state.pending = []
        device = geo.device
        prefill(state.model, state.cache, self._ids(state, tokens.tolist()).unsqueeze(0).to(device), self.compress)
        state.tokens = tokens.clone()

    @torch.inference_mode()
    def propose(self, state: _State, ctx: DraftContext) -> DraftProposal | None:
        tokens = ctx.tokens
        self._sync(state, tokens)
        count = min(self.num_tokens, ctx.max_tokens)
        if count <= 0:
            return None
        feed = tokens[state.cache.logical_length :].tolist()  # the root at least
        drafts: list[int] = []
        probs: list[torch.Tensor] = []
        for j in range(count):
            logits = fit_vocab(self._forward(state, feed).to(tokens.device), state.width)  # [V]
            if ctx.warp is None:
                x = int(logits.argmax())
                confidence = float(torch.softmax(logits, -1)[x]) if self.stop_below is not None else 1.0
            else:
                q = torch.softmax(ctx.warp(logits.unsqueeze(0)), dim=-1)[0]  # [V]
                x = draw_from(None, q, ctx.generator, j + 1)
                probs.append(q)
                confidence = float(q[x]) if self.stop_below is not None else 1.0
            drafts.append(x)
            if self.stop_below is not None and confidence < self.stop_below:
                break
            feed = [x]
        out = torch.tensor(drafts, dtype=torch.long, device=tokens.device)
        return DraftProposal(tokens=out, parents=torch.arange(len(drafts), device=tokens.device),
                             probs=torch.stack(probs) if probs else None)

    def _sync(self, state: _State, tokens: torch.Tensor) -> None:
        """Bring the draft cache in line with ``tokens`` [n] (the sequence, pending root last):
        keep the appended entries whose tokens the sequence continued with, drop the rest."""
        cache = state.cache
        seen = cache.logical_length
        if tokens.numel() <= seen or not torch.equal(tokens[:seen], state.tokens):
            # Not a continuation of what the draft saw (the caller rewrote the sequence).
            self._prefill(state, tokens[:-1])
            return
        tail = tokens[seen:].tolist()
        keep = 0
        # the last token (the root) is always fed again: its logits are what drafting needs
        while keep < min(len(state.pending), len(tail) - 1) and state.pending[keep] == tail[keep]:
            keep += 1
        cache.commit(keep=list(range(keep)), advance=keep)
        state.pending = []
        state.tokens = tokens[: seen + keep].clone()

    def _forward(self, state: _State, feed: list[int]) -> torch.Tensor:
        """Append ``feed`` to the draft cache (uncommitted); the logits after its last token, [V_d]."""
        cache = state.cache
        device = adapter.geometry(state.model).device
        ids = self._ids(state, feed).to(device)
        tree = DraftTree.chain(int(ids[0]), ids[1:], device=device)
        hidden = verify(state.model, cache, tree, adapter.geometry(state.model).dtype)
        state.pending += feed
        return adapter.output_logits(state.model, hidden[-1])

    @staticmethod
    def _ids(state: _State, tokens: list[int]) -> torch.Tensor:
        """Token ids for the draft's embedding. An id past the draft's vocabulary (a padded
        id of a wider target) becomes 0: it only makes the drafts after it worse."""
        limit = _vocab_size(state.model)
        return torch.tensor([t if t < limit else 0 for t in tokens], dtype=torch.long)
