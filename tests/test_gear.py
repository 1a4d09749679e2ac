"""GEAR quantized KV: the quantizer on hand-made groups, the cache holding quantized groups and
a full-precision tail, honest byte counts, exact drafting on the quantized cache, bad values."""

from __future__ import annotations

import pytest
import torch

import accel
from accel import adapter
from accel.cache import SharedCache
from accel.engine import Batch, Row, plan_strategies
from accel.strategy import StrategyError, build_strategy
from accel.steps import prefill
from helpers import Scripted, TINY_VOCAB, decode_snapshots, make_tiny_model
from snapkv import GEAR, SnapKV
from snapkv.gear import quantize_group
from speculative import PromptLookup


@pytest.fixture(scope="module")
def model():
    return make_tiny_model(seed=31)


def _prompts():
    base = torch.randint(2, TINY_VOCAB, (11,), generator=torch.Generator().manual_seed(8))
    return [base.repeat(4), base[:6].repeat(5)]


def test_plain_quantization_is_per_channel_for_keys_and_per_token_for_values():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 16, 8) * torch.linspace(0.1, 5, 8)  # channels of very different ranges
    keys = quantize_group(x, bits=2, rank=0, outliers=0, per_channel=True)
    values = quantize_group(x, bits=2, rank=0, outliers=0, per_channel=False)
    for c in range(8):  # 2 bits: at most 4 levels per channel (keys) ...
        assert keys[0, 0, :, c].unique().numel() <= 4
    for t in range(16):  # ... and per token (values)
        assert values[0, 0, t].unique().numel() <= 4
    span = x.amax(dim=-2, keepdim=True) - x.amin(dim=-2, keepdim=True)
    assert bool(((keys - x).abs() <= span / 3 / 2 * 1.01 + 1e-3).all())  # within half a step
    assert keys.dtype == x.dtype and keys.shape == x.shape


def test_low_rank_and_outliers_repair_the_quantization_error():
    torch.manual_seed(1)
    x = torch.randn(1, 2, 32, 16)
    x[0, 0, 5, 3] = 40.0  # an outlier that would stretch its channel's range
    err = {cfg: float((quantize_group(x, 2, *cfg, per_channel=True) - x).norm())
           for cfg in [(0, 0), (4, 0), (0, 8), (4, 8)]}
    assert err[(4, 0)] < err[(0, 0)] and err[(0, 8)] < err[(0, 0)] and err[(4, 8)] < min(err[(4, 0)], err[(0, 8)])
    kept = quantize_group(x, 2, 4, 8, per_channel=True)
    assert float(kept[0, 0, 5, 3]) == 40.0  # the outlier is exact


def test_the_cache_holds_quantized_groups_and_a_full_precision_tail(model):
    """After the prefill: full groups quantized in every layer, the newest entries exact."""
    gear = GEAR(bits=4, group=8, rank=0, outliers=0)
    prompt = _prompts()[0]  # 44 tokens: 5 groups of 8 and a tail of 4
    plan = plan_strategies([gear])
    batch = Batch(model)
    reference = SharedCache(2)
    with torch.inference_mode(), adapter.packed_gqa_attention(model), adapter.per_layer_masks(model, batch.cache):
        batch.admit([Row(prompt=prompt, plan=plan, max_new_tokens=4, eos=frozenset())])
        prefill(model, reference, prompt.unsqueeze(0))
    for layer in range(2):
        got, full = batch.cache.keys(layer), reference.keys(layer)
        assert torch.equal(got[:, :, 40:], full[:, :, 40:])  # the tail waits for its group to fill
        assert not torch.equal(got[:, :, :40], full[:, :, :40])
        groups = got[0, :, :40].reshape(2, 5, 8, 16)  # [H, groups, G, D]
        for h in range(2):
            for g in range(5):
                for c in range(16):
                    assert groups[h, g, :, c].unique().numel() <= 16
        assert torch.allclose(got[:, :, :40], full[:, :, :40], atol=0.25)


