"""FastGen: each head's cheapest policy that recovers enough attention (golden, on hand-made
votes), the policies applied to generated tokens by their ids, the padded per-head layout,
exact drafting with the policies re-applied during decoding, bad values."""

from __future__ import annotations

import pytest
import torch

from accel.strategy import StrategyError, build_strategy
from helpers import Scripted, TINY_VOCAB, assert_same_caches, decode_snapshots, make_tiny_model
from snapkv import FastGen
from snapkv.fastgen import POLICIES, choose_policies, policy_masks
from speculative import PromptLookup


def _masks(votes, ids, window=1, special=(7,), punctuation=(9,), frequent=0.25, local=0.5):
    n = votes.shape[-1]
    positions = torch.arange(n).expand_as(votes)
    valid = torch.ones_like(votes, dtype=torch.bool)
    return valid, policy_masks(votes, valid, positions, ids.expand_as(votes), window, special, punctuation,
                               frequent, local)


def test_each_head_takes_the_cheapest_policy_that_recovers_enough():
    ids = torch.tensor([3, 7, 4, 9, 4, 4, 4, 4])  # position 0 is the sink, 1 special, 3 punctuation
    votes = torch.tensor([[[.5, .3, .0, .0, .0, .0, .0, .2],  # sink, special and the window: special
                           [.1, .1, .0, .6, .0, .0, .0, .2],  # needs the punctuation at 3
                           [.05, .0, .0, .0, .0, .75, .0, .2],  # a heavy hitter at 5: frequency
                           [.1, .0, .0, .0, .1, .1, .5, .2],  # the latest half: local
                           [.0, .0, .1, .0, .35, .35, .0, .2]]])  # 2 is none of those: full
    valid, masks = _masks(votes, ids)
    choice, keep = choose_policies(votes, valid, masks, recovery=0.95)
    assert [POLICIES[c] for c in choice[0].tolist()] == ["special", "punctuation", "frequency", "local", "full"]
    kept = [torch.nonzero(k).flatten().tolist() for k in keep[0]]
    assert kept == [[0, 1, 7], [0, 1, 3, 7], [0, 1, 3, 5, 7], [0, 1, 3, 4, 5, 6, 7], list(range(8))]
    # each policy keeps what the cheaper ones keep
    assert all(bool((masks[i] <= masks[i + 1]).all()) for i in range(len(POLICIES) - 1))


def test_policies_apply_to_generated_tokens_by_their_ids():
    """Decode-time eviction: with any policy enough, a head keeps the latest window, the
    first position and the special tokens wherever they sit, prompt or generated."""
    torch.manual_seed(0)
    keys = torch.randn(1, 2, 12, 8)
    queries = torch.randn(1, 4, 3, 8)
    tokens = torch.tensor([5, 6, 7, 6, 6, 7, 6, 6, 6, 7, 6, 6, 6, 6, 6, 6, 6, 6, 6, 7])
    positions = torch.tensor([0, 2, 3, 5, 6, 8, 10, 12, 13, 14, 15, 16])  # what the row holds
    strat = FastGen(window=3, recovery=1e-6, special_ids=(7,), decode_slack=4)
    sel = strat.evict(0, queries, keys, keys, None, positions.expand(1, 2, 12), tokens)
    held = positions[sel.indices[0, 0]].tolist()
    assert held == [0, 2, 5, 14, 15, 16]  # sink; token 7 at 2 and 5; the latest 3 (14: also a 7)
    assert sel.valid is None and torch.equal(sel.indices[0, 0], sel.indices[0, 1])


@pytest.fixture(scope="module")
def model():
    return make_tiny_model(seed=41)


def _prompts():
    a = torch.randint(2, TINY_VOCAB, (10,), generator=torch.Generator().manual_seed(12)).repeat(4)
    b = torch.randint(2, TINY_VOCAB, (7,), generator=torch.Generator().manual_seed(13)).repeat(4)
    return [a, b]


@pytest.mark.parametrize("fastgen", [
    FastGen(window=4, recovery=0.3, frequent=0.2, local=0.2, punctuation_ids=(5, 17, 30), decode_slack=6),
    FastGen(window=4, recovery=0.35, frequent=0.2, local=0.2, punctuation_ids=(5, 17, 30), decode_budget=16,
            decode_slack=4),
], ids=["every_slack_tokens", "decode_budget"])
def test_drafting_equals_plain_decoding_with_fastgen(model, fastgen):
    new = 30
    plain, plain_caches = decode_snapshots(model, _prompts(), [fastgen], new)
    for drafter in (PromptLookup(max_ngram=2, num_tokens=6), Scripted(mode="random", size=5)):
        drafted, caches = decode_snapshots(model, _prompts(), [fastgen, drafter], new)
        assert [r.generated for r in drafted] == [r.generated for r in plain]
        assert all(r.stats.drafted_tokens > 0 for r in drafted)
        assert_same_caches(caches, plain_caches)
    assert all(r.upkeep.evictions >= 2 for r in plain)  # the policies were applied to generated tokens
    # heads keep different counts: the padded per-head layout
    assert any(not bool(v.all()) for layers in plain_caches.values() for _, _, v in layers)
    if fastgen.decode_budget is not None:
        for key, layers in plain_caches.items():
            for _, _, valid in layers:
                assert int(valid.sum(-1).max()) <= 16 + 4, key


@pytest.mark.parametrize("spec, field", [
    ({"name": "fastgen", "recovery": 0}, "recovery"),
    ({"name": "fastgen", "recovery": 1.5}, "recovery"),
    ({"name": "fastgen", "window": 16, "decode_budget": 16}, "decode_budget"),
    ({"name": "fastgen", "local": 1.0}, "local"),
])
def test_bad_fastgen_values_name_the_field(spec, field):
    with pytest.raises(StrategyError, match=field):
        build_strategy(spec)
