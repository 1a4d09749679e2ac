"""Compiled verify steps: the whole decoder of a step in one ``torch.compile`` graph.

A step of accel's engine (a plain token per row, or every row's draft tree) through
transformers' modules is some 50 small eager operations a layer: norms, rotary embeddings,
reshapes, the cache write, attention, the MLP, and the Python of the modules between them.
In bfloat16 on a CPU with AMX or avx512_bf16 the matrix products of a small model take a
fraction of that, so the step is dispatch overhead (the Kernel Looping paper's point on
accelerators: one graph per step, no boundaries inside it).

:class:`CompiledStep` runs the decoder of a Llama-family model (:data:`accel.adapter.LEAN_ARCHITECTURES`)
as one function of plain tensors, compiled once by Inductor with dynamic batch, tree and cache
sizes, so that a few graphs (one token or several per row, one row or several) serve a
whole server's life:

- the weights are views of the model's own parameters, passed as inputs (no copy; the same
  graph for every layer's shapes);
- the cache keeps its bookkeeping in Python (:meth:`accel.cache.SharedCache.claim` books the
  step's columns before the graph runs); the graph writes the new keys and values into the
  cache's buffers through one custom operator (``accel::store_kv``), in place;
- attention folds the query heads that share a KV head into the query length (no K/V copies
  per query head) under the step's additive mask (:meth:`accel.cache.SharedCache.prepare_step`).

It serves the steps it can: no ordered attention (exact bf16 drafting keeps transformers'
path, see :mod:`accel.kernels.invariance`), the same mask for every layer, no forward hooks
(accel's capture contexts, a user's). Prefills stay on transformers' path (compressors run
inside them). Plain and drafted decoding take the same path, so greedy drafting stays equal
to plain greedy decoding; against transformers' own forward the numbers agree to rounding.

A model whose step cannot be compiled falls back, with one warning saying why, to the same
function run eagerly (or, for an architecture it does not cover, to transformers' forward).
"""

from __future__ import annotations

import logging
import os
import threading
import warnings
from typing import Literal

import torch
import torch.nn.functional as F

from .. import adapter
from ..files import cache_dir
from .ordered import attend_gathered, gathered_inputs

__all__ = ["CompileMode", "CompiledStep", "enable", "disable", "step_of", "compile_modes"]

log = logging.getLogger(__name__)

CompileMode = Literal["auto", "on", "off"]
#: What ``compile=`` accepts.
compile_modes = ("auto", "on", "off")

_ATTR = "_accel_compiled_step"


@torch.library.custom_op("accel::store_kv", mutates_args=("key_buffer", "value_buffer"))
def store_kv(key_buffer: torch.Tensor, value_buffer: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
             column: torch.Tensor) -> None:
    """Write keys and values [B, H_kv, T, D] into buffers [Bcap, H_kv, cap, D] at columns
    ``column .. column + T - 1`` of their first B rows, in place (``column``: a one-element
    CPU LongTensor, so that a graph does not specialize on it)."""
    b, t, base = keys.shape[0], keys.shape[2], int(column)
    key_buffer[:b, :, base : base + t].copy_(keys)
    value_buffer[:b, :, base : base + t].copy_(values)


@store_kv.register_fake
def _store_kv_fake(key_buffer, value_buffer, keys, values, column):
    return None


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as Llama computes it: in float32, cast back, then scaled."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
            kv_heads: int, scaling: float) -> torch.Tensor:
    """q [B, H_q, T, D] over keys, values [B, H_kv, S, D] under an additive mask
    [B, 1, T, S] -> [B, T, H_q * D]. The G query heads of
    a KV head are folded into the query length: [B, H_kv, G * T, D]."""
    b, hq, t, d = q.shape
    g = hq // kv_heads
    s = keys.shape[2]
    folded = q.reshape(b, kv_heads, g * t, d)
    mask = mask.unsqueeze(2).expand(b, 1, g, t, s).reshape(b, 1, g * t, s)
    out = F.scaled_dot_product_attention(folded, keys, values, attn_mask=mask, scale=scaling)
    return out.reshape(b, hq, t, d).transpose(1, 2).reshape(b, t, hq * d)


