"""Timing verify passes: the measurements behind a :class:`~accel.calibration.cost_model.CostTable`.

Plain functions: :func:`filled_cache` fills a cache with a forward over random ids,
:func:`time_pass` times verify passes over it (milliseconds of each), :func:`linear_kernels`
switches a model between plain, transposed and packed linear layers for a block, and
:func:`measure` puts them together into a table (each point's fastest pass).
:func:`accel.calibration.calibrate.cost_table` caches the result.

Measuring swaps the model's linear layers and puts them back; do not run it while the model
serves requests.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from typing import Callable, Iterator

import torch

from .. import adapter
from ..kernels import invariance
from ..cache import SharedCache
from .cost_model import KERNELS, CostTable, chosen_kernels, monotone, packed_rows, split_rows, weight_layout
from ..kernels.cpu import (PackedLinear, is_prepacked, is_transposed, packable_dtypes, prepack, prepack_available, transpose_weights, unprepack,
                  untranspose_weights)

__all__ = ["DEFAULT_BATCH_ROWS", "DEFAULT_BATCH_TOKENS", "DEFAULT_CACHE_LENS", "DEFAULT_TOKENS", "filled_cache", "linear_kernels",
           "measure", "time_pass"]

#: Query tokens per pass of the measured grid.
DEFAULT_TOKENS = (1, 2, 4, 8, 16, 32, 64)
#: Cached entries of the measured grid.
DEFAULT_CACHE_LENS = (256, 2048)
#: Rows and tokens per row of the batch passes measured beside the grid (CostTable.batch_ms).
DEFAULT_BATCH_ROWS = (4, 8)
DEFAULT_BATCH_TOKENS = (1, 2, 4)


@contextmanager
def linear_kernels(model) -> Iterator[Callable[[str], None]]:
    """Inside the block, ``use(kernel)`` runs ``model``'s linear layers on one of
    :data:`~accel.calibration.cost_model.KERNELS`: ``"plain"`` (row-major weights, ``F.linear``, as
    transformers runs them), ``"transposed"`` (column-major weights,
    :func:`accel.kernels.cpu.transpose_weights`), ``"packed"`` (:func:`accel.kernels.cpu.prepack`, for
    every pass whatever its window was) or ``"split"`` (:func:`accel.kernels.cpu.split_linear` on
    row-major weights, for every pass). Modules are swapped by reference (the weights are
    packed on entry, and again when a layout change made the packed copies stale); on exit the
    model is as it was: the same modules, windows and weight layout.

    Yields ``use``. A model that cannot be packed stays unpacked whatever ``use`` is told.
    """
    was_packed, was_transposed = is_prepacked(model), is_transposed(model)
    other = prepack if not was_packed else unprepack
    before = _linears(model)
    windows = {n: (m.min_rows, m.max_rows, m.split_rows) for n, m in before.items() if isinstance(m, PackedLinear)}
    other(model)
    after = _linears(model)
    names = [n for n in before if before[n] is not after.get(n, before[n])]
    packed_mods, plain_mods = (before, after) if was_packed else (after, before)

    def swap(packed: bool) -> None:
        chosen = packed_mods if packed else plain_mods
        for name in names:
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, chosen[name])

    def use(kernel: str) -> None:
        if kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
        swap(kernel in ("packed", "split"))
        if kernel != "packed":  # (packed kernels read their own copy: any layout will do)
            (transpose_weights if kernel == "transposed" else untranspose_weights)(model)
        for m in packed_mods.values():
            if isinstance(m, PackedLinear):
                m.min_rows, m.max_rows = 1, None  # packed means packed for every pass, whatever the window was
                m.split_rows = _EVERY_PASS if kernel == "split" else 0
                m.refresh()  # packed again if a layout change made the copy stale

    try:
        yield use
    finally:
        swap(was_packed)
        (transpose_weights if was_transposed else untranspose_weights)(model)
        for name, (lo, hi, split) in windows.items():
            before[name].min_rows, before[name].max_rows, before[name].split_rows = lo, hi, split


_EVERY_PASS = 1 << 62  # split_rows that covers any pass


def _linears(model) -> dict[str, torch.nn.Module]:
    return {n: m for n, m in model.named_modules() if isinstance(m, (torch.nn.Linear, PackedLinear))}


def filled_cache(model, length: int, seed: int = 0, rows: int = 1) -> SharedCache:
    """A :class:`~accel.cache.SharedCache` holding ``length`` committed entries in each of
    ``rows`` rows, from a forward over random ids (their values do not matter for timing)."""
    geo = adapter.geometry(model)
    vocab = model.config.get_text_config(decoder=True).vocab_size
    ids = torch.randint(0, vocab, (rows, length), generator=torch.Generator().manual_seed(seed)).to(geo.device)
    positions = torch.arange(length, device=geo.device).unsqueeze(0).expand(rows, length)
    cache = SharedCache(geo.num_layers)
    cache.kv_align = invariance.kv_align(model)  # laid out as the engine lays out its caches
    cache.ordered = invariance.ordered(model)
    with torch.inference_mode():
        adapter.backbone_forward(model, ids, positions, cache)
    cache.commit(advance=length)
    return cache


def time_pass(model, cache: SharedCache, tokens: int, repeats: int, warmup: int = 1) -> list[float]:
    """Milliseconds of ``repeats`` verify passes of ``tokens`` query tokens per row of
    ``cache`` (after ``warmup`` untimed ones): ids [B, T], position ids [B, T] after each
    row's entries (every row as long as the first), a chain of drafts (causal among the new
    tokens), the output head on every token, run as a verify pass runs
    (:func:`accel.steps.forward_tokens`: with ordered attention where ``cache.ordered``, which
    in bf16 costs a tree more than sdpa would). The entries appended are rolled back each time."""
    from ..steps import forward_tokens

    geo = adapter.geometry(model)
    vocab = model.config.get_text_config(decoder=True).vocab_size
    rows, start = cache.batch_size, cache.logical_lengths[0]
    ids = torch.randint(0, vocab, (rows, tokens), generator=torch.Generator().manual_seed(tokens)).to(geo.device)
    positions = torch.arange(start, start + tokens, device=geo.device).unsqueeze(0).expand(rows, tokens)
    chain = torch.ones(rows, tokens, tokens, dtype=torch.bool, device=geo.device).tril() if tokens > 1 else None
    times = []
    with torch.inference_mode(), adapter.packed_gqa_attention(model):
        for i in range(warmup + repeats):
            _sync(geo.device)
            start = time.perf_counter()
            hidden = forward_tokens(model, cache, ids, positions, chain, geo.dtype)
            adapter.output_logits(model, hidden.reshape(-1, hidden.shape[-1]))
            _sync(geo.device)
            if i >= warmup:
                times.append((time.perf_counter() - start) * 1e3)
            cache.rollback()
    return times


def measure(
    model,
    tokens: tuple[int, ...] = DEFAULT_TOKENS,
    cache_lens: tuple[int, ...] = DEFAULT_CACHE_LENS,
    repeats: int = 3,
    budget_s: float = 20.0,
    batch_rows: tuple[int, ...] = DEFAULT_BATCH_ROWS,
    batch_tokens: tuple[int, ...] = DEFAULT_BATCH_TOKENS,
) -> CostTable:
    """Measure a :class:`CostTable` for ``model`` (no cache files involved).

    Every point of the grid ``tokens`` x ``cache_lens`` is timed with each linear kernel of
    :func:`linear_kernels` the model can run (on a float32 CPU model: plain, transposed, and
    packed and split where :func:`accel.kernels.cpu.prepack_available`; on a bf16 CPU model (a
    quantized one's bf16 output layer included) plain and packed where
    :func:`accel.kernels.cpu.packable_dtypes` has bf16; elsewhere plain only), in
    alternating rounds so that all see the same machine load. The weight layout
    (:func:`accel.calibration.cost_model.weight_layout`), the window where packed kernels beat it
    (:func:`accel.calibration.cost_model.packed_rows`) and the passes where split ones beat both
    (:func:`accel.calibration.cost_model.split_rows`) decide which kernels each token count runs with, and
    the grid keeps those times, made non-decreasing in both axes (see :func:`accel.calibration.cost_model.monotone`).

    Each point is the fastest of ``1 + repeats`` passes, the first after a warm-up: a busy
    machine only ever adds time to a pass, so the fastest is the least disturbed (with a median
    of two, one burst decided between close kernels). Once ``budget_s`` seconds have gone no
    further round starts, but the first two always run (filling the caches is not bounded).
    With three kernels (before the split one), on the 2-core Intel Xeon, the default model took
    ~22 s, a 0.5B model ~50 s and a 1.5B one ~155 s; with the four, on the 2-core AMD EPYC
    (Zen 3), the default model took 30 s (25 s with three, the same hour). Cache lengths are
    capped so every pass fits the model's positions.

    Then, with the kernels so chosen, passes of ``batch_rows`` rows x ``batch_tokens`` tokens
    per row over the first cache length in every row (:attr:`CostTable.batch_ms`: what a
    batch's verify pass costs beyond one row's pass of as many tokens), fastest of ``1 +
    repeats`` alternating rounds; ``batch_rows=()`` skips them.
    """
    start = time.perf_counter()
    load = _load_average()
    tokens = tuple(sorted(set(tokens)))
    cache_lens = _fit_positions(model, cache_lens, max(tokens))
    caches = [filled_cache(model, n, seed=i) for i, n in enumerate(cache_lens)]
    param = next(model.parameters())
    names = ["plain"]
    if param.device.type == "cpu" and param.dtype == torch.float32:  # what accel.load_model applies
        names.append("transposed")
        if prepack_available():
            names += ["packed", "split"]  # (the split kernel runs inside packed layers)
    elif param.device.type == "cpu" and param.dtype in packable_dtypes():  # bf16 on a CPU with bf16 instructions
        names.append("packed")
    points = [(c, t) for c in range(len(caches)) for t in range(len(tokens))]
    samples: dict[str, dict] = {name: {p: [] for p in points} for name in names}
    with linear_kernels(model) as use:
        # the kernels' passes alternate, so a load that comes and goes hits all alike
        for round_ in range(1 + max(1, repeats)):
            if round_ > 1 and time.perf_counter() - start >= budget_s:
                break
            for name in names:
                use(name)
                for c, t in points:
                    samples[name][(c, t)] += time_pass(model, caches[c], tokens[t], repeats=1,
                                                       warmup=1 if round_ == 0 else 0)
        kernel_ms = {name: tuple(tuple(min(samples[name][(c, t)]) for t in range(len(tokens)))
                                 for c in range(len(caches))) for name in names}
        window, layout, split = packed_rows(tokens, kernel_ms), weight_layout(kernel_ms), split_rows(tokens, kernel_ms)
        chosen = chosen_kernels(tokens, layout, window, split)
        batch_rows = tuple(sorted({r for r in batch_rows if r >= 2}))
        batch_tokens = tuple(sorted({t for t in batch_tokens if t >= 1}))
        batch_ms: tuple[tuple[float, ...], ...] = ()
        if batch_rows and batch_tokens:
            del caches  # (the one-row caches: memory for the batch's)
            batch_ms = _batch_passes(model, use, batch_rows, batch_tokens, cache_lens[0], repeats,
                                     lambda n: chosen_kernels((n,), layout, window, split)[0])
    ms = [[kernel_ms[chosen[t]][c][t] for t in range(len(tokens))] for c in range(len(cache_lens))]
    return CostTable(tokens=tokens, cache_lens=cache_lens, ms=monotone(ms), kernel_tokens=tokens,
                     kernel_ms=kernel_ms, measured=True, seconds=round(time.perf_counter() - start, 2),
                     load=_max(load, _load_average()), batch_rows=batch_rows if batch_ms else (),
                     batch_tokens=batch_tokens if batch_ms else (), batch_ms=batch_ms,
                     batch_cache=cache_lens[0] if batch_ms else 0)


def _batch_passes(model, use: Callable[[str], None], rows: tuple[int, ...], tokens: tuple[int, ...], cache_len: int,
                  repeats: int, kernel_for: Callable[[int], str]) -> tuple[tuple[float, ...], ...]:
    """ms [len(rows)][len(tokens)]: the fastest of ``1 + repeats`` passes of r rows x t tokens
    per row over ``cache_len`` entries per row, each pass with the kernel ``kernel_for(r * t)``
    (rounds alternate over the points; the points of one kernel run together)."""
    caches = {r: filled_cache(model, cache_len, seed=r, rows=r) for r in rows}
    points = sorted(((r, t) for r in rows for t in tokens), key=lambda p: kernel_for(p[0] * p[1]))
    samples: dict[tuple[int, int], list[float]] = {p: [] for p in points}
    for round_ in range(1 + max(1, repeats)):
        current = None
        for r, t in points:
            if kernel_for(r * t) != current:
                current = kernel_for(r * t)
                use(current)
            samples[(r, t)] += time_pass(model, caches[r], t, repeats=1, warmup=1 if round_ == 0 else 0)
    return tuple(tuple(min(samples[(r, t)]) for t in tokens) for r in rows)


def _fit_positions(model, cache_lens: tuple[int, ...], max_tokens: int) -> tuple[int, ...]:
    limit = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
    lens = sorted(set(cache_lens))
    if limit:
        lens = sorted({max(1, min(n, int(limit) - max_tokens)) for n in lens})
    return tuple(lens)


def _load_average() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):  # not on every platform
        return None


def _max(a: float | None, b: float | None) -> float | None:
    return None if a is None and b is None else max(x for x in (a, b) if x is not None)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
