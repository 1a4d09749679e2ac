"""Medusa heads packed for drafting: one hidden state in, each head's top tokens out.

:func:`pack_heads` lays a :class:`~.heads.MedusaHeads` module's weights out for the decode
loop's case of one hidden vector at a time: independent heads stacked so all K run as one
batched matmul per layer (:class:`PackedHeads`), sequential heads as
:class:`~accel.kernels.cpu.PackedLinear` layers (oneDNN-packed on CPUs) drafting a tree a level at a
time (:class:`PackedPathHeads`). :func:`load_heads` reads, packs and caches heads per folder,
dtype and device, so strategies hold configuration only and every request shares the
weights; :func:`lm_layer` does the same for the model's output layer in the head dtype.
"""

from __future__ import annotations

import os
import threading
import weakref
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from accel.kernels.cpu import PackedLinear, bf16_native

from .formats import resolve_heads_dir
from .heads import MedusaHeads, head_hidden

__all__ = [
    "PackedHeads",
    "PackedPathHeads",
    "LoadedHeads",
    "pack_heads",
    "load_heads",
    "lm_layer",
    "bf16_fast_on_cpu",
]


def pack_heads(heads: MedusaHeads, dtype: torch.dtype | None = None, device: torch.device | str | None = None,
               head_dtype: torch.dtype | None = None) -> PackedHeads | PackedPathHeads:
    """The weights of ``heads`` stacked for fast drafting in ``dtype`` on ``device``, own
    output layers in ``head_dtype`` (default ``dtype``); see :class:`PackedHeads` and
    :class:`PackedPathHeads`."""
    dtype = dtype or torch.float32
    L, K, H = heads.num_layers, heads.num_heads, heads.hidden_size
    with torch.no_grad():
        subset = heads.vocab_subset.to(device) if heads.vocab_subset is not None else None
        out = None
        if heads.own_lm_head:
            out = torch.stack([h.lm_head.weight if subset is None else h.lm_head.weight[heads.vocab_subset] for h in heads.heads])
            out = out.to(device=device, dtype=head_dtype or dtype).contiguous()
        if heads.sequential:
            def packed(linear: nn.Linear, to: torch.dtype) -> PackedLinear:
                return PackedLinear.from_weight(linear.weight.to(device=device, dtype=to).contiguous(),
                                                linear.bias.to(device=device, dtype=to).contiguous())

            return PackedPathHeads(
                tuple(tuple(packed(b.linear, dtype) for b in h.blocks) for h in heads.heads),
                tuple(PackedLinear.from_weight(o) for o in out) if out is not None else None,
                subset,
            )
        if L:
            weight = torch.stack([torch.stack([h.blocks[l].linear.weight for h in heads.heads]) for l in range(L)])
            bias = torch.stack([torch.stack([h.blocks[l].linear.bias for h in heads.heads]) for l in range(L)])
        else:
            weight, bias = torch.empty(0, K, H, H), torch.empty(0, K, H)
        return PackedHeads(weight.to(device=device, dtype=dtype).contiguous(), bias.to(device=device, dtype=dtype).contiguous(),
                           out, subset)


