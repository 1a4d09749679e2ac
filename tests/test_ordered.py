"""Ordered attention (accel.kernels.ordered): the same numbers as sdpa up to float32 rounding, and
bit for bit the same for a query whatever else is verified with it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from accel.kernels import native, ordered
from accel.kernels.ordered import Layout, attend

LOW = torch.finfo(torch.bfloat16).min


@pytest.fixture(params=["torch", "native"])
def impl(request, monkeypatch):
    """Each test on both implementations: torch's operations (the native kernel turned off)
    and the one-pass C++ kernel (skipped where it cannot be built)."""
    if request.param == "torch":
        monkeypatch.setattr(native, "ordered_serves", lambda *a: False)
    elif native.ordered_kernel() is None:
        pytest.skip("no C++ compiler for the native kernel on this machine")
    return request.param


def _tree(parents: list[int]) -> torch.Tensor:
    """[T, T] ancestors-and-itself of a tree given by each node's parent (-1: root)."""
    t = len(parents)
    seen = torch.zeros(t, t, dtype=torch.bool)
    for i in range(t):
        j = i
        while j >= 0:
            seen[i, j] = True
            j = parents[j]
    return seen


def _case(lengths, pending, parents, heads_kv=3, groups=3, d=64, per_head=False, seed=0):
    """Random keys/values/queries on a cache of rows of ``lengths`` committed entries, a
    chain of ``pending`` earlier entries and a tree; the additive mask and its Layout."""
    gen = torch.Generator().manual_seed(seed)
    b, t = len(lengths), len(parents)
    start = max(lengths) + pending
    s = start + t
    k = torch.randn(b, heads_kv, s, d, generator=gen).bfloat16()
    v = torch.randn(b, heads_kv, s, d, generator=gen).bfloat16()
    q = torch.randn(b, heads_kv * groups, t, d, generator=gen).bfloat16()
    tree = _tree(parents).expand(b, t, t).clone()
    heads = heads_kv * groups if per_head else 1
    allowed = torch.zeros(b, heads, t, s, dtype=torch.bool)
    for i, n in enumerate(lengths):
        allowed[i, :, :, :n] = True
    allowed[:, :, :, max(lengths):start] = True
    allowed[:, :, :, start:] = tree[:, None]
    if per_head:  # a dropped entry per KV head (SnapKV's per-head budgets)
        for h in range(heads_kv):
            allowed[:, h * groups:(h + 1) * groups, :, 3 + h] = False
    mask = torch.zeros(allowed.shape, dtype=torch.bfloat16).masked_fill(~allowed, LOW)
    return q, k, v, mask, Layout(tuple(lengths), pending, tree)


def _sdpa(q, k, v, mask, scale):
    g = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(q.float(), k.float().repeat_interleave(g, 1), v.float().repeat_interleave(g, 1),
                                         attn_mask=mask.float(), scale=scale)
    return out.transpose(1, 2)


