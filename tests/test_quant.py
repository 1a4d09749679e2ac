"""accel.kernels.quant: int8 copies of models that only draft."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from accel.kernels.cpu import PackedLinear, is_prepacked, prepack, prepack_supported
from accel.kernels.quant import Int8Linear, int8_available, int8_copy, int8_supported, is_int8
from helpers import TINY_VOCAB, make_tiny_model

pytestmark = pytest.mark.skipif(not int8_supported(), reason="this torch build has no int8 linear kernel")


def test_where_the_build_has_the_int8_kernel_accel_uses_it():
    # the skip above asks whether the kernel runs here; a kernel giving wrong numbers fails here
    assert int8_available()


def test_int8_linear_is_f_linear_within_int8_rounding():
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(24, 16, generator=g), torch.randn(24, generator=g)
    layer = Int8Linear(w, b)
    assert layer.weight is w and layer.bias is b
    for shape in ((16,), (3, 16), (2, 5, 16)):
        x = torch.randn(*shape, generator=g)
        ref = torch.nn.functional.linear(x, w, b)
        out = layer(x)
        assert out.shape == ref.shape and out.dtype == torch.float32
        assert (out - ref).abs().max() < 0.05 * ref.abs().max()
    with pytest.raises(ValueError, match="float32"):
        Int8Linear(w.to(torch.bfloat16))


@pytest.mark.parametrize("packed", [False, True])
def test_int8_copy_shares_everything_but_the_linear_kernels(packed):
    model = make_tiny_model(seed=4)
    if packed:
        if not prepack_supported():
            pytest.skip("this torch build has no oneDNN linear packing")
        prepack(model)
        assert is_prepacked(model)
    before = {n: p.clone() for n, p in model.named_parameters()}
    q = int8_copy(model)
    assert int8_copy(model) is q and q is not model  # made once
    assert is_int8(q) and not is_int8(model)
    assert not any(isinstance(m, (nn.Linear, PackedLinear)) for m in q.modules())
    assert isinstance(q.lm_head, Int8Linear)
    # the parameters are the original tensors, untouched
    ours = dict(model.named_parameters())
    assert all(p is ours[n] for n, p in q.named_parameters())
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    ids = torch.randint(0, TINY_VOCAB, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ref, out = model(ids).logits, q(ids).logits
    assert (out - ref).abs().max() < 0.1 * ref.abs().max()
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.75
