"""Golden tests of SnapKV scoring and selection on small hand-made tensors."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from accel.strategy import REGISTRY, Selection, build_strategy
from snapkv import (
    H2O,
    AdaSnapKV,
    SnapKV,
    StreamingLLM,
    pool_scores,
    prefix_scores,
    reduce_gqa,
    select_topk,
    snapkv_indices,
    window_scores,
)


def _qkv(b=2, h_kv=2, g=2, w=4, length=24, d=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h_kv * g, w, d, generator=gen)
    k = torch.randn(b, h_kv, length, d, generator=gen)
    v = torch.randn(b, h_kv, length, d, generator=gen)
    return q, k, v


def _naive_window_scores(q, k):
    """Loop over query heads and window queries; full causal softmax for each."""
    b, h_q, w, d = q.shape
    h_kv, length = k.shape[1], k.shape[2]
    g = h_q // h_kv
    out = torch.zeros(b, h_q, length, dtype=torch.float64)
    for bi in range(b):
        for h in range(h_q):
            for i in range(w):
                pos = length - w + i
                logits = k[bi, h // g, : pos + 1].double() @ q[bi, h, i].double() / math.sqrt(d)
                out[bi, h, : pos + 1] += logits.softmax(-1)
    return out


def _naive_pool(x, kernel, pooling):
    pad = kernel // 2
    out = torch.empty_like(x)
    n = x.shape[-1]
    for j in range(n):
        lo, hi = max(0, j - pad), min(n, j + pad + 1)
        win = x[..., lo:hi]
        out[..., j] = win.amax(-1) if pooling == "max" else win.sum(-1) / kernel
    return out


# ----------------------------------------------------------------------------- scoring


def test_window_scores_matches_naive_loop_gqa():
    q, k, _ = _qkv(b=2, h_kv=2, g=3, w=5, length=13, d=4)
    got = window_scores(q, k)
    assert got.shape == (2, 6, 13) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), _naive_window_scores(q, k), rtol=1e-5, atol=1e-6)
    # every window query's weights sum to one: each head's scores sum to w
    torch.testing.assert_close(got.sum(-1), torch.full((2, 6), 5.0))
    # chunking the queries changes nothing
    torch.testing.assert_close(window_scores(q, k, chunk=2), got)


def test_window_scores_hand_computed_one_head():
    # D = 1, scale 1; window queries at positions 1 and 2 both equal 1.
    # query@1 sees keys 0,1 with logits [0, ln2]        -> [1/3, 2/3, 0]
    # query@2 sees keys 0..2 with logits [0, ln2, ln3]  -> [1/6, 2/6, 3/6]
    q = torch.ones(1, 1, 2, 1)
    k = torch.tensor([0.0, math.log(2), math.log(3)]).view(1, 1, 3, 1)
    torch.testing.assert_close(window_scores(q, k), torch.tensor([[[0.5, 1.0, 0.5]]]))


def test_avg_pooling_hand_made():
    x = torch.tensor([3.0, 0.0, 0.0, 6.0, 0.0])
    # kernel 3, zero padding counted: [(0+3+0)/3, (3+0+0)/3, (0+0+6)/3, (0+6+0)/3, (6+0+0)/3]
    torch.testing.assert_close(pool_scores(x, 3, "avg"), torch.tensor([1.0, 1.0, 2.0, 2.0, 2.0]))
    torch.testing.assert_close(pool_scores(x, 3, "max"), torch.tensor([3.0, 3.0, 6.0, 6.0, 6.0]))
    torch.testing.assert_close(pool_scores(x, 1, "avg"), x)


@pytest.mark.parametrize("pooling", ["max", "avg"])
@pytest.mark.parametrize("kernel", [1, 3, 5, 9])
def test_pooling_matches_naive(kernel, pooling):
    x = torch.rand(2, 3, 11, generator=torch.Generator().manual_seed(kernel))
    torch.testing.assert_close(pool_scores(x, kernel, pooling), _naive_pool(x, kernel, pooling))


@pytest.mark.parametrize("kernel", [0, 2, 4, -1])
def test_pooling_rejects_even_or_nonpositive_kernel(kernel):
    with pytest.raises(ValueError, match="kernel"):
        pool_scores(torch.zeros(5), kernel)


def test_gqa_reductions_hand_made():
    # 4 query heads, 2 KV heads: group 0 = heads 0,1; group 1 = heads 2,3.
    s = torch.tensor([[[1.0, 4.0], [3.0, 0.0], [2.0, 2.0], [6.0, -2.0]]])  # [1, 4, 2]
    torch.testing.assert_close(reduce_gqa(s, 2, "mean"), torch.tensor([[[2.0, 2.0], [4.0, 0.0]]]))
    torch.testing.assert_close(reduce_gqa(s, 2, "max"), torch.tensor([[[3.0, 4.0], [6.0, 2.0]]]))
    torch.testing.assert_close(reduce_gqa(s, 2, "sum"), torch.tensor([[[4.0, 4.0], [8.0, 0.0]]]))
    torch.testing.assert_close(reduce_gqa(s, 4, "mean"), s)


def test_select_topk_sorted_ascending():
    s = torch.tensor([[[0.1, 0.9, 0.3, 0.8, 0.0, 0.7]]])
    assert select_topk(s, 3).tolist() == [[[1, 3, 5]]]
    assert select_topk(s, 0).shape == (1, 1, 0)


# ----------------------------------------------------------------------------- SnapKV


def test_snapkv_kept_prefix_is_top_scored_and_window_kept():
    q, k, v = _qkv(b=2, h_kv=2, g=2, w=4, length=30, d=8)
    press = SnapKV(budget=12, window=4, kernel=3, pooling="max", gqa="mean")
    sel = press.select(0, q, k, v)
    assert isinstance(sel, Selection) and sel.valid is None
    idx = sel.indices
    assert idx.shape == (2, 2, 12) and idx.dtype == torch.long
    assert (idx.diff(dim=-1) > 0).all()  # ascending, unique
    assert (idx[..., -4:] == torch.arange(26, 30)).all()  # the window, always
    # brute force: naive votes -> prefix -> naive pooling -> mean over the group
    votes = _naive_window_scores(q, k).float()[..., :26]
    ref = _naive_pool(votes, 3, "max").view(2, 2, 2, 26).mean(2)  # [B, H_kv, P]
    torch.testing.assert_close(prefix_scores(q, k, 3, "max", "mean"), ref, rtol=1e-5, atol=1e-6)
    for b in range(2):
        for h in range(2):
            kept = idx[b, h, :8]
            dropped = torch.ones(26, dtype=torch.bool)
            dropped[kept] = False
            assert ref[b, h, kept].min() >= ref[b, h, dropped].max() - 1e-6
    # the functional form agrees with the strategy
    assert torch.equal(snapkv_indices(q, k, 12, 4, 3, "max", "mean"), idx)


def test_snapkv_without_pooling_keeps_exactly_brute_force_top():
    q, k, v = _qkv(b=1, h_kv=3, g=1, w=3, length=20, d=4, seed=3)
    sel = SnapKV(budget=8, window=3, kernel=1, gqa="mean").select(0, q, k, v)
    votes = _naive_window_scores(q, k)[..., :17]  # [1, 3, 17]
    for h in range(3):
        top = sorted(votes[0, h].argsort(descending=True)[:5].tolist())
        assert sel.indices[0, h].tolist() == top + [17, 18, 19]


def test_max_pooling_keeps_neighbours_of_a_spike():
    # one key p aligned with the (single) window query; all other keys orthogonal to it
    length, p, d = 16, 6, 4
    k = torch.zeros(1, 1, length, d)
    k[0, 0, :, 1] = torch.linspace(-0.2, 0.2, length)  # small background, rising to the end
    k[0, 0, p, 0] = 20.0
    q = torch.ones(1, 1, 1, d)
    sel = SnapKV(budget=4, window=1, kernel=3).select(0, q, k, k)
    assert sel.indices[0, 0].tolist() == [p - 1, p, p + 1, length - 1]
    # without pooling the spike's neighbours lose to the (slightly) higher tail
    sel1 = SnapKV(budget=4, window=1, kernel=1).select(0, q, k, k)
    assert sel1.indices[0, 0].tolist() == [p, length - 3, length - 2, length - 1]


def test_no_compression_when_prompt_fits_budget():
    q, k, v = _qkv(b=1, h_kv=2, g=2, w=4, length=10, d=4)
    assert SnapKV(budget=10, window=4).select(0, q, k, v) is None
    assert SnapKV(budget=64, window=4).select(0, q, k, v) is None
    assert AdaSnapKV(budget=10, window=4).select(0, q, k, v) is None
    assert SnapKV(ratio=1.0, window=4).select(0, q, k, v) is None
    assert StreamingLLM(sink=2, recent=8).select(0, None, k, v) is None
    assert H2O(budget=10).select(0, q, k, v) is None
    assert SnapKV(budget=9, window=4).select(0, q, k, v) is not None


def test_ratio_budget_and_observation_window():
    press = SnapKV(ratio=0.25, window=4)
    assert press.budget is None and press.ratio == 0.25
    assert press.observation_window(100) == 4 and press.observation_window(3) == 3
    q, k, v = _qkv(b=1, h_kv=1, g=1, w=4, length=40, d=4)
    assert press.select(0, q, k, v).indices.shape == (1, 1, 10)
    # a small ratio never drops the window
    sel = SnapKV(ratio=0.05, window=4).select(0, q, k, v)
    assert sel.indices[0, 0].tolist() == [36, 37, 38, 39]
    # spec round trip
    assert build_strategy(press.spec()) == press
    assert build_strategy("snapkv:ratio=0.25,window=4") == press


def test_paper_configuration_by_parameters():
    press = build_strategy({"name": "snapkv", "budget": 1024, "window": 32, "kernel": 7, "pooling": "max"})
    assert (press.budget, press.window, press.kernel, press.pooling) == (1024, 32, 7, "max")
    assert REGISTRY["snapkv"] is SnapKV and SnapKV().budget == 1024


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"budget": 32, "window": 32}, ["budget", "window"]),
        ({"budget": 8, "window": 16}, ["budget", "window"]),
        ({"kernel": 4}, ["kernel"]),
        ({"kernel": 0}, ["kernel"]),
        ({"ratio": 0.0}, ["ratio"]),
        ({"ratio": 1.5}, ["ratio"]),
        ({"budget": 100, "ratio": 0.5}, ["budget", "ratio"]),
        ({"budget": None}, ["budget"]),
        ({"budget": 0}, ["budget"]),
        ({"windw": 8}, ["windw"]),
        ({"pooling": "min"}, ["pooling"]),
        ({"gqa": "median"}, ["gqa"]),
    ],
)
def test_validation_errors_name_the_field(fields, named):
    with pytest.raises(ValidationError) as err:
        SnapKV(**fields)
    for field in named:
        assert field in str(err.value)


# ----------------------------------------------------------------------------- StreamingLLM


def test_streaming_llm_keeps_sink_and_recent():
    _, k, v = _qkv(b=2, h_kv=3, g=1, w=1, length=20, d=4)
    press = StreamingLLM(sink=3, recent=5)
    assert press.observation_window(20) == 0
    sel = press.select(0, None, k, v)
    expected = [0, 1, 2, 15, 16, 17, 18, 19]
    assert sel.indices.shape == (2, 3, 8)
    assert (sel.indices == torch.tensor(expected)).all()
    assert StreamingLLM(sink=0, recent=4).select(0, None, k, v).indices[0, 0].tolist() == [16, 17, 18, 19]
    with pytest.raises(ValidationError, match="recent"):
        StreamingLLM(sink=0, recent=0)
    with pytest.raises(ValidationError, match="budget"):
        StreamingLLM(budget=10)


# ----------------------------------------------------------------------------- H2O


def test_h2o_chunked_scores_equal_naive_column_sum():
    b, h_kv, g, length, d = 2, 2, 2, 11, 4
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(b, h_kv * g, length, d, generator=gen)
    k = torch.randn(b, h_kv, length, d, generator=gen)
    kk = k.repeat_interleave(g, dim=1)  # naive: materialize repeated keys, full L x L
    logits = q @ kk.transpose(-1, -2) / math.sqrt(d)
    logits.masked_fill_(torch.ones(length, length, dtype=torch.bool).triu(1), float("-inf"))
    naive = logits.softmax(-1).sum(-2).view(b, h_kv, g, length).mean(2)
    press = H2O(budget=6, chunk=3)
    assert press.observation_window(length) == length
    torch.testing.assert_close(press.score(0, q, k), naive)
    sel = press.select(0, q, k, k)
    assert sel.indices.shape == (b, h_kv, 6)
    assert (sel.indices[..., 3:] == torch.tensor([8, 9, 10])).all()  # recent = budget // 2
    for bi in range(b):
        for h in range(h_kv):
            top = sorted(naive[bi, h, :8].argsort(descending=True)[:3].tolist())
            assert sel.indices[bi, h, :3].tolist() == top
    with pytest.raises(ValidationError, match="recent"):
        H2O(budget=4, recent=5)


# ----------------------------------------------------------------------------- AdaSnapKV


def _check_ada(sel, budget, h_kv, length, window, floor):
    idx, valid = sel.indices, sel.valid
    assert valid is not None and valid.shape == idx.shape and valid.dtype == torch.bool
    assert (valid.sum(dim=(-1, -2)) == budget * h_kv).all()  # same total as SnapKV
    assert (idx.diff(dim=-1) >= 0).all() and ((idx >= 0) & (idx < length)).all()
    for b in range(idx.shape[0]):
        for h in range(h_kv):
            row = idx[b, h][valid[b, h]]
            assert (row.diff() > 0).all()  # valid entries ascending and unique
            assert row[-window:].tolist() == list(range(length - window, length))
            assert len(row) - window >= floor
            assert valid[b, h, : len(row)].all()  # padding only at the end


def test_ada_uneven_heads_get_uneven_budgets():
    # direct test of the allocation on hand-made scores: head 0 peaky, head 1 flat
    length, window, budget = 24, 4, 12  # prefix 20, per-head prefix budget 8
    scores = torch.zeros(1, 2, length)
    scores[0, 0, [2, 9, 15]] = 10.0  # three spikes, zeros elsewhere
    scores[0, 1, :20] = 1.0 + torch.linspace(0, 0.01, 20)  # flat but distinct
    press = AdaSnapKV(budget=budget, window=window, alpha=0.25)  # floor = 2
    sel = press.choose(scores, budget, 0, window)
    _check_ada(sel, budget, 2, length, window, floor=2)
    counts = sel.valid.sum(-1)[0] - window
    # floors (2 each) then 12 shared: head 0's third spike + 11 of head 1's entries
    assert counts.tolist() == [3, 13]
    assert sel.indices[0, 0][sel.valid[0, 0]].tolist() == [2, 9, 15, 20, 21, 22, 23]
    assert sel.indices.shape == (1, 2, 17)
    assert (sel.indices[0, 0, 7:] == 23).all()  # padding repeats the last window position
    row1 = sel.indices[0, 1][sel.valid[0, 1]].tolist()
    assert row1 == list(range(7, 20)) + [20, 21, 22, 23]  # the 13 highest of the flat head


def test_ada_alpha_one_is_snapkv():
    q, k, v = _qkv(b=2, h_kv=2, g=2, w=4, length=30, d=8, seed=5)
    ada = AdaSnapKV(budget=12, window=4, kernel=3, gqa="mean", alpha=1.0).select(0, q, k, v)
    ref = SnapKV(budget=12, window=4, kernel=3, gqa="mean").select(0, q, k, v)
    assert ada.valid.all() and torch.equal(ada.indices, ref.indices)


@pytest.mark.parametrize("alpha", [0.0, 0.2, 0.5])
def test_ada_select_invariants_random(alpha):
    q, k, v = _qkv(b=2, h_kv=4, g=2, w=4, length=40, d=8, seed=11)
    budget, window = 10, 4
    press = AdaSnapKV(budget=budget, window=window, kernel=3, alpha=alpha)
    assert press.name == "ada_snapkv" and REGISTRY["ada_snapkv"] is AdaSnapKV
    sel = press.select(0, q, k, v)
    _check_ada(sel, budget, 4, 40, window, floor=int(alpha * (budget - window)))