def decoder_step(ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor,
                 embed: torch.Tensor, layers: list, norm: torch.Tensor, key_buffers: list[torch.Tensor],
                 value_buffers: list[torch.Tensor], column: torch.Tensor, ordered: tuple | None, eps: float,
                 heads: int, kv_heads: int, head_dim: int, scaling: float) -> torch.Tensor:
    """One forward of T new tokens per row through every decoder layer, over the cache's
    buffers: ids [B, T]; cos, sin [B, T, D]; mask [B, 1, T, S] additive. The new entries go
    to columns ``column ..`` (a one-element LongTensor) of every row; attention reads columns
    ``0 .. S - 1``: sdpa, or with ``ordered`` (what :func:`accel.kernels.ordered.gathered_inputs`
    derived for this forward) ordered attention. Returns the final normed hidden states [B, T, H]."""
    b, t = ids.shape
    span = mask.shape[-1]
    x = F.embedding(ids, embed)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    for (n1, qw, qb, kw, kb, vw, vb, ow, ob, n2, gw, uw, dw), kbuf, vbuf in zip(layers, key_buffers, value_buffers):
        h = _rms(x, n1, eps)
        q = F.linear(h, qw, qb).view(b, t, heads, head_dim).transpose(1, 2)
        k = F.linear(h, kw, kb).view(b, t, kv_heads, head_dim).transpose(1, 2)
        v = F.linear(h, vw, vb).view(b, t, kv_heads, head_dim).transpose(1, 2)
        q = q * cos + adapter.rotate_half(q) * sin
        k = k * cos + adapter.rotate_half(k) * sin
        torch.ops.accel.store_kv(kbuf, vbuf, k, v, column)
        if ordered is None:
            attn = _attend(q, kbuf[:b, :, :span], vbuf[:b, :, :span], mask, kv_heads, scaling)
        else:
            attn = attend_gathered(q, kbuf[:b, :, :span], vbuf[:b, :, :span], ordered, scaling).reshape(b, t, -1)
        x = x + F.linear(attn, ow, ob)
        h = _rms(x, n2, eps)
        x = x + F.linear(F.silu(F.linear(h, gw)) * F.linear(h, uw), dw)
    return _rms(x, norm, eps)


