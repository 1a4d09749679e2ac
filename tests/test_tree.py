"""Golden tests of draft trees: structure, masks, positions, and merging proposals."""

import pytest
import torch

from accel.strategy import DraftProposal
from accel.tree import DraftTree, merge_proposals, tree_attention_bias, tree_position_ids


def prop(tokens, parents, probs=None):
    return DraftProposal(torch.tensor(tokens), torch.tensor(parents), probs)


@pytest.fixture
def small():
    #   root(10)
    #    ├── 11 (1)
    #    │    └── 13 (3)
    #    └── 12 (2)
    return DraftTree(torch.tensor([10, 11, 12, 13]), torch.tensor([-1, 0, 0, 1]))


def test_small_tree_structure(small):
    assert small.depth.tolist() == [0, 1, 1, 2]
    assert small.ancestor_mask.tolist() == [
        [True, False, False, False],
        [True, True, False, False],
        [True, False, True, False],
        [True, True, False, True],
    ]
    assert small.children == [[1, 2], [3], [], []]
    assert small.paths == [[0, 1, 3], [0, 2]]
    assert small.retrieve_indices.tolist() == [[0, 1, 3], [0, 2, -1]]
    assert small.retrieve_indices.dtype == torch.long
    assert (small.num_nodes, small.num_drafts, len(small)) == (4, 3, 4)
    assert small.path_tokens([0, 1, 3]) == [10, 11, 13]


def test_small_tree_bias_and_positions(small):
    bias = tree_attention_bias(small, past_len=2, dtype=torch.float32)
    assert bias.shape == (1, 1, 4, 6) and bias.dtype == torch.float32
    m = torch.finfo(torch.float32).min
    assert bias[0, 0, :, :2].eq(0).all()  # the cache is visible to every node
    assert bias[0, 0, :, 2:].tolist() == [
        [0, m, m, m],
        [0, 0, m, m],
        [0, m, 0, m],
        [0, 0, m, 0],
    ]
    half = tree_attention_bias(small, past_len=0, dtype=torch.float16)
    assert half.dtype == torch.float16 and half[0, 0, 0, 1].item() == torch.finfo(torch.float16).min
    pos = tree_position_ids(small, logical_len=5)
    assert pos.tolist() == [[5, 6, 6, 7]] and pos.dtype == torch.long


def test_chain_and_root_only():
    chain = DraftTree.chain(7, [1, 2, 3])
    assert chain.tokens.tolist() == [7, 1, 2, 3] and chain.parents.tolist() == [-1, 0, 1, 2]
    assert chain.depth.tolist() == [0, 1, 2, 3]
    assert torch.equal(chain.ancestor_mask, torch.ones(4, 4, dtype=torch.bool).tril())
    assert chain.retrieve_indices.tolist() == [[0, 1, 2, 3]]
    assert DraftTree.chain(7, torch.tensor([1, 2])).tokens.tolist() == [7, 1, 2]

    root = DraftTree.root_only(7)
    assert root.tokens.tolist() == [7] and root.parents.tolist() == [-1]
    assert root.children == [[]] and root.retrieve_indices.tolist() == [[0]]
    assert tree_attention_bias(root, 3, torch.float32).tolist() == [[[[0, 0, 0, 0]]]]
    assert tree_position_ids(root, 9).tolist() == [[9]]
    assert DraftTree.root_only(-1).token_list == [-1]  # the engine's placeholder root


def test_from_proposal():
    tree = DraftTree.from_proposal(10, prop([11, 12, 13], [0, 0, 1]))
    assert tree.tokens.tolist() == [10, 11, 12, 13] and tree.parents.tolist() == [-1, 0, 0, 1]
    assert tree.probs is None
    q = torch.full((2, 5), 0.2)
    sampled = DraftTree.from_proposal(10, prop([1, 2], [0, 1], q))
    assert sampled.probs.shape == (3, 5)
    assert sampled.probs[0].eq(0).all() and torch.equal(sampled.probs[1:], q)
    assert DraftTree.from_proposal(4, None).tokens.tolist() == [4]
    assert DraftTree.from_proposal(4, prop([], [])).tokens.tolist() == [4]


@pytest.mark.parametrize(
    "parents, match",
    [
        ([-1, 0, 2], "node 2 has parent 2"),  # parent not earlier than the node
        ([-1, 0, 3], "node 2 has parent 3"),
        ([-1, -1, 0], "node 1 has parent -1"),  # negative parent below the root
        ([0, 0, 1], r"parents\[0\] must be -1"),
    ],
)
def test_invalid_parents_raise(parents, match):
    with pytest.raises(ValueError, match=match):
        DraftTree(torch.tensor([1, 2, 3]), torch.tensor(parents))


def test_invalid_proposals_raise():
    with pytest.raises(ValueError, match="node 2 has parent 2"):
        DraftTree.from_proposal(0, prop([5, 6], [0, 2]))
    with pytest.raises(ValueError, match="proposal 1: node 1 has parent 1"):
        merge_proposals([prop([5], [0]), prop([6], [1])], max_nodes=8)
    with pytest.raises(ValueError, match="shape"):
        DraftTree(torch.tensor([1, 2]), torch.tensor([-1, 0]), torch.zeros(3, 4))


