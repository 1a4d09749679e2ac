"""Running the grid: configurations x task items x repeats, warmed up and interleaved.

What is measured (all wall-clock, ``time.perf_counter``, under ``torch.inference_mode``):

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
- ``peak_rss_mib``: the process's peak resident memory during the call (the kernel's
  high-water mark, reset before each call; a sampling thread where that is not possible),
  model weights included. ``peak_gpu_mib`` on CUDA: ``torch.cuda.max_memory_allocated``.
- KV bytes: accel's own count of kept vs full entries; baselines keep everything
  (``prompt + new - 1`` entries of ``adapter.geometry(model).entry_bytes()``).

Order: one untimed warm-up per configuration on the first item (its prompt cut to its last
``WARMUP_PROMPT`` tokens: a warm-up loads and initialises, it need not repeat a long prefill),
then for each repeat r and
item i every configuration once, in the configuration order rotated by ``r + i`` so slow
drift of a shared machine spreads over all configurations.

Batched grid (``batch_sizes`` other than ``[1]``, :func:`run_batched_grid`): for each task and
batch size B the task's items form groups of B (:func:`make_groups`); for each repeat r and
group g every configuration that takes B rows runs the group once (one batched call, see
:mod:`.batched`), in the order rotated by ``r + g``. One results row per (group,
configuration, repeat), with the call's aggregate figures and a ``rows`` list of per-row
figures; exactness and agreement per row are against the reference's row in the same group.

Arrivals (:func:`run_arrivals`): per repeat, every configuration with a service form serves
the same requests at the same times, rotated by the repeat; one results row each.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
import zlib
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from .. import adapter
from ..kernels.cpu import is_prepacked, is_transposed
from ..strategy import Strategy, build_strategies
from . import batched as bt
from .batched import BatchMeasurement, cut_at_eos, percentile, sync_device
from .schema import (Arrivals, Experiment, HFAssisted, HFGenerate, HFGenerateBatch, HFGenerateUnpacked, HFPromptLookup,
                     KVPressSnapKV)
from .tasks import TaskItem, score

__all__ = [
    "Configuration",
    "Measurement",
    "build_configurations",
    "run_grid",
    "run_batched_grid",
    "run_arrivals",
    "make_groups",
    "PeakMemory",
]


@dataclass
class Measurement:
    """One timed generation."""

    new_ids: list[int]
    prefill_s: float
    decode_s: float
    e2e_s: float
    decode_tokens: int  # tokens after the first one(s) that came with the prefill
    verify_steps: int
    accepted_per_step: list[int]
    kv_bytes_full: int
    kv_bytes_kept: int

    @property
    def decode_tok_s(self) -> float | None:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 and self.decode_tokens else None

    @property
    def mean_accepted(self) -> float | None:
        """Tokens per verify step, bonus included (1.0 for plain decoding)."""
        if not self.verify_steps:
            return None
        return (sum(self.accepted_per_step) + self.verify_steps) / self.verify_steps


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


# --------------------------------------------------------------------------- memory


class PeakMemory:
    """Peak resident memory (MiB) of this process during a ``with`` block.

    Linux: resets the kernel's high-water mark (``/proc/self/clear_refs``) and reads
    ``VmHWM`` afterwards. Elsewhere, or if that is refused, a thread samples ``psutil``'s RSS
    every 5 ms.
    """

    def __init__(self) -> None:
        self.peak_mib: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._samples: list[int] = []

    @staticmethod
    def _hwm_kib() -> int | None:
        try:
            with open("/proc/self/status") as fh:
                for line in fh:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1])
        except OSError:
            return None
        return None

    @staticmethod
    def _reset_hwm() -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as fh:
                fh.write("5")
            return True
        except OSError:
            return False

    def __enter__(self) -> "PeakMemory":
        self._kernel = self._reset_hwm() and self._hwm_kib() is not None
        if not self._kernel:
            import psutil

            proc = psutil.Process()

            def sample() -> None:
                while not self._stop.is_set():
                    self._samples.append(proc.memory_info().rss)
                    self._stop.wait(0.005)

            self._thread = threading.Thread(target=sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._kernel:
            kib = self._hwm_kib()
            self.peak_mib = kib / 1024 if kib is not None else None
        else:
            self._stop.set()
            assert self._thread is not None
            self._thread.join()
            self.peak_mib = max(self._samples) / 2**20 if self._samples else None


# --------------------------------------------------------------------------- configurations


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
        timer = bt.ChunkTimer()  # one token per step for greedy, accepted drafts + 1 for prompt lookup
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
               sampling: Sampling = Sampling()) -> Callable[[TaskItem, int], Measurement]:
    import accel

    geo = adapter.geometry(model)

    def run(item: TaskItem, max_new_tokens: int) -> Measurement:
        ids = item.input_ids.to(geo.device)
        sync_device(geo.device)
        t0 = time.perf_counter()
        sampled = {} if sampling.greedy else {"temperature": sampling.temperature, "top_p": sampling.top_p,
                                               "seed": sampling.item_seed(item)}
        result = accel.generate(model, ids, strategies=strategies, max_new_tokens=max_new_tokens,
                                eos_token_id=eos, max_draft_tokens=max_draft, **sampled)
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
        row = bt.RowResult(new_ids=m.new_ids, first_token_s=m.prefill_s, latency_s=m.e2e_s,
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
            impl, why = bt.cb_probe(model, eos, pad, b)
            batch = bt.cb_batch(model, eos, pad, b)
            configs.append(Configuration(
                b.name, "baseline", f"transformers continuous batching (model.generate_batch; arrivals: "
                f"init_continuous_batching + add_request), attention {impl or 'none'}, page_size {b.page_size}, "
                f"max_batch_tokens {b.max_batch_tokens}", False, _single(batch), why,
                batch=batch, serve=bt.cb_arrivals(model, eos, pad, b)))
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
            _accel_run(model, strategies, eos, max_draft, sampling),
            batch=bt.accel_batched(model, strategies, eos, pad, max_draft),
            serve=bt.accel_arrivals(model, strategies, eos, max_draft)))
    return configs


# --------------------------------------------------------------------------- the grid


def _agreement(out: list[int], ref: list[int]) -> float:
    """Fraction of the reference's tokens that ``out`` reproduces as a common prefix."""
    if not ref:
        return 1.0 if not out else 0.0
    n = 0
    for a, b in zip(out, ref):
        if a != b:
            break
        n += 1
    return n / len(ref)


