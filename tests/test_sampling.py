"""Sampling with drafters is lossless end to end: what ``accel.generate`` emits at T=1, and
with top-k / top-p, follows the target's own distribution, for prompt lookup, Medusa, merged
drafters (with a draft model too), rows of a batch, and a SnapKV-compressed cache.

Every check is :func:`helpers.chi2_fails` against the exact marginals of the first three new
tokens (:func:`_reference`), and every test has a negative control: the same samples drawn
with a rule that accepts every draft fail the same check, so each test can fail.
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch
from transformers import TopKLogitsWarper, TopPLogitsWarper

import accel
from accel import adapter
from accel.acceptance import Acceptance
from accel.cache import SharedCache
from accel.steps import prefill, verify_logits
from accel.strategy import AcceptanceRule, DraftProposal, Drafter
from accel.tree import DraftTree
from helpers import SMALL_DRAFT, TINY_VOCAB, chi2_fails, make_tiny_model
from snapkv import SnapKV
from speculative import DraftModel, Medusa, MedusaHeads, PromptLookup

V = TINY_VOCAB
NEW = 3  # new tokens per sample: the first from the prefill, then drafted steps


def _peaked(seed: int, scale: float = 15.0, **overrides):
    """A tiny model whose next-token distributions are peaked (top token ~0.3-0.6) but not
    point masses, so drafts are accepted often and a wrong rule shows."""
    model = make_tiny_model(seed=seed, **overrides)
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    return model


@pytest.fixture(scope="module")
def model():
    return _peaked(7)


@pytest.fixture(scope="module")
def prompts(model):
    """Two prompts of different lengths from the model's own greedy loops, so prompt lookup
    finds continuations the model often samples."""
    out = []
    for seed, n in ((7, 30), (5, 21)):
        base = torch.randint(2, V, (6,), generator=torch.Generator().manual_seed(seed))
        loop = accel.generate(model, base.unsqueeze(0), max_new_tokens=60, eos_token_id=[]).sequences[0]
        out.append(loop[-n:])
    return out


@pytest.fixture(scope="module")
def heads_dir(tmp_path_factory):
    """Random Medusa heads for the tiny models, saved to a folder."""
    folder = tmp_path_factory.mktemp("sampling_heads")
    heads = MedusaHeads(3, 64, V, 1, False)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    heads.save_pretrained(folder)
    return str(folder)


class Likely(Drafter):
    """Drafts the target's most likely next tokens (from a table of its exact conditionals),
    so drafts are accepted about as often as they are rejected: what follows a rejection (the
    residual distribution) then decides most of what is emitted."""

    name: ClassVar[str] = "likely_sampling_test"
    table: Any = None  # {t1: (the mode of t2 given t1, [the mode of t3 given t1, t2 for each t2])}

    def start(self, model, prompt):
        return int(prompt.numel())

    def propose(self, prompt_len, ctx):
        new = ctx.tokens[prompt_len:].tolist()  # emitted so far; the last one is the root
        if len(new) == 1 and new[0] in self.table:
            second, thirds = self.table[new[0]]
            chain = [second, thirds[second]]
        elif len(new) == 2 and new[0] in self.table:
            chain = [self.table[new[0]][1][new[1]]]
        else:
            return None
        chain = chain[: ctx.max_tokens]
        return DraftProposal(torch.tensor(chain), torch.arange(len(chain))) if chain else None


class AcceptEverything(AcceptanceRule):
    """WRONG on purpose: accept every draft down the first branch, then sample the bonus from p."""

    name: ClassVar[str] = "accept_everything_sampling_test"

    def accept(self, tree, probs, generator):
        path = [0]
        while tree.children[path[-1]]:
            path.append(tree.children[path[-1]][0])
        return Acceptance(path=path, next_token=int(torch.multinomial(probs[path[-1]], 1, generator=generator)))


# --------------------------------------------------------------------------- the reference


def _warped_probs(logits: torch.Tensor, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """softmax of transformers' own top-k / top-p warpers (T=1) over float32 logits [N, V]."""
    ids = torch.zeros((logits.shape[0], 1), dtype=torch.long)
    if top_k:
        logits = TopKLogitsWarper(top_k)(ids, logits)
    if top_p is not None and top_p < 1:
        logits = TopPLogitsWarper(top_p)(ids, logits)
    return torch.softmax(logits.double(), -1)


