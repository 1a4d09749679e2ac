"""Int8 weights for models that only propose: a draft model's linear layers in 8 bits.

A draft model's output is never emitted: the target verifies every token it proposes, so
greedy output stays the target's and sampling keeps the target's distribution (the
recorded q is the quantized draft's own). What a draft costs is what decides its worth, and
on a CPU a one-token step of a model is bound by reading its weights: int8 weights read a
quarter of the bytes of float32. On a 2-core Intel Xeon (Ice Lake, avx512_vnni) a one-token
step of Qwen2.5-Coder-0.5B over 300 cached tokens takes 48.6 ms in int8 against 100.2 ms in
float32 (60.0 against 118.0 ms over 2,048), its output layer alone (151,936 x 896) 6.7
against 22.3 ms (``python benchmarks/draft_int8.py``).

- :class:`Int8Linear` -- ``nn.Linear`` arithmetic from a per-output-channel symmetric int8
  copy of the weight (torch's fbgemm / x86 dynamic-quantized linear kernel: activations are
  quantized per call). The float ``weight`` stays referenced, so shapes and ties read as
  before; only ``forward`` uses the int8 copy.
- :func:`int8_copy` -- a copy of a model whose linear layers are :class:`Int8Linear`; every
  other parameter is shared with the original, so it costs the int8 weights only.
- :func:`int8_supported` -- whether this torch build and CPU run the kernel;
  :func:`int8_available` -- and whether it gives the right numbers (where not, no int8 copy).

torch 2.13 marks its quantized-tensor API deprecated (to move to torchao); its warnings are
silenced here, and :func:`int8_available` is False wherever the kernel is gone, so callers
fall back to float weights.
"""

from __future__ import annotations

import copy
import functools
import threading
import warnings
import weakref

import torch
from torch import nn

from .cpu import PackedLinear

__all__ = ["Int8Linear", "int8_available", "int8_copy", "int8_supported", "is_int8", "release_int8_copy"]


class Int8Linear(nn.Module):
    """``x @ weight.T + bias`` with an int8 copy of ``weight`` [out, in]. x: [..., in] float32
    CPU -> [..., out] float32. Each output channel has its own scale (max |w| / 127)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
            raise ValueError(f"Int8Linear needs a 2-D float32 CPU weight, got {tuple(weight.shape)} "
                             f"{weight.dtype} on {weight.device}")
        self.in_features, self.out_features = int(weight.shape[1]), int(weight.shape[0])
        self.weight, self.bias = weight, bias  # by reference: the float originals
        w = weight.detach().contiguous()  # (row-major also where accel.kernels.cpu.transpose_weights stored it not)
        scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12).double()
        with warnings.catch_warnings():  # torch 2.13: quantized tensors are deprecated
            warnings.simplefilter("ignore")
            qweight = torch.quantize_per_channel(w, scale, torch.zeros_like(scale, dtype=torch.long), 0, torch.qint8)
            self._packed = torch.ops.quantized.linear_prepack(qweight, None if bias is None else bias.detach())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if flat.dtype != torch.float32:
            flat = flat.float()
        out = torch.ops.quantized.linear_dynamic(flat, self._packed, True)
        return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def __deepcopy__(self, memo):  # the packed copy is opaque and read-only: share it
        other = Int8Linear.__new__(Int8Linear)
        nn.Module.__init__(other)
        other.in_features, other.out_features = self.in_features, self.out_features
        other.weight, other.bias, other._packed = self.weight, self.bias, self._packed
        return other

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, int8"


def _probe_operands() -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn(8, 8, generator=torch.Generator().manual_seed(0))  # [out, in]
    return w, torch.randn(4, 8, generator=torch.Generator().manual_seed(1))


@functools.cache
def int8_supported() -> bool:
    """Whether this torch build and CPU have the quantized linear kernel :class:`Int8Linear`
    calls and it runs, whatever numbers it gives (checked once). :func:`int8_available` also
    checks the numbers."""
    try:
        w, x = _probe_operands()
        Int8Linear(w)(x)
        return True
    except (RuntimeError, AttributeError, NotImplementedError):
        return False


@functools.cache
def int8_available() -> bool:
    """Whether accel makes int8 copies here: :func:`int8_supported`, and :class:`Int8Linear`
    agrees with ``F.linear`` within int8 rounding on a 4 x 8 example (checked once)."""
    if not int8_supported():
        return False
    w, x = _probe_operands()
    return bool(torch.allclose(Int8Linear(w)(x), x @ w.T, atol=0.1, rtol=0.05))


def is_int8(model: nn.Module) -> bool:
    """Whether any layer of ``model`` is an :class:`Int8Linear`."""
    return any(isinstance(m, Int8Linear) for m in model.modules())


_COPIES: "weakref.WeakKeyDictionary[nn.Module, nn.Module]" = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def int8_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose float32 CPU linear layers (plain or packed, the output layer
    included) are :class:`Int8Linear`; parameters and buffers are shared with ``model``, not
    copied. Made once per model object and reused. Raises ValueError where
    :func:`int8_available` is false or the model has no float32 CPU linear layer."""
    with _LOCK:
        hit = _COPIES.get(model)
        if hit is None:
            hit = _COPIES[model] = _make_int8_copy(model)
        return hit


def release_int8_copy(model: nn.Module) -> None:
    """Forget the copy :func:`int8_copy` made of ``model`` (its int8 weights are freed once
    nothing else holds it)."""
    with _LOCK:
        _COPIES.pop(model, None)


def _make_int8_copy(model: nn.Module) -> nn.Module:
    if not int8_available():
        raise ValueError("int8 weights need torch's quantized linear kernel (fbgemm / x86 / qnnpack), "
                         "which this torch build or CPU lacks")
    linears = [m for m in model.modules() if isinstance(m, (nn.Linear, PackedLinear))
               and m.weight.dtype == torch.float32 and m.weight.device.type == "cpu"]
    if not linears:
        raise ValueError(f"{type(model).__name__} has no float32 CPU linear layer to quantize")
    # deepcopy's memo: tensors map to themselves (shared), linear layers to their int8 twins
    memo: dict[int, object] = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
    memo.update({id(m): Int8Linear(m.weight, m.bias) for m in linears})
    return copy.deepcopy(model, memo=memo).eval()
