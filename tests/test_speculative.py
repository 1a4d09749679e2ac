"""Exactness of speculative decoding: whatever a drafter proposes, greedy output is unchanged."""

from __future__ import annotations

import pytest
import torch

import accel
from accel.strategy import DraftContext, DraftProposal
from helpers import Scripted, generate_alone, make_tiny_model, repetitive_prompt
from snapkv import SnapKV
from speculative import PromptLookup


@pytest.mark.parametrize("mode", ["random", "oracle", "right_then_wrong", "empty"])
@pytest.mark.parametrize("compressed", [False, True])
def test_greedy_output_is_unchanged_by_any_drafter(mode, compressed):
    model = make_tiny_model(seed=11)
    ids = repetitive_prompt(1, 48)
    base = [SnapKV(budget=16, window=4, kernel=3)] if compressed else []
    ref = generate_alone(model, ids, 30, base).sequences
    drafter = Scripted(mode=mode, reference=tuple(ref[0].tolist()))
    out = accel.generate(model, ids, strategies=base + [drafter], max_new_tokens=30, eos_token_id=[])
    assert torch.equal(out.sequences, ref)
    if mode == "oracle":
        assert out.stats.mean_accepted > 4  # 6 drafts per step, nearly all accepted
    if mode == "random":
        assert out.stats.drafted_tokens > 0


def test_compressed_reference_differs_from_full():
    # the SnapKV case above is a real test only if compression changes the output
    model = make_tiny_model(seed=11)
    ids = repetitive_prompt(1, 48)
    full = generate_alone(model, ids, 30).sequences
    snap = generate_alone(model, ids, 30, [SnapKV(budget=16, window=4, kernel=3)]).sequences
    assert not torch.equal(full, snap)


@pytest.mark.parametrize("compressed", [False, True])
def test_prompt_lookup_is_exact_and_accepts_on_repetitive_text(compressed):
    model = make_tiny_model(seed=12)
    ids = repetitive_prompt(2, 60)
    base = [SnapKV(budget=24, window=4, kernel=3)] if compressed else []
    ref = generate_alone(model, ids, 40, base).sequences
    out = accel.generate(model, ids, strategies=base + [PromptLookup(num_tokens=6, branches=3)],
                         max_new_tokens=40, eos_token_id=[])
    assert torch.equal(out.sequences, ref)
    assert out.stats.verify_steps < 39  # some drafts were accepted


def test_composed_drafters_are_exact():
    model = make_tiny_model(seed=13)
    ids = repetitive_prompt(3, 40)
    ref = generate_alone(model, ids, 25).sequences
    strategies = [PromptLookup(num_tokens=4), Scripted(mode="random", size=5), Scripted(mode="right_then_wrong", k=2, reference=tuple(ref[0].tolist()))]
    out = accel.generate(model, ids, strategies=strategies, max_new_tokens=25, eos_token_id=[])
    assert torch.equal(out.sequences, ref)


def test_mean_accepted_for_a_scripted_drafter():
    model = make_tiny_model(seed=14)
    ids = repetitive_prompt(4, 20)
    ref = generate_alone(model, ids, 41).sequences
    drafter = Scripted(mode="right_then_wrong", k=2, size=4, reference=tuple(ref[0].tolist()))
    out = accel.generate(model, ids, strategies=[drafter], max_new_tokens=41, eos_token_id=[])
    assert torch.equal(out.sequences, ref)
    # the slow start's first step verifies one draft (accepted: 2 tokens); then every step
    # accepts exactly 2 drafts and adds the bonus: 3 tokens per step, 40 tokens after the first
    assert out.stats.verify_steps == 14  # 2 + 13 x 3 = 41, the last step's third token cut
    assert out.stats.accepted_per_step == [1] + [2] * 13
    assert out.stats.mean_accepted == pytest.approx((1 + 2 * 13 + 14) / 14)


def test_sampling_with_drafters_is_reproducible():
    model = make_tiny_model(seed=15)
    ids = repetitive_prompt(5, 30)
    kw = dict(strategies=[PromptLookup()], max_new_tokens=20, temperature=0.8, seed=3, eos_token_id=[])
    assert torch.equal(accel.generate(model, ids, **kw).sequences, accel.generate(model, ids, **kw).sequences)


def test_drafter_with_top_k_1_sampling_equals_greedy():
    # top_k=1 makes the target a point mass: lossless sampling must then reproduce greedy output
    model = make_tiny_model(seed=16)
    ids = repetitive_prompt(6, 40)
    ref = generate_alone(model, ids, 30).sequences
    out = accel.generate(model, ids, strategies=[PromptLookup(), Scripted(mode="random")], max_new_tokens=30,
                         temperature=1.0, top_k=1, seed=0, eos_token_id=[])
    assert torch.equal(out.sequences, ref)