def _conditionals(model, prompt: torch.Tensor, compressor=None, top_k=None, top_p=None):
    """Exact next-token distributions when sampling plainly from ``model`` on the cache a plain
    ``accel.generate`` builds (compressed by ``compressor`` when given): p1 [V] of the first
    new token, the first tokens it allows, and for each of them [1 + V, V]: p(t2 | t1), then
    p(t3 | t1, t2) for every t2.

    Token 1 comes from the prefill. Then one pass over a batch of copies of that cache, one
    per possible first token t1, feeds t1 and below it every possible second token as
    siblings: p(t2 | t1) and p(t3 | t1, t2) for all t1, t2 at once.
    """
    geo = adapter.geometry(model)
    tokens = torch.arange(V)
    with torch.inference_mode(), adapter.packed_gqa_attention(model):
        one = SharedCache(geo.num_layers, adapter.layer_windows(model))
        with adapter.per_layer_masks(model, one):
            p1 = _warped_probs(adapter.output_logits(model, prefill(model, one, [prompt], compressor)), top_k, top_p)[0]
        firsts = torch.nonzero(p1).flatten().tolist()
        cache = SharedCache(geo.num_layers, adapter.layer_windows(model))
        parents = torch.cat([torch.tensor([-1]), torch.zeros(V, dtype=torch.long)])
        trees = [DraftTree(torch.cat([torch.tensor([t1]), tokens]), parents) for t1 in firsts]
        with adapter.per_layer_masks(model, cache):
            prefill(model, cache, [prompt] * len(firsts), compressor)
            _, logits = verify_logits(model, cache, trees, geo.dtype)
    return p1, firsts, _warped_probs(logits, top_k, top_p).reshape(len(firsts), 1 + V, V)


def _reference(model, prompt: torch.Tensor, compressor=None, top_k=None, top_p=None) -> list[torch.Tensor]:
    """Exact marginals [V] of new tokens 1, 2 and 3 (see :func:`_conditionals`)."""
    p1, firsts, probs = _conditionals(model, prompt, compressor, top_k, top_p)
    w = p1[firsts].unsqueeze(1)  # [F, 1]
    p2 = (w * probs[:, 0]).sum(0)
    p3 = (w.unsqueeze(2) * probs[:, 0].unsqueeze(2) * probs[:, 1:]).sum((0, 1))
    return [p1, p2, p3]


def _full_forward_reference(model, prompt: torch.Tensor, top_k=None, top_p=None) -> list[torch.Tensor]:
    """The same marginals from plain forwards of whole sequences, without any cache (token 3
    only where the warp leaves few first tokens: V^2 sequences otherwise)."""
    with torch.no_grad():
        p1 = _warped_probs(model(prompt.unsqueeze(0)).logits[0, -1:].float(), top_k, top_p)[0]
        one = torch.cat([prompt.expand(V, -1), torch.arange(V).unsqueeze(1)], 1)
        p2_given = _warped_probs(model(one).logits[:, -1].float(), top_k, top_p)  # [V(t1), V]
        p12 = p1[:, None] * p2_given
        firsts = torch.nonzero(p1).flatten().tolist()
        if len(firsts) > 10:
            return [p1, p12.sum(0)]
        p3 = torch.zeros(V, dtype=torch.double)
        for t1 in firsts:
            two = torch.cat([one[t1].expand(V, -1), torch.arange(V).unsqueeze(1)], 1)
            p3 += (p12[t1].unsqueeze(1) * _warped_probs(model(two).logits[:, -1].float(), top_k, top_p)).sum(0)
    return [p1, p12.sum(0), p3]


# --------------------------------------------------------------------------- sampling


