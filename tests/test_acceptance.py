"""Acceptance rules: golden greedy walks, a statistical test that speculative sampling
reproduces the target distribution (and that the test catches wrong rules), typical acceptance."""

import pytest
import torch

from accel.strategy import REGISTRY, StrategyError, build_strategy
from accel.acceptance import Acceptance, _draw, draw_from, greedy_accept, sample_accept
from accel.tree import DraftTree
from helpers import chi2_fails
from speculative import TypicalAcceptance

V = 8


def onehot_logits(argmaxes, v=V):
    logits = torch.zeros(len(argmaxes), v)
    for row, t in enumerate(argmaxes):
        logits[row, t] = 1.0
    return logits


# --------------------------------------------------------------------------- greedy


def test_greedy_full_accept_of_a_chain():
    tree = DraftTree.chain(0, [3, 5])
    acc = greedy_accept(tree, onehot_logits([3, 5, 6]))
    assert (acc.path, acc.next_token, acc.accepted) == ([0, 1, 2], 6, 2)
    assert acc.emitted(tree) == [3, 5, 6]


def test_greedy_rejects_first_token():
    acc = greedy_accept(DraftTree.chain(0, [3, 5]), onehot_logits([4, 5, 6]))
    assert (acc.path, acc.next_token, acc.accepted) == ([0], 4, 0)


def test_greedy_picks_the_right_branch():
    #  root ├── 2 (1)
    #       └── 3 (2) ── 6 (3)
    tree = DraftTree(torch.tensor([0, 2, 3, 6]), torch.tensor([-1, 0, 0, 2]))
    acc = greedy_accept(tree, onehot_logits([3, 7, 6, 1]))
    assert (acc.path, acc.next_token, acc.accepted) == ([0, 2, 3], 1, 2)


def test_greedy_ties_take_the_first_maximum():
    tree = DraftTree(torch.tensor([0, 2, 3]), torch.tensor([-1, 0, 0]))
    logits = torch.zeros(3, V)
    logits[0, 2] = logits[0, 3] = 1.0  # tie: torch.argmax -> 2
    logits[1, 4] = 1.0
    acc = greedy_accept(tree, logits)
    assert acc.path == [0, 1] and acc.next_token == 4


def test_greedy_empty_tree_and_bad_shape():
    logits = torch.tensor([[0.1, 0.5, 0.2]])
    acc = greedy_accept(DraftTree.root_only(9), logits)
    assert (acc.path, acc.next_token, acc.accepted) == ([0], 1, 0)
    with pytest.raises(ValueError, match="N\\+1=3"):
        greedy_accept(DraftTree.chain(0, [1, 2]), logits)


def test_acceptance_dataclass():
    assert Acceptance(path=[0, 2], next_token=1).accepted == 1
    assert Acceptance(path=[0], next_token=1, accepted=0).accepted == 0
    with pytest.raises(ValueError):
        Acceptance(path=[0, 1], next_token=1, accepted=0)
    with pytest.raises(ValueError):
        Acceptance(path=[1], next_token=1)


# --------------------------------------------------------------------------- sampling: statistics

# The target: p0 after the root, p1 after any first token, p2 after any second token.
P0 = torch.tensor([0.30, 0.20, 0.15, 0.10, 0.10, 0.10, 0.05, 0.00])
P1 = torch.tensor([0.05, 0.05, 0.40, 0.10, 0.10, 0.10, 0.10, 0.10])
P2 = torch.full((V,), 1.0 / V)
# A draft distribution unlike p0, with mass on token 7 that p0 forbids.
Q = torch.tensor([0.05, 0.05, 0.10, 0.30, 0.20, 0.10, 0.05, 0.15])


def emitted_counts(rule, make_tree, probs, n, seed=0):
    """Run ``n`` acceptance steps. Returns counts of the first emitted token [V], and counts
    of the second emitted token [V, V] indexed by the first."""
    g = torch.Generator().manual_seed(seed)
    first = torch.zeros(V)
    second = torch.zeros(V, V)
    for _ in range(n):
        tree = make_tree(g)
        out = rule(tree, probs, g).emitted(tree)
        first[out[0]] += 1
        if len(out) > 1:
            second[out[0], out[1]] += 1
    return first, second