def _schedule(configs: list[Configuration], items: list[TaskItem], repeats: int) -> Iterator[tuple[int, int, list[Configuration]]]:
    runnable = [c for c in configs if c.unavailable is None]
    for r in range(repeats):
        for i in range(len(items)):
            k = (r + i) % len(runnable) if runnable else 0
            yield r, i, runnable[k:] + runnable[:k]


@contextmanager
def _progress(total: int, quiet: bool) -> Iterator[Callable[[str, int], None]]:
    if quiet:
        yield lambda desc, advance: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TimeRemainingColumn(), console=Console(stderr=True), transient=False) as progress:
        tid = progress.add_task("bench", total=total)

        def update(desc: str, advance: int) -> None:
            progress.update(tid, description=desc, advance=advance)

        yield update


def run_grid(
    experiment: Experiment,
    model: Any,
    tokenizer: Any,
    configs: list[Configuration],
    items: list[TaskItem],
    results_path: Path,
    quiet: bool = False,
) -> list[dict[str, Any]]:
    """Warm up, run the interleaved grid, append one row per run to ``results_path``."""
    gen = experiment.generation
    device = adapter.geometry(model).device
    runnable = [c for c in configs if c.unavailable is None]
    warm = runnable if experiment.warmup_tokens > 0 and items else []
    total = len(warm) + experiment.repeats * len(items) * len(runnable)
    names = {c.name for c in runnable}
    rows: list[dict[str, Any]] = []

    with torch.inference_mode(), _progress(total, quiet) as step, open(results_path, "w", encoding="utf-8") as out:
        for c in warm:
            step(f"warm-up {c.name}", 0)
            try:
                c.generate(_warmup_item(items[0]), min(experiment.warmup_tokens, gen.max_new_tokens))
            except Exception:
                pass  # the timed runs record the error
            step(f"warm-up {c.name}", 1)

        for r, i, order in _schedule(configs, items, experiment.repeats):
            item = items[i]
            group: dict[str, dict[str, Any]] = {}
            outputs: dict[str, list[int]] = {}
            for c in order:
                step(f"r{r} {item.task}/{item.item_id} {c.name}", 0)
                row = _row(experiment, c, item, r)
                try:
                    if device.type == "cuda":
                        torch.cuda.reset_peak_memory_stats(device)
                    with PeakMemory() as mem:
                        m = c.generate(item, gen.max_new_tokens)
                    row.update(_measured(m, mem, device, tokenizer, item))
                    outputs[c.name] = m.new_ids
                except Exception as err:  # record and go on: one failure must not lose the grid
                    row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
                group[c.name] = row
                step(f"r{r} {item.task}/{item.item_id} {c.name}", 1)
            # sampled outputs are draws, not a reference to match: they are not compared
            ref = outputs.get(experiment.reference) if experiment.reference in names and gen.temperature == 0 else None
            for name, row in group.items():
                if name in outputs and ref is not None:
                    row["agreement"] = _agreement(outputs[name], ref)
                    row["exact"] = outputs[name] == ref
            for c in configs:  # file order, so results.jsonl reads the same whatever the rotation
                if c.name in group:
                    out.write(json.dumps(group[c.name]) + "\n")
                    rows.append(group[c.name])
            out.flush()
    return rows


