"""N-Grammys: the model-derived bigram table, its cache, the best-first draft tree, and
greedy exactness whatever the table says."""

from __future__ import annotations

import pytest
import torch

import accel
from accel.strategy import DraftContext, build_strategy
from helpers import TINY_VOCAB, make_tiny_model
from speculative import NGrammys, PromptLookup
from speculative.ngrammys import BigramTable, bigram_table, model_bigrams, sink_token


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ACCEL_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _greedy(model, ids, new, strategies=()):
    return accel.generate(model, ids, strategies=list(strategies), max_new_tokens=new, eos_token_id=[])


@pytest.mark.parametrize("after_bos", [True, False])
def test_the_table_is_the_models_top_k_after_each_token(after_bos):
    model = make_tiny_model()
    bos = model.config.bos_token_id
    assert bos is not None
    table = model_bigrams(model, top_k=3, chunk=40, progress=False, after_bos=after_bos)
    assert table.tokens.shape == (TINY_VOCAB, 3) and table.probs.shape == (TINY_VOCAB, 3)
    with torch.inference_mode():
        for v in (0, 7, 41, TINY_VOCAB - 1):
            ids = [bos, v] if after_bos else [v]  # after BOS: position 0 is the attention sink, not context
            probs = torch.softmax(model(input_ids=torch.tensor([ids])).logits[0, -1].float(), -1)
            top = probs.topk(3)
            assert table.tokens[v].tolist() == top.indices.tolist()
            torch.testing.assert_close(table.probs[v], top.values)
    assert (table.probs[:, :-1] >= table.probs[:, 1:]).all()


def test_a_model_without_bos_gets_each_token_alone():
    model = make_tiny_model()
    model.config.bos_token_id = None
    assert sink_token(model) is None
    assert torch.equal(model_bigrams(model, 2, progress=False).tokens, model_bigrams(model, 2, progress=False, after_bos=False).tokens)


def test_the_table_is_computed_once_and_cached_per_model(cache, monkeypatch):
    import speculative.ngrammys as ng

    model = make_tiny_model()
    first = bigram_table(model, 4, progress=False)
    files = list((cache / "ngrammys").glob("*.safetensors"))
    assert len(files) == 1
    ng._MEMO.clear()  # a new process: read from the cache, not computed again

    def fail(*a, **k):
        raise AssertionError("computed again")

    monkeypatch.setattr(ng, "model_bigrams", fail)
    again = bigram_table(model, 4, progress=False)
    assert torch.equal(again.tokens, first.tokens)
    other = make_tiny_model(seed=1)  # same config, other weights: another table
    with pytest.raises(AssertionError, match="computed again"):
        bigram_table(other, 4, progress=False)


def test_a_table_for_another_vocabulary_is_refused(tmp_path):
    path = tmp_path / "t.safetensors"
    BigramTable(torch.zeros((50, 2), dtype=torch.long), torch.ones((50, 2))).save(path)
    with pytest.raises(ValueError, match="vocabulary of 50 tokens, the model has 97"):
        NGrammys(table=str(path)).check(make_tiny_model())
    (tmp_path / "junk.safetensors").write_bytes(b"not a table")
    with pytest.raises(ValueError, match="not a readable bigram table"):
        NGrammys(table=str(tmp_path / "junk.safetensors")).check(make_tiny_model())


def _table(rows: dict[int, list[tuple[int, float]]], k: int = 2) -> BigramTable:
    tokens = torch.zeros((TINY_VOCAB, k), dtype=torch.long)
    probs = torch.full((TINY_VOCAB, k), 1e-6)
    for v, row in rows.items():
        for j, (t, p) in enumerate(row):
            tokens[v, j], probs[v, j] = t, p
    return BigramTable(tokens, probs)


def test_the_tree_grows_best_first_from_the_table_and_the_context(tmp_path):
    # root 10: table says 11 (0.9) or 12 (0.05); 11 -> 13 (0.8); the context says 10 -> 20 21
    path = tmp_path / "t.safetensors"
    _table({10: [(11, 0.9), (12, 0.05)], 11: [(13, 0.8), (14, 0.1)], 13: [(15, 0.5), (16, 0.1)],
            20: [(30, 0.01), (31, 0.01)]}).save(path)
    drafter = NGrammys(table=str(path), top_k=2, context_confidence=0.65)
    state = drafter.start(make_tiny_model(), torch.tensor([1]))
    tokens = torch.tensor([5, 10, 20, 21, 7, 10])  # "10 20 21" earlier: context continuation of the root
    prop = drafter.propose(state, DraftContext(tokens=tokens, hidden=None, max_tokens=5))
    # scores: 11 .9, 11-13 .72, 20 .65, 20-21 .42 (the chain), 11-13-15 .36, then 12 .05 ...
    nodes = list(zip(prop.tokens.tolist(), prop.parents.tolist()))
    assert nodes == [(11, 0), (13, 1), (20, 0), (21, 3), (15, 2)]
    assert drafter.propose(state, DraftContext(tokens=tokens, hidden=None, max_tokens=0)) is None
    no_ctx = NGrammys(table=str(path), top_k=2, context=False)
    prop = no_ctx.propose(no_ctx.start(make_tiny_model(), tokens), DraftContext(tokens=tokens, hidden=None, max_tokens=3))
    assert list(zip(prop.tokens.tolist(), prop.parents.tolist())) == [(11, 0), (13, 1), (15, 2)]


def test_greedy_output_is_exact_whatever_the_table_says(cache):
    model = make_tiny_model()
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, TINY_VOCAB, (n,), generator=gen) for n in (9, 23, 14)]
    for strategies in ([NGrammys(top_k=3)], [NGrammys(top_k=2, context=False), PromptLookup()]):
        for ids in prompts:
            plain = _greedy(model, ids.unsqueeze(0), 24).sequences
            assert torch.equal(_greedy(model, ids.unsqueeze(0), 24, strategies).sequences, plain)
        # a batch of three rows: each row as alone
        out = accel.generate(model, [p for p in prompts], strategies=strategies, max_new_tokens=24, eos_token_id=[])
        for b, ids in enumerate(prompts):
            alone = _greedy(model, ids.unsqueeze(0), 24).sequences[0, ids.numel():]
            assert out.sequences[b][-24:].tolist() == alone.tolist()


def test_a_table_that_knows_the_answer_is_accepted(tmp_path):
    # a table made from the plain greedy continuation itself: drafting must then pay
    model = make_tiny_model()
    ids = torch.randint(2, TINY_VOCAB, (12,), generator=torch.Generator().manual_seed(5)).unsqueeze(0)
    plain = _greedy(model, ids, 32)
    seq = plain.sequences[0].tolist()
    rows: dict[int, list[tuple[int, float]]] = {}
    for a, b in zip(seq[11:], seq[12:]):
        rows.setdefault(a, [(b, 0.9)])
    path = tmp_path / "oracle.safetensors"
    _table(rows, k=1).save(path)
    got = _greedy(model, ids, 32, [NGrammys(table=str(path), top_k=1, context=False)])
    assert torch.equal(got.sequences, plain.sequences)
    assert got.stats.verify_steps < plain.stats.verify_steps  # drafts were accepted
    assert got.stats.mean_accepted > 1.2


def test_built_from_a_spec():
    assert build_strategy("ngrammys:top_k=3") == NGrammys(top_k=3)
    with pytest.raises(ValueError, match="top_k"):
        NGrammys(top_k=0)
