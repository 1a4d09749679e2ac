"""The configurations of an experiment: HF baselines and accel runs, each a named way to
generate (:class:`Configuration`), built by :func:`build_configurations`.

What each one times (all wall-clock, ``time.perf_counter``, under ``torch.inference_mode``):

- accel runs (``accel.generate``): ``prefill_s`` and ``decode_s`` come from
  :class:`accel.engine.Stats` (prefill = prompt forward + first token; decode = every verify
  step after it); ``decode_tok_s = stats.decode_tokens / stats.decode_s``; ``e2e_s`` is the
  whole ``accel.generate`` call.
- HF baselines (``model.generate``): ``e2e_s`` is the whole call. A streamer timestamps
  the first new token(s): ``prefill_s`` is the time from the call to that moment (for
  ``hf_prompt_lookup`` and ``hf_assisted`` the first forward also verifies the first draft,
  as transformers merges them), ``decode_s = e2e_s - prefill_s`` and ``decode_tok_s`` counts the tokens
  after the first ones. Each later streamer chunk is one verify step, which gives
  ``accepted_per_step`` (chunk length - 1) for prompt lookup and assisted generation too.
- KV bytes: accel's own count of kept vs full entries; baselines keep everything
  (``prompt + new - 1`` entries of ``adapter.geometry(model).entry_bytes()``).

A configuration's batched and arrivals forms come from :mod:`.batched` and
:mod:`.continuous_batching`.
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass, replace
from typing import Any, Callable

import torch

from .. import adapter
from ..strategy import Strategy, build_strategies
from . import batched as bt
from . import continuous_batching as cb
from .measurement import BatchMeasurement, ChunkTimer, Measurement, RowResult, cut_at_eos, sync_device
from .schema import (Arrivals, Experiment, HFAssisted, HFGenerate, HFGenerateBatch, HFGenerateUnpacked, HFPromptLookup,
                     KVPressSnapKV)
from .tasks import TaskItem

__all__ = ["Configuration", "Sampling", "build_configurations", "load_models"]


@dataclass
class Configuration:
    """A named way to generate: an HF baseline or an accel run.

    ``generate`` runs one item; ``batch`` a list of items in one call (at most ``max_batch``
    of them, None: any number; ``batch_note`` says why not more); ``serve`` requests arriving
    over time (``serve_note``: why it has none).
    """

    name: str
    kind: str  # "baseline" | "run"
    spec: str  # human-readable strategies / call
    drafts: bool
    generate: Callable[[TaskItem, int], Measurement] | None
    unavailable: str | None = None  # why it cannot run here, or None
    batch: Callable[[list[TaskItem], int], BatchMeasurement] | None = None
    max_batch: int | None = None
    batch_note: str | None = None
    serve: Callable[[list[TaskItem], Arrivals, int], BatchMeasurement] | None = None
    serve_note: str | None = None
    precision: str | None = None  # the model's dtype or quantization (``Experiment.precisions``)

    def takes(self, batch_size: int) -> bool:
        """Whether a batched call of ``batch_size`` rows runs here."""
        return (self.unavailable is None and self.batch is not None
                and (self.max_batch is None or batch_size <= self.max_batch))


def _plain_kernels(model: Any, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` run with ``model``'s linear layers on plain kernels, row-major and unpacked
    (:func:`accel.calibration.timing.linear_kernels`; the swap, a few module references and, on a model
    with transposed weights, a copy of them, is outside the call's timing)."""
    from accel.calibration.timing import linear_kernels

    def run(*args: Any, **kwargs: Any) -> Any:
        with linear_kernels(model) as use:
            use("plain")
            return fn(*args, **kwargs)

    return run


@dataclass(frozen=True)
class Sampling:
    """The experiment's sampling settings (temperature 0: greedy) and the seed of each item."""

    temperature: float = 0.0
    top_p: float | None = None
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def item_seed(self, item: TaskItem) -> int:
        """The seed of an item's runs: the same for every configuration and repeat."""
        return (self.seed * 1_000_003 + zlib.crc32(f"{item.task}/{item.item_id}".encode())) % 2**31

    def call_text(self) -> str:
        """How the baselines' ``model.generate`` calls sample, for the configuration table."""
        if self.greedy:
            return "do_sample=False"
        return f"do_sample=True, temperature={self.temperature}" + (
            f", top_p={self.top_p}" if self.top_p is not None else "")

    def hf(self) -> dict[str, Any]:
        if self.greedy:
            return {"do_sample": False}
        out = {"do_sample": True, "temperature": self.temperature, "top_k": 0, "repetition_penalty": 1.0}
        return out | ({"top_p": self.top_p} if self.top_p is not None else {})