WARMUP_PROMPT = 256


def _warmup_item(item: TaskItem) -> TaskItem:
    """``item`` with its prompt cut to its last :data:`WARMUP_PROMPT` tokens."""
    if item.prompt_tokens <= WARMUP_PROMPT:
        return item
    return replace(item, input_ids=item.input_ids[:, -WARMUP_PROMPT:])


def _row(experiment: Experiment, c: Configuration, item: TaskItem, repeat: int) -> dict[str, Any]:
    return {
        "experiment": experiment.name, "config": c.name, "config_kind": c.kind, "strategies": c.spec,
        "precision": c.precision or experiment.precision, "drafts": c.drafts, "task": item.task, "kind": item.kind, "item": item.item_id, "repeat": repeat,
        "meta": item.meta, "prompt_tokens": item.prompt_tokens, "new_tokens": None, "prefill_s": None,
        "decode_s": None, "decode_tok_s": None, "e2e_s": None, "verify_steps": None, "mean_accepted": None,
        "accepted_per_step": None, "kv_bytes_kept": None, "kv_bytes_full": None, "peak_rss_mib": None,
        "peak_gpu_mib": None, "correct": None, "score": None, "agreement": None, "exact": None, "text": None,
        "error": None,
    }


def _measured(m: Measurement, mem: PeakMemory, device: torch.device, tokenizer: Any, item: TaskItem) -> dict[str, Any]:
    text = tokenizer.decode(m.new_ids, skip_special_tokens=True)
    correct, sc = score(item, text)
    return {
        "new_tokens": len(m.new_ids), "prefill_s": m.prefill_s, "decode_s": m.decode_s,
        "decode_tok_s": m.decode_tok_s, "e2e_s": m.e2e_s, "verify_steps": m.verify_steps,
        "mean_accepted": m.mean_accepted, "accepted_per_step": m.accepted_per_step,
        "kv_bytes_kept": m.kv_bytes_kept, "kv_bytes_full": m.kv_bytes_full, "peak_rss_mib": mem.peak_mib,
        "peak_gpu_mib": torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None,
        "correct": correct, "score": sc, "text": text,
    }


# --------------------------------------------------------------------------- batched grid


@dataclass
class Group:
    """B items of one task that run as one batched call."""

    task: str
    kind: str
    batch_size: int
    index: int  # within (task, batch size)
    items: list[TaskItem]