def test_kept_bytes_count_the_packed_groups_and_the_full_tail(model):
    gear = GEAR(bits=4, group=8, rank=2, outliers=0.05)
    prompt = _prompts()[0]  # 44 tokens + 10 fed = 54 entries: 6 groups of 8 and 6 exact
    res = accel.generate(model, prompt.unsqueeze(0), strategies=[gear], max_new_tokens=11, eos_token_id=[])
    per_entry = 2 * 2 * 16 * 4  # (K, V) * KV heads * head_dim * float32, one layer
    group = (2 * 2 * 8 * 16 * 4 // 8  # codes
             + 2 * 2 * 16 * 2 + 2 * 2 * 8 * 2  # key scales / zeros per channel, value ones per token
             + 2 * 2 * 2 * (8 + 16) * 2  # rank-2 factors of keys and values
             + 2 * 2 * 7 * (4 + 2))  # ceil(0.05 * 128) = 7 outliers of keys and values: value + index
    assert gear.group_bytes(2, 16, 4) == group
    assert res.stats.kv_bytes_kept == 2 * (6 * group + 6 * per_entry)  # 2 layers
    assert res.stats.kv_bytes_full == 54 * 2 * per_entry


def _decode_budget():
    return SnapKV(budget=20, window=4, kernel=3, decode_budget=14, decode_slack=4)


@pytest.mark.parametrize("strategies", [
    [GEAR(group=8)],
    [_decode_budget(), GEAR(bits=2, group=8, rank=1, outliers=0)],
], ids=["gear", "snapkv_decode_budget+gear2"])
def test_drafting_equals_plain_decoding_on_the_quantized_cache(model, strategies):
    """Greedy drafting gives plain decoding's tokens on the quantized cache, batch of 2 (rows
    of different packed lengths): a group is quantized at the same length in both, as no
    step verifies tokens past the length where the next group fills (decode_snapshots
    asserts it)."""
    new = 30
    plain, _ = decode_snapshots(model, _prompts(), strategies, new)
    for drafter in (PromptLookup(max_ngram=2, num_tokens=6), Scripted(mode="random", size=5)):
        drafted, caches = decode_snapshots(model, _prompts(), strategies + [drafter], new)
        assert [r.generated for r in drafted] == [r.generated for r in plain]
        assert all(r.stats.drafted_tokens > 0 for r in drafted)
        assert sum(r.stats.accepted_tokens for r in drafted) > 0 or drafter.name == "scripted_test"
        # float32 verify passes agree with plain steps to a few ulps, which can round a code
        # the other way: not claimed exact (bit-identical low-precision verification is)
        assert not any(r.stats.exact_verify for r in drafted)
    for row in plain:  # both rows' groups were packed: fewer bytes than half the entries'
        assert row.stats.kv_bytes_kept < row.stats.kv_bytes_full // 2


def test_bf16_drafting_is_bit_exact_with_evictions_requantizing_groups():
    """bfloat16 verification is bit-identical to plain steps (ordered attention), so drafting
    is exact on a GEAR cache with outliers and a low-rank term whose groups an eviction
    decodes and quantizes again."""
    low = make_tiny_model(seed=31).to(torch.bfloat16)
    strategies = [_decode_budget(), GEAR(bits=2, group=8, rank=1)]
    plain, _ = decode_snapshots(low, _prompts(), strategies, 30)
    assert all(r.upkeep.evictions > 0 for r in plain)
    for drafter in (PromptLookup(max_ngram=2, num_tokens=6), Scripted(mode="random", size=5)):
        drafted, _ = decode_snapshots(low, _prompts(), strategies + [drafter], 30)
        assert [r.generated for r in drafted] == [r.generated for r in plain]
        assert all(r.stats.exact_verify for r in drafted)


def test_the_cache_stores_codes_not_entries(model):
    """After the prefill a GEAR layer's entry buffer holds only the tail; the groups live in
    packed parts whose storage is exactly what group_bytes counts."""
    gear = GEAR(bits=4, group=8, rank=2, outliers=0.05)
    prompt = torch.randint(2, TINY_VOCAB, (203,), generator=torch.Generator().manual_seed(3))  # 25 groups + 3
    batch = Batch(model)
    with torch.inference_mode(), adapter.packed_gqa_attention(model), adapter.per_layer_masks(model, batch.cache):
        batch.admit([Row(prompt=prompt, plan=plan_strategies([gear]), max_new_tokens=4, eos=frozenset())])
    cache = batch.cache
    for layer in range(2):
        assert cache.packed_columns(layer, 0) == 200
        assert cache._k[layer].shape[2] <= 3 + 2 * 8  # the tail and at most two groups to spare
        parts = cache._packed[layer].parts
        assert parts["k_codes"].dtype == torch.uint8 and parts["k_codes"].shape[-1] == 16 // 2
        stored = sum(t.untyped_storage().nbytes() for t in parts.values())
        assert stored == 25 * gear.group_bytes(2, 16, 4)
    assert cache.kept_bytes(0) == 2 * (25 * gear.group_bytes(2, 16, 4) + 3 * 2 * 2 * 16 * 4)
    # nothing else is held: the packed parts and the (short) entry buffers
    buffers = sum(cache._k[layer].numel() * 4 * 2 for layer in range(2))
    assert cache.storage_bytes() == 2 * 25 * gear.group_bytes(2, 16, 4) + buffers