def _hf_generate(model: Any, eos: list[int], pad: int, extra: dict[str, Any],
                 sampling: Sampling = Sampling()) -> Callable[[TaskItem, int], Measurement]:
    geo = adapter.geometry(model)

    def run(item: TaskItem, max_new_tokens: int) -> Measurement:
        ids = item.input_ids.to(geo.device)
        timer = ChunkTimer()  # one token per step for greedy, accepted drafts + 1 for prompt lookup
        if not sampling.greedy:
            torch.manual_seed(sampling.item_seed(item))
        sync_device(geo.device)
        timer.start()
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
            eos_token_id=eos or None, pad_token_id=pad, streamer=timer, **sampling.hf(), **extra,
        )
        sync_device(geo.device)
        e2e = time.perf_counter() - timer.t0
        new = cut_at_eos(out[0, ids.shape[1]:].tolist(), eos)
        first_t, first_n = timer.chunks[0] if timer.chunks else (e2e, len(new))
        later = timer.chunks[1:]
        entries = ids.shape[1] + max(len(new) - 1, 0)
        return Measurement(
            new_ids=new, prefill_s=first_t, decode_s=e2e - first_t, e2e_s=e2e,
            decode_tokens=max(len(new) - first_n, 0), verify_steps=len(later),
            accepted_per_step=[n - 1 for _, n in later],
            kv_bytes_full=geo.entry_bytes() * entries, kv_bytes_kept=geo.entry_bytes() * entries,
        )

    return run


def _kvpress(model: Any, eos: list[int], pad: int, spec: KVPressSnapKV) -> tuple[Callable | None, str | None]:
    """kvpress's SnapKVPress around ``model.generate`` (same timing as the HF baselines).

    Optional: kvpress 0.5.5 needs transformers < 5.3 and imports ``datasets``; where it does
    not import, the baseline is reported unavailable with the reason.
    """
    try:
        from kvpress import SnapKVPress
    except Exception as err:  # ImportError, or an incompatible transformers API
        return None, f"kvpress does not import here ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})"
    geo = adapter.geometry(model)
    plain = _hf_generate(model, eos, pad, {})

    def run(item: TaskItem, max_new_tokens: int) -> Measurement:
        n = item.prompt_tokens
        ratio = max(0.0, 1.0 - spec.budget / n)
        press = SnapKVPress(compression_ratio=ratio, window_size=spec.window, kernel_size=spec.kernel)
        with press(model):
            m = plain(item, max_new_tokens)
        kept = min(spec.budget, n) + max(len(m.new_ids) - 1, 0)
        m.kv_bytes_kept = geo.entry_bytes() * kept
        return m

    return run, None


def _hf_assisted(model: Any, eos: list[int], pad: int, spec: HFAssisted,
                 sampling: Sampling = Sampling()) -> tuple[Callable | None, str | None]:
    """transformers' assisted generation with the draft model ``spec.model`` (the same shared
    object an accel ``draft_model`` run of that name drafts with); unavailable, with the
    reason, when the draft model is not on this machine."""
    from ..models import ModelNotAvailableError, load_shared

    geo = adapter.geometry(model)
    try:
        draft, _ = load_shared(spec.model, geo.dtype, geo.device)
    except ModelNotAvailableError as err:
        return None, f"draft model {spec.model!r} is not available: {str(err).splitlines()[0]}"
    extra = {
        "assistant_model": draft,
        "num_assistant_tokens": spec.num_tokens,
        "num_assistant_tokens_schedule": spec.schedule,
        "assistant_confidence_threshold": spec.confidence_threshold,
    }
    return _hf_generate(model, eos, pad, extra, sampling), None


def _accel_run(model: Any, strategies: list[Strategy], eos: list[int], max_draft: int | None,
               sampling: Sampling = Sampling(), prefill_chunk: int | None = None
               ) -> Callable[[TaskItem, int], Measurement]:
    import accel

    geo = adapter.geometry(model)

    def run(item: TaskItem, max_new_tokens: int) -> Measurement:
        ids = item.input_ids.to(geo.device)
        sync_device(geo.device)
        t0 = time.perf_counter()
        sampled = {} if sampling.greedy else {"temperature": sampling.temperature, "top_p": sampling.top_p,
                                               "seed": sampling.item_seed(item)}
        result = accel.generate(model, ids, strategies=strategies, max_new_tokens=max_new_tokens,
                                eos_token_id=eos, max_draft_tokens=max_draft, prefill_chunk=prefill_chunk,
                                **sampled)
        sync_device(geo.device)
        e2e = time.perf_counter() - t0
        st = result.stats
        return Measurement(
            new_ids=result.sequences[0, ids.shape[1]:].tolist(), prefill_s=st.prefill_s, decode_s=st.decode_s,
            e2e_s=e2e, decode_tokens=st.decode_tokens, verify_steps=st.verify_steps,
            accepted_per_step=list(st.accepted_per_step), kv_bytes_full=st.kv_bytes_full, kv_bytes_kept=st.kv_bytes_kept,
        )

    return run