def _sample(model, rows: list[torch.Tensor], strategies, runs: int, seed: int, **sampling):
    """``runs`` calls of ``accel.generate`` on the batch ``rows`` (row b seeded ``seed + b``,
    then the next call's seeds): counts [rows, NEW, V] of each row's new tokens, and the
    drafted / accepted draft tokens of all calls."""
    counts = torch.zeros(len(rows), NEW, V)
    width = max(int(r.numel()) for r in rows)
    drafted = accepted = 0
    for i in range(runs):
        out = accel.generate(model, rows, strategies=strategies, max_new_tokens=NEW, temperature=1.0,
                             seed=seed + i * len(rows), eos_token_id=[], **sampling)
        for b in range(len(rows)):
            for j, t in enumerate(out.sequences[b, width : width + NEW].tolist()):
                counts[b, j, t] += 1
        drafted += out.stats.drafted_tokens
        accepted += out.stats.accepted_tokens
    return counts, drafted, accepted


def _by_prompt(counts: torch.Tensor, rows: list[torch.Tensor], prompts: list[torch.Tensor]) -> list[torch.Tensor]:
    """The counts [NEW, V] of every prompt, summed over the rows that carry it."""
    return [sum(counts[b] for b, r in enumerate(rows) if torch.equal(r, p)) for p in prompts]


def _check_lossless(model, prompts, strategies, *, runs: int, wrong_runs: int, compressor=None, **sampling):
    """Sample the batch (each prompt in 4 rows), check every prompt's new tokens against its
    reference, then the negative control: the same strategies with an acceptance rule that
    accepts every draft fail the check on some token of every prompt."""
    rows = [p for p in prompts for _ in range(4)]
    refs = [_reference(model, p, compressor, **sampling) for p in prompts]
    counts, drafted, accepted = _sample(model, rows, strategies, runs, seed=0, **sampling)
    assert drafted > 0 and accepted > 0, (drafted, accepted)  # the rejection-sampling path ran
    for i, (got, ref) in enumerate(zip(_by_prompt(counts, rows, prompts), refs)):
        for j in range(NEW):
            assert not chi2_fails(got[j], ref[j]), f"prompt {i}, new token {j + 1}"

    wrong, _, _ = _sample(model, rows, list(strategies) + [AcceptEverything()], wrong_runs, seed=10**6, **sampling)
    for i, (got, ref) in enumerate(zip(_by_prompt(wrong, rows, prompts), refs)):
        assert any(chi2_fails(got[j], ref[j]) for j in range(1, NEW)), f"prompt {i}: the wrong rule passed"


SAMPLING = {"T=1": {}, "top_k": {"top_k": 8}, "top_p": {"top_p": 0.9}}


# --------------------------------------------------------------------------- the helper and the reference


def test_chi2_helper_passes_its_own_distribution_and_fails_a_shifted_one():
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(V, generator=g) * 3, -1)
    for seed in range(5):
        draws = torch.multinomial(p, 600, replacement=True, generator=torch.Generator().manual_seed(seed))
        counts = torch.bincount(draws, minlength=V).float()
        assert not chi2_fails(counts, p)
        assert chi2_fails(counts, 0.8 * p + 0.2 * p.roll(1))  # a fifth of the mass moved by one token
        assert chi2_fails(counts, torch.full((V,), 1.0 / V))
    point = torch.zeros(V)
    point[5] = 1.0
    assert not chi2_fails(point * 600, point) and chi2_fails(point.roll(1) * 600, point)
    forbidden = p.clone()
    forbidden[int(draws[0])] = 0.0  # one sample in a zero-probability bin fails outright
    assert chi2_fails(counts, forbidden)


@pytest.mark.parametrize("sampling", list(SAMPLING))
def test_the_reference_is_the_models_own_distribution(model, prompts, sampling):
    full = _full_forward_reference(model, prompts[1], **SAMPLING[sampling])
    cached = _reference(model, prompts[1], **SAMPLING[sampling])
    assert len(full) == 3 or sampling != "top_k"
    for a, b in zip(full, cached):
        assert torch.allclose(a, b, atol=1e-5)
    assert all(abs(float(b.sum()) - 1) < 1e-9 for b in cached)
    if sampling != "T=1":  # the warp cut the support
        assert all(int((p > 0).sum()) < V for p in cached)


