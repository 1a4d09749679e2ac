"""Eviction during decoding (``decode_budget``): the cache stays bounded over a long generation,
greedy drafting equals plain greedy decoding with the same eviction schedule (batch > 1
included), eviction keeps what the selector scores highest, bad values name the field."""

from __future__ import annotations

import pytest
import torch

from typing import ClassVar

import accel

from accel import adapter
from accel.engine import Batch, Row, plan_strategies
from accel.maintenance import Upkeep
from accel.strategy import StrategyError, build_strategy
from helpers import Scripted, TINY_VOCAB, assert_same_caches, decode_snapshots, make_tiny_model
from snapkv import H2O, AdaSnapKV, SnapKV, StreamingLLM
from snapkv.scoring import decode_votes, window_scores
from speculative import PromptLookup


@pytest.fixture(scope="module")
def model():
    return make_tiny_model(seed=21, num_kv_heads=2)


def _prompts():
    """Two repetitive prompts of different lengths (prompt lookup finds matches)."""
    a = torch.randint(2, TINY_VOCAB, (9,), generator=torch.Generator().manual_seed(5)).repeat(5)
    b = torch.randint(2, TINY_VOCAB, (7,), generator=torch.Generator().manual_seed(6)).repeat(4)
    return [a, b]


def _head_counts(cache, layer: int, row: int) -> torch.Tensor:
    """Valid committed entries per KV head of one row and layer, [H_kv]."""
    valid = cache.entry_valid(layer, row)
    n = cache.row_lengths(layer)[row]
    return valid.sum(-1) if valid is not None else torch.full((cache.keys(layer, row).shape[1],), n)


class _Spied(SnapKV):
    """SnapKV that records the number of queries each eviction scored with."""

    windows: ClassVar[list[int]] = []

    def evict(self, layer_idx, queries, keys, values, valid, positions=None, tokens=None):
        self.windows.append(0 if queries is None else queries.shape[2])
        return super().evict(layer_idx, queries, keys, values, valid, positions, tokens)