def make_groups(items: list[TaskItem], batch_sizes: list[int]) -> list[Group]:
    """For each task (file order) and batch size (as listed): the task's N items in
    ``ceil(N / B)`` groups of B consecutive items, cycling through the task's items to fill the
    last group (so a task with fewer than B items makes one group, its items repeated)."""
    groups = []
    for task in dict.fromkeys(i.task for i in items):
        its = [i for i in items if i.task == task]
        for b in batch_sizes:
            for g in range(math.ceil(len(its) / b)):
                groups.append(Group(task, its[0].kind, b, g, [its[(g * b + j) % len(its)] for j in range(b)]))
    return groups


def _error(err: BaseException) -> str:
    return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"


def _batch_row(experiment: Experiment, c: Configuration, task: str, kind: str, batch_size: int, group: int,
               items: list[TaskItem], repeat: int, mode: str) -> dict[str, Any]:
    return {
        "experiment": experiment.name, "mode": mode, "config": c.name, "config_kind": c.kind, "strategies": c.spec,
        "precision": c.precision or experiment.precision, "drafts": c.drafts, "task": task, "kind": kind, "batch_size": batch_size, "group": group,
        "items": [i.item_id for i in items], "repeat": repeat, "prompt_tokens": sum(i.prompt_tokens for i in items),
        "new_tokens": None, "e2e_s": None, "tok_s": None, "prefill_s": None, "decode_s": None, "decode_tokens": None,
        "decode_tok_s": None, "latency_mean_s": None, "latency_p50_s": None, "latency_p95_s": None,
        "ttft_mean_s": None, "ttft_p50_s": None, "ttft_p95_s": None, "verify_steps": None, "mean_accepted": None,
        "kv_bytes_kept": None, "kv_bytes_full": None, "peak_rss_mib": None, "peak_gpu_mib": None,
        "overhead_s": None, "failures": None, "exact_rows": None, "compared_rows": None, "agreement": None,
        "rows": [], "error": None,
    }


def _mean_of(xs: list[float | None]) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _batch_measured(m: BatchMeasurement, mem: PeakMemory, device: torch.device, tokenizer: Any,
                    items: list[TaskItem]) -> dict[str, Any]:
    per = []
    for item, r in zip(items, m.rows):
        text = tokenizer.decode(r.new_ids, skip_special_tokens=True)
        correct, sc = score(item, text) if r.error is None else (None, None)
        steps = r.verify_steps
        per.append({
            "item": item.item_id, "prompt_tokens": item.prompt_tokens, "new_tokens": len(r.new_ids),
            "first_token_s": r.first_token_s, "latency_s": r.latency_s, "verify_steps": steps,
            "mean_accepted": (sum(r.accepted_per_step) + steps) / steps if steps else None,
            "kv_bytes_kept": r.kv_bytes_kept, "kv_bytes_full": r.kv_bytes_full, "correct": correct, "score": sc,
            "exact": None, "agreement": None, "text": text, "error": r.error,
        })
    ok = [p for p in per if p["error"] is None]
    lat = [p["latency_s"] for p in ok]
    ttft = [p["first_token_s"] for p in ok]
    steps = sum(r.verify_steps for r in m.rows)
    accepted = sum(sum(r.accepted_per_step) for r in m.rows)
    return {
        "new_tokens": m.new_tokens, "e2e_s": m.e2e_s, "tok_s": m.new_tokens / m.e2e_s if m.e2e_s > 0 else None,
        "prefill_s": m.prefill_s, "decode_s": m.decode_s, "decode_tokens": m.decode_tokens,
        "decode_tok_s": m.decode_tokens / m.decode_s if m.decode_s and m.decode_tokens else None,
        "latency_mean_s": _mean_of(lat), "latency_p50_s": percentile(lat, 50), "latency_p95_s": percentile(lat, 95),
        "ttft_mean_s": _mean_of(ttft), "ttft_p50_s": percentile(ttft, 50), "ttft_p95_s": percentile(ttft, 95),
        "verify_steps": steps, "mean_accepted": (accepted + steps) / steps if steps else None,
        "kv_bytes_kept": sum(r.kv_bytes_kept for r in m.rows), "kv_bytes_full": sum(r.kv_bytes_full for r in m.rows),
        "peak_rss_mib": mem.peak_mib,
        "peak_gpu_mib": torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None,
        "overhead_s": m.overhead_s, "failures": len(per) - len(ok), "rows": per,
    }