# --------------------------------------------------------------------------- each drafter


def test_prompt_lookup_one_row_at_t1(model, prompts):
    ref = _reference(model, prompts[0])
    counts, drafted, accepted = _sample(model, [prompts[0]], [PromptLookup()], runs=300, seed=0)
    assert drafted > 0 and accepted > 0
    for j in range(NEW):
        assert not chi2_fails(counts[0, j], ref[j]), f"new token {j + 1}"
    wrong, _, _ = _sample(model, [prompts[0]], [PromptLookup(), AcceptEverything()], runs=150, seed=10**6)
    assert any(chi2_fails(wrong[0, j], ref[j]) for j in range(1, NEW))


def test_drafts_of_the_most_likely_tokens(model, prompts):
    """The drafts are the target's modes, accepted about half the time, over a top-3 support:
    a wrong correction after a rejection (drawn from p, say, instead of the residual) shows."""
    p1, firsts, probs = _conditionals(model, prompts[0], top_k=3)
    table = {t1: (int(probs[f, 0].argmax()), probs[f, 1:].argmax(-1).tolist()) for f, t1 in enumerate(firsts)}
    _check_lossless(model, prompts[:1], [Likely(table=table)], runs=100, wrong_runs=30, top_k=3)


@pytest.mark.parametrize("sampling", ["top_k", "top_p"])
def test_prompt_lookup(model, prompts, sampling):
    _check_lossless(model, prompts, [PromptLookup()], runs=80, wrong_runs=40, **SAMPLING[sampling])


@pytest.mark.parametrize("sampling", ["T=1", "top_p"])
def test_medusa(model, prompts, heads_dir, sampling):
    _check_lossless(model, prompts, [Medusa(heads=heads_dir, max_nodes=8)], runs=80, wrong_runs=40,
                    **SAMPLING[sampling])


# --------------------------------------------------------------------------- merged drafters


def test_prompt_lookup_merged_with_medusa(model, prompts, heads_dir):
    _check_lossless(model, prompts, [PromptLookup(num_tokens=4), Medusa(heads=heads_dir, max_nodes=6)],
                    runs=80, wrong_runs=40)


def test_prompt_lookup_medusa_and_a_draft_model_merged(model, prompts, heads_dir):
    """A sampled drafter (q recorded) beside deterministic ones below the same root."""
    draft = _peaked(4, **SMALL_DRAFT)
    strategies = [PromptLookup(num_tokens=3), Medusa(heads=heads_dir, max_nodes=4),
                  DraftModel(model=draft, num_tokens=2, stop_below=None)]
    _check_lossless(model, prompts, strategies, runs=80, wrong_runs=40, top_k=8)


# --------------------------------------------------------------------------- a compressed cache


SNAP = SnapKV(budget=10, window=4, kernel=3)


def test_plain_sampling_over_a_snapkv_cache_follows_the_compressed_reference(model, prompts):
    """The reference over the compressed cache is what plain sampling there produces, and it
    is not the uncompressed one (so the tests below see the compression)."""
    compressed, full = _reference(model, prompts[0], SNAP), _reference(model, prompts[0])
    assert 0.5 * float((compressed[1] - full[1]).abs().sum()) > 0.1  # total variation of token 2
    counts, _, _ = _sample(model, [prompts[0]] * 4, [SNAP], runs=100, seed=0)
    got = counts.sum(0)
    for j in range(NEW):
        assert not chi2_fails(got[j], compressed[j]), f"new token {j + 1}"
    assert chi2_fails(got[1], full[1]) or chi2_fails(got[2], full[2])


@pytest.mark.parametrize("sampling", ["T=1", "top_p"])
def test_prompt_lookup_over_a_snapkv_cache(model, prompts, sampling):
    _check_lossless(model, prompts, [SNAP, PromptLookup()], runs=80, wrong_runs=40, compressor=SNAP,
                    **SAMPLING[sampling])
