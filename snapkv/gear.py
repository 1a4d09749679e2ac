"""GEAR (Kang et al. 2024): quantized KV entries repaired by a low-rank and a sparse term."""

from __future__ import annotations

import math
from typing import ClassVar, Literal

import torch
from pydantic import ConfigDict, Field, ValidationInfo, field_validator

from accel.kernels import native
from accel.strategy import KVQuantizer, register

__all__ = ["GEAR", "decode_group", "encode_group", "quantize_group"]


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

    Packed storage: the cache keeps, per group, what :func:`encode_group` makes of it and
    nothing else of the group's entries: the codes packed two (4 bits) or four (2 bits) to a
    byte, scales and zero points and both factors in float16 (bfloat16 for a bfloat16
    cache), each outlier's value (cache precision) and its index in the group (int16, int32
    for groups above 2**15 entries). Attention reads the groups back per layer per step
    (:func:`decode_group`), so the numbers it computes with are the reconstructions.

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
        if head_dim % (8 // self.bits):
            raise ValueError(f"gear.bits: {self.bits}-bit codes pack {8 // self.bits} to a byte along the head "
                             f"dimension, which is {head_dim} here")
        if self.rank > head_dim:
            raise ValueError(f"gear.rank: rank ({self.rank}) must not exceed the model's head dimension ({head_dim})")

    def outlier_count(self, head_dim: int) -> int:
        """Entries kept exact in one group of one head, keys or values."""
        return math.ceil(self.outliers * self.group * head_dim) if self.outliers else 0

    def encode(self, keys: torch.Tensor, values: torch.Tensor) -> dict[str, torch.Tensor]:
        """keys, values [H_kv, m, G, D] -> ``k_*`` and ``v_*`` parts of :func:`encode_group`."""
        k = encode_group(keys, self.bits, self.rank, self.outlier_count(keys.shape[-1]), per_channel=True)
        v = encode_group(values, self.bits, self.rank, self.outlier_count(values.shape[-1]), per_channel=False)
        return {**{f"k_{n}": t for n, t in k.items()}, **{f"v_{n}": t for n, t in v.items()}}

    def decode(self, parts: dict[str, torch.Tensor], keys: torch.Tensor, values: torch.Tensor,
               groups: list[int] | None = None) -> None:
        for prefix, out, per_channel in (("k_", keys, True), ("v_", values, False)):
            decode_group({n[2:]: t for n, t in parts.items() if n.startswith(prefix)}, self.bits, per_channel, out,
                         groups)

    def group_bytes(self, num_kv_heads: int, head_dim: int, element_size: int) -> int:
        g, d, h = self.group, head_dim, num_kv_heads
        meta = 2  # float16 / bfloat16 scales, zero points and factors
        codes = 2 * h * g * d * self.bits // 8
        scales = h * 2 * d * meta + h * 2 * g * meta  # keys per channel, values per token
        factors = 2 * h * self.rank * (g + d) * meta
        index = 2 if g * d <= 2**15 else 4
        sparse = 2 * h * self.outlier_count(d) * (element_size + index)
        return codes + scales + factors + sparse


def _meta_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.bfloat16 if dtype == torch.bfloat16 else torch.float16


def encode_group(x: torch.Tensor, bits: int, rank: int, outliers: int, per_channel: bool) -> dict[str, torch.Tensor]:
    """GEAR's stored form of groups ``x`` [..., G, D]: the ``outliers`` largest-magnitude
    entries of each [G, D] kept exact, the rest quantized to ``bits`` (one scale and zero
    point per channel over the G tokens with ``per_channel``, else per token over the D
    channels) plus a rank-``rank`` approximation of its quantization error.

    Returns, with ``...`` the leading dims of x:
        codes [..., G, D * bits / 8] uint8, D's codes packed from the low bits up;
        scale, zero [..., D] (per channel) or [..., G] (per token), float16 or bfloat16;
        a [..., G, rank], b [..., rank, D] the error's factors (rank > 0 only);
        idx [..., outliers] int16 / int32 flat positions in [G, D], val [..., outliers]
        their exact values, x's dtype (outliers > 0 only).
    """
    meta = _meta_dtype(x.dtype)
    g, d = x.shape[-2], x.shape[-1]
    flat = x.float().reshape(*x.shape[:-2], g * d)
    parts: dict[str, torch.Tensor] = {}
    if outliers:
        top = flat.abs().topk(min(outliers, g * d), dim=-1).indices
        parts["idx"] = top.to(torch.int16 if g * d <= 2**15 else torch.int32)
        parts["val"] = x.reshape(flat.shape).gather(-1, top)
        flat = flat.scatter(-1, top, 0.0)
    dense = flat.reshape(x.shape)
    axis = -2 if per_channel else -1
    lo = dense.amin(dim=axis, keepdim=True).to(meta)
    levels = 2**bits - 1
    scale = ((dense.amax(dim=axis, keepdim=True) - lo.float()) / levels).to(meta)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = ((dense - lo.float()) / scale.float()).round().clamp(0, levels).to(torch.uint8)
    parts["scale"], parts["zero"] = scale.squeeze(axis), lo.squeeze(axis)
    if rank:
        u, s, vh = torch.linalg.svd(dense - (codes.float() * scale.float() + lo.float()), full_matrices=False)
        parts["a"] = (u[..., :rank] * s[..., None, :rank]).to(meta)
        parts["b"] = vh[..., :rank, :].to(meta)
    per = 8 // bits
    packed = codes[..., 0::per].clone()
    for i in range(1, per):
        packed |= codes[..., i::per] << (bits * i)
    parts["codes"] = packed
    return parts


def decode_group(parts: dict[str, torch.Tensor], bits: int, per_channel: bool, out: torch.Tensor,
                 groups: list[int] | None = None) -> None:
    """Write the entries :func:`encode_group` stored as ``parts`` into ``out`` [..., G, D]
    (a view, any dtype): codes * scale + zero, plus the factors' product, outliers exact.
    ``groups``: for out [B, H, g, G, D], the groups each row b holds; those past them may be
    left as they were (or written from whatever parts hold there)."""
    target = out if out.dtype == torch.float32 else torch.empty(out.shape, dtype=torch.float32, device=out.device)
    if not native.gear_decode(parts, bits, per_channel, target, groups):
        _decode_torch(parts, bits, per_channel, target)
    if target is not out:
        out.copy_(target)


def _decode_torch(parts: dict[str, torch.Tensor], bits: int, per_channel: bool, target: torch.Tensor) -> None:
    """:func:`decode_group` in torch ops, into float32 ``target`` (where the native kernel
    is not available, :mod:`accel.kernels.native`)."""
    packed = parts["codes"]
    per, mask = 8 // bits, 2**bits - 1
    codes = torch.stack([(packed >> (bits * i)) & mask for i in range(per)], dim=-1).flatten(-2)
    axis = -2 if per_channel else -1
    target.copy_(codes)
    target.mul_(parts["scale"].unsqueeze(axis).float()).add_(parts["zero"].unsqueeze(axis).float())
    if "a" in parts:
        target.add_(parts["a"].float() @ parts["b"].float())
    if "idx" in parts:
        target.view(*target.shape[:-2], -1).scatter_(-1, parts["idx"].long(), parts["val"].float())


def quantize_group(x: torch.Tensor, bits: int, rank: int, outliers: int, per_channel: bool) -> torch.Tensor:
    """What attention reads back for groups ``x`` [..., G, D] (:func:`decode_group` of
    :func:`encode_group`): same shape and dtype as x."""
    out = torch.empty_like(x)
    decode_group(encode_group(x, bits, rank, outliers, per_channel), bits, per_channel, out)
    return out