def _compare_rows(group: dict[str, dict[str, Any]], reference: str) -> None:
    """Per-row exactness and agreement against the reference's row at the same position."""
    ref = group.get(reference)
    if ref is None or ref["error"] or not ref["rows"]:
        return
    for row in group.values():
        if row["error"] or not row["rows"]:
            continue
        compared = []
        for mine, theirs in zip(row["rows"], ref["rows"]):
            if mine["error"] or theirs["error"]:
                continue
            mine["exact"] = mine["_ids"] == theirs["_ids"]
            mine["agreement"] = _agreement(mine["_ids"], theirs["_ids"])
            compared.append(mine)
        row["exact_rows"] = sum(r["exact"] for r in compared)
        row["compared_rows"] = len(compared)
        row["agreement"] = _mean_of([r["agreement"] for r in compared])


def _timed_batch(call: Callable[[], BatchMeasurement], row: dict[str, Any], device: torch.device, tokenizer: Any,
                 items: list[TaskItem]) -> None:
    """Run ``call`` under PeakMemory and fill ``row`` (or its error)."""
    try:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        with PeakMemory() as mem:
            m = call()
        row.update(_batch_measured(m, mem, device, tokenizer, items))
        for r, result in zip(row["rows"], m.rows):
            r["_ids"] = result.new_ids  # for the comparison; not written
    except Exception as err:  # record and go on
        row["error"] = _error(err)


def _write_group(out: Any, configs: list[Configuration], group: dict[str, dict[str, Any]], reference: str,
                 rows: list[dict[str, Any]]) -> None:
    _compare_rows(group, reference)
    for c in configs:  # file order, whatever the rotation
        if c.name in group:
            row = group[c.name]
            for r in row["rows"]:
                r.pop("_ids", None)
            out.write(json.dumps(row) + "\n")
            rows.append(row)
    out.flush()


def _cycled(items: list[TaskItem], n: int) -> list[TaskItem]:
    return [items[k % len(items)] for k in range(n)]


def run_batched_grid(
    experiment: Experiment,
    model: Any,
    tokenizer: Any,
    configs: list[Configuration],
    items: list[TaskItem],
    results_path: Path,
    quiet: bool = False,
) -> list[dict[str, Any]]:
    """Warm up, run every group with every configuration that takes its batch size, in
    rotated order; append one row per (group, configuration, repeat) to ``results_path``."""
    gen = experiment.generation
    device = adapter.geometry(model).device
    groups = make_groups(items, experiment.batch_sizes)
    takers = {b: [c for c in configs if c.takes(b)] for b in experiment.batch_sizes}
    warm = [c for c in configs if c.takes(1)] if experiment.warmup_tokens > 0 and items else []
    total = len(warm) + experiment.repeats * sum(len(takers[g.batch_size]) for g in groups)
    first = [i for i in items if i.task == items[0].task] if items else []
    rows: list[dict[str, Any]] = []

    with torch.inference_mode(), _progress(total, quiet) as step, open(results_path, "a", encoding="utf-8") as out:
        for c in warm:  # a batch of two where it can, so batched code paths are warm too
            step(f"warm-up {c.name}", 0)
            try:
                c.batch(_cycled(first, 2 if c.takes(2) else 1), min(experiment.warmup_tokens, gen.max_new_tokens))
            except Exception:
                pass  # the timed runs record the error
            step(f"warm-up {c.name}", 1)

        for r in range(experiment.repeats):
            for gi, g in enumerate(groups):
                runnable = takers[g.batch_size]
                k = (r + gi) % len(runnable) if runnable else 0
                group: dict[str, dict[str, Any]] = {}
                for c in runnable[k:] + runnable[:k]:
                    desc = f"r{r} {g.task} B={g.batch_size} #{g.index} {c.name}"
                    step(desc, 0)
                    row = _batch_row(experiment, c, g.task, g.kind, g.batch_size, g.index, g.items, r, "batch")
                    _timed_batch(lambda: c.batch(g.items, gen.max_new_tokens), row, device, tokenizer, g.items)
                    group[c.name] = row
                    step(desc, 1)
                _write_group(out, configs, group, experiment.reference, rows)
    return rows


