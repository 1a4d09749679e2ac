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


def test_prefill_hook_stores_selection_but_returns_full_entries():
    c = SharedCache(num_layers=1)
    seen = {}

    def hook(layer, keys, values):
        seen[layer] = keys.shape[2]
        return torch.tensor([[[1, 3], [0, 4]]]), None

    c.prefill_hook = hook
    keys, _ = c._store(0, *kv(t=5))
    assert keys.shape[2] == 5  # the layer still attends to the whole prompt
    assert seen == {0: 5}
    assert positions(c, head=0) == [1, 3] and positions(c, head=1) == [0, 4]


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