def _spec_text(strategies: list[Strategy]) -> str:
    if not strategies:
        return "accel, plain decoding"
    parts = []
    for s in strategies:
        fields = ",".join(f"{k}={v}" for k, v in s.model_dump().items() if v is not None)
        parts.append(f"{s.name}:{fields}" if fields else s.name)
    return " + ".join(parts)


def _one_row(generate: Callable[[TaskItem, int], Measurement]) -> Callable[[list[TaskItem], int], BatchMeasurement]:
    """A one-item ``generate`` as a batched call of one row."""

    def run(items: list[TaskItem], max_new_tokens: int) -> BatchMeasurement:
        (item,) = items
        m = generate(item, max_new_tokens)
        row = RowResult(new_ids=m.new_ids, first_token_s=m.prefill_s, latency_s=m.e2e_s,
                           kv_bytes_kept=m.kv_bytes_kept, kv_bytes_full=m.kv_bytes_full,
                           verify_steps=m.verify_steps, accepted_per_step=m.accepted_per_step)
        return BatchMeasurement(rows=[row], e2e_s=m.e2e_s, prefill_s=m.prefill_s, decode_s=m.decode_s,
                                decode_tokens=m.decode_tokens)

    return run


def _single(batch: Callable[[list[TaskItem], int], BatchMeasurement]) -> Callable[[TaskItem, int], Measurement]:
    """A batched call as a one-item ``generate``."""

    def run(item: TaskItem, max_new_tokens: int) -> Measurement:
        m = batch([item], max_new_tokens)
        (row,) = m.rows
        if row.error:
            raise RuntimeError(row.error)
        first = row.first_token_s if row.first_token_s is not None else m.e2e_s
        return Measurement(
            new_ids=row.new_ids, prefill_s=first, decode_s=m.e2e_s - first, e2e_s=m.e2e_s,
            decode_tokens=max(len(row.new_ids) - 1, 0), verify_steps=row.verify_steps,
            accepted_per_step=row.accepted_per_step, kv_bytes_full=row.kv_bytes_full, kv_bytes_kept=row.kv_bytes_kept,
        )

    return run


_NO_SERVICE = "no service form: it runs one call at a time"


def build_precision_configurations(experiment: Experiment, models: list[tuple[str, Any]],
                                   tokenizer: Any) -> list[Configuration]:
    """:func:`build_configurations` for each ``(precision, model)``, each named
    ``NAME@PRECISION`` where ``experiment.precisions`` lists several (else as they are)."""
    configs = []
    for precision, model in models:
        for c in build_configurations(experiment, model, tokenizer):
            name = f"{c.name}@{precision}" if experiment.precisions else c.name
            configs.append(replace(c, name=name, precision=precision))
    return configs