def test_rows_joining_and_leaving_a_packed_batch_decode_as_alone(model):
    """A continuous batch of GEAR rows (rows of different packed lengths join, the last row
    moves into a finished one's slot) gives each request the tokens it gets alone."""
    gear = GEAR(bits=4, group=8, rank=1)
    base = torch.randint(2, TINY_VOCAB, (60,), generator=torch.Generator().manual_seed(5))
    prompts = [base[:n] for n in (44, 27, 60, 35)]
    news = [6, 20, 12, 9]
    alone = [accel.generate(model, p.unsqueeze(0), strategies=[gear], max_new_tokens=n, eos_token_id=[]).sequences[0,
             p.numel():].tolist() for p, n in zip(prompts, news)]
    with accel.Engine(model, max_batch=3, eos_token_id=[]) as engine:
        handles = [engine.submit(p, max_new_tokens=n, strategies=[gear]) for p, n in zip(prompts, news)]
        got = [h.result(timeout=120).tokens for h in handles]
    assert got == alone


def test_bad_gear_values_name_the_field(model):
    with pytest.raises(StrategyError, match=r"^gear\.bits: "):
        build_strategy({"name": "gear", "bits": 3})
    with pytest.raises(StrategyError, match=r"^gear\.rank: .*rank \(9\) must not exceed group \(8\)"):
        build_strategy("gear:group=8,rank=9")
    with pytest.raises(ValueError, match="rank"):  # the tiny model's heads have 16 dimensions
        accel.generate(model, _prompts()[0].unsqueeze(0), strategies=[GEAR(rank=17)], max_new_tokens=2)
    with pytest.raises(ValueError, match=r"^gear\.bits: 2-bit codes pack 4 to a byte .* 6 here"):
        GEAR(bits=2).check_geometry(2, 6)
    with pytest.raises(ValueError, match="one KV quantizer"):
        accel.generate(model, _prompts()[0].unsqueeze(0), strategies=[GEAR(), GEAR(bits=2)], max_new_tokens=2)


@pytest.mark.parametrize("bits,rank,per_channel", [(4, 2, True), (4, 2, False), (2, 1, True), (2, 0, False)])
def test_the_native_decode_kernel_gives_the_torch_decode(monkeypatch, bits, rank, per_channel):
    """accel.kernels.native's one-pass decode equals the torch ops' (the low-rank sum in
    another order: within float32 rounding), written into a strided view of a buffer."""
    from accel.kernels import native
    from snapkv.gear import _decode_torch, encode_group

    if native.gear_kernel() is None:
        pytest.skip("no C++ compiler for the native kernel on this machine")
    torch.manual_seed(bits + rank)
    x = torch.randn(2, 3, 4, 16, 32) * torch.linspace(0.2, 3, 32)
    for meta in (torch.float32, torch.bfloat16):
        parts = encode_group(x.to(meta), bits, rank, 9, per_channel)
        ref = torch.empty(x.shape)
        _decode_torch(parts, bits, per_channel, ref)
        buf = torch.full((2, 3, 4 * 16 + 5, 32), 7.0)
        out = buf[:, :, : 4 * 16].unflatten(2, (4, 16))
        assert native.gear_decode(parts, bits, per_channel, out)
        assert torch.allclose(out, ref, rtol=0, atol=1e-5)
        assert bool((buf[:, :, 4 * 16 :] == 7.0).all())  # nothing past the groups written
        flat = out.reshape(2, 3, 4, -1)
        assert torch.equal(flat.gather(-1, parts["idx"].long()), parts["val"].float())  # outliers exact
        buf.fill_(7.0)
        assert native.gear_decode(parts, bits, per_channel, out, groups=[4, 1])  # row 1 holds one group
        assert torch.allclose(out[0], ref[0], rtol=0, atol=1e-5) and torch.allclose(out[1, :, :1], ref[1, :, :1],
                                                                                   rtol=0, atol=1e-5)
        assert bool((out[1, :, 1:] == 7.0).all())  # a row's groups past its count are not decoded
