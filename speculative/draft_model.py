"""Draft-model speculative sampling (Leviathan et al. 2023; Chen et al. 2023, "Accelerating
Large Language Model Decoding with Speculative Sampling").

A small model of the same vocabulary drafts ``num_tokens`` tokens one after another; the
target verifies them in one pass. Greedy (``ctx.warp is None``): each draft is the draft
model's argmax, a point mass, and greedy acceptance keeps the output exact. Sampling: each
draft x_j is drawn from q_j = ``softmax(warp(draft logits))`` and q_j is recorded in
``DraftProposal.probs``, so the engine's rejection rule (:func:`accel.acceptance.sample_accept`:
accept with min(1, p(x)/q(x)), else resample from norm(max(p - q, 0))) is Chen et al.'s
lossless speculative sampling: every emitted token is distributed as the target's p.

The draft model keeps its own :class:`~accel.cache.SharedCache` (optionally compressed by
``compress``, e.g. SnapKV); the verifier's cache is untouched. The rows of a batch that draft
with the same draft model share one batched draft cache, so each draft forward feeds every
row at once (:meth:`DraftModel.propose_batch`): drafting k tokens for B rows costs about k
forwards of B rows, not B x k forwards of one. Every fed token is committed at once; each step
first brings a row in line with the sequence: the entries of the longest prefix it shares with
the sequence are kept, the rejected drafts are cut off (:meth:`SharedCache.cut`), and the
tokens the draft has not seen (the bonus token, and the last draft when all were accepted)
are fed before drafting on.

Drafts only propose, so their weights may be coarser than the target's: ``quantize="int8"``
drafts with an int8 copy of the draft model's linear layers (:mod:`accel.kernels.quant`), which on a
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
from pydantic import ConfigDict, Field, field_serializer, field_validator

from accel import adapter

from accel.calibration import calibrate
from accel.acceptance import draw_from
from accel.cache import SharedCache
from accel.steps import prefill, verify
from accel.models import load_shared
from accel.kernels.quant import int8_copy
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
    from accel.models import has_tokenizer_files

    path = getattr(model, "name_or_path", "") or ""
    if not path or not Path(path).is_dir() or not has_tokenizer_files(Path(path)):
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


def _ids(draft: Any, tokens: list[int]) -> torch.Tensor:
    """Token ids for the draft's embedding, LongTensor [n]. An id past the draft's vocabulary
    (a padded id of a wider target) becomes 0: it only makes the drafts after it worse."""
    limit = _vocab_size(draft)
    return torch.tensor([t if t < limit else 0 for t in tokens], dtype=torch.long)


# --------------------------------------------------------------------------- per request

@dataclass(eq=False)
class _State:
    """One request's draft model state: a row of a :class:`_Rows` cache.

    tokens: LongTensor [L], the sequence behind the row's cache entries (L is the row's
        logical length: the prompt, the emitted tokens, the drafts fed since).
    floor: tokens of the row's draft prefill (its entries may be compressed: never cut).
    width: the target's logits width.
    """

    model: Any
    rows: "_Rows"
    tokens: torch.Tensor
    floor: int
    width: int
    released: bool = False


class _Rows:
    """The draft rows of requests that draft together: one batched :class:`SharedCache`
    whose row b belongs to ``members[b]``, so one draft forward serves every row.

    Requests admitted together start in one group (one prefill forward for all,
    :meth:`DraftModel.start_batch`); a batched step merges the groups of the rows it drafts
    for (one copy of each joining row: requests admitted later); a request that leaves the
    batch releases its row (the last row moves into its slot).
    """

    def __init__(self, model: Any, keep_behind: int) -> None:
        self.model = model
        geo = adapter.geometry(model)
        self.dtype, self.device = geo.dtype, geo.device
        self.cache = SharedCache(geo.num_layers, adapter.layer_windows(model))
        self.cache.keep_behind = keep_behind  # rejected drafts are cut off: at most num_tokens
        self.cache.row_capacity = 16
        self.members: list[_State] = []

    def row(self, state: _State) -> int | None:
        """``state``'s row in the cache, or None if it has none here."""
        return next((i for i, s in enumerate(self.members) if s is state), None)

    def join(self, states: list[_State], cache: SharedCache) -> None:
        """Add the rows of ``cache`` (nothing uncommitted), row b being ``states[b]``'s."""
        self.cache.extend(cache)
        self.members += states
        for state in states:
            state.rows = self

    def absorb(self, other: "_Rows") -> None:
        """Move every row of ``other`` into this group."""
        if other.model is not self.model:
            raise ValueError("rows of different draft models cannot draft together")
        self.cache.extend(other.cache)
        self.cache.keep_behind = max(self.cache.keep_behind, other.cache.keep_behind)
        for state in other.members:
            state.rows = self
        self.members += other.members
        other.members = []

    def leave(self, state: _State) -> None:
        """Remove ``state``'s row (if it has one here)."""
        i = self.row(state)
        if i is None:
            return
        self.cache.remove(i)
        last = self.members.pop()
        if last is not state:
            self.members[i] = last

    def forward(self, feeds: list[list[int] | None]) -> torch.Tensor:
        """Append each row's ``feeds[b]`` (a chain of draft-vocabulary ids; None: nothing)
        and commit them; the draft logits after each fed row's last token, [F, V_d] (fed
        rows in row order). One forward for every row (rows without a feed take a dummy
        token whose entry is dropped)."""
        cache = self.cache
        trees = [DraftTree.chain(f[0], f[1:], device=self.device) if f else DraftTree.root_only(0, device=self.device)
                 for f in feeds]
        try:
            hidden = verify(self.model, cache, trees, self.dtype)  # [B, T, H]
        except BaseException:
            if cache.pending_entries:
                cache.rollback()
            raise
        cache.commit([list(range(len(f))) if f else [] for f in feeds])
        fed = [b for b, f in enumerate(feeds) if f]
        last = hidden[torch.tensor(fed, device=hidden.device), torch.tensor([len(feeds[b]) - 1 for b in fed],
                                                                            device=hidden.device)]
        return adapter.output_logits(self.model, last)


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
            raise ValueError(f"needs a prompt compressor (snapkv, ada_snapkv, streaming_llm, h2o, fastgen), got {what!r}")
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
        return self.start_batch(model, [prompt])[0]

    @torch.inference_mode()
    def start_batch(self, model: Any, prompts: list[torch.Tensor]) -> list[_State]:
        """Prefill the draft model over every prompt [n_b] in one forward: the rows of one
        draft cache, which then draft together."""
        self.check(model)
        draft, _ = self.resolve(model)
        rows = _Rows(draft, self.num_tokens)
        states = [_State(draft, rows, p.clone(), int(p.numel()), _vocab_size(model)) for p in prompts]
        rows.join(states, self._prefilled(draft, prompts))
        return states

    @torch.inference_mode()
    def release(self, state: _State) -> None:
        if not state.released:
            state.released = True
            state.rows.leave(state)

    def _prefilled(self, draft: Any, prompts: list[torch.Tensor]) -> SharedCache:
        """A fresh draft cache holding ``prompts`` (compressed if configured), one row each."""
        geo = adapter.geometry(draft)
        fresh = SharedCache(geo.num_layers, adapter.layer_windows(draft))
        prefill(draft, fresh, [_ids(draft, p.tolist()).to(geo.device) for p in prompts], self.compress)
        return fresh

    def _prefill(self, state: _State, tokens: torch.Tensor) -> None:
        """Give ``state`` a fresh row holding ``tokens`` [n], in the group it belongs to."""
        state.rows.leave(state)
        state.rows.join([state], self._prefilled(state.model, [tokens]))
        state.tokens, state.floor = tokens.clone(), int(tokens.numel())

    @torch.inference_mode()
    def propose(self, state: _State, ctx: DraftContext) -> DraftProposal | None:
        return self.propose_batch([state], [ctx])[0]

    @torch.inference_mode()
    def propose_batch(self, states: list[_State], ctxs: list[DraftContext]) -> list[DraftProposal | None]:
        """Draft every row's chain together: each draft forward feeds all rows at once (the
        rows' first feeds ragged, then one token per row still drafting), so drafting for B
        rows costs about as many forwards as drafting for one."""
        counts = [min(self.num_tokens, c.max_tokens) for c in ctxs]
        live = [i for i, n in enumerate(counts) if n > 0 and not states[i].released]
        out: list[DraftProposal | None] = [None] * len(states)
        if not live:
            return out
        rows = states[live[0]].rows
        for i in live[1:]:
            if states[i].rows is not rows:
                rows.absorb(states[i].rows)
        first = {i: self._sync(states[i], ctxs[i].tokens) for i in live}  # may re-prefill a row
        where = {i: rows.row(states[i]) for i in live}
        feeds: list[list[int] | None] = [None] * len(rows.members)
        for i in live:
            feeds[where[i]] = _ids(states[i].model, first[i]).tolist()
        drafts: dict[int, list[int]] = {i: [] for i in live}
        probs: dict[int, list[torch.Tensor]] = {i: [] for i in live}
        active = sorted(live, key=where.get)  # the order of the rows' logits
        while active:
            logits = rows.forward(feeds)  # [A, V_d]
            for i in active:  # the fed tokens are committed: the states follow at once
                fed = drafts[i][-1:] if drafts[i] else first[i]
                states[i].tokens = torch.cat([states[i].tokens, states[i].tokens.new_tensor(fed)])
            feeds = [None] * len(rows.members)
            still = []
            for j, i in enumerate(active):
                state, ctx = states[i], ctxs[i]
                x, confidence, q = self._pick(fit_vocab(logits[j].to(ctx.tokens.device), state.width), ctx,
                                              len(drafts[i]) + 1)
                drafts[i].append(x)
                if q is not None:
                    probs[i].append(q)
                if len(drafts[i]) < counts[i] and (self.stop_below is None or confidence >= self.stop_below):
                    feeds[where[i]] = _ids(state.model, [x]).tolist()
                    still.append(i)
            active = still
        for i in live:
            device = ctxs[i].tokens.device
            out[i] = DraftProposal(tokens=torch.tensor(drafts[i], dtype=torch.long, device=device),
                                   parents=torch.arange(len(drafts[i]), device=device),
                                   probs=torch.stack(probs[i]) if probs[i] else None)
        return out

    def _pick(self, logits: torch.Tensor, ctx: DraftContext, node: int) -> tuple[int, float, torch.Tensor | None]:
        """One draft from draft logits [V]: (token, its draft probability, q [V] or None).
        Greedy: the argmax (a point mass, q None). Sampling: a draw from q = softmax(warp(logits))."""
        if ctx.warp is None:
            x = int(logits.argmax())
            confidence = float(torch.softmax(logits, -1)[x]) if self.stop_below is not None else 1.0
            return x, confidence, None
        q = torch.softmax(ctx.warp(logits.unsqueeze(0)), dim=-1)[0]  # [V]
        x = draw_from(None, q, ctx.generator, node)
        return x, float(q[x]), q

    def _sync(self, state: _State, tokens: torch.Tensor) -> list[int]:
        """Bring the state's row in line with ``tokens`` [n] (the sequence, pending root last):
        keep the entries of the longest common prefix, cut the rest (rejected drafts), and
        return the tokens still to feed (at least the root: its logits are what drafting
        needs). A sequence that departs from the row inside its prefill (the caller rewrote
        it), or further back than a sliding window's slack, gets a fresh prefill."""
        seen = state.tokens
        n = min(seen.numel(), tokens.numel() - 1)
        same = torch.eq(seen[:n], tokens[:n])
        common = n if bool(same.all()) else int((~same).nonzero()[0])
        if common >= state.floor and common < seen.numel():
            cache, row = state.rows.cache, state.rows.row(state)
            lengths = list(cache.logical_lengths)
            lengths[row] = common
            try:
                cache.cut(lengths)
                state.tokens = seen[:common]
            except ValueError:  # more than a sliding window's slack: prefill again
                common = -1
        if common < state.floor:
            self._prefill(state, tokens[:-1])
            common = tokens.numel() - 1
        return tokens[common:].tolist()