def build_configurations(experiment: Experiment, model: Any, tokenizer: Any) -> list[Configuration]:
    """Baselines first, then runs, in file order."""
    eos = adapter.default_eos(model, tokenizer)
    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is None:
        pad = getattr(model.generation_config, "pad_token_id", None)
    if pad is None:
        pad = eos[0] if eos else 0
    gen = experiment.generation
    max_draft = gen.max_draft_tokens
    sampling = Sampling(gen.temperature, gen.top_p, experiment.seed)
    verb = sampling.call_text()
    configs = []
    for b in experiment.baselines:
        if isinstance(b, HFGenerate):
            configs.append(Configuration(
                b.name, "baseline", f"model.generate({verb}); batched: left padding + attention mask; "
                "arrivals: static batches", False, _hf_generate(model, eos, pad, {}, sampling),
                batch=bt.hf_generate_batched(model, eos, pad), serve=bt.hf_static_batches(model, eos, pad)))
        elif isinstance(b, HFGenerateUnpacked):
            configs.append(Configuration(
                b.name, "baseline", f"model.generate({verb}) on plain (unpacked) linear kernels; batched: left "
                "padding + attention mask; arrivals: static batches", False,
                _plain_kernels(model, _hf_generate(model, eos, pad, {}, sampling)),
                batch=_plain_kernels(model, bt.hf_generate_batched(model, eos, pad)),
                serve=_plain_kernels(model, bt.hf_static_batches(model, eos, pad))))
        elif isinstance(b, HFPromptLookup):
            extra = {"prompt_lookup_num_tokens": b.num_tokens, "max_matching_ngram_size": b.max_ngram}
            fn = _hf_generate(model, eos, pad, extra, sampling)
            configs.append(Configuration(
                b.name, "baseline",
                f"model.generate({verb}, prompt_lookup_num_tokens={b.num_tokens}, "
                f"max_matching_ngram_size={b.max_ngram})", True, fn, batch=_one_row(fn), max_batch=1,
                batch_note="transformers' assisted generation takes one row per call", serve_note=_NO_SERVICE))
        elif isinstance(b, HFGenerateBatch):
            impl, why = cb.cb_probe(model, eos, pad, b)
            batch = cb.cb_batch(model, eos, pad, b)
            configs.append(Configuration(
                b.name, "baseline", f"transformers continuous batching (model.generate_batch; arrivals: "
                f"init_continuous_batching + add_request), attention {impl or 'none'}, page_size {b.page_size}, "
                f"max_batch_tokens {b.max_batch_tokens}", False, _single(batch), why,
                batch=batch, serve=cb.cb_arrivals(model, eos, pad, b)))
        elif isinstance(b, HFAssisted):
            fn, why = _hf_assisted(model, eos, pad, b, sampling)
            configs.append(Configuration(
                b.name, "baseline", f"model.generate({verb}, assistant_model={b.model}, "
                f"num_assistant_tokens={b.num_tokens}, num_assistant_tokens_schedule={b.schedule}, "
                f"assistant_confidence_threshold={b.confidence_threshold})", True, fn, why,
                batch=_one_row(fn) if fn is not None else None, max_batch=1,
                batch_note="transformers' assisted generation takes one row per call", serve_note=_NO_SERVICE))
        elif isinstance(b, KVPressSnapKV):
            fn, why = _kvpress(model, eos, pad, b)
            configs.append(Configuration(
                b.name, "baseline", f"kvpress SnapKVPress(budget={b.budget}, window_size={b.window}, "
                f"kernel_size={b.kernel}) + model.generate", False, fn, why,
                batch=_one_row(fn) if fn is not None else None, max_batch=1,
                batch_note="run one row per call here (the press scores every row's padded prompt)",
                serve_note=_NO_SERVICE))
    for name, specs in experiment.runs.items():
        strategies = build_strategies(specs)
        configs.append(Configuration(
            name, "run", _spec_text(strategies), any(s.drafts for s in strategies),
            _accel_run(model, strategies, eos, max_draft, sampling, gen.prefill_chunk),
            batch=bt.accel_batched(model, strategies, eos, pad, max_draft, gen.prefill_chunk),
            serve=bt.accel_arrivals(model, strategies, eos, max_draft, gen.prefill_chunk)))
    return configs


# --------------------------------------------------------------------------- the grid


def load_models(experiment: Experiment, model: Any, tokenizer: Any) -> tuple[list[tuple[str, Any]], Any]:
    """``[(precision, model)]``: one model of ``dtype`` / ``quantize``, or one per entry of
    ``precisions``; loaded, or made from a given ``model`` (a copy per precision: cast, or
    quantized with :func:`accel.kernels.lowbit.quantize_model`). Also the tokenizer."""
    import copy

    from ..dtypes import DTYPES
    from ..kernels.compiled import enable as enable_compiled
    from ..kernels.lowbit import quantization_of, quantize_model

    wanted = experiment.precisions or [experiment.precision]
    if model is not None:
        made = [(experiment.precision, model)]
        if not experiment.precisions:
            if experiment.quantize is not None and quantization_of(model) is None:
                made = [(experiment.precision, quantize_model(copy.deepcopy(model), experiment.quantize))]
        else:
            made = []
            for p in wanted:
                twin = copy.deepcopy(model)
                made.append((p, twin.to(DTYPES[p]) if p in DTYPES else quantize_model(twin, p)))
        for _, m in made:
            enable_compiled(m, experiment.compile)
        return made, tokenizer
    from ..models import load_model

    device = torch.device(experiment.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {experiment.device!r}: CUDA is not available on this machine")
    models = []
    for p in wanted:
        dtype, quantize = (p, None) if p in DTYPES else (experiment.dtype, p)
        loaded, loaded_tok = load_model(experiment.model, dtype=dtype, device=device, prepack=experiment.prepack,
                                        compile=experiment.compile, quantize=quantize)
        tokenizer = tokenizer if tokenizer is not None else loaded_tok
        models.append((p, loaded))
    return models, tokenizer
