"""Unit tests of the shared cache: select / append / commit, logical vs physical length."""

import pytest
import torch

from accel.cache import SharedCache


def kv(b=1, h=2, t=5, d=4, start=0):
    """Entries whose every value encodes its position, so moves are easy to check."""
    pos = torch.arange(start, start + t, dtype=torch.float32)
    k = pos.view(1, 1, t, 1).expand(b, h, t, d).clone()
    return k, -k


def positions(cache, layer=0, head=0):
    return cache.keys(layer)[0, head, :, 0].tolist()


def test_append_grows_physical_not_logical_until_commit():
    c = SharedCache(num_layers=2)
    for layer in range(2):
        keys, values = c._store(layer, *kv(t=5))
        assert keys.shape == (1, 2, 5, 4)
    assert c.physical_length(0) == 5 and c.committed_length(0) == 0
    assert c.logical_length == 0
    c.commit(keep=None, advance=5)
    assert c.logical_length == 5 and c.committed_length(1) == 5


def test_commit_keeps_only_the_accepted_subset():
    c = SharedCache(num_layers=1)
    c._store(0, *kv(t=3))
    c.commit(keep=None, advance=3)
    c._store(0, *kv(t=4, start=10))  # a 4-node draft tree: 10, 11, 12, 13
    assert c.physical_length() == 7
    c.commit(keep=[0, 2, 3])  # accepted path root -> node 2 -> node 3
    assert positions(c) == [0, 1, 2, 10, 12, 13]
    assert torch.equal(c.values(0), -c.keys(0))
    assert c.logical_length == 6 and c.physical_length() == 6


def test_commit_contiguous_prefix_and_rollback():
    c = SharedCache(num_layers=1)
    c._store(0, *kv(t=2))
    c.commit(keep=None, advance=2)
    c._store(0, *kv(t=3, start=5))
    c.commit(keep=[0, 1])
    assert positions(c) == [0, 1, 5, 6]
    c._store(0, *kv(t=3, start=20))
    c.rollback()
    assert positions(c) == [0, 1, 5, 6] and c.logical_length == 4


def test_select_keeps_per_head_subsets_and_logical_length():
    c = SharedCache(num_layers=1)
    c._store(0, *kv(h=2, t=6))
    c.commit(keep=None, advance=6)
    idx = torch.tensor([[[0, 4, 5], [1, 2, 5]]])  # [B=1, H_kv=2, K=3]
    c.select(0, idx)
    assert c.physical_length() == 3 and c.logical_length == 6
    assert positions(c, head=0) == [0, 4, 5]
    assert positions(c, head=1) == [1, 2, 5]
    # appending after a selection continues at the physical end
    c._store(0, *kv(h=2, t=1, start=6))
    c.commit([0])
    assert positions(c, head=1) == [1, 2, 5, 6] and c.logical_length == 7


def test_select_refuses_uncommitted_entries():
    c = SharedCache(num_layers=1)
    c._store(0, *kv(t=3))
    with pytest.raises(RuntimeError, match="uncommitted"):
        c.select(0, torch.zeros(1, 2, 1, dtype=torch.long))


def test_prefill_selection_is_per_row_and_returns_full_entries():
    c = SharedCache(num_layers=1)
    seen = []

    def select(layer, row, keys, values):
        seen.append((layer, row, keys.shape[2]))
        if row == 0:
            return torch.tensor([[[1, 3], [0, 4]]]), None
        return None  # row 1 keeps its whole (shorter) prompt

    c.begin_prefill([5, 3], select)
    k = torch.cat([kv(t=5)[0], kv(t=5, start=100)[0]])  # [2, 2, 5, 4]; row 1 is right-padded
    keys, _ = c._store(0, k, -k)
    c.end_prefill()
    assert keys.shape[2] == 5  # the layer still attends to the whole prompt
    assert seen == [(0, 0, 5), (0, 1, 3)]  # each row offered its own entries, padding left out
    assert positions(c, head=0) == [1, 3] and positions(c, head=1) == [0, 4]
    assert c.keys(0, row=1)[0, 0, :, 0].tolist() == [100, 101, 102]
    assert c.row_lengths(0) == [2, 3] and c.logical_lengths == [5, 3]


def kv_rows(starts, t, h=2, d=4):
    """[B, h, t, d] entries, row b counting from starts[b]."""
    return torch.cat([kv(h=h, t=t, d=d, start=s)[0] for s in starts])


def row_positions(cache, row, layer=0, head=0):
    return cache.keys(layer, row=row)[0, head, :, 0].tolist()


def test_ragged_commit_keeps_each_rows_path_behind_its_own_entries():
    c = SharedCache(num_layers=1)
    c.begin_prefill([3, 1])
    c._store(0, kv_rows([0, 50], 3), -kv_rows([0, 50], 3))
    c.end_prefill()
    assert c.row_lengths() == [3, 1]
    # a step of 3 new entries per row, appended at the common column 3
    c._store(0, kv_rows([10, 60], 3), -kv_rows([10, 60], 3))
    c.commit([[0, 2], [0, 1, 2]])
    assert row_positions(c, 0) == [0, 1, 2, 10, 12]
    assert row_positions(c, 1) == [50, 60, 61, 62]
    assert c.logical_lengths == [5, 4]
    assert torch.equal(c.values(0, row=1), -c.keys(0, row=1))


