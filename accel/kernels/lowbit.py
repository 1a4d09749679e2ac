"""Int8 and int4 weight-only verifiers: a model's linear layers in 8 or 4 bits, the rest in
bfloat16 (``accel.load_model(..., quantize="int8" | "int4")``).

On a CPU a decode step is bound by reading the weights, and torch has kernels that read
them in 8 or 4 bits and multiply by bfloat16 activations (vectorized on x86 for bf16):

- ``int8``: :class:`Int8WeightLinear`, per-output-channel symmetric int8 weights
  (``scale = max |w| / 127``), ``torch.ops.aten._weight_int8pack_mm``.
- ``int4``: :class:`Int4WeightLinear`, asymmetric groups of ``group_size`` input features
  (each group's min..max in 16 steps), ``torch.ops.aten._weight_int4pack_mm_for_cpu`` over
  the weight packed once by ``torch.ops.aten._convert_weight_to_int4pack_for_cpu``. The
  group size is one for the whole model: by default the largest of 256 / 128 / 64 / 32 that
  divides every layer's input features (576 rules out 128 for the default model). The
  kernel also needs the output features to be a multiple of 16.

:func:`quantize_model` swaps a model's ``nn.Linear`` layers for these in place and casts
everything else (embeddings, norms, the output layer unless asked, hence activations and
the KV cache) to bfloat16. A layer the kernel cannot take stays a bfloat16 ``nn.Linear``
and is named in a notice on stderr and in :func:`quantization_of`. The output layer is
quantized only with ``lm_head=True`` (``quantize="int4:lm_head=true"``): it is the largest
single matrix of a small model and its cost and quality effect are to be measured per model
and machine, so the default keeps it as it was (a tied output layer shares the input
embedding's weights, which stay bfloat16 for lookups either way).

What is exact on such a model: greedy drafting equals plain greedy decoding *of the
quantized model*. The model reads as a bfloat16 one everywhere accel asks (its first
parameter, :func:`accel.adapter.geometry`), so verification takes the bfloat16 path of
:mod:`accel.kernels.invariance`: ordered attention, and rows padded to a multiple the probe
finds invariant for this model's kernels, or the label approximate.

On CUDA the layers are torchao's (``Int8WeightOnlyConfig`` / ``Int4WeightOnlyConfig``)
where torchao is installed; otherwise :func:`quantize_model` raises a ValueError saying so.

Names: a quantization is written ``int8`` / ``int4`` or with options,
``int4:group_size=64,lm_head=true`` (:class:`Quantization`, :func:`as_quantization`), as
strategies are on the command line.
"""

from __future__ import annotations

import sys
import threading
import weakref
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import torch
from pydantic import BaseModel, BeforeValidator, ConfigDict, ValidationError, model_validator
from torch import nn

__all__ = ["GROUP_SIZES", "SCHEMES", "Int4WeightLinear", "Int8WeightLinear", "Quantization", "QuantizationInfo",
           "QuantizeSpec", "as_quantization", "choose_group_size", "compute_dtype", "dequantize_int4",
           "dequantize_int8", "kernel_problem", "load_quantized", "quantization_of", "quantize_arg",
           "quantize_int4", "quantize_int8", "quantize_model", "quantize_name"]

#: Weight-only quantizations, by name.
SCHEMES = ("int8", "int4")

#: int4 group sizes the CPU kernel takes, largest first.
GROUP_SIZES = (256, 128, 64, 32)

_INT4_OUT_MULTIPLE = 16  # _convert_weight_to_int4pack_for_cpu: output features a multiple of 16
_INNER_K_TILES = 1  # the CPU int4 kernel's packing takes any value; it does not change the result


# ---------------------------------------------------------------------------- names


