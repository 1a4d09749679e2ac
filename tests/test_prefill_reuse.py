"""Prefill reuse (``accel.steps.reusing_prefills``): calls on the same prompts start from one
kept uncompressed prefill, each compressor selecting from it; the tokens, the kept entries
and the KV bytes are those of a call that prefills on its own."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch

import accel
from accel.cache import SharedCache
from accel.steps import PrefillReuse, prefill, reusing_prefills
from snapkv import SnapKV, StreamingLLM
from accel.strategy import Drafter
from speculative import PromptLookup

from helpers import left_padded, make_tiny_model, random_prompt, repetitive_prompt

KW = dict(max_new_tokens=12, eos_token_id=[])


class Features(Drafter):
    """Reads layer 1's prompt hidden states (as EAGLE does); proposes nothing."""

    name: ClassVar[str] = "features_test"

    def feature_layers(self, model: Any) -> tuple[int, ...]:
        return (1,)

    def propose(self, state: Any, ctx: Any) -> None:
        return None


@pytest.fixture(scope="module")
def model():
    return make_tiny_model(seed=4)


def _same(a, b):
    assert torch.equal(a.sequences, b.sequences)
    assert a.stats.kv_bytes_kept == b.stats.kv_bytes_kept
    assert a.stats.kv_bytes_full == b.stats.kv_bytes_full


@pytest.mark.parametrize("chunk", [None, 48])
def test_each_configuration_starts_from_one_prefill(model, chunk):
    prompt = repetitive_prompt(1, 200, period=23)
    grid = {"full": [], "snapkv_64": [SnapKV(budget=64, window=16)], "snapkv_32": [SnapKV(budget=32, window=8)],
            "snapkv_64+lookup": [SnapKV(budget=64, window=16), PromptLookup()], "lookup": [PromptLookup()],
            "streaming": [StreamingLLM(sink=4, recent=40)]}
    alone = {name: accel.generate(model, prompt, strategies=s, prefill_chunk=chunk, **KW) for name, s in grid.items()}
    with reusing_prefills() as reuse:
        shared = {name: accel.generate(model, prompt, strategies=s, prefill_chunk=chunk, **KW)
                  for name, s in grid.items()}
    assert (reuse.misses, reuse.hits) == (1, len(grid) - 1)
    for name in grid:
        _same(shared[name], alone[name])
    assert shared["snapkv_32"].stats.kv_bytes_kept < shared["snapkv_64"].stats.kv_bytes_kept < \
        shared["full"].stats.kv_bytes_kept


def test_the_kept_prefill_is_left_as_it_was(model):
    prompt = random_prompt(2, 150)
    with reusing_prefills() as reuse:
        accel.generate(model, prompt, **KW)
        before = [(k.clone(), v.clone()) for k, v in zip(reuse.kept.cache._k, reuse.kept.cache._v)]
        hidden = reuse.kept.hidden.clone()
        accel.generate(model, prompt, strategies=[SnapKV(budget=40, window=8)], **KW)
        accel.generate(model, prompt, **KW)  # the full cache grows by its decode
    for (k, v), k2, v2 in zip(before, reuse.kept.cache._k, reuse.kept.cache._v):
        assert torch.equal(k, k2) and torch.equal(v, v2)
    assert torch.equal(hidden, reuse.kept.hidden)
    assert reuse.hits == 2


def test_another_prompt_or_chunk_replaces_the_kept_prefill(model):
    a, b = random_prompt(3, 120), random_prompt(4, 120)
    with reusing_prefills() as reuse:
        accel.generate(model, a, **KW)
        accel.generate(model, b, **KW)
        assert reuse.kept.matches(model, [b[0]], None)
        accel.generate(model, b, prefill_chunk=32, **KW)
        accel.generate(model, b, prefill_chunk=32, strategies=[SnapKV(budget=32, window=8)], **KW)
    assert (reuse.misses, reuse.hits) == (3, 1)