def test_step_mask_hides_other_rows_padding_and_respects_the_tree():
    c = SharedCache(num_layers=1)
    c.begin_prefill([3, 1])
    c._store(0, kv_rows([0, 50], 3), -kv_rows([0, 50], 3))
    c.end_prefill()
    tree = torch.tensor([[True, False], [True, True]]).expand(2, 2, 2)  # root, child
    pos = torch.tensor([[3, 4], [1, 2]])
    mask = c.prepare_step(pos, tree, torch.float32, groups=1)
    assert mask.shape == (2, 1, 2, 5)
    seen = mask == 0
    assert seen[0, 0].tolist() == [[True, True, True, True, False], [True, True, True, True, True]]
    assert seen[1, 0].tolist() == [[True, False, False, True, False], [True, False, False, True, True]]


def test_sliding_window_layer_keeps_and_sees_only_its_window():
    c = SharedCache(num_layers=2, windows=[None, 4])
    c.begin_prefill([10])
    for layer in range(2):
        c._store(layer, *kv(t=10))
    c.end_prefill()
    assert c.row_lengths(0) == [10] and c.row_lengths(1) == [4]  # positions 6..9 kept
    assert positions(c, layer=1) == [6, 7, 8, 9]
    c.prepare_step(torch.tensor([[10]]), None, torch.float32, groups=1)
    seen = c.layer_mask(1)[0, 0, 0] == 0
    assert seen.tolist() == [False, True, True, True, True]  # position 6 is out of reach of 10
    assert (c.layer_mask(0) == 0).all()
    assert not c.uniform_masks


def test_extend_and_remove_move_whole_rows():
    a, b = SharedCache(num_layers=1), SharedCache(num_layers=1)
    for cache, starts, n in ((a, [0, 100], 2), (b, [200], 4)):
        cache.begin_prefill([n] * len(starts))
        cache._store(0, kv_rows(starts, n), -kv_rows(starts, n))
        cache.end_prefill()
    a.extend(b)
    assert a.batch_size == 3 and a.logical_lengths == [2, 2, 4]
    assert row_positions(a, 2) == [200, 201, 202, 203]
    a.remove(0)  # the last row moves into slot 0
    assert a.logical_lengths == [4, 2]
    assert row_positions(a, 0) == [200, 201, 202, 203] and row_positions(a, 1) == [100, 101]
    assert torch.equal(a.values(0, row=0), -a.keys(0, row=0))


def test_kept_bytes_counts_live_entries_only():
    c = SharedCache(num_layers=2)
    for layer in range(2):
        c._store(layer, *kv(b=1, h=2, t=10, d=4))
    c.commit(keep=None, advance=10)
    assert c.kept_bytes() == 2 * 2 * 10 * 2 * 4 * 4  # layers * K,V * t * heads * d * fp32
    for layer in range(2):
        c.select(layer, torch.arange(3).view(1, 1, 3).expand(1, 2, 3))
    assert c.kept_bytes() == 2 * 2 * 3 * 2 * 4 * 4


def test_buffer_growth_preserves_entries():
    c = SharedCache(num_layers=1)
    for step in range(600):  # crosses the growth slack more than once
        c._store(0, *kv(t=1, start=step))
        c.commit([0])
    assert positions(c) == list(range(600))


def test_cut_takes_rows_back_to_earlier_lengths():
    c = SharedCache(num_layers=2, windows=[None, 3])
    c.keep_behind = 2
    c.begin_prefill([4, 2])
    for layer in range(2):
        c._store(layer, kv_rows([0, 100], 4), -kv_rows([0, 100], 4))
    c.end_prefill()
    for step in range(3):  # three tokens appended to both rows, one by one
        for layer in range(2):
            c._store(layer, kv_rows([4 + step, 102 + step], 1), -kv_rows([4 + step, 102 + step], 1))
        c.commit(keep=[[0], [0]])
    assert c.logical_lengths == [7, 5]
    c.cut([5, 5])  # row 0 loses its newest two tokens, row 1 nothing
    assert c.logical_lengths == [5, 5] and c.row_lengths(0) == [5, 5]
    assert row_positions(c, 0) == [0, 1, 2, 3, 4] and row_positions(c, 1) == [100, 101, 102, 103, 104]
    assert c.row_lengths(1) == [4, 5]  # the window layer (3 prompt entries kept of row 0): one per token too
    for layer in range(2):  # appending after a cut continues behind the kept entries
        c._store(layer, kv_rows([50, 150], 1), -kv_rows([50, 150], 1))
    c.commit(keep=[[0], [0]])
    assert row_positions(c, 0) == [0, 1, 2, 3, 4, 50]
    with pytest.raises(ValueError, match="exceed"):
        c.cut([7, 6])
    with pytest.raises(ValueError, match="lengths"):
        c.cut([1])
    with pytest.raises(ValueError, match="keep_behind"):  # older window entries may be trimmed
        c.cut([3, 6])
    c.keep_behind = 10
    with pytest.raises(ValueError, match="layer 1"):  # the window layer holds fewer entries
        c.cut([0, 6])
    c._store(0, kv_rows([60, 160], 1), -kv_rows([60, 160], 1))
    with pytest.raises(RuntimeError, match="uncommitted"):
        c.cut([5, 5])


def test_window_trim_keeps_entries_a_cut_may_need():
    for behind, kept in ((0, 4), (3, 7)):
        c = SharedCache(num_layers=1, windows=[4])
        c.keep_behind = behind
        c.begin_prefill([1])
        c._store(0, *kv(t=1))
        c.end_prefill()
        for p in range(1, 300):  # long enough for the amortised trim
            c.prepare_step(torch.tensor([[p]]), None, torch.float32, groups=1)
            c._store(0, *kv(t=1, start=p))
            c.commit(keep=[0])
        assert positions(c)[0] == 261 - 4 - behind  # trimmed once, at 261 tokens
        c.cut([300 - behind])
        assert positions(c)[-kept:] == list(range(300 - behind - kept, 300 - behind))