class Quantization(BaseModel):
    """A weight-only quantization: ``scheme`` and its options. ``str()`` is its name
    (``int4``, or ``int4:group_size=64,lm_head=true`` with options that are not defaults)."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    scheme: Literal["int8", "int4"]
    """``int8``: per-output-channel symmetric weights; ``int4``: asymmetric groups."""
    group_size: Literal["auto", 32, 64, 128, 256] = "auto"
    """int4 only: input features per group; ``auto``: the largest of 256 / 128 / 64 / 32 that
    divides every layer's input features."""
    lm_head: bool = False
    """Quantize the output layer too (default: it stays in bfloat16)."""

    def __str__(self) -> str:
        opts = []
        if self.group_size != "auto":
            opts.append(f"group_size={self.group_size}")
        if self.lm_head:
            opts.append("lm_head=true")
        return self.scheme + (":" + ",".join(opts) if opts else "")

    @model_validator(mode="after")
    def _group_for_int4(self) -> "Quantization":
        if self.scheme != "int4" and self.group_size != "auto":
            raise ValueError(f"group_size applies to int4 only, not {self.scheme}")
        return self


def _choices() -> str:
    return (f"{', '.join(SCHEMES)} (options: int4:group_size={'|'.join(map(str, GROUP_SIZES))}, "
            "lm_head=true), or none")


def as_quantization(value: "Quantization | str | dict | None") -> Quantization | None:
    """``value`` as a :class:`Quantization`: None / ``"none"`` (no quantization), a name
    (``"int4"``, ``"int4:group_size=64,lm_head=true"``), a mapping of its fields, or one
    already. Raises ValueError naming the choices for anything else (``"int3"``)."""
    if value is None or isinstance(value, Quantization):
        return value
    given = value
    if isinstance(value, str):
        name, _, opts = value.strip().lower().partition(":")
        if name in ("", "none", "off", "no"):
            if opts:
                raise ValueError(f"quantize={value!r}: options need a scheme; choose one of {_choices()}")
            return None
        if name not in SCHEMES:
            raise ValueError(f"unknown quantization {value!r}; choose one of {_choices()}")
        fields: dict[str, Any] = {"scheme": name}
        for item in filter(None, (o.strip() for o in opts.split(","))):
            key, eq, text = item.partition("=")
            if not eq:
                raise ValueError(f"quantize={value!r}: expected key=value options, got {item!r}")
            key = key.strip()
            text = text.strip()
            fields[key] = int(text) if text.isdigit() else {"true": True, "false": False}.get(text, text)
        value = fields
    if isinstance(value, dict):
        try:
            return Quantization.model_validate(value)
        except ValidationError as err:
            why = "; ".join((f"{'.'.join(map(str, e['loc']))}: " if e["loc"] else "")
                            + e["msg"].removeprefix("Value error, ") for e in err.errors())
            raise ValueError(f"quantize={given!r}: {why}; choose one of {_choices()}") from None
    raise ValueError(f"quantize must be a name or a mapping, got {type(value).__name__}; choose one of {_choices()}")


def quantize_name(value: "Quantization | str | dict | None") -> str | None:
    """The name of a quantization (``str(as_quantization(value))``), None for none."""
    q = as_quantization(value)
    return None if q is None else str(q)


def quantize_arg(value: str) -> str:
    """argparse ``type=`` for a ``--quantize`` flag: the quantization's name (``none`` for
    none), or a usage error naming the choices."""
    import argparse

    try:
        q = as_quantization(value)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return "none" if q is None else str(q)


def _spec_value(v: Any) -> Any:
    if isinstance(v, (str, dict)) or v is None:
        return as_quantization(v)
    return v


#: A pydantic field type for a quantization: a name, a mapping of its fields, or null.
QuantizeSpec = Annotated[Quantization | None, BeforeValidator(_spec_value)]


def compute_dtype(dtype: torch.dtype, device: torch.device | str) -> torch.dtype:
    """The dtype a quantized model computes in (activations, norms, embeddings, KV cache):
    bfloat16 on a CPU (torch's weight-only CPU kernels are vectorized for it), on CUDA
    ``dtype`` where it is a 16-bit float, else bfloat16."""
    if torch.device(device).type == "cuda" and dtype in (torch.bfloat16, torch.float16):
        return dtype
    return torch.bfloat16