class CompiledStep:
    """The decode and verify forwards of one model as :func:`decoder_step`, compiled
    (``compiled=True``) or run eagerly.

    Build it with :func:`enable`; :func:`accel.steps.forward_tokens` runs it for the steps
    :meth:`serves`, transformers' forward for the others.
    """

    def __init__(self, model, weights: adapter.DecoderWeights, compiled: bool = True):
        self.weights = weights
        self.compiled = compiled
        self.failure: str | None = None  # why compiling failed (the eager function runs since)
        self._lock = threading.Lock()
        self._fn = _compile(_bind(weights)) if compiled else _bind(weights)
        self._eager = _bind(weights)
        self.calls = 0

    def serves(self, model, cache) -> bool:
        """Whether this step can run the forward ``cache`` was just prepared for
        (:meth:`~accel.cache.SharedCache.prepare_step`)."""
        return (cache._prefill is None and not cache.ragged and cache.uniform_masks and not cache.packed
                and not torch.is_grad_enabled() and not adapter.has_hooks(model))

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, cache, mask: torch.Tensor | None) -> torch.Tensor:
        """ids, positions [B, T] over ``cache`` (prepared for them) -> hidden states [B, T, H];
        the new entries stay uncommitted, as with transformers' forward."""
        w = self.weights
        b, t = ids.shape
        like = torch.empty((b, w.kv_heads, t, w.head_dim), dtype=w.embed.dtype, device=ids.device)
        claims = {cache.claim(layer, b, t, like) for layer in range(cache.num_layers)}
        if len(claims) != 1:  # serves() rules this out: every layer holds the same entries
            raise RuntimeError(f"layers claimed different columns: {sorted(claims)}")
        base, span = claims.pop()
        cos, sin = w.rotary(like, positions)
        if mask is None:  # one token per row over equally long rows: every column is visible
            mask = torch.zeros((b, 1, t, span), dtype=w.embed.dtype, device=ids.device)
        buffers = [cache.storage(layer) for layer in range(cache.num_layers)]
        ordered = None
        if cache.ordered:  # every layer holds the same entries: one layout for all
            ordered = gathered_inputs(cache.layout(0), mask, w.kv_heads, w.heads // w.kv_heads, w.head_dim)
        args = (ids, cos, sin, mask, w.embed, list(w.layers), w.norm, [k for k, _ in buffers],
                [v for _, v in buffers], torch.tensor([base]), ordered)
        self.calls += 1
        if self.compiled and self.failure is None:
            _dynamic(args)
            try:
                with _no_duck_shapes():
                    return self._fn(*args)
            except Exception as err:  # a graph Inductor cannot build: eager from now on
                with self._lock:
                    if self.failure is None:
                        self.failure = f"{type(err).__name__}: {err}".splitlines()[0][:300]
                        warnings.warn(f"accel: compiling the decode step failed ({self.failure}); "
                                      "running it eagerly", RuntimeWarning, stacklevel=3)
        return self._eager(*args)


def _bind(w: adapter.DecoderWeights):
    """:func:`decoder_step` with the model's sizes fixed (constants of the graph: only the
    batch, tree and cache sizes vary between calls)."""
    eps, heads, kv_heads, head_dim, scaling = w.eps, w.heads, w.kv_heads, w.head_dim, w.scaling

    def step(ids, cos, sin, mask, embed, layers, norm, key_buffers, value_buffers, column, ordered):
        return decoder_step(ids, cos, sin, mask, embed, layers, norm, key_buffers, value_buffers, column,
                            ordered, eps, heads, kv_heads, head_dim, scaling)

    return step


def _dynamic(args) -> None:
    """Mark the sizes that vary between steps (rows, tokens per row, cache columns, buffer
    capacity) as dynamic from the first call on; the model's sizes stay constants."""
    ids, cos, sin, mask, _, _, _, keys, values, _, ordered = args
    mark = torch._dynamo.maybe_mark_dynamic
    for tensor, dims in ((ids, (0, 1)), (cos, (0, 1)), (sin, (0, 1)), (mask, (0, 2, 3))):
        for dim in dims:
            mark(tensor, dim)
    for buffer in (*keys, *values):
        mark(buffer, 0)
        mark(buffer, 2)
    if ordered is not None:  # cols [B, T, W]; then counts [B, T] (and the mask), or the mask laid out [B, 1, T, W / BLOCK, BLOCK, 1]
        for dim in (0, 1, 2):
            mark(ordered[0], dim)
        for dim in ((0, 1) if len(ordered) == 3 else (0, 2, 3)):
            mark(ordered[1], dim)


def _no_duck_shapes():
    """Sizes that happen to be equal in the first call (rows and tree nodes, say) get symbols
    of their own, so that a later call where they differ does not compile again."""
    return torch.fx.experimental._config.patch(use_duck_shape=False)


def _compile(fn):
    """``torch.compile`` (sizes marked dynamic by :func:`_dynamic`), Inductor's caches under ``$ACCEL_CACHE/inductor``
    (unless ``TORCHINDUCTOR_CACHE_DIR`` is set) so that a second process starts warm."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir() / "inductor"))
    return torch.compile(fn, fullgraph=True)


def step_of(model) -> CompiledStep | None:
    """The compiled step :func:`enable` attached to ``model``, or None."""
    return getattr(model, _ATTR, None)


def enable(model, mode: CompileMode = "on", *, compiled: bool = True) -> CompiledStep | None:
    """Run ``model``'s decode and verify steps as :class:`CompiledStep` (``mode="on"``), or
    transformers' forward (``"off"``). ``"auto"`` is "on" where the compiled step covers the
    model's architecture. A model it cannot cover keeps transformers' forward: with a warning
    when ``mode="on"`` asked for it. Returns the step, or None. ``compiled=False`` runs the
    same function eagerly (tests)."""
    if mode not in compile_modes:
        raise ValueError(f"compile must be one of {', '.join(compile_modes)}, got {mode!r}")
    if mode == "off":
        disable(model)
        return None
    current = step_of(model)
    if current is not None and current.compiled == compiled:
        return current
    weights, why = adapter.decoder_weights(model)
    if weights is None:
        disable(model)
        if mode == "on":
            warnings.warn(f"accel: compile='on' but {type(model).__name__} runs transformers' forward: {why}",
                          RuntimeWarning, stacklevel=2)
        return None
    step = CompiledStep(model, weights, compiled=compiled)
    setattr(model, _ATTR, step)
    return step


def disable(model) -> None:
    """Back to transformers' forward for every step of ``model``."""
    if step_of(model) is not None:
        delattr(model, _ATTR)
