"""Prompt prefix reuse (accel.serving.prefix): the store, loading prefixes into a cache, and the
Engine giving every request exactly its alone tokens while reusing entries."""

from __future__ import annotations

import pytest
import torch

import accel
from accel import adapter
from accel.cache import SharedCache
from accel.steps import prefill, prefill_rest
from accel.api import make_rows
from accel.calibration.cost_model import CostTable, sharing_pays
from accel.engine import Batch, plan_strategies
from accel.serving.prefix import PrefixStore
from accel.serving.service import DEFAULT_PREFIX_CACHE_MB
from helpers import TINY_VOCAB, alone_tokens, make_tiny_model
from snapkv import SnapKV
from speculative import PromptLookup

SYSTEM = torch.randint(2, TINY_VOCAB, (20,), generator=torch.Generator().manual_seed(7))


def _prompt(i: int, n: int) -> torch.Tensor:
    """The shared 20-token 'system turn', then ``n`` tokens of prompt ``i``."""
    return torch.cat([SYSTEM, torch.randint(2, TINY_VOCAB, (n,), generator=torch.Generator().manual_seed(i))])


@pytest.fixture(scope="module")
def model():
    return make_tiny_model(seed=41)


def _filled(model, prompts):
    """A cache holding the whole-prompt prefill of ``prompts`` (no compression)."""
    geo = adapter.geometry(model)
    cache = SharedCache(geo.num_layers)
    with torch.inference_mode():
        hidden = prefill(model, cache, prompts)
    return cache, hidden


# ----------------------------------------------------------------------------- the store


def test_match_is_the_longest_stored_prefix_short_of_the_last_token(model):
    a, b = _prompt(1, 6), _prompt(2, 9)
    cache, _ = _filled(model, [a, b])
    store = PrefixStore(2**30, min_tokens=8)
    store.add(a, cache, 0)
    store.add(b, cache, 1)
    longer = torch.cat([b, torch.tensor([5, 6, 7])])
    m = store.match(longer)
    assert m.length == b.numel()  # all of b, which the new prompt extends
    assert torch.equal(m.keys[0][:, : m.length], cache.keys(0, 1)[0])
    assert store.match(b).length == b.numel() - 1  # the same prompt: all but its last token
    assert store.match(torch.cat([SYSTEM, torch.tensor([1, 1, 1])])).length == SYSTEM.numel()
    assert store.match(torch.randint(2, TINY_VOCAB, (30,), generator=torch.Generator().manual_seed(9))) is None
    assert PrefixStore(2**30, min_tokens=21).match(a) is None  # nothing stored
    short = PrefixStore(2**30, min_tokens=21)
    short.add(a, cache, 0)
    assert short.match(torch.cat([SYSTEM, torch.tensor([1, 1])])) is None  # 20 shared < min_tokens
    assert store.hits == 3 and store.reused_tokens == b.numel() + b.numel() - 1 + SYSTEM.numel()


def test_add_keeps_one_entry_per_line_of_prompts_and_stays_within_its_bytes(model):
    a = _prompt(1, 6)
    longer = torch.cat([a, torch.tensor([3, 4, 5, 6])])
    cache, _ = _filled(model, [a, longer])
    store = PrefixStore(2**30)
    store.add(a, cache, 0)
    one = store.nbytes
    store.add(longer, cache, 1)  # starts with a: replaces it
    assert len(store) == 1 and store.nbytes > one
    store.add(a, cache, 0)  # a stored prompt starts with it: nothing to add
    assert len(store) == 1
    assert store.match(torch.cat([a, torch.tensor([9])])).length == a.numel()

    prompts = [_prompt(i, 6) for i in range(10, 16)]
    cache, _ = _filled(model, prompts)
    small = PrefixStore(3 * one)
    for b, p in enumerate(prompts):
        small.add(p, cache, b)
        assert small.nbytes <= small.max_bytes
    assert len(small) == 3  # the oldest went first
    assert small.match(prompts[0]).length == SYSTEM.numel()  # its own entry is gone, the system turn is not
    assert small.match(prompts[-1]).length == prompts[-1].numel() - 1
    tiny = PrefixStore(one - 1)
    tiny.add(prompts[0], cache, 0)  # larger than the whole budget: not kept
    assert len(tiny) == 0 and tiny.nbytes == 0


