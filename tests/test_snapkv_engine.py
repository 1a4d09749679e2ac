"""SnapKV on the shared cache of a tiny model: budgets held, no-op when it should be, stats."""

import pytest
import torch

import accel
from accel import adapter
from accel.cache import SharedCache
from accel.steps import prefill
from helpers import TINY_VOCAB, make_tiny_model, random_prompt
from snapkv import H2O, SnapKV, StreamingLLM
from snapkv.scoring import snapkv_indices


@pytest.mark.parametrize("strategy", [SnapKV(budget=20, window=4, kernel=3), StreamingLLM(sink=4, recent=16),
                                      H2O(budget=20)])
def test_each_layer_holds_exactly_budget_entries_per_kv_head(strategy):
    model = make_tiny_model(num_kv_heads=2)
    cache = SharedCache(adapter.geometry(model).num_layers)
    with torch.inference_mode():
        prefill(model, cache, random_prompt(0, 64), strategy)
    for layer in range(cache.num_layers):
        assert cache.keys(layer).shape == (1, 2, 20, 16)
        assert cache.physical_length(layer) == 20
    assert cache.logical_length == 64


def test_kept_entries_are_the_snapkv_selection():
    """The cache holds exactly the keys SnapKV scores highest, computed from the layer's own queries."""
    model = make_tiny_model(seed=2)
    ids = random_prompt(3, 50)
    strat = SnapKV(budget=12, window=4, kernel=3)
    full, snap, probe = SharedCache(2), SharedCache(2), SharedCache(2)
    positions = torch.arange(50).unsqueeze(0)
    captured = {}
    with torch.inference_mode():
        prefill(model, full, ids, None)
        prefill(model, snap, ids, strat)
        with adapter.capture_window_queries(model, probe, 4, captured):
            adapter.backbone_forward(model, ids, positions, SharedCache(2))
            assert not captured  # the hooks only act on forwards that carry their own cache
            adapter.backbone_forward(model, ids, positions, probe)
    for layer in range(2):
        idx = snapkv_indices(captured[layer], full.keys(layer), 12, 4, 3, "max", strat.gqa)
        expect = full.keys(layer).gather(2, idx.unsqueeze(-1).expand(-1, -1, -1, 16))
        assert torch.allclose(snap.keys(layer), expect)


def test_budget_at_least_prompt_length_is_identical_to_no_strategy():
    model = make_tiny_model(seed=4)
    ids = random_prompt(5, 30)
    plain = accel.generate(model, ids, max_new_tokens=15, eos_token_id=[])
    same = accel.generate(model, ids, strategies=[SnapKV(budget=30, window=4)], max_new_tokens=15, eos_token_id=[])
    assert torch.equal(plain.sequences, same.sequences)
    assert same.stats.kv_bytes_kept == plain.stats.kv_bytes_kept


def test_kv_bytes_full_and_kept():
    model = make_tiny_model()
    ids = random_prompt(6, 100)
    res = accel.generate(model, ids, strategies=[SnapKV(budget=24, window=4)], max_new_tokens=11, eos_token_id=[])
    per_token = 2 * 2 * 2 * 16 * 4  # layers * (K, V) * kv heads * head_dim * fp32
    # the last generated token is never fed back, so 100 + 10 tokens have KV
    assert res.stats.kv_bytes_full == 110 * per_token
    assert res.stats.kv_bytes_kept == (24 + 10) * per_token


def test_compression_works_with_eager_attention():
    model = make_tiny_model(seed=7, attn_implementation="eager")
    ids = random_prompt(8, 40)
    sdpa = make_tiny_model(seed=7)
    a = accel.generate(model, ids, strategies=[SnapKV(budget=16, window=4)], max_new_tokens=12, eos_token_id=[])
    b = accel.generate(sdpa, ids, strategies=[SnapKV(budget=16, window=4)], max_new_tokens=12, eos_token_id=[])
    assert torch.equal(a.sequences, b.sequences)


def test_ratio_keeps_that_fraction():
    model = make_tiny_model()
    res = accel.generate(model, random_prompt(0, 80), strategies=[SnapKV(ratio=0.25, window=4)], max_new_tokens=1, eos_token_id=[])
    assert res.stats.kv_bytes_kept * 4 == res.stats.kv_bytes_full


def _ada_cache(model, ids, strategy):
    cache = SharedCache(adapter.geometry(model).num_layers)
    with torch.inference_mode():
        prefill(model, cache, ids, strategy)
    return cache


def test_ada_snapkv_stores_uneven_heads_with_padding_masked_out():
    from snapkv import AdaSnapKV

    model = make_tiny_model(seed=8)
    ids = random_prompt(9, 96)
    strat = AdaSnapKV(budget=24, window=4, kernel=3, alpha=0.2)
    cache = _ada_cache(model, ids, strat)
    assert cache.ragged
    valid = [cache._valid[layer] for layer in range(2)]
    counts = [v.sum(-1) if v is not None else None for v in valid]
    for layer, c in enumerate(counts):
        if c is not None:
            assert int(c.sum()) == 24 * 2  # same total as SnapKV over the 2 KV heads
    assert any(c is not None and c.min() < c.max() for c in counts)
    # less stored than the full prompt
    assert all(cache.physical_length(layer) < 96 for layer in range(2))

    # padded entries must not influence attention: scramble them, the output stays
    def run(scramble):
        c = _ada_cache(model, ids, strat)
        if scramble:
            c._k = [k.clone() for k in c._k]  # inference tensors are read-only outside inference_mode
            c._v = [v.clone() for v in c._v]
            for layer in range(2):
                if c._valid[layer] is not None:
                    pad = ~c._valid[layer]
                    k = c._k[layer][:, :, : pad.shape[2]]
                    k[pad] = 50.0
                    c._v[layer][:, :, : pad.shape[2]][pad] = -30.0
        from accel.steps import verify
        from accel.tree import DraftTree

        tree = DraftTree.chain(5, [6, 7, 8])
        with torch.inference_mode(), adapter.per_layer_masks(model, c):
            return verify(model, c, tree, torch.float32)

    assert torch.allclose(run(False), run(True), atol=1e-5)


def test_ada_with_full_floor_equals_snapkv():
    from snapkv import AdaSnapKV

    model = make_tiny_model(seed=10)
    ids = random_prompt(11, 80)
    a = accel.generate(model, ids, strategies=[AdaSnapKV(budget=20, window=4, kernel=3, alpha=1.0)], max_new_tokens=12, eos_token_id=[])
    s = accel.generate(model, ids, strategies=[SnapKV(budget=20, window=4, kernel=3)], max_new_tokens=12, eos_token_id=[])
    assert torch.equal(a.sequences, s.sequences)


def test_drafters_on_an_ada_cache_are_exact():
    from snapkv import AdaSnapKV
    from speculative import PromptLookup

    model = make_tiny_model(seed=12)
    base = torch.randint(2, TINY_VOCAB, (20,), generator=torch.Generator().manual_seed(4))
    ids = base.repeat(5).unsqueeze(0)
    ada = [AdaSnapKV(budget=24, window=4, kernel=3)]
    ref = accel.generate(model, ids, strategies=ada, max_new_tokens=30, eos_token_id=[])
    out = accel.generate(model, ids, strategies=ada + [PromptLookup()], max_new_tokens=30, eos_token_id=[])
    assert torch.equal(out.sequences, ref.sequences)
    assert out.stats.verify_steps < ref.stats.verify_steps