def arrival_items(experiment: Experiment, items: list[TaskItem]) -> list[TaskItem]:
    """The arrivals' requests: the task's items in order, cycled to ``arrivals.requests``."""
    arrivals = experiment.arrivals
    assert arrivals is not None
    task = arrivals.task or experiment.task_name(0)
    return _cycled([i for i in items if i.task == task], arrivals.requests)


def run_arrivals(
    experiment: Experiment,
    model: Any,
    tokenizer: Any,
    configs: list[Configuration],
    items: list[TaskItem],
    results_path: Path,
    quiet: bool = False,
) -> list[dict[str, Any]]:
    """Every configuration with a service form serves the same requests at the same times
    (order rotated per repeat); one row each per repeat, appended to ``results_path``."""
    arrivals = experiment.arrivals
    assert arrivals is not None
    gen = experiment.generation
    device = adapter.geometry(model).device
    requests = arrival_items(experiment, items)
    servers = [c for c in configs if c.unavailable is None and c.serve is not None]
    warm = servers if experiment.warmup_tokens > 0 else []
    total = len(warm) + experiment.repeats * len(servers)
    max_batch = arrivals.max_batch or arrivals.requests
    rows: list[dict[str, Any]] = []

    with torch.inference_mode(), _progress(total, quiet) as step, open(results_path, "a", encoding="utf-8") as out:
        for c in warm:
            step(f"warm-up {c.name} (arrivals)", 0)
            try:
                c.serve(requests[:2], Arrivals(requests=2, interval_s=0.0, max_batch=2),
                        min(experiment.warmup_tokens, gen.max_new_tokens))
            except Exception:
                pass
            step(f"warm-up {c.name} (arrivals)", 1)
        for r in range(experiment.repeats):
            k = r % len(servers) if servers else 0
            group: dict[str, dict[str, Any]] = {}
            for c in servers[k:] + servers[:k]:
                desc = f"r{r} arrivals {len(requests)} x {arrivals.interval_s:g}s {c.name}"
                step(desc, 0)
                row = _batch_row(experiment, c, requests[0].task, requests[0].kind, max_batch, 0, requests, r, "arrivals")
                row.update(requests=arrivals.requests, interval_s=arrivals.interval_s)
                _timed_batch(lambda: c.serve(requests, arrivals, gen.max_new_tokens), row, device, tokenizer, requests)
                group[c.name] = row
                step(desc, 1)
            _write_group(out, configs, group, experiment.reference, rows)
    return rows


def machine_info(model: Any, experiment: Experiment) -> dict[str, Any]:
    """What the run ran on, for summary.md and results."""
    import platform

    import transformers

    from ..models import DEFAULT_MODEL_NAME

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    info = {
        "platform": platform.platform(), "cpu": cpu, "cpu_count": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "python": platform.python_version(), "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
        "transformers": transformers.__version__, "device": str(adapter.geometry(model).device),
        "gpu": torch.cuda.get_device_name(adapter.geometry(model).device)
        if adapter.geometry(model).device.type == "cuda" else None,
        "model": experiment.model, "model_class": type(model).__name__,
        "model_name": DEFAULT_MODEL_NAME if experiment.model == "default" else (getattr(model.config, "name_or_path", "") or ""),
        "parameters": _parameters(model), "dtype": experiment.dtype,
        "quantize": None if experiment.quantize is None else str(experiment.quantize),
        "precisions": list(experiment.precisions),
        "prepacked": is_prepacked(model), "transposed": is_transposed(model),
    }
    return info


def _parameters(model: Any) -> int:
    """The model's parameter count, quantized weights included (held as buffers)."""
    from ..kernels.lowbit import quantization_of

    quant = quantization_of(model)
    return sum(p.numel() for p in model.parameters()) + (quant.weights if quant is not None else 0)