@pytest.mark.parametrize("strategy", [
    _Spied(budget=24, window=4, kernel=3, decode_budget=12, decode_slack=4),
    AdaSnapKV(budget=24, window=4, kernel=3, decode_budget=12, decode_slack=4),
], ids=["snapkv", "ada_snapkv"])
def test_entries_stay_within_budget_plus_slack_over_a_long_generation(model, strategy):
    plan = plan_strategies([strategy])
    rows = [Row(prompt=p, plan=plan, max_new_tokens=60, eos=frozenset()) for p in _prompts()]
    batch = Batch(model)
    peak = 0
    with adapter.packed_gqa_attention(model), adapter.per_layer_masks(model, batch.cache), torch.inference_mode():
        batch.admit(rows)
        while batch.rows:
            batch.step()
            for b in range(len(batch.rows)):
                for layer in range(batch.cache.num_layers):
                    counts = _head_counts(batch.cache, layer, b)
                    if strategy.name == "ada_snapkv":  # the budget holds on average over the heads
                        held = -(-int(counts.sum()) // counts.numel())
                    else:
                        held = int(counts.max())
                    assert held <= 12 + 4, (batch.cache.logical_lengths[b], layer, counts.tolist())
                    peak = max(peak, held)
            batch.retire_done()
    assert peak == 12 + 4 - 1  # a row grows until it reaches budget + slack, and is evicted then
    assert all(r.upkeep.evictions >= 10 for r in rows)  # ~60 tokens / 4 slack, per row
    assert all(len(r.generated) == 60 for r in rows)
    if isinstance(strategy, _Spied):  # every eviction scored with the full window of latest queries
        assert _Spied.windows and set(_Spied.windows) == {4}


def test_the_query_ring_holds_the_latest_tokens_in_order():
    up = Upkeep(layers=[0], window=4, queries={0: torch.zeros(1, 4, 1)}, slots=[-1] * 4)
    step = torch.arange(8.0).reshape(1, 1, 8, 1)  # node j's query is j
    up.record({0: step}, 0, [0, 2, 5], 10)  # positions 10, 11, 12 <- nodes 0, 2, 5
    assert up.latest_queries(0, 13).flatten().tolist() == [0, 2, 5]
    up.record({0: step + 10}, 0, [0, 1, 3, 4, 6, 7], 13)  # positions 13..18: only the last 4 stay
    assert up.latest_queries(0, 19).flatten().tolist() == [13, 14, 16, 17]
    assert up.latest_queries(0, 20) is None  # position 19 was never recorded


SELECTORS = {
    "snapkv": SnapKV(budget=20, window=4, kernel=3, decode_budget=12, decode_slack=4),
    "ada_snapkv": AdaSnapKV(budget=20, window=4, kernel=3, alpha=0.3, decode_budget=12, decode_slack=4),
    "h2o": H2O(budget=20, decode_budget=12, decode_slack=4, decode_queries=4),
    "streaming_llm": StreamingLLM(sink=2, recent=18, decode_budget=10, decode_slack=4),
}


@pytest.mark.parametrize("name", list(SELECTORS))
def test_drafting_equals_plain_decoding_with_the_same_eviction(model, name):
    """Tokens, and the caches too: at every length a drafted row reaches, its cache is the
    one plain decoding had there (evicted at the same lengths, to the same entries)."""
    selector = SELECTORS[name]
    new = 32
    plain, plain_caches = decode_snapshots(model, _prompts(), [selector], new)
    for drafter in (PromptLookup(max_ngram=2, num_tokens=6), Scripted(mode="random", size=5)):
        drafted, caches = decode_snapshots(model, _prompts(), [selector, drafter], new)
        assert [r.generated for r in drafted] == [r.generated for r in plain]
        assert sum(r.stats.accepted_tokens for r in drafted) > 0 or drafter.name == "scripted_test"
        assert all(r.stats.drafted_tokens > 0 for r in drafted)
        assert len(caches) < len(plain_caches) or drafter.name == "scripted_test"
        assert_same_caches(caches, plain_caches)
    for row in plain:  # evicted: a row ends with at most budget + slack entries per head
        assert row.upkeep.evictions >= 3
        per_token = row.stats.kv_bytes_full // (int(row.prompt.numel()) + new - 1)  # all layers' K and V
        assert row.stats.kv_bytes_kept <= (12 + 4) * per_token * (2 if name == "ada_snapkv" else 1)


def test_a_row_decodes_as_it_would_alone(model):
    selector = SELECTORS["snapkv"]
    prompts = _prompts()
    both = accel.generate(model, prompts, strategies=[selector], max_new_tokens=30, eos_token_id=[])
    alone = accel.generate(model, prompts[1].unsqueeze(0), strategies=[selector], max_new_tokens=30, eos_token_id=[])
    assert torch.equal(both.sequences[1, -30:], alone.sequences[0, -30:])


def test_eviction_keeps_the_latest_window_and_the_top_voted_entries():
    torch.manual_seed(0)
    keys = torch.randn(1, 2, 12, 8)
    queries = torch.randn(1, 4, 3, 8)  # 2 query heads per KV head, the latest 3 tokens
    strat = SnapKV(budget=8, window=3, kernel=1, gqa="max", decode_budget=6, decode_slack=2)
    sel = strat.evict(0, queries, keys, keys, None)
    votes = window_scores(queries, keys).reshape(1, 2, 2, 12).amax(dim=2)  # [1, H_kv, n]
    for h in range(2):
        top = votes[0, h, :9].topk(3).indices.sort().values.tolist()
        assert sel.indices[0, h].tolist() == top + [9, 10, 11]
    assert sel.valid is None


def test_decode_votes_rank_the_window_causally_past_padding():
    torch.manual_seed(1)
    keys = torch.randn(1, 1, 10, 8)
    queries = torch.randn(1, 2, 3, 8)
    assert torch.allclose(decode_votes(queries, keys), window_scores(queries, keys))
    # the same entries with padding columns between them (a per-head layout): same votes
    padded = torch.cat([keys[:, :, :4], torch.randn(1, 1, 2, 8), keys[:, :, 4:]], dim=2)
    valid = torch.ones(1, 1, 12, dtype=torch.bool)
    valid[..., 4:6] = False
    got = decode_votes(queries, padded, valid)
    assert torch.allclose(got[..., torch.nonzero(valid[0, 0]).flatten()], window_scores(queries, keys))
    assert float(got[..., 4:6].abs().max()) == 0.0


@pytest.mark.parametrize("spec, field", [
    ({"name": "snapkv", "decode_budget": 0}, "decode_budget"),
    ({"name": "snapkv", "window": 32, "decode_budget": 16}, "decode_budget"),
    ({"name": "ada_snapkv", "window": 8, "decode_budget": 8}, "decode_budget"),
    ({"name": "h2o", "decode_budget": 40, "decode_queries": 32}, "decode_budget"),
    ({"name": "streaming_llm", "sink": 4, "decode_budget": 4}, "decode_budget"),
    ({"name": "snapkv", "decode_budget": 64, "decode_slack": 0}, "decode_slack"),
])
def test_bad_decode_budget_names_the_field(spec, field):
    with pytest.raises(StrategyError, match=field):
        build_strategy(spec)
