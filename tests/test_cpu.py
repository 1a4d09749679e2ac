"""accel.kernels.cpu.prepack: oneDNN-packed linear layers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from accel.kernels.cpu import PackedLinear, is_prepacked, prepack, prepack_available, prepack_supported
from helpers import make_tiny_model, random_prompt

pytestmark = pytest.mark.skipif(not prepack_supported(), reason="this torch build has no oneDNN linear packing")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_where_the_build_has_the_packed_kernel_accel_uses_it(dtype):
    # the skips above ask whether oneDNN's ops exist here; whether accel packs asks also whether
    # they give F.linear's numbers: a kernel that gives wrong numbers fails here, it skips nothing
    if not prepack_supported(dtype):
        pytest.skip(f"this CPU or build cannot pack {dtype} weights")
    assert prepack_available(dtype)


def test_prepack_swaps_every_linear_and_keeps_parameters_and_ties():
    model = make_tiny_model(seed=1, tie_word_embeddings=True)
    keys = list(model.state_dict())
    linears = sum(type(m) is nn.Linear for m in model.modules())
    assert prepack(model) is model
    assert is_prepacked(model)
    assert sum(isinstance(m, PackedLinear) for m in model.modules()) == linears
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert list(model.state_dict()) == keys
    assert model.lm_head.weight is model.model.embed_tokens.weight  # the tie survives
    prepack(model)  # a second call finds nothing left to swap
    assert sum(isinstance(m, PackedLinear) for m in model.modules()) == linears


def test_prepacked_logits_match_the_unpacked_model():
    plain = make_tiny_model(seed=2)
    packed = prepack(make_tiny_model(seed=2))
    ids = random_prompt(0, 20)
    with torch.inference_mode():
        a = plain(ids).logits
        b = packed(ids).logits
    assert a.shape == b.shape
    assert torch.allclose(a, b, atol=1e-4, rtol=1e-4)


def test_packed_layer_falls_back_for_gradients_and_other_dtypes():
    layer = PackedLinear(nn.Linear(8, 4))
    x = torch.randn(3, 8, requires_grad=True)
    layer.weight.requires_grad_(True)
    layer(x).sum().backward()  # the packed kernel has no backward: F.linear takes over
    assert x.grad is not None and layer.weight.grad is not None
    with torch.no_grad():
        layer.weight.mul_(2)  # an in-place update makes the packed copy stale
        ref = nn.functional.linear(x, layer.weight, layer.bias)
        assert torch.equal(layer(x), ref)
    layer.to(torch.bfloat16)
    with torch.no_grad():
        out = layer(x.detach().to(torch.bfloat16))
    assert out.dtype == torch.bfloat16 and out.shape == (3, 4)


def test_a_prepacked_model_can_be_deep_copied_and_pickled():
    import copy
    import io

    model = prepack(make_tiny_model(seed=4, tie_word_embeddings=True))
    ids = random_prompt(2, 16)
    clone = copy.deepcopy(model)  # accel train-heads copies the model to make its data in bf16
    assert is_prepacked(clone)
    assert clone.lm_head.weight is clone.model.embed_tokens.weight
    assert clone.lm_head.weight.data_ptr() != model.lm_head.weight.data_ptr()
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    half = copy.deepcopy(model).to(torch.bfloat16)  # moved weights fall back to F.linear
    with torch.inference_mode():
        ref = model(ids).logits
        assert torch.equal(clone(ids).logits, ref)
        assert torch.equal(loaded(ids).logits, ref)
        half = half(ids).logits
    assert half.dtype == torch.bfloat16 and half.shape == ref.shape


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_layer_from_plain_tensors_matches_f_linear(dtype):
    if not prepack_supported(dtype):
        pytest.skip(f"this CPU or build cannot pack {dtype} weights")
    g = torch.Generator().manual_seed(0)
    w = torch.randn(40, 16, generator=g).to(dtype)
    b = torch.randn(40, generator=g).to(dtype)
    layer = PackedLinear.from_weight(w, b)
    assert layer._packed is not None and "packed" in repr(layer)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for rows in (1, 3, 13):
        x = torch.randn(2, rows, 16, generator=g).to(dtype)
        out = layer(x)
        assert out.dtype == dtype and out.shape == (2, rows, 40)
        ref = nn.functional.linear(x.float(), w.float(), b.float())
        assert torch.allclose(out.float(), ref, atol=tol, rtol=tol)


def test_packed_layer_from_unpackable_tensors_runs_f_linear():
    w = torch.randn(8, 4, dtype=torch.float16)
    layer = PackedLinear.from_weight(w)
    assert layer._packed is None and "not packed" in repr(layer)
    x = torch.randn(3, 4, dtype=torch.float16)
    assert torch.equal(layer(x), nn.functional.linear(x, w))


def test_a_weight_changed_in_place_is_packed_again():
    x = torch.randn(3, 8)
    layer = PackedLinear(nn.Linear(8, 4))
    with torch.no_grad():
        assert layer._usable(x)
        layer.weight.mul_(2)  # a normal tensor's version counter moves: seen without force
        assert not layer._usable(x)  # the stale copy is not used
        torch.testing.assert_close(layer(x), nn.functional.linear(x, layer.weight, layer.bias))
        layer.refresh()
        assert layer._usable(x)
        torch.testing.assert_close(layer(x), nn.functional.linear(x, layer.weight, layer.bias))

    with torch.inference_mode():
        inf = PackedLinear.from_weight(torch.randn(4, 8), torch.randn(4))
        assert inf.weight.is_inference()
        inf.weight.mul_(2)  # no version counter: unseen until refresh(force=True)
        inf.refresh(force=True)
        torch.testing.assert_close(inf(x), nn.functional.linear(x, inf.weight, inf.bias))


def test_unprepack_restores_plain_linears_with_the_same_parameters():
    from accel.kernels.cpu import unprepack

    model = make_tiny_model(seed=6, tie_word_embeddings=True)
    params = {n: p.data_ptr() for n, p in model.named_parameters()}
    ids = torch.tensor([[3, 5, 7, 9]])
    with torch.inference_mode():
        ref = model(ids).logits
    assert unprepack(prepack(model)) is model and not is_prepacked(model)
    assert all(type(m) is not PackedLinear for m in model.modules())
    assert {n: p.data_ptr() for n, p in model.named_parameters()} == params
    assert model.lm_head.weight is model.get_input_embeddings().weight
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, ref)


def test_a_window_of_rows_runs_packed_kernels_and_plain_ones_outside_it(monkeypatch):
    import accel.kernels.cpu as cpu

    calls: list[int] = []
    real = cpu._packed_linear
    monkeypatch.setattr(cpu, "_packed_linear", lambda x, packed, bias: calls.append(x.numel() // x.shape[-1]) or real(x, packed, bias))
    linear = nn.Linear(8, 4)
    layer = PackedLinear(linear, min_rows=4, max_rows=9)
    with torch.inference_mode():
        for rows in (1, 3, 4, 9, 10):
            x = torch.randn(rows, 8)
            out = layer(x)
            if rows < 4 or rows > 9:
                assert torch.equal(out, nn.functional.linear(x, linear.weight, linear.bias))
            else:
                torch.testing.assert_close(out, nn.functional.linear(x, linear.weight, linear.bias))
        layer(torch.randn(2, 2, 8))  # rows are counted over every leading dimension: 4
    assert calls == [4, 9, 4]
    model = prepack(make_tiny_model(seed=6), min_rows=8)
    assert {(m.min_rows, m.max_rows) for m in model.modules() if isinstance(m, PackedLinear)} == {(8, None)}
    prepack(model, min_rows=2, max_rows=32)  # a packed model only changes its window
    assert {(m.min_rows, m.max_rows) for m in model.modules() if isinstance(m, PackedLinear)} == {(2, 32)}
    for bad in (dict(min_rows=0), dict(min_rows=4, max_rows=2), dict(min_rows=True)):
        with pytest.raises(ValueError, match="rows"):
            prepack(model, **bad)


def test_packed_passes_of_many_lengths_run_a_bounded_set_of_row_counts(monkeypatch):
    import accel.kernels.cpu as cpu

    assert [cpu.packed_rows(n) for n in (1, 17, 32, 33, 34, 63, 64, 65, 700, 2049)] == [
        1, 17, 32, 34, 34, 64, 64, 68, 704, 2176]
    assert all(n <= cpu.packed_rows(n) < n * 1.0625 + 1 for n in range(1, 5000))
    calls: list[int] = []
    real = cpu._packed_linear
    monkeypatch.setattr(cpu, "_packed_linear", lambda x, packed, bias: calls.append(x.numel() // x.shape[-1]) or real(x, packed, bias))
    linear = nn.Linear(8, 6)
    layer = PackedLinear(linear)
    with torch.inference_mode():
        for rows in range(1, 600, 7):
            x = torch.randn(1, rows, 8)
            out = layer(x)
            assert out.shape == (1, rows, 6) and out.is_contiguous()
            torch.testing.assert_close(out, nn.functional.linear(x, linear.weight, linear.bias))
    assert len(calls) == len(range(1, 600, 7)) and calls[:5] == [1, 8, 15, 22, 29]  # exact up to 32 rows
    assert calls == [cpu.packed_rows(n) for n in range(1, 600, 7)]
    assert len(set(calls)) == 54  # of 86 lengths: 5 up to 32 rows, the other 81 share 49 sizes


@pytest.mark.parametrize("shape", [(1, 8), (3, 8), (2, 5, 8)])
@pytest.mark.parametrize("bias", [True, False])
def test_split_linear_is_f_linear_over_two_halves(shape, bias):
    from accel.kernels.cpu import split_linear

    linear = nn.Linear(8, 6, bias=bias)
    x = torch.randn(*shape)
    out = split_linear(x, linear.weight, linear.bias)
    assert out.shape == (*shape[:-1], 6)
    torch.testing.assert_close(out, nn.functional.linear(x, linear.weight, linear.bias))
    # each half of the output is its own product of half the weight rows
    top = x.reshape(-1, 8) @ linear.weight[:3].T + (linear.bias[:3] if bias else 0)
    torch.testing.assert_close(out.reshape(-1, 6)[:, :3], top)


def test_a_split_window_runs_before_the_packed_one(monkeypatch):
    import accel.kernels.cpu as cpu

    calls: list[tuple[str, int]] = []
    real_split, real_packed = cpu.split_linear, cpu._packed_linear
    monkeypatch.setattr(cpu, "split_linear", lambda x, w, b: calls.append(("split", x.numel() // 8)) or real_split(x, w, b))
    monkeypatch.setattr(cpu, "_packed_linear", lambda x, p, b: calls.append(("packed", x.shape[0])) or real_packed(x, p, b))
    linear = nn.Linear(8, 4)
    layer = PackedLinear(linear, min_rows=1, max_rows=9, split_rows=2)
    with torch.inference_mode():
        for rows in (1, 2, 3, 10):
            x = torch.randn(rows, 8)
            torch.testing.assert_close(layer(x), nn.functional.linear(x, linear.weight, linear.bias))
    assert calls == [("split", 1), ("split", 2), ("packed", 3)]  # 10 rows: plain F.linear
    odd = PackedLinear(nn.Linear(8, 5), split_rows=4)  # an odd number of outputs cannot be halved: packed
    calls.clear()
    with torch.inference_mode():
        odd(torch.randn(1, 8))
    assert calls == [("packed", 1)]
    calls.clear()
    x = torch.randn(1, 8, requires_grad=True)
    layer(x).sum().backward()  # gradients: F.linear, never the inference kernels
    assert calls == [] and x.grad is not None
    model = prepack(make_tiny_model(seed=6), min_rows=2, split_rows=1)
    from accel.kernels.cpu import split_rows

    assert split_rows(model) == 1 and "split for rows <= 1" in repr(model.lm_head)
    prepack(model, min_rows=2)  # setting the windows again resets the split one too
    assert split_rows(model) == 0 and split_rows(make_tiny_model()) == 0
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match="split_rows"):
            prepack(model, split_rows=bad)


def test_a_split_model_decodes_like_the_plain_one():
    reference = make_tiny_model(seed=7)
    model = prepack(make_tiny_model(seed=7), min_rows=2, split_rows=1)
    ids = random_prompt(3, 9)
    with torch.inference_mode():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=1e-4, atol=1e-5)
        ref = reference.generate(ids, max_new_tokens=12, do_sample=False)
        assert torch.equal(model.generate(ids, max_new_tokens=12, do_sample=False), ref)


def test_a_low_precision_layer_runs_verify_passes_in_chunks_its_kernel_keeps_row_invariant(monkeypatch):
    # a fake kernel whose rows come out otherwise (as oneDNN's bf16 blocking does on an AMX
    # Xeon above 32 rows) once a call has more than 8 rows: the layer probes that, and a
    # pass of 20 or 300 rows then gives every row its single-row result bit for bit
    from accel.kernels import cpu

    def kernel(self, x):
        out = nn.functional.linear(x, self.weight, self.bias)
        return out + 1e-2 if x.numel() // self.in_features > 8 else out

    monkeypatch.setattr(cpu, "_chunk_memo", {})
    monkeypatch.setattr(PackedLinear, "_rows", kernel)
    gen = torch.Generator().manual_seed(0)
    layer = PackedLinear.from_weight(torch.randn(24, 16, generator=gen).bfloat16())
    assert layer.chunk_rows == 8
    x = torch.randn(300, 16, generator=gen).bfloat16()
    single = torch.cat([layer(x[i : i + 1]) for i in range(len(x))])
    for rows in (9, 20, 300):
        assert torch.equal(layer(x[:rows]), single[:rows])
    assert torch.equal(layer(x[:20].reshape(4, 5, 16)), single[:20].reshape(4, 5, 24))  # any leading shape
    # a prefill longer than the chunked passes runs whole (its own kernel, not compared)
    assert torch.equal(layer(torch.zeros(cpu.CHUNKED_MAX_ROWS + 1, 16).bfloat16())[0], torch.full((24,), 1e-2).bfloat16())
    # float32 layers are never chunked; nor is a kernel that gives one row otherwise than two
    assert PackedLinear.from_weight(torch.randn(24, 16, generator=gen)).chunk_rows == 0
    monkeypatch.setattr(PackedLinear, "_rows", lambda self, x: kernel(self, x) + (x.numel() == self.in_features))
    assert PackedLinear.from_weight(torch.randn(8, 16, generator=gen).bfloat16()).chunk_rows == 0