def test_packed_gqa_attention_matches_sdpa_and_is_restored():
    from accel import adapter
    from accel.cache import SharedCache
    from accel.steps import prefill, verify
    from accel.tree import DraftTree

    model = make_tiny_model(seed=17)  # 4 query heads on 2 KV heads
    ids = repetitive_prompt(7, 30)
    tree = DraftTree.from_proposal(5, DraftProposal(torch.tensor([6, 7, 8, 9]), torch.tensor([0, 1, 0, 3])))
    outs = []
    for packed in (False, True):
        cache = SharedCache(2)
        with torch.inference_mode():
            prefill(model, cache, ids, None)
            if packed:
                with adapter.packed_gqa_attention(model):
                    assert model.config._attn_implementation != "sdpa"
                    outs.append(verify(model, cache, tree, torch.float32))
            else:
                outs.append(verify(model, cache, tree, torch.float32))
    assert torch.allclose(outs[0], outs[1], atol=1e-5)
    assert model.config._attn_implementation == "sdpa"
    accel.generate(model, ids, strategies=[PromptLookup()], max_new_tokens=3)
    assert model.config._attn_implementation == "sdpa"


def test_grouped_mask_is_built_once_per_mask_object():
    from accel import adapter

    mask = torch.randn(1, 1, 3, 7)
    grouped = adapter._grouped_mask(mask, 1, 3, 7, 2)
    assert torch.equal(grouped, torch.cat([mask, mask], dim=2))
    assert adapter._grouped_mask(mask, 1, 3, 7, 2) is grouped  # the next layer of the same forward
    other = mask.clone()  # the next verify step's mask: rebuilt, not reused
    again = adapter._grouped_mask(other, 1, 3, 7, 2)
    assert again is not grouped and torch.equal(again, grouped)
    assert adapter._grouped_mask(other, 1, 3, 7, 3).shape == (1, 1, 9, 7)
    assert adapter._grouped_mask(other, 2, 3, 7, 3).shape == (2, 1, 9, 7)


def test_find_continuations_prefers_long_and_recent_matches():
    from speculative.prompt_lookup import find_continuations

    #        0  1  2  3  4  5  6  7  8  9 10 11
    seq = [5, 6, 7, 8, 1, 6, 7, 9, 2, 4, 6, 7]
    found = find_continuations(torch.tensor(seq), max_ngram=3, min_ngram=1, length=2, branches=3)
    # the final 2-gram (6, 7) occurs at 1 and 5: most recent first; no 3-gram (4, 6, 7) match
    assert [(n, c.tolist()) for n, c in found[:2]] == [(2, [9, 2]), (2, [8, 1])]
    assert all(n == 1 for n, _ in found[2:])


def test_find_continuations_prefers_the_match_that_agrees_furthest_back():
    from speculative.prompt_lookup import find_continuations

    # the source passage 3 4 5 6 7 | 8 9 is being copied: the sequence ends with "3 4 5 6 7";
    # "6 7" also occurs later, after "2 2", followed by 1 -- more recent, but it agrees for
    # only 2 tokens where the source agrees for 5
    seq = [3, 4, 5, 6, 7, 8, 9, 2, 2, 6, 7, 1, 0, 3, 4, 5, 6, 7]
    found = find_continuations(torch.tensor(seq), max_ngram=2, min_ngram=2, length=2, branches=2)
    assert [c.tolist() for _, c in found] == [[8, 9], [1, 0]]
    # with nothing but n tokens of agreement anywhere, the most recent match comes first
    found = find_continuations(torch.tensor([6, 7, 1, 6, 7, 2, 5, 6, 7]), max_ngram=2, min_ngram=2, length=1, branches=2)
    assert [c.tolist() for _, c in found] == [[2], [1]]


def test_prompt_lookup_gates_weak_matches_after_poor_acceptance():
    pl = PromptLookup(max_ngram=2, min_gain=0.5, adaptive=False)  # length fixed: only the gate acts
    state = pl.start(None, torch.tensor([1]))
    weak = DraftContext(tokens=torch.tensor([3, 4, 5, 9, 4]), hidden=None, max_tokens=8)  # only a 1-gram match
    strong = DraftContext(tokens=torch.tensor([3, 4, 5, 9, 3, 4]), hidden=None, max_tokens=8)  # a 2-gram match
    assert pl.propose(state, weak) is not None
    for _ in range(5):
        pl.feedback(state, 4, 0)
    assert pl.propose(state, weak) is None
    assert pl.propose(state, strong).tokens.tolist()[:2] == [5, 9]


def test_prompt_lookup_draft_length_follows_acceptance():
    pl = PromptLookup(num_tokens=12, adaptive=True)
    state = pl.start(None, torch.tensor([1]))
    assert state.length == 12
    pl.feedback(state, 12, 5)  # partly accepted: a copy that ran out; keep the length
    assert state.length == 12
    pl.feedback(state, 12, 0)
    pl.feedback(state, 6, 0)
    assert state.length == 3  # nothing accepted twice: halved twice
    pl.feedback(state, 3, 3)  # fully accepted: back to the longest draft
    assert state.length == 12
    fixed = PromptLookup(num_tokens=12)  # the default keeps the length
    state = fixed.start(None, torch.tensor([1]))
    fixed.feedback(state, 12, 0)
    assert state.length == 12