# ---------------------------------------------------------------------------- arithmetic


def quantize_int8(weight: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric int8: weight [N, K] -> (codes [N, K] int8 in -127..127,
    scales [N] in ``dtype``), ``w ~ codes * scale``. The scales are rounded to ``dtype``
    first and the codes chosen for the rounded scales."""
    w = weight.detach().float()
    scales = (w.abs().amax(dim=1) / 127.0).clamp_min(torch.finfo(torch.float32).tiny).to(dtype)
    codes = torch.round(w / scales.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return codes, scales


def dequantize_int8(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 [N, K] weights of :func:`quantize_int8`'s output."""
    return codes.float() * scales.float()[:, None]


def quantize_int4(weight: torch.Tensor, group_size: int,
                  dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric int4 groups along the input features: weight [N, K] (K a multiple of
    ``group_size``) -> (codes [N, K] int32 in 0..15, scales [N, K / g], zeros [N, K / g]
    both in ``dtype``), ``w ~ (code - 8) * scale + zero``: each group's min..max in 15 steps,
    ``zero`` the value of code 8 (the layout of torch's int4 kernels). Scales and zeros are
    rounded to ``dtype`` first and the codes chosen for the rounded values."""
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"input features {k} are not a multiple of the group size {group_size}")
    w = weight.detach().float().reshape(n, k // group_size, group_size)
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    scales = ((hi - lo) / 15.0).clamp_min(1e-6 * hi.abs().clamp_min(1e-30)).to(dtype)
    zeros = (lo + 8.0 * scales.float()).to(dtype)
    codes = torch.round((w - zeros.float()[..., None]) / scales.float()[..., None]) + 8
    return codes.clamp(0, 15).to(torch.int32).reshape(n, k), scales, zeros


def dequantize_int4(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """float32 [N, K] weights of :func:`quantize_int4`'s output."""
    n, k = codes.shape
    groups = scales.shape[1]
    c = codes.float().reshape(n, groups, k // groups)
    return ((c - 8) * scales.float()[..., None] + zeros.float()[..., None]).reshape(n, k)


def _flat(x: torch.Tensor, in_features: int, dtype: torch.dtype) -> torch.Tensor:
    flat = x.reshape(-1, in_features)
    if flat.dtype != dtype:
        flat = flat.to(dtype)
    return flat.contiguous()


class Int8WeightLinear(nn.Module):
    """``x @ W.T + bias`` with W held as per-output-channel int8 codes and scales.
    x: [..., in] -> [..., out] in the scales' dtype (bfloat16). Buffers: ``qweight`` [out, in]
    int8, ``scales`` [out]; ``bias`` [out] or None."""

    def __init__(self, linear: nn.Linear, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        codes, scales = quantize_int8(linear.weight, dtype)
        self.register_buffer("qweight", codes)
        self.register_buffer("scales", scales)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().to(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.aten._weight_int8pack_mm(_flat(x, self.in_features, self.scales.dtype), self.qweight,
                                                 self.scales)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def dequantized(self) -> torch.Tensor:
        """The weight [out, in] this layer multiplies by, in float32."""
        return dequantize_int8(self.qweight, self.scales)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, int8"


class Int4WeightLinear(nn.Module):
    """``x @ W.T + bias`` with W held as int4 codes in groups of ``group_size`` input
    features, packed once for torch's CPU kernel. x: [..., in] -> [..., out] in the scales'
    dtype (bfloat16). Buffers: ``qweight`` (the packed codes, [out, in / 2] uint8),
    ``scales_zeros`` [in / group_size, out, 2]; ``bias`` [out] or None."""

    def __init__(self, linear: nn.Linear, group_size: int, dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.group_size = int(group_size)
        codes, scales, zeros = quantize_int4(linear.weight, self.group_size, dtype)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.contiguous(), _INNER_K_TILES)
        self.register_buffer("qweight", packed)
        self.register_buffer("scales_zeros", torch.stack([scales.t(), zeros.t()], dim=-1).contiguous())
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().to(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = _flat(x, self.in_features, self.scales_zeros.dtype)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.qweight, self.group_size, self.scales_zeros)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"int4 groups of {self.group_size}")


_QUANTIZED = (Int8WeightLinear, Int4WeightLinear)


# ---------------------------------------------------------------------------- availability

_problems: dict[str, str | None] = {}
_problems_lock = threading.Lock()

_OPS = {"int8": ("_weight_int8pack_mm",),
        "int4": ("_convert_weight_to_int4pack_for_cpu", "_weight_int4pack_mm_for_cpu")}


def kernel_problem(scheme: str) -> str | None:
    """None where this torch build runs ``scheme``'s CPU kernel correctly here (checked once,
    on a 32 x 64 example against the dequantized weights); else what is missing or wrong, and
    what to use instead."""
    with _problems_lock:
        if scheme not in _problems:
            _problems[scheme] = _check_kernel(scheme)
        return _problems[scheme]


def _check_kernel(scheme: str) -> str | None:
    instead = ("try quantize='int8'" if scheme == "int4" else "try quantize='int4'") + \
        " or no quantization with dtype='bfloat16'"
    missing = [op for op in _OPS[scheme] if not hasattr(torch.ops.aten, op)]
    if missing:
        return (f"quantize={scheme!r} needs torch.ops.aten.{' and torch.ops.aten.'.join(missing)}, which this torch "
                f"build ({torch.__version__}) lacks; {instead}")
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(32, 64, generator=gen)
    x = torch.randn(3, 64, generator=gen).to(torch.bfloat16)
    linear = nn.Linear(64, 32, bias=False)
    with torch.no_grad():
        linear.weight.copy_(w)
    try:
        if scheme == "int8":
            layer: nn.Module = Int8WeightLinear(linear)
            ref = dequantize_int8(*quantize_int8(w))
        else:
            layer = Int4WeightLinear(linear, 32)
            ref = dequantize_int4(*quantize_int4(w, 32))
        with torch.inference_mode():
            out = layer(x).float()
    except (RuntimeError, NotImplementedError) as err:
        return (f"quantize={scheme!r}: torch.ops.aten.{_OPS[scheme][-1]} fails on this CPU with this torch build "
                f"({torch.__version__}): {str(err).splitlines()[0]}; {instead}")
    expect = x.float() @ ref.T
    if not torch.allclose(out, expect, atol=0.05, rtol=0.02):
        return (f"quantize={scheme!r}: torch.ops.aten.{_OPS[scheme][-1]} gives wrong results on this CPU with this "
                f"torch build ({torch.__version__}); {instead}")
    return None


# ---------------------------------------------------------------------------- models


@dataclass(frozen=True)
class QuantizationInfo:
    """How a model's linear layers are quantized (:func:`quantization_of`)."""

    scheme: str  # "int8" | "int4"
    group_size: int | None  # int4: input features per group
    lm_head: bool  # whether the output layer is quantized
    quantized: int  # linear layers quantized
    kept: tuple[str, ...]  # linear layers left in their float dtype (output layer included unless lm_head)
    backend: str  # "torch" (accel's layers over torch's CPU kernels) or "torchao"
    weights: int = 0  # elements of the quantized weight matrices (not among the model's parameters)

    @property
    def name(self) -> str:
        """``int8``, ``int4``, with ``:lm_head=true`` where the output layer is quantized
        (the group size goes into :meth:`key`)."""
        return self.scheme + (":lm_head=true" if self.lm_head else "")

    def key(self) -> dict[str, Any]:
        """What a cost table of the model depends on (see :func:`accel.calibration.calibrate.calibration_key`)."""
        return {"scheme": self.scheme, "group_size": self.group_size, "lm_head": self.lm_head,
                "quantized": self.quantized, "backend": self.backend}


_TORCHAO: "weakref.WeakKeyDictionary[nn.Module, QuantizationInfo]" = weakref.WeakKeyDictionary()


def quantization_of(model: nn.Module) -> QuantizationInfo | None:
    """How ``model``'s linear layers are quantized, read from its modules; None when none is."""
    if model in _TORCHAO:
        return _TORCHAO[model]
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, _QUANTIZED)]
    if not layers:
        return None
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    kept = tuple(n for n, m in model.named_modules() if isinstance(m, nn.Linear))
    first = layers[0][1]
    return QuantizationInfo(
        scheme="int4" if isinstance(first, Int4WeightLinear) else "int8",
        group_size=first.group_size if isinstance(first, Int4WeightLinear) else None,
        lm_head=isinstance(out, _QUANTIZED), quantized=len(layers), kept=kept, backend="torch",
        weights=sum(m.in_features * m.out_features for _, m in layers))


def choose_group_size(in_features: list[int]) -> int:
    """The largest of :data:`GROUP_SIZES` dividing every one of ``in_features``; where none
    divides all, the one that divides the most (ties: the largest)."""
    return max(GROUP_SIZES, key=lambda g: (sum(k % g == 0 for k in in_features), g))


def _targets(model: nn.Module, q: Quantization) -> list[tuple[str, nn.Linear]]:
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return [(n, m) for n, m in model.named_modules()
            if type(m) is nn.Linear and (q.lm_head or m is not out)]


def _set(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)


def quantize_model(model: nn.Module, quantize: "Quantization | str | dict",
                   dtype: torch.dtype | None = None) -> nn.Module:
    """Quantize ``model``'s linear layers (its output layer only with ``lm_head``) in place
    and cast everything else to ``dtype`` (default :func:`compute_dtype`: bfloat16 on a CPU);
    returns ``model``. The weights are quantized from their values as loaded (load in
    float32 for the most precise source).

    CPU: float ``nn.Linear`` layers become :class:`Int8WeightLinear` /
    :class:`Int4WeightLinear`; a layer the int4 kernel cannot take (input features not a
    multiple of the group size, output features not a multiple of 16) stays an
    ``nn.Linear`` in ``dtype``, named on stderr and in :func:`quantization_of`. CUDA:
    torchao's weight-only layers where installed. Raises ValueError for a bad ``quantize``
    (naming the choices), a model already quantized, a kernel this torch build or machine
    lacks (saying what is missing), or CUDA without torchao."""
    q = as_quantization(quantize)
    if q is None:
        raise ValueError(f"quantize_model needs a quantization; choose one of {_choices()}")
    if quantization_of(model) is not None:
        raise ValueError(f"{type(model).__name__} is quantized already ({quantization_of(model).name})")
    param = next(model.parameters())
    device = param.device
    target_dtype = dtype if dtype is not None else compute_dtype(param.dtype, device)
    if device.type == "cuda":
        return _torchao_quantize(model, q, target_dtype)
    if device.type != "cpu":
        raise ValueError(f"quantize={str(q)!r} runs on a CPU (torch's kernels) or CUDA (torchao), not on {device.type}")
    problem = kernel_problem(q.scheme)
    if problem is not None:
        raise ValueError(problem)
    targets = _targets(model, q)
    if not targets:
        raise ValueError(f"{type(model).__name__} has no nn.Linear layer to quantize")
    group = None
    skipped: list[tuple[str, str]] = []
    if q.scheme == "int4":
        group = choose_group_size([m.in_features for _, m in targets]) if q.group_size == "auto" else q.group_size
    with torch.no_grad():
        for name, linear in targets:
            if q.scheme == "int8":
                _set(model, name, Int8WeightLinear(linear, target_dtype))
                continue
            why = []
            if linear.in_features % group:
                why.append(f"in_features {linear.in_features} not a multiple of {group}")
            if linear.out_features % _INT4_OUT_MULTIPLE:
                why.append(f"out_features {linear.out_features} not a multiple of {_INT4_OUT_MULTIPLE}")
            if why:
                skipped.append((name, ", ".join(why)))
            else:
                _set(model, name, Int4WeightLinear(linear, group, target_dtype))
    model.to(dtype=target_dtype)  # the rest: embeddings, norms, kept layers (int codes are not floats: untouched)
    if skipped:
        print(f"accel: quantize={str(q)!r}: {len(skipped)} linear layer(s) stay {str(target_dtype).removeprefix('torch.')}"
              f" (the int4 kernel cannot take them): "
              + "; ".join(f"{n} ({why})" for n, why in skipped[:8]) + (" ..." if len(skipped) > 8 else ""),
              file=sys.stderr, flush=True)
    return model


def _torchao_quantize(model: nn.Module, q: Quantization, dtype: torch.dtype) -> nn.Module:
    """CUDA: torchao's weight-only int8 / int4 linear layers (``quantize_``), the rest in ``dtype``."""
    try:
        from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig, quantize_
    except ImportError as err:
        raise ValueError(f"quantize={str(q)!r} on CUDA needs torchao (torch's weight-only kernels here are CPU ones), "
                         f"which is not importable ({err}); install torchao, or run without quantize in "
                         "dtype='bfloat16' / 'float16'") from None
    targets = _targets(model, q)
    if not targets:
        raise ValueError(f"{type(model).__name__} has no nn.Linear layer to quantize")
    model.to(dtype=dtype)
    chosen = {id(m) for _, m in targets}
    group = None
    kept: list[str] = []
    if q.scheme == "int4":
        group = choose_group_size([m.in_features for _, m in targets]) if q.group_size == "auto" else q.group_size
        kept = [n for n, m in targets if m.in_features % group]
        chosen -= {id(m) for n, m in targets if n in kept}
        config: Any = Int4WeightOnlyConfig(group_size=group)
    else:
        config = Int8WeightOnlyConfig()
    quantize_(model, config, filter_fn=lambda m, fqn: id(m) in chosen)
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    names = [n for n, m in model.named_modules() if type(m) is nn.Linear and (id(m) not in chosen or m is out)]
    _TORCHAO[model] = QuantizationInfo(q.scheme, group, q.lm_head and id(out) in chosen, len(chosen),
                                       tuple(dict.fromkeys(kept + [n for n in names if n not in kept])), "torchao")
    return model


def load_quantized(load, *args, quantize, dtype, device, prepack="auto", pack=None, **kwargs):
    """``load(*args, dtype=dtype, device=device, quantize=None, **kwargs)``
    (``accel.models.load_model`` or ``load_default``), then :func:`quantize_model`; the
    bad-input checks (the quantization's name, the CPU kernel) come first, before anything is
    loaded. ``prepack`` (oneDNN packing, :func:`accel.models.prepacked`) applies to the layers
    the quantization leaves in their float dtype (the output layer unless ``lm_head=true``),
    after quantizing, through ``pack(model, prepack)`` (the loader's packing function; None: no
    packing): with ``"auto"`` the quantized model's calibration decides. Returns
    ``(model, tokenizer)``."""
    from ..dtypes import as_dtype

    q = as_quantization(quantize)
    if q is None:
        return load(*args, dtype=dtype, device=device, prepack=prepack, quantize=None, **kwargs)
    dtype = as_dtype(dtype)
    if torch.device(device).type == "cpu":
        problem = kernel_problem(q.scheme)
        if problem is not None:
            raise ValueError(problem)
    model, tokenizer = load(*args, dtype=dtype, device=device, prepack=False, quantize=None, **kwargs)
    model = quantize_model(model, q, compute_dtype(dtype, device))
    return (model if pack is None else pack(model, prepack)), tokenizer