@dataclass(frozen=True)
class PackedHeads:
    """Head weights stacked for one hidden vector at a time (the decode loop's case).

    weight: [L, K, H, H] residual-block weights, layer-major; bias: [L, K, H].
    lm_heads: [K, V', H] own output layers (in the head dtype), or None to use the model's.
    subset: LongTensor [V'] token id of each output row, or None (rows are token ids).
    """

    weight: torch.Tensor
    bias: torch.Tensor
    lm_heads: torch.Tensor | None
    subset: torch.Tensor | None = None

    def hidden(self, h: torch.Tensor, num_heads: int) -> torch.Tensor:
        """[H] -> [K, H] (or R rows' [R, H] -> [K, R, H]): every head's residual blocks on the
        same hidden state."""
        layers = [partial(_stacked_linear, self.weight[layer], self.bias[layer]) for layer in range(self.weight.shape[0])]
        return head_hidden(h.unsqueeze(0).expand(num_heads, *h.shape), layers, dtype=self.weight.dtype)

    @property
    def device(self) -> torch.device:
        return self.weight.device

    def top_tokens(self, h: torch.Tensor, k: int, num_heads: int, lm: PackedLinear | None,
                   log_probs: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Each head's ``k`` most likely tokens, [K, k] (rank 0 first), for hidden state [H]
        (for R rows' [R, H]: [K, R, k]); with ``log_probs`` also their log-probabilities under
        the head, of the same shape, float32.

        lm: the model's output layer restricted to ``subset`` (all rows without one), in the
        head dtype; unused when the heads have their own (``lm_heads``).
        """
        x = self.hidden(h, num_heads)
        if self.lm_heads is not None:
            x = x.to(self.lm_heads.dtype)
            if x.dim() == 2:
                logits = torch.bmm(self.lm_heads, x.unsqueeze(-1)).squeeze(-1)
            else:  # [K, R, H] -> [K, R, V']
                logits = torch.bmm(self.lm_heads, x.transpose(1, 2)).transpose(1, 2)
        else:
            logits = lm(x.to(lm.weight.dtype))
        return _top(logits, k, self.subset, log_probs)


@dataclass(frozen=True)
class PackedPathHeads:
    """Sequential heads' weights, for drafting a tree one level at a time; every matrix a
    :class:`~accel.kernels.cpu.PackedLinear` (oneDNN-packed on CPUs, so a few rows cost little).

    blocks: per head, its L residual blocks' linear layers, the first the path block of head
        k (0-based) with weight [H, (k + 2) H], the others [H, H]; lm_heads: per head its own
        output layer [V', H] (in the head dtype), or None to use the model's; subset as in
        :class:`PackedHeads`.
    """

    blocks: tuple[tuple[PackedLinear, ...], ...]
    lm_heads: tuple[PackedLinear, ...] | None
    subset: torch.Tensor | None = None

    @property
    def device(self) -> torch.device:
        return self.blocks[0][0].weight.device

    def top_tokens(self, head: int, h: torch.Tensor, path_emb: torch.Tensor, k: int, lm: PackedLinear | None,
                   log_probs: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Head ``head``'s ``k`` most likely tokens after each of P paths, [P, k] (rank 0 first);
        with ``log_probs`` also their log-probabilities, [P, k] float32.

        h: [H] the verifier's hidden state; path_emb: [P, head + 1, H] the input embeddings of
        each path's tokens, the root first. For R rows at once, h [R, H] and path_emb
        [R, P, head + 1, H] give [R, P, k]. lm as in :meth:`PackedHeads.top_tokens`.
        """
        blocks = self.blocks[head]
        x = head_hidden(h.unsqueeze(-2).expand(*path_emb.shape[:-2], -1), blocks, path_emb, dtype=blocks[0].weight.dtype)
        out = self.lm_heads[head] if self.lm_heads is not None else lm
        return _top(out(x.to(out.weight.dtype)), k, self.subset, log_probs)


def _stacked_linear(weight: torch.Tensor, bias: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """K heads' linear layers as one batched matmul: weight [K, H, H], bias [K, H], x [K, H]
    -> [K, H] (or x [K, R, H] -> [K, R, H])."""
    if x.dim() == 2:
        return torch.bmm(weight, x.unsqueeze(-1)).squeeze(-1) + bias
    return torch.baddbmm(bias.unsqueeze(1), x, weight.transpose(1, 2))


def _top(logits: torch.Tensor, k: int, subset: torch.Tensor | None,
         log_probs: bool) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` best rows of ``logits`` [..., V'] as token ids (through ``subset``), rank 0
    first; with ``log_probs`` also their log-softmax values (float32)."""
    values, idx = torch.topk(logits, k, dim=-1, sorted=True)
    tokens = subset[idx] if subset is not None else idx
    if not log_probs:
        return tokens
    return tokens, values.float() - torch.logsumexp(logits.float(), dim=-1, keepdim=True)


@dataclass(frozen=True)
class LoadedHeads:
    """Heads loaded and packed by :func:`load_heads`, with the facts the drafter checks."""

    packed: PackedHeads | PackedPathHeads
    sequential: bool
    num_heads: int
    hidden_size: int
    vocab_size: int
    own_lm_head: bool
    topk_accuracy: list[list[float]] | None
    source: Path


# Loaded heads by (resolved folder, weights mtime, dtype, device, head dtype): strategies
# hold configuration only, so the weights live here and every request shares them.
_HEADS_CACHE: dict[tuple[Any, ...], LoadedHeads] = {}
# The model's output layer converted to the head dtype and packed, by id(weight), with a
# weak reference and the tensor's version counter to notice a replaced or modified weight.
_LM_CACHE: dict[tuple[Any, ...], tuple[weakref.ref, int, PackedLinear]] = {}
_LOCK = threading.Lock()


def load_heads(heads: str | os.PathLike, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
               head_dtype: torch.dtype | None = None) -> LoadedHeads:
    """Heads from ``heads`` (a folder or ``"default"``), packed in ``dtype`` on ``device``
    (own output layers in ``head_dtype``), cached for the life of the process."""
    path = resolve_heads_dir(heads)
    stamp = max((p.stat().st_mtime_ns for p in path.iterdir() if p.is_file()), default=0)
    device = torch.device(device)
    key = (str(path), stamp, dtype, str(device), head_dtype)
    with _LOCK:
        hit = _HEADS_CACHE.get(key)
        if hit is None:
            module = MedusaHeads.from_pretrained(path)
            hit = LoadedHeads(
                packed=pack_heads(module, dtype, device, head_dtype),
                sequential=module.sequential,
                num_heads=module.num_heads,
                hidden_size=module.hidden_size,
                vocab_size=module.vocab_size,
                own_lm_head=module.own_lm_head,
                topk_accuracy=module.topk_accuracy,
                source=path,
            )
            _HEADS_CACHE[key] = hit
    return hit


def lm_layer(out: nn.Module, dtype: torch.dtype, rows: torch.Tensor | None = None) -> PackedLinear:
    """The model's output layer ``out`` (weight [V, H], optional bias; only ``rows`` if
    given) in ``dtype``, as a :class:`~accel.kernels.cpu.PackedLinear`: ``out`` itself when it
    already is one over all rows in that dtype, else a packed copy cached for the weight's
    life. ``rows`` must be a long-lived tensor (the cached heads' subset)."""
    weight, bias = out.weight, getattr(out, "bias", None)
    if rows is None and weight.dtype == dtype and isinstance(out, PackedLinear):
        return out
    key = (id(weight), dtype, id(rows) if rows is not None else None)
    with _LOCK:
        hit = _LM_CACHE.get(key)
        if hit is not None and hit[0]() is weight and hit[1] == weight._version:
            return hit[2]
        w = weight.detach()
        w = (w[rows] if rows is not None else w).to(dtype).contiguous()
        b = None if bias is None else (bias.detach()[rows] if rows is not None else bias.detach()).to(dtype).contiguous()
        for k in [k for k, v in _LM_CACHE.items() if v[0]() is None]:
            del _LM_CACHE[k]
        layer = PackedLinear.from_weight(w, b)
        _LM_CACHE[key] = (weakref.ref(weight), weight._version, layer)
        return layer


def bf16_fast_on_cpu() -> bool:
    """Whether bfloat16 matmuls are fast on this CPU (``head_dtype="auto"`` and training's
    defaults read it): only with native bf16 instructions (:func:`accel.kernels.cpu.bf16_native`);
    without them oneDNN's bf16 kernels are correct but slower than float32."""
    return bf16_native()