def point_chain(g):
    return DraftTree.chain(0, [0, 2])  # root -> 0 -> 2 (p0(0) = 0.3, p1(2) = 0.4)


def point_siblings(g):
    return DraftTree(torch.tensor([9, 1, 3, 7]), torch.tensor([-1, 0, 0, 0]))  # 7: p0 forbids it


def sampled_chain(g):
    x1 = int(torch.multinomial(Q, 1, generator=g))
    x2 = int(torch.multinomial(Q, 1, generator=g))
    return DraftTree(torch.tensor([9, x1, x2]), torch.tensor([-1, 0, 1]), torch.stack([Q, Q, Q]))


def iid_and_point_siblings(g):
    # Two i.i.d. samples from Q plus a deterministic sibling (one-hot row), as merge_proposals
    # builds when a sampled drafter and a deterministic one are merged.
    x = torch.multinomial(Q, 2, replacement=True, generator=g).tolist()
    onehot = torch.zeros(V)
    onehot[4] = 1.0
    return DraftTree(torch.tensor([9, x[0], x[1], 4]), torch.tensor([-1, 0, 0, 0]), torch.stack([Q, Q, Q, onehot]))


def resample_from_p(tree, probs, g):
    """WRONG: after a rejection at the root, sample the correction from p, not the residual."""
    acc = sample_accept(tree, probs, g)
    if acc.accepted == 0:
        acc.next_token = int(torch.multinomial(probs[0], 1, generator=g))
    return acc


def always_accept(tree, probs, g):
    """WRONG: accept the first child all the way down."""
    path = [0]
    while tree.children[path[-1]]:
        path.append(tree.children[path[-1]][0])
    return Acceptance(path=path, next_token=int(torch.multinomial(probs[path[-1]], 1, generator=g)))


def test_sampling_point_mass_chain_is_lossless():
    first, second = emitted_counts(sample_accept, point_chain, torch.stack([P0, P1, P2]), n=8000)
    assert not chi2_fails(first, P0)
    assert second[0].sum() == first[0]  # token 0 is only emitted by accepting the draft
    assert not chi2_fails(second[0], P1)  # the second token, given the first was the draft
    assert 0.5 * (first / first.sum() - P0).abs().sum() < 0.02  # total variation


@pytest.mark.parametrize("make_tree", [point_siblings, sampled_chain, iid_and_point_siblings])
def test_sampling_trees_and_sampled_drafts_are_lossless(make_tree):
    probs = torch.stack([P0, P1, P2, P1])[: make_tree(torch.Generator()).num_nodes]
    first, second = emitted_counts(sample_accept, make_tree, probs, n=4000, seed=1)
    assert not chi2_fails(first, P0)
    if make_tree is sampled_chain:  # second token given any accepted first token ~ p1
        assert not chi2_fails(second.sum(0), P1)


@pytest.mark.parametrize("rule", [resample_from_p, always_accept])
def test_statistical_check_detects_wrong_rules(rule):
    first, _ = emitted_counts(rule, point_chain, torch.stack([P0, P1, P2]), n=2000, seed=2)
    assert chi2_fails(first, P0)


def test_sampling_is_reproducible_with_a_seed():
    probs = torch.stack([P0, P1, P2, P1])
    runs = [emitted_counts(sample_accept, iid_and_point_siblings, probs, n=50, seed=7)[0] for _ in range(2)]
    assert torch.equal(runs[0], runs[1])


# --------------------------------------------------------------------------- sampling: edge cases


def test_sampling_with_one_hot_target_is_greedy():
    tree = DraftTree(torch.tensor([0, 2, 3, 6]), torch.tensor([-1, 0, 0, 2]))
    logits = onehot_logits([3, 7, 6, 1])
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        acc = sample_accept(tree, logits, g)  # one-hot rows are valid probabilities
        assert (acc.path, acc.next_token) == ([0, 2, 3], 1)


def test_sampling_root_only_and_forbidden_draft():
    g = torch.Generator().manual_seed(0)
    acc = sample_accept(DraftTree.root_only(5), P0.unsqueeze(0), g)
    assert acc.path == [0] and P0[acc.next_token] > 0
    forbidden = DraftTree.chain(0, [7])  # p0(7) = 0
    for _ in range(50):
        acc = sample_accept(forbidden, torch.stack([P0, P1]), g)
        assert acc.path == [0] and acc.next_token != 7