# --------------------------------------------------------------------------- merging


def test_merge_deduplicates_shared_prefix_and_reports_sources():
    merged = merge_proposals([prop([5, 6, 7], [0, 1, 2]), prop([5, 6, 9], [0, 1, 2]), None], max_nodes=16)
    p = merged.proposal
    assert p.tokens.tolist() == [5, 6, 7, 9]
    assert p.parents.tolist() == [0, 1, 2, 2]  # 9 hangs below the shared "5 6"
    assert p.probs is None
    assert merged.source.tolist() == [0, 0, 0, 1]
    assert merged.proposed_by.tolist() == [[True, True, True, False], [True, True, False, True], [False] * 4]
    tree = DraftTree.from_proposal(4, p)
    assert tree.paths == [[0, 1, 2, 3], [0, 1, 2, 4]]


def test_merge_dedups_within_one_proposal_and_keeps_single_proposal():
    single = prop([5, 8, 6], [0, 0, 1])
    merged = merge_proposals([single], max_nodes=8)
    assert merged.proposal.tokens.tolist() == [5, 8, 6] and merged.proposal.parents.tolist() == [0, 0, 1]
    dup = merge_proposals([prop([5, 5, 6], [0, 0, 2])], max_nodes=8)  # two identical siblings
    assert dup.proposal.tokens.tolist() == [5, 6] and dup.proposal.parents.tolist() == [0, 1]


def test_merge_cap_is_breadth_first_then_proposal_order():
    # ranks: depth 1: 1 (p0), 9 (p1); depth 2: 2 (p0), 8 (p1); depth 3: 3 (p0) ...
    merged = merge_proposals([prop([1, 2, 3, 4], [0, 1, 2, 3]), prop([9, 8], [0, 1])], max_nodes=4)
    p = merged.proposal
    assert p.tokens.tolist() == [1, 2, 9, 8]
    assert p.parents.tolist() == [0, 1, 0, 3]
    assert merged.source.tolist() == [0, 0, 1, 1]
    assert all(par <= i for i, par in enumerate(p.parents.tolist()))  # topological (node i+1)
    three = merge_proposals([prop([1, 2, 3, 4], [0, 1, 2, 3]), prop([9, 8], [0, 1])], max_nodes=3)
    assert three.proposal.tokens.tolist() == [1, 2, 9]


def test_merge_topological_for_trees():
    a = prop([1, 2, 3, 4], [0, 0, 1, 2])
    b = prop([2, 7, 1, 5], [0, 1, 0, 3])  # 2->7 and 1->5 extend a's nodes
    merged = merge_proposals([a, b], max_nodes=16)
    p = merged.proposal
    assert p.tokens.tolist() == [1, 2, 3, 4, 7, 5]
    assert p.parents.tolist() == [0, 0, 1, 2, 2, 1]
    assert merged.source.tolist() == [0, 0, 0, 0, 1, 1]
    tree = DraftTree.from_proposal(0, p)  # validates topological order
    assert sorted(tree.path_tokens(path)[1:] for path in tree.paths) == [[1, 3], [1, 5], [2, 4], [2, 7]]


def test_merge_nothing():
    assert merge_proposals([], max_nodes=4) is None
    assert merge_proposals([None, prop([], [])], max_nodes=4) is None
    assert merge_proposals([prop([1], [0])], max_nodes=0) is None


def test_merge_sampled_proposals_are_not_deduplicated():
    q = torch.tensor([[0.1, 0.2, 0.3, 0.4]])
    merged = merge_proposals([prop([2], [0]), prop([2], [0], q)], max_nodes=8)
    p = merged.proposal
    assert p.tokens.tolist() == [2, 2] and p.parents.tolist() == [0, 0]
    assert merged.source.tolist() == [0, 1]
    assert p.probs.tolist() == [[0.0, 0.0, 1.0, 0.0], q[0].tolist()]  # point mass as one-hot
    with pytest.raises(ValueError, match="V=5"):
        merge_proposals([prop([2], [0], q), prop([1], [0], torch.full((1, 5), 0.2))], max_nodes=8)


_DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", _DEVICES)
def test_chain_and_root_only_live_on_the_given_device(device):
    want = torch.device(device).type
    for tree in (DraftTree.chain(5, [6, 7], device=device), DraftTree.root_only(5, device=device),
                 DraftTree.chain(5, torch.tensor([6, 7]), device=device)):
        for name in ("tokens", "parents", "depth", "ancestor_mask", "retrieve_indices"):
            assert getattr(tree, name).device.type == want, name
    assert DraftTree.chain(5, torch.tensor([6, 7], device=device)).tokens.device.type == want
    assert DraftTree.chain(5, [6, 7], device=device).token_list == [5, 6, 7]