def test_batched_rows_of_different_lengths(model):
    prompts = [repetitive_prompt(5, 90, period=11), repetitive_prompt(6, 140, period=13)]
    ids, mask = left_padded(prompts)
    strategies = [SnapKV(budget=48, window=8), PromptLookup()]
    alone = accel.generate(model, ids, attention_mask=mask, strategies=strategies, **KW)
    with reusing_prefills() as reuse:
        accel.generate(model, ids, attention_mask=mask, **KW)
        shared = accel.generate(model, ids, attention_mask=mask, strategies=strategies, **KW)
    assert reuse.hits == 1
    _same(shared, alone)


def test_what_cannot_start_from_it_prefills_on_its_own(model):
    prompt = random_prompt(7, 130)
    with reusing_prefills(PrefillReuse(window=8)) as reuse:
        accel.generate(model, prompt, **KW)
        wide = accel.generate(model, prompt, strategies=[SnapKV(budget=40, window=16)], **KW)  # needs 16 queries
        heads = accel.generate(model, prompt, strategies=[Features()], **KW)  # reads prompt states
    assert (reuse.misses, reuse.hits) == (1, 0)
    _same(wide, accel.generate(model, prompt, strategies=[SnapKV(budget=40, window=16)], **KW))
    assert torch.equal(heads.sequences, accel.generate(model, prompt, **KW).sequences)


def test_explicit_prefill_then_calls_hit(model):
    prompt = random_prompt(8, 100)
    reuse = PrefillReuse()
    kept = reuse.prefill(model, prompt)
    assert kept.seconds > 0 and kept.cache.logical_lengths == [100]
    with reusing_prefills(reuse):
        out = accel.generate(model, prompt, strategies=[SnapKV(budget=32, window=8)], **KW)
    assert (reuse.misses, reuse.hits) == (1, 1)
    _same(out, accel.generate(model, prompt, strategies=[SnapKV(budget=32, window=8)], **KW))
    assert accel.steps._REUSE.get() is None  # the block is over


def test_bad_window_is_refused():
    with pytest.raises(ValueError, match="window"):
        PrefillReuse(window=-1)


def test_load_prompts_refuses_and_leaves_nothing_half_loaded(model):
    full = SharedCache(2)
    prefill(model, full, random_prompt(9, 40))
    held = SharedCache(2)
    prefill(model, held, random_prompt(9, 40))
    with pytest.raises(RuntimeError, match="already holds rows"):
        held.load_prompts(full)
    broken = SharedCache(2)
    prefill(model, broken, random_prompt(9, 40))
    broken._len[1] = [39]
    fresh = SharedCache(2)
    with pytest.raises(RuntimeError, match="layer 1"):
        fresh.load_prompts(broken)
    assert fresh.batch_size == 0 and fresh._k[0] is None
    fresh.load_prompts(full)
    assert torch.equal(fresh.keys(0), full.keys(0)) and fresh.logical_lengths == [40]


def test_a_batch_of_one_prompt_repeated_starts_from_its_one_row_prefill(model):
    prompt = repetitive_prompt(10, 160, period=17)
    batch = prompt.repeat(3, 1)
    strategies = [SnapKV(budget=48, window=8), PromptLookup()]
    alone = accel.generate(model, batch, strategies=strategies, **KW)
    reuse = PrefillReuse()
    reuse.prefill(model, prompt)
    with reusing_prefills(reuse):
        shared = accel.generate(model, batch, strategies=strategies, **KW)
        full = accel.generate(model, batch, **KW)
    assert (reuse.misses, reuse.hits) == (1, 2)
    _same(shared, alone)
    assert torch.equal(full.sequences, accel.generate(model, batch, **KW).sequences)
    assert len(reuse.kept.rows) == 1


def test_rows_in_another_order_map_to_their_kept_rows(model):
    a, b = random_prompt(11, 70), random_prompt(12, 110)
    ids, mask = left_padded([a, b])
    swapped, smask = left_padded([b, a])
    strategies = [SnapKV(budget=40, window=8)]
    with reusing_prefills() as reuse:
        accel.generate(model, ids, attention_mask=mask, **KW)
        shared = accel.generate(model, swapped, attention_mask=smask, strategies=strategies, **KW)
    assert reuse.hits == 1
    _same(shared, accel.generate(model, swapped, attention_mask=smask, strategies=strategies, **KW))