def test_degenerate_residual_falls_back_to_p():
    g = torch.Generator().manual_seed(0)
    assert _draw(torch.zeros(4), g) is None
    assert _draw(torch.tensor([float("nan"), 1.0]), g) is None
    assert draw_from(torch.zeros(4), torch.tensor([0.0, 0.0, 1.0, 0.0]), g, 0) == 2
    with pytest.raises(ValueError, match="node 3"):
        draw_from(None, torch.zeros(4), g, 3)
    # q equal to p: every draft is accepted (ratio 1), never a NaN residual
    tree = DraftTree(torch.tensor([0, 1]), torch.tensor([-1, 0]), torch.stack([P0, P0]))
    for _ in range(20):
        assert sample_accept(tree, torch.stack([P0, P1]), g).path == [0, 1]


# --------------------------------------------------------------------------- typical acceptance


def test_typical_is_a_registered_lossy_rule():
    assert TypicalAcceptance.lossy is True and TypicalAcceptance.accepts is True
    assert REGISTRY["typical"] is TypicalAcceptance
    rule = build_strategy("typical:posterior_threshold=0.2,alpha=0.5")
    assert isinstance(rule, TypicalAcceptance) and rule.posterior_threshold == 0.2 and rule.alpha == 0.5
    assert build_strategy(rule.spec()) == rule
    with pytest.raises(StrategyError, match="posterior_threshold"):
        build_strategy({"name": "typical", "posterior_threshold": 0})
    with pytest.raises(StrategyError, match="alpha"):
        build_strategy({"name": "typical", "alpha": -1})
    assert "LOSSY" in TypicalAcceptance.__doc__


def test_typical_accepts_likely_and_rejects_unlikely_drafts():
    peaked = torch.tensor([0.01, 0.01, 0.01, 0.9, 0.01, 0.02, 0.02, 0.02])
    probs = torch.stack([peaked, P1])
    rule = TypicalAcceptance()
    g = torch.Generator().manual_seed(0)
    assert rule.accept(DraftTree.chain(0, [3]), probs, g).path == [0, 1]
    low = rule.accept(DraftTree.chain(0, [0]), probs, g)
    assert low.path == [0] and low.accepted == 0


def test_typical_takes_the_longest_accepted_path():
    #  root ├── 3 (1)            p0(3) high, then p1(5) low: path length 1
    #       └── 4 (2) ── 2 (3)   p0(4) moderate, then p3... row 2 (after node 2) likes 2
    tree = DraftTree(torch.tensor([0, 3, 4, 5, 2]), torch.tensor([-1, 0, 0, 1, 2]))
    flat_ish = torch.tensor([0.05, 0.05, 0.05, 0.45, 0.30, 0.04, 0.03, 0.03])
    probs = torch.stack([flat_ish, P1, P1, P2, P2])  # P1(5) = 0.1 > threshold? see below
    rule = TypicalAcceptance(posterior_threshold=0.2, alpha=0.3)
    acc = rule.accept(tree, probs, torch.Generator().manual_seed(0))
    # thresholds: min(0.2, 0.3 * exp(-H)); for P1 that is ~0.04, so 5 (0.1) and 2 (0.4) pass;
    # both paths have length 2 -> the first path (through node 1) wins the tie.
    assert acc.path == [0, 1, 3]
    strict = TypicalAcceptance(posterior_threshold=0.2, alpha=1.0)  # P1 threshold 0.2: 5 fails
    assert strict.accept(tree, probs, torch.Generator().manual_seed(0)).path == [0, 2, 4]


def test_typical_with_one_hot_target_is_greedy():
    tree = DraftTree(torch.tensor([0, 2, 3, 6]), torch.tensor([-1, 0, 0, 2]))
    probs = onehot_logits([3, 7, 6, 1])
    acc = TypicalAcceptance().accept(tree, probs, torch.Generator().manual_seed(0))
    assert (acc.path, acc.next_token) == ([0, 2, 3], 1)
    root = TypicalAcceptance().accept(DraftTree.root_only(0), probs[:1], None)
    assert (root.path, root.next_token) == ([0], 3)
