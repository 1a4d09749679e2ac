"""GEAR (Kang et al. 2024): quantized KV entries repaired by a low-rank and a sparse term."""

from __future__ import annotations

import math
from typing import ClassVar, Literal

import torch
from pydantic import ConfigDict, Field, ValidationInfo, field_validator

from accel.strategy import KVQuantizer, register

__all__ = ["GEAR", "quantize_group"]


@register
class GEAR(KVQuantizer):
    """GEAR quantization of the entries a row keeps, a group of ``group`` tokens at a time.

    Per layer, KV head and group of G tokens, for the keys X [G, D] and for the values:

    1. the ``outliers`` fraction of X's entries largest in magnitude are kept exact (sparse);
    2. the rest is quantized to ``bits`` bits, uniform with a scale and a zero point: keys per
       channel (each of the D channels over the G tokens), values per token (each token over
       its D channels), as KIVI does;
    3. the quantization error of that part is approximated at ``rank`` r (its truncated SVD,
       two factors [G, r] and [r, D]) and added back.

    Stacks after any selector (``strategies=[snapkv, gear]`` quantizes what SnapKV keeps);
    alone it quantizes the whole cache. After the prefill every full group of a row's kept
    entries is quantized, then each group of generated entries as it fills: the newest
    entries (fewer than G) stay in full precision. Sliding-window layers stay in full
    precision. See :mod:`accel.maintenance` for when it runs and why drafting stays exact.

    Simulated quantization: the cache holds the dequantized numbers (codes * scale + zero +
    low-rank term, outliers exact), so attention code is unchanged and computes with exactly
    what a packed store would give back. Scales, zero points and factors are rounded to
    float16 (bfloat16 for a bfloat16 cache) as a packed store keeps them, and the bytes
    reported (:meth:`group_bytes`) are a packed store's: codes at ``bits`` bits, scales, zero
    points, both factors, and each outlier's value (cache precision) and index.

    Drafting on a GEAR cache: groups are quantized at the same lengths in drafted and plain
    decoding (:mod:`accel.maintenance`); exact where verification is bit-identical to plain
    steps (low precision with ordered attention). In float32 a verify pass's entries differ
    from a plain step's by a few ulps and a code on a rounding boundary may round the other
    way, so the rows report ``exact_verify=False`` (outputs agreed in every test).
    """

    name: ClassVar[str] = "gear"
    model_config = ConfigDict(use_attribute_docstrings=True)

    bits: Literal[2, 4] = 4
    """Bits per quantized entry: 4 or 2."""
    group: int = Field(64, gt=0)
    """Tokens quantized together (G): the newest entries wait in full precision until G fill."""
    rank: int = Field(2, ge=0)
    """Rank r of the low-rank correction of each group's quantization error (0: none); at
    most the head dimension and the group."""
    outliers: float = Field(0.01, ge=0, lt=0.5)
    """Fraction of each group's entries (the largest in magnitude) kept exact."""

    @field_validator("rank")
    @classmethod
    def _rank_fits_group(cls, rank: int, info: ValidationInfo) -> int:
        group = info.data.get("group")
        if group is not None and rank > group:
            raise ValueError(f"rank ({rank}) must not exceed group ({group})")
        return rank

    def group_size(self) -> int:
        return self.group

    def check_geometry(self, num_kv_heads: int, head_dim: int) -> None:
        if self.rank > head_dim:
            raise ValueError(f"gear.rank: rank ({self.rank}) must not exceed the model's head dimension ({head_dim})")

    def outlier_count(self, head_dim: int) -> int:
        """Entries kept exact in one group of one head, keys or values."""
        return math.ceil(self.outliers * self.group * head_dim) if self.outliers else 0

    def quantize(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """keys, values [R, H_kv, G, D] -> their GEAR reconstructions (same shape, dtype)."""
        return (quantize_group(keys, self.bits, self.rank, self.outlier_count(keys.shape[-1]), per_channel=True),
                quantize_group(values, self.bits, self.rank, self.outlier_count(values.shape[-1]), per_channel=False))

    def group_bytes(self, num_kv_heads: int, head_dim: int, element_size: int) -> int:
        g, d, h = self.group, head_dim, num_kv_heads
        meta = 2  # float16 / bfloat16 scales, zero points and factors
        codes = 2 * h * g * d * self.bits // 8
        scales = h * 2 * d * meta + h * 2 * g * meta  # keys per channel, values per token
        factors = 2 * h * self.rank * (g + d) * meta
        index = 2 if g * d <= 2**16 else 4
        sparse = 2 * h * self.outlier_count(d) * (element_size + index)
        return codes + scales + factors + sparse


def _meta_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.bfloat16 if dtype == torch.bfloat16 else torch.float16


def quantize_group(x: torch.Tensor, bits: int, rank: int, outliers: int, per_channel: bool) -> torch.Tensor:
    """GEAR's reconstruction of groups ``x`` [..., G, D]: the ``outliers`` largest-magnitude
    entries of each [G, D] exact, the rest quantized to ``bits`` (one scale and zero point per
    channel over the G tokens with ``per_channel``, else per token over the D channels) plus
    a rank-``rank`` approximation of its quantization error. Same shape and dtype as x."""
    meta = _meta_dtype(x.dtype)
    g, d = x.shape[-2], x.shape[-1]
    flat = x.float().reshape(*x.shape[:-2], g * d)
    sparse = None
    if outliers:
        top = flat.abs().topk(min(outliers, g * d), dim=-1).indices
        sparse = torch.zeros_like(flat, dtype=torch.bool).scatter_(-1, top, True)
        flat = flat.masked_fill(sparse, 0.0)
    dense = flat.reshape(x.shape)
    axis = -2 if per_channel else -1
    lo = dense.amin(dim=axis, keepdim=True).to(meta).float()
    levels = 2**bits - 1
    scale = ((dense.amax(dim=axis, keepdim=True) - lo) / levels).to(meta).float()
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    out = ((dense - lo) / scale).round().clamp(0, levels) * scale + lo
    if rank:
        u, s, vh = torch.linalg.svd(dense - out, full_matrices=False)
        a = (u[..., :rank] * s[..., None, :rank]).to(meta).float()  # [..., G, r]
        b = vh[..., :rank, :].to(meta).float()  # [..., r, D]
        out = out + a @ b
    if sparse is not None:
        out = torch.where(sparse.reshape(x.shape), x.float(), out)
    return out.to(x.dtype)