@pytest.mark.parametrize("gather", [0, 10**9])
@pytest.mark.parametrize("lengths,pending,parents,per_head", [
    ((130,), 0, [-1], False),
    ((130, 70, 5), 0, [-1, 0, 0, 1, 2, 4], False),
    ((200, 64), 3, [-1, 0, 1], True),
    ((63, 129), 0, [-1, 0, 0, 0, 1, 1, 2, 3], True),
])
def test_attend_equals_sdpa_in_float32(lengths, pending, parents, per_head, gather, impl, monkeypatch):
    monkeypatch.setattr(ordered, "GATHER", gather)
    monkeypatch.setattr(ordered, "probe_widths", lambda head_dim, groups: True)  # both paths, on any machine
    q, k, v, mask, layout = _case(lengths, pending, parents, per_head=per_head)
    out = attend(q.float(), k.float(), v.float(), mask, layout, 0.125)
    assert out.shape == (len(lengths), len(parents), q.shape[1], q.shape[3])
    assert torch.allclose(out, _sdpa(q, k, v, mask, 0.125), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("gather", [0, 10**9])
def test_a_node_gets_the_plain_steps_numbers_bit_for_bit(gather, impl, monkeypatch):
    # node 4's path is 0 -> 2 -> 4 (its siblings sit between them); committed, the path sits
    # at columns n, n+1 and the plain step at n+2 sees it there, next to another row
    monkeypatch.setattr(ordered, "GATHER", gather)
    n, parents = 62, [-1, 0, 0, 1, 2, 2]
    q, k, v, mask, layout = _case((n, 20), 0, parents, seed=1)
    tree_out = attend(q, k, v, mask, layout, 0.125)
    path = [0, 2, 4]
    k2 = torch.cat([k[:, :, :n], k[:, :, [n + p for p in path]]], dim=2)[:1]  # row 0 alone, path committed
    v2 = torch.cat([v[:, :, :n], v[:, :, [n + p for p in path]]], dim=2)[:1]
    mask2 = torch.zeros(1, 1, 1, n + 3, dtype=torch.bfloat16)
    plain = attend(q[:1, :, 4:5], k2, v2, mask2, Layout((n + 2,), 0, torch.ones(1, 1, 1, dtype=torch.bool)), 0.125)
    assert torch.equal(plain[0, 0], tree_out[0, 4])
    # garbage in the siblings' and the other row's entries does not move it either
    k[:, :, n + 1] += 3
    k[1] -= 1
    assert torch.equal(attend(q, k, v, mask, Layout(layout.lengths, 0, layout.tree), 0.125)[0, 4],
                       tree_out[0, 4])


def test_the_probe_catches_a_batch_dependent_product_and_ordered_attention_follows_it(monkeypatch):
    from accel.kernels import invariance
    from helpers import make_tiny_model

    # a product that gives a matrix other numbers when other matrices share its batch
    mm = ordered._mm
    monkeypatch.setattr(ordered, "_mm", lambda a, b: mm(a, b) + (1e-3 if a.shape[0] > 1 else 0.0))
    assert not ordered.probe.__wrapped__(64, 3)  # (uncached)
    monkeypatch.setattr(ordered, "_mm", mm)
    # low precision runs ordered attention exactly where the probe passes; float32 never
    model = make_tiny_model(seed=2, hidden_size=192, num_attention_heads=3, num_kv_heads=1,
                            intermediate_size=512).to(torch.bfloat16)
    for verdict in (True, False):
        monkeypatch.setattr(invariance, "_ordered_probe", lambda head_dim, groups: verdict)
        assert invariance.ordered(model) == verdict
        assert not invariance.ordered(make_tiny_model(seed=2))  # float32 runs sdpa


def test_the_tail_gather_reads_a_slice_of_a_cache_buffer_and_any_other_layout():
    # a cache layer hands attention buf[:B, :, :S] of a larger buffer; ordered attention gathers
    # each query's columns from it by one index_select over the buffer's rows
    gen = torch.Generator().manual_seed(0)
    buf = torch.randn(5, 3, 300, 8, generator=gen).bfloat16()
    cols = torch.randint(0, 120, (2, 4, 64), generator=gen)
    rows = torch.arange(2)[:, None, None]
    for x in (buf[:2, :, :120], buf[:2, :, :120].transpose(1, 2).contiguous().transpose(1, 2)):
        want = x.transpose(1, 2)[rows, cols].permute(0, 3, 1, 2, 4)  # [B, H, T, W, D]
        assert torch.equal(ordered._gather(x, cols), want)


def test_the_gather_limit_is_where_the_measured_paths_cross():
    # (entries, queries) -> (gathered, read in place) ms: gathering wins up to 512 pairs
    timings = {(128, 1): (1.0, 2.0), (512, 1): (2.0, 3.0), (256, 4): (9.0, 4.0), (1024, 2): (8.0, 5.0)}
    assert ordered.choose_limit(timings) == 512
    assert ordered.choose_limit({(128, 1): (2.0, 1.0), (512, 1): (3.0, 2.0)}) == 0  # never gather
    assert ordered.choose_limit({(128, 1): (1.0, 2.0), (512, 2): (1.0, 2.0)}) == 1024  # always
    # a noisy point inside a run of wins does not move the limit past the losses around it
    noisy = {(128, 1): (1.0, 2.0), (256, 1): (2.1, 2.0), (512, 1): (1.0, 3.0), (1024, 1): (5.0, 2.0)}
    assert ordered.choose_limit(noisy) == 512


def test_without_a_set_limit_the_measured_one_picks_the_path(monkeypatch):
    monkeypatch.setattr(ordered, "GATHER", None)
    q, k, v, mask, layout = _case((200,), 0, [-1, 0, 1])
    for limit, blocks in ((0, 3), (10**9, 0)):
        monkeypatch.setattr(ordered, "gather_limit", lambda *a, limit=limit: limit)
        assert ordered.direct_blocks(Layout(layout.lengths, 0, layout.tree), True, (64, 3, 3)) == blocks
        # a limit given to the call wins over both
        assert ordered.direct_blocks(Layout(layout.lengths, 0, layout.tree), True, (64, 3, 3), 10**9 - limit) == 3 - blocks
    monkeypatch.undo()
    timings = ordered.gather_timings(16, 2, 2)  # measured here, on random data
    assert set(timings) == set(ordered._LIMIT_POINTS) and all(g > 0 and d > 0 for g, d in timings.values())
    want = _sdpa(q, k, v, mask, 0.125)
    for gather in (None, 0, 10**9):
        assert torch.allclose(attend(q, k, v, mask, layout, 0.125, gather=gather).float(), want, atol=2e-2)


def test_the_native_kernel_agrees_with_the_torch_operations_in_bf16_and_reads_only_its_own_keys(monkeypatch):
    # the one-pass kernel and torch's operations sum in different orders: they agree to bf16
    # rounding; the kernel's result for a query does not move when other rows, queries and
    # rows of the call change (its own virtual columns fix every sum)
    if native.ordered_kernel() is None:
        pytest.skip("no C++ compiler for the native kernel on this machine")
    q, k, v, mask, layout = _case((150, 70, 5), 2, [-1, 0, 0, 1, 2, 4], per_head=True, seed=4)
    out = attend(q, k, v, mask, layout, 0.125)
    assert out.dtype == torch.bfloat16 and out.shape == (3, 6, 9, 64)
    with monkeypatch.context() as mp:
        mp.setattr(native, "ordered_serves", lambda *a: False)
        ref = attend(q, k, v, mask, Layout(layout.lengths, 2, layout.tree), 0.125)
    assert (out.float() - ref.float()).abs().max() < 2e-2
    assert (out.float() - _sdpa(q, k, v, mask, 0.125)).abs().max() < 2e-2
    # row 1 alone, its queries 0, 2, 4 only (their tree cut to them): the same bits
    keep = [0, 2, 4]
    tree = layout.tree[1:2][:, keep][:, :, keep]
    start = max(layout.lengths) + 2
    cols = list(range(70)) + [start - 2, start - 1] + [start + i for i in keep]  # its entries, the pending two, the nodes
    alone = attend(q[1:2, :, keep], k[1:2, :, cols], v[1:2, :, cols], mask[1:2][:, :, keep][:, :, :, cols],
                   Layout((70,), 2, tree), 0.125)
    assert torch.equal(alone[0], out[1, keep])