def test_add_refuses_compressed_rows_and_bad_settings(model):
    geo = adapter.geometry(model)
    cache = SharedCache(geo.num_layers)
    p = _prompt(3, 40)
    with torch.inference_mode():
        prefill(model, cache, [p], [SnapKV(budget=16, window=4)])
    with pytest.raises(ValueError, match="only full prompt entries"):
        PrefixStore(2**30).add(p, cache, 0)
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="max_bytes"):
            PrefixStore(bad)
    with pytest.raises(ValueError, match="min_tokens"):
        PrefixStore(10, min_tokens=0)


# ----------------------------------------------------------------------------- the cache


def test_loaded_prefix_plus_the_rest_equals_the_whole_prefill(model):
    prompts = [_prompt(4, 9), _prompt(5, 1), _prompt(6, 15)]
    whole, hidden = _filled(model, prompts)
    geo = adapter.geometry(model)
    store = PrefixStore(2**30)
    sys_cache, _ = _filled(model, [torch.cat([SYSTEM, torch.tensor([1])])])
    store.add(torch.cat([SYSTEM, torch.tensor([1])]), sys_cache, 0)
    matches = [store.match(p) for p in prompts[:2]] + [None]  # the third row starts empty
    cache = SharedCache(geo.num_layers)
    cache.load_prefixes([(m.keys, m.values, m.length) if m else None for m in matches])
    assert cache.logical_lengths == [20, 20, 0]
    with torch.inference_mode():
        rest = prefill_rest(model, cache, prompts, geo.dtype)
    assert cache.logical_lengths == [p.numel() for p in prompts]
    torch.testing.assert_close(rest, hidden, rtol=1e-4, atol=1e-5)
    for layer in range(geo.num_layers):
        assert cache.row_lengths(layer) == whole.row_lengths(layer)
        for row in range(3):
            torch.testing.assert_close(cache.keys(layer, row), whole.keys(layer, row), rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(cache.values(layer, row), whole.values(layer, row), rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="longer than the row"):
        prefill_rest(model, cache, prompts, geo.dtype)  # nothing left to prefill
    with pytest.raises(ValueError, match="sliding windows"):
        SharedCache(2, windows=[4, None]).load_prefixes([None])


# ----------------------------------------------------------------------------- the engine


def test_engine_reuses_prefixes_and_every_request_gets_its_alone_tokens(model):
    first = _prompt(20, 12)
    later = [first, _prompt(21, 3), _prompt(22, 30), torch.cat([first, torch.tensor([4, 5, 6, 7, 8])]),
             _prompt(23, 9)]
    strategies = [[], [], [PromptLookup()], [], [SnapKV(budget=16, window=4)]]  # the SnapKV row prefills whole
    with accel.Engine(model, max_batch=8, eos_token_id=[]) as engine:
        assert engine.submit(first, max_new_tokens=10).result(timeout=60).tokens == alone_tokens(model, first, 10)
        handles = [engine.submit(p, max_new_tokens=10, strategies=s) for p, s in zip(later, strategies)]
        results = [h.result(timeout=60) for h in handles]
        sampled = engine.submit(_prompt(24, 5), max_new_tokens=10, temperature=0.8, seed=3).result(timeout=60)
        m = engine.metrics()
    for p, s, r in zip(later, strategies, results):
        assert r.tokens == alone_tokens(model, p, 10, s)
    assert sampled.tokens == alone_tokens(model, _prompt(24, 5), 10, temperature=0.8, seed=3)
    cached = [r.stats.cached_prompt_tokens for r in results]
    assert cached[0] == first.numel() - 1  # the same prompt again
    assert cached[1] == cached[2] == 20  # the shared system turn
    assert cached[3] == first.numel()  # the whole earlier prompt it extends
    assert cached[4] == 0  # compressed: never reuses
    assert sampled.stats.cached_prompt_tokens >= 20
    assert m["prefix_hits"] == 5 and m["prefix_tokens_reused"] == sum(cached) + sampled.stats.cached_prompt_tokens
    assert 0 < m["prefix_cache_bytes"] <= DEFAULT_PREFIX_CACHE_MB * 2**20
    assert m["prefills"] >= 3 and m["prefill_seconds"] > 0 and m["step_seconds"] > 0


@pytest.mark.filterwarnings("ignore:accel. .* verification of .* is approximate:RuntimeWarning")
def test_engine_without_prefix_reuse_and_in_low_precision_prefills_whole(model):
    p = _prompt(30, 6)
    with accel.Engine(model, max_batch=2, eos_token_id=[], prefix_cache_mb=0) as engine:
        for _ in range(2):
            assert engine.submit(p, max_new_tokens=4).result(timeout=60).stats.cached_prompt_tokens == 0
        assert engine.metrics()["prefix_hits"] == 0
    bf16 = make_tiny_model(seed=41).to(torch.bfloat16)
    with accel.Engine(bf16, max_batch=2, eos_token_id=[]) as engine:  # not claimed exact: no reuse
        for _ in range(2):
            assert engine.submit(p, max_new_tokens=4).result(timeout=60).stats.cached_prompt_tokens == 0
    for bad in (-1, float("nan"), "64", True):
        with pytest.raises(ValueError, match="prefix_cache_mb"):
            accel.Engine(model, prefix_cache_mb=bad)


def _table(fixed: float, per_token: float) -> CostTable:
    """A fake cost table: every pass costs ``fixed`` plus ``per_token`` per query token."""
    tokens = (1, 64, 1024)
    return CostTable(tokens=tokens, cache_lens=(256,), ms=(tuple(fixed + per_token * t for t in tokens),))


def test_sharing_pays_when_the_shared_tokens_outweigh_an_extra_pass():
    weights_bound = _table(fixed=40.0, per_token=0.1)  # a pass is mostly its weight reads
    compute_bound = _table(fixed=5.0, per_token=2.0)
    assert not sharing_pays(weights_bound, rows=2, shared=40, longest=50)  # saves 40 tokens of 0.1 ms < 40 ms
    assert sharing_pays(weights_bound, rows=4, shared=1000, longest=1010)
    assert sharing_pays(compute_bound, rows=2, shared=40, longest=50)
    assert not sharing_pays(compute_bound, rows=1, shared=40, longest=50)  # nothing to share with
    assert not sharing_pays(compute_bound, rows=3, shared=50, longest=50)  # no rest left to run


def _admit_together(model, prompts, costs):
    rows = make_rows(model, prompts, plan_strategies([]), max_new_tokens=8, temperature=0.0, top_k=None,
                     top_p=None, eos=[], seed=None)
    store = PrefixStore(2**30)
    batch = Batch(model, prefixes=store, costs=costs)
    with adapter.packed_gqa_attention(model), adapter.per_layer_masks(model, batch.cache), torch.inference_mode():
        batch.admit(rows)
        while batch.rows:
            batch.step()
            batch.retire_done()
    return rows, store


def test_prompts_admitted_together_share_their_common_prefix_when_it_pays(model):
    document = torch.randint(2, TINY_VOCAB, (40,), generator=torch.Generator().manual_seed(50))
    prompts = [torch.cat([document, torch.tensor([3 + i, 4, 5 + i])]) for i in range(3)]
    prompts.append(_prompt(51, 4))  # shares nothing with them
    rows, store = _admit_together(model, prompts, _table(fixed=5.0, per_token=2.0))
    assert [r.generated for r in rows] == [alone_tokens(model, p, 8) for p in prompts]
    assert [r.stats.cached_prompt_tokens for r in rows] == [document.numel()] * 3 + [0]
    assert store.hits == 3
    rows, store = _admit_together(model, prompts, _table(fixed=40.0, per_token=0.1))  # an extra pass costs more
    assert [r.generated for r in rows] == [alone_tokens(model, p, 8) for p in prompts]
    assert store.hits == 0 and [r.stats.cached_prompt_tokens for r in rows] == [0] * 4
