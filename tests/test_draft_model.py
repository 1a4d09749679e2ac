"""DraftModel: a small model drafts, the target verifies. Greedy output is unchanged whatever
the draft model says; the draft cache follows partial acceptance; vocabularies must match;
sampling with a draft model reproduces the target's distribution (and the same statistical
check catches a wrong acceptance rule). Marked ``models``: the real Qwen2.5-Coder pair."""

from __future__ import annotations

from copy import deepcopy
from typing import Any, ClassVar

import pytest
import torch

import accel
from accel.acceptance import Acceptance
from accel.strategy import AcceptanceRule, StrategyError, build_strategy
from helpers import SMALL_DRAFT, TINY_VOCAB, chi2_fails, generate_alone, load_packaged, make_tiny_model, repetitive_prompt
from snapkv import AdaSnapKV, SnapKV
from speculative import DraftModel
from speculative.draft_model import check_vocabularies, fit_vocab


def _noisy_copy(model, std: float, seed: int = 0):
    """The same architecture and weights plus Gaussian noise: a draft that agrees often, not always."""
    copy = deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in copy.parameters():
            p.add_(torch.randn(p.shape, generator=g) * std)
    return copy


# --------------------------------------------------------------------------- greedy exactness


TARGET = dict(seed=11)
# Tiny random models are unsure of every token, so the default stop_below (0.3) would end
# each draft after one token: tests that count or check drafts turn it off.


@pytest.mark.parametrize("draft_kind, where", [
    ("small_random", "none"), ("garbage", "none"), ("noisy_copy", "none"), ("same_weights", "none"),
    ("noisy_copy", "draft_snapkv"), ("noisy_copy", "draft_ada"), ("noisy_copy", "target_snapkv"),
    ("garbage", "target_snapkv"), ("noisy_copy", "int8"), ("garbage", "int8"),
])
def test_greedy_equals_plain_greedy(draft_kind, where):
    """where: no compression, SnapKV / AdaSnapKV (padded per-head budgets) on the draft
    model's cache, SnapKV on the target's, or the draft in int8 weights."""
    target = make_tiny_model(**TARGET)
    draft = {
        "small_random": lambda: make_tiny_model(seed=5, **SMALL_DRAFT),
        "garbage": lambda: make_tiny_model(seed=6, num_hidden_layers=3, initializer_range=1.0),
        "noisy_copy": lambda: _noisy_copy(target, 0.005),
        "same_weights": lambda: target,
    }[draft_kind]()
    ids = repetitive_prompt(3, 40)
    compress = {"draft_snapkv": SnapKV(budget=16, window=4, kernel=3),
                "draft_ada": AdaSnapKV(budget=16, window=4, kernel=3)}.get(where)
    base = [SnapKV(budget=16, window=4, kernel=3)] if where == "target_snapkv" else []
    ref = generate_alone(target, ids, 40, base)
    quantize = "int8" if where == "int8" else "none"
    drafter = DraftModel(model=draft, num_tokens=4, stop_below=None, compress=compress, quantize=quantize)
    out = generate_alone(target, ids, 40, base + [drafter])
    assert torch.equal(out.sequences, ref.sequences)
    assert out.stats.drafted_tokens > 0
    if draft_kind == "same_weights":  # the draft computes what the verifier does: all accepted
        assert out.stats.accepted_tokens == out.stats.drafted_tokens
        assert out.stats.accepted_per_step[:3] == [1, 2, 4]  # the slow start, then num_tokens each step


def test_int8_draft_of_the_target_itself_agrees_mostly_and_stays_exact():
    """The target drafting for itself in int8: its drafts are the int8 model's greedy chain
    (not the float one's), most of them accepted, the output the float target's."""
    from accel.kernels.quant import int8_copy, is_int8

    target = make_tiny_model(**TARGET)
    ids = repetitive_prompt(3, 40)
    strategy = DraftModel(model=target, num_tokens=4, stop_below=None, quantize="int8")
    drafter, _ = strategy.resolve(target)
    assert drafter is int8_copy(target) and is_int8(drafter) and not is_int8(target)
    out = generate_alone(target, ids, 40, [strategy])
    assert torch.equal(out.sequences, generate_alone(target, ids, 40).sequences)
    assert out.stats.accepted_tokens >= 0.6 * out.stats.drafted_tokens > 0


def test_int8_of_a_draft_that_cannot_have_it_is_refused():
    target = make_tiny_model(**TARGET)
    with pytest.raises(ValueError, match="quantize='int8'.*float32"):
        generate_alone(target, repetitive_prompt(3, 20), 40,
                       [DraftModel(model=deepcopy(target).to(torch.bfloat16), quantize="int8")])


def test_batch_rows_keep_their_own_draft_state():
    target = make_tiny_model(**TARGET)
    ids = torch.cat([repetitive_prompt(3, 30), repetitive_prompt(4, 30)])
    strategy = DraftModel(model=_noisy_copy(target, 0.005), num_tokens=3, stop_below=None)
    out = accel.generate(target, ids, strategies=[strategy], max_new_tokens=24, eos_token_id=[])
    assert torch.equal(out.sequences, accel.generate(target, ids, max_new_tokens=24, eos_token_id=[]).sequences)


def test_engine_budget_and_dynamic_lookahead():
    target = make_tiny_model(**TARGET)
    ids = repetitive_prompt(3, 40)
    ref = generate_alone(target, ids, 40)
    draft = _noisy_copy(target, 0.005)
    capped = generate_alone(target, ids, 40, [DraftModel(model=draft, num_tokens=6, stop_below=None)],
                            max_draft_tokens=2)
    assert torch.equal(capped.sequences, ref.sequences)
    assert capped.stats.drafted_tokens <= 2 * capped.stats.verify_steps
    full = generate_alone(target, ids, 40, [DraftModel(model=draft, num_tokens=6, stop_below=None)])
    cautious = generate_alone(target, ids, 40, [DraftModel(model=draft, num_tokens=6, stop_below=0.5)])
    assert torch.equal(cautious.sequences, ref.sequences)
    assert cautious.stats.drafted_tokens < full.stats.drafted_tokens


# --------------------------------------------------------------------------- batched drafting


def _ctx(tokens, budget=4):
    from accel.strategy import DraftContext

    return DraftContext(tokens=tokens, hidden=None, max_tokens=budget)


def test_batched_drafts_equal_row_by_row_drafts_in_fewer_forwards(monkeypatch):
    """propose_batch gives each row the chain propose gives it alone, over two steps (the
    second after partial acceptance, with ragged feeds and budgets), with one draft forward
    per draft depth for all rows instead of one per row; rows prefilled together
    (start_batch) and apart join one draft cache."""
    import speculative.draft_model as dm

    target = make_tiny_model(**TARGET)
    strategy = DraftModel(model=_noisy_copy(target, 0.005), num_tokens=4, stop_below=None)
    prompts = [repetitive_prompt(s, n)[0] for s, n in ((3, 20), (4, 33), (5, 27))]
    forwards: list[int] = []
    verify = dm.verify
    monkeypatch.setattr(dm, "verify", lambda model, cache, trees, dtype: forwards.append(len(trees))
                        or verify(model, cache, trees, dtype))
    with torch.inference_mode():
        alone = [strategy.start(target, p) for p in prompts]
        together = strategy.start_batch(target, prompts[:2]) + [strategy.start(target, prompts[2])]
        assert together[0].rows is together[1].rows is not together[2].rows  # one prefill forward for two
        first = [torch.cat([p, p.new_tensor([7])]) for p in prompts]
        forwards.clear()
        a = [strategy.propose(s, _ctx(t)) for s, t in zip(alone, first)]
        assert forwards == [1] * 12
        forwards.clear()
        b = strategy.propose_batch(together, [_ctx(t) for t in first])
        assert forwards == [3] * 4  # every depth, all rows at once
        assert [p.tokens.tolist() for p in a] == [p.tokens.tolist() for p in b]
        # row 0 accepts two drafts, row 1 none, row 2 all four; then each its bonus token
        accepted = [2, 0, 4]
        second = [torch.cat([t, p.tokens[:k], t.new_tensor([9])]) for t, p, k in zip(first, a, accepted)]
        budgets = [4, 2, 3]
        a2 = [strategy.propose(s, _ctx(t, n)) for s, t, n in zip(alone, second, budgets)]
        b2 = strategy.propose_batch(together, [_ctx(t, n) for t, n in zip(second, budgets)])
    assert [p.tokens.tolist() for p in a2] == [p.tokens.tolist() for p in b2]
    assert [len(p) for p in b2] == budgets
    rows = together[0].rows
    assert all(s.rows is rows for s in together) and rows.cache.batch_size == 3
    for s, t, p in zip(together, second, b2):  # each row holds its sequence and drafts but the last
        assert torch.equal(s.tokens, torch.cat([t, p.tokens[:-1]]))
        assert rows.cache.logical_lengths[rows.row(s)] == s.tokens.numel()
    for s in together:
        strategy.release(s)
    assert rows.cache.batch_size == 0 and not rows.members


@pytest.mark.parametrize("draft_kind, compress, target_snapkv", [
    ("noisy_copy", None, False), ("garbage", None, False), ("noisy_copy", "snapkv", True),
    ("noisy_copy", "ada", False),
])
def test_batch_with_a_draft_model_equals_each_row_alone(draft_kind, compress, target_snapkv):
    """Prompts of different lengths in one batch: each row's output is its output alone and
    its plain greedy output, and the draft forwards fed several rows at once."""
    target = make_tiny_model(**TARGET)
    draft = _noisy_copy(target, 0.005) if draft_kind == "noisy_copy" else make_tiny_model(
        seed=6, num_hidden_layers=3, initializer_range=1.0)
    comp = {"snapkv": SnapKV(budget=12, window=4, kernel=3), "ada": AdaSnapKV(budget=12, window=4, kernel=3)}.get(compress)
    base = [SnapKV(budget=16, window=4, kernel=3)] if target_snapkv else []
    strategies = base + [DraftModel(model=draft, num_tokens=3, stop_below=None, compress=comp)]
    prompts = [repetitive_prompt(s, n) for s, n in ((3, 40), (4, 22), (5, 31), (6, 45))]
    rows_fed: list[int] = []
    hook = draft.model.register_forward_pre_hook(lambda m, args, kw: rows_fed.append(kw["input_ids"].shape[0]),
                                                 with_kwargs=True)
    try:
        batch = accel.generate(target, prompts, strategies=strategies, max_new_tokens=30, eos_token_id=[])
    finally:
        hook.remove()
    assert max(rows_fed) == 4
    for b, ids in enumerate(prompts):
        alone = generate_alone(target, ids, 30, strategies).sequences[0, ids.shape[1]:]
        plain = generate_alone(target, ids, 30, base).sequences[0, ids.shape[1]:]
        got = batch.sequences[b, -30:]
        assert torch.equal(got, alone) and torch.equal(got, plain), f"row {b}"


def test_rows_leave_the_draft_cache_and_a_failed_batched_draft_falls_back(monkeypatch):
    """Rows of different lengths finish at different steps: each finished row leaves the
    batched draft cache. A batched draft that fails halfway leaves every row consistent:
    the engine drafts row by row for that step and the output stays exact."""
    import speculative.draft_model as dm

    target = make_tiny_model(**TARGET)
    strategy = DraftModel(model=_noisy_copy(target, 0.005), num_tokens=3, stop_below=None)
    started: list[Any] = []
    start = DraftModel.start
    monkeypatch.setattr(DraftModel, "start", lambda self, m, p: started.append(start(self, m, p)) or started[-1])
    forward = dm._Rows.forward
    calls = {"batched": 0, "sizes": []}

    def flaky(self, feeds):
        calls["sizes"].append(self.cache.batch_size)
        if sum(f is not None for f in feeds) > 1:
            calls["batched"] += 1
            if calls["batched"] == 2:  # the second depth of a batched draft
                raise RuntimeError("a flaky draft forward")
        return forward(self, feeds)

    monkeypatch.setattr(dm._Rows, "forward", flaky)
    prompts = [repetitive_prompt(s, 30) for s in (3, 4, 5)]
    lengths = [8, 20, 14]
    outs = []
    for ids, n in zip(prompts, lengths):
        outs.append(generate_alone(target, ids, n).sequences[0, ids.shape[1]:])
    with accel.Engine(target, strategies=[strategy], max_batch=4) as engine:
        handles = [engine.submit(ids[0], max_new_tokens=n, eos_token_id=[]) for ids, n in zip(prompts, lengths)]
        results = [h.result(timeout=120) for h in handles]
    for r, ref in zip(results, outs):
        assert r.finish_reason == "length" and r.tokens == ref.tolist()
    assert calls["batched"] > 2 and max(calls["sizes"]) == 3 and calls["sizes"][-1] < 3
    assert all(s.released for s in started) and all(not s.rows.members for s in started)


# --------------------------------------------------------------------------- the draft cache


class Checked(DraftModel):
    """DraftModel that checks, at every step, that its cache holds exactly the sequence and
    that its drafts are what the draft model computes without a cache."""

    LOG: ClassVar[list[tuple[int, int]]] = []  # (proposed, accepted) per step

    def propose(self, state, ctx):
        prop = super().propose(state, ctx)
        seq = ctx.tokens
        # after drafting: the row holds the sequence and every draft but the last, all
        # committed, and nothing else (rejected drafts of earlier steps were cut off)
        rows = state.rows
        assert torch.equal(state.tokens, torch.cat([seq, prop.tokens[:-1]]))
        assert rows.cache.logical_lengths[rows.row(state)] == state.tokens.numel()
        assert rows.cache.pending_entries == 0
        # the chain is the draft model's own greedy continuation, computed from scratch
        full = torch.cat([seq, prop.tokens[:-1]]).unsqueeze(0)
        logits = state.model(full).logits[0, seq.numel() - 1 :]
        assert prop.tokens.tolist() == logits.argmax(-1).tolist()
        return prop

    def feedback(self, state, proposed, accepted):
        Checked.LOG.append((proposed, accepted))


def test_draft_cache_follows_partial_acceptance():
    target = make_tiny_model(**TARGET)
    ids = repetitive_prompt(3, 40)
    Checked.LOG.clear()
    out = generate_alone(target, ids, 60, [Checked(model=_noisy_copy(target, 0.005), num_tokens=4, stop_below=None)])
    assert torch.equal(out.sequences, generate_alone(target, ids, 60).sequences)
    partial = [a for p, a in Checked.LOG if 0 < a < p]
    assert partial and any(a == 0 for _, a in Checked.LOG) and any(a == p for p, a in Checked.LOG)


def test_draft_cache_restarts_when_the_sequence_is_rewritten():
    from accel.strategy import DraftContext

    target = make_tiny_model(**TARGET)
    strategy = DraftModel(model=target, num_tokens=3, stop_below=None)
    with torch.inference_mode():
        state = strategy.start(target, repetitive_prompt(3, 20)[0])
        other = repetitive_prompt(4, 25)[0]
        prop = strategy.propose(state, DraftContext(tokens=other, hidden=None, max_tokens=3))
    assert len(prop) == 3 and state.floor == other.numel() - 1  # a fresh prefill of the new sequence
    assert torch.equal(state.tokens, torch.cat([other, prop.tokens[:-1]]))
    assert state.rows.cache.logical_lengths == [state.tokens.numel()]


# --------------------------------------------------------------------------- vocabularies


def test_mismatched_vocabulary_is_refused():
    target = make_tiny_model(**TARGET)
    other = make_tiny_model(seed=2, vocab_size=TINY_VOCAB + 4)
    strategy = DraftModel(model=other)
    with pytest.raises(ValueError, match="different vocabularies"):
        strategy.check(target)
    with pytest.raises(ValueError, match="different vocabularies"):
        generate_alone(target, repetitive_prompt(3, 12), 4, [strategy])


def _save_tokenizer(folder, words):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    tok.pre_tokenizer = WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=words[0]).save_pretrained(folder)
    return str(folder)


def test_tokenizers_are_compared_and_padded_widths_allowed(tmp_path):
    words = [f"w{i}" for i in range(TINY_VOCAB)]
    target = make_tiny_model(**TARGET)
    target.name_or_path = _save_tokenizer(tmp_path / "t", words)
    wider = make_tiny_model(seed=4, vocab_size=TINY_VOCAB + 7, **SMALL_DRAFT)  # padded output layer
    wider.name_or_path = _save_tokenizer(tmp_path / "d", words)
    check_vocabularies(target, wider)
    ids = repetitive_prompt(3, 30)
    out = generate_alone(target, ids, 20, [DraftModel(model=wider, num_tokens=3, stop_below=None)])
    assert torch.equal(out.sequences, generate_alone(target, ids, 20).sequences)

    renamed = make_tiny_model(seed=4)
    renamed.name_or_path = _save_tokenizer(tmp_path / "r", words[:50] + ["x"] + words[51:])
    with pytest.raises(ValueError, match="token 50 is 'w50' for the target but 'x'"):
        DraftModel(model=renamed).check(target)
    shorter = make_tiny_model(seed=4)
    shorter.name_or_path = _save_tokenizer(tmp_path / "s", words[:90])
    with pytest.raises(ValueError, match="tokenizers of 90 and 97 tokens"):
        DraftModel(model=shorter).check(target)


def test_fit_vocab_cuts_and_pads():
    x = torch.arange(6.0).reshape(2, 3)
    assert torch.equal(fit_vocab(x, 2), x[:, :2])
    padded = fit_vocab(x, 5)
    assert padded.shape == (2, 5) and torch.equal(padded[:, :3], x) and torch.isneginf(padded[:, 3:]).all()
    assert fit_vocab(x, 3) is x


# --------------------------------------------------------------------------- configuration


def test_built_from_yaml_mappings_and_cli_specs():
    s = build_strategy({"name": "draft_model", "model": "qwen2.5-coder-0.5b-instruct", "num_tokens": 5})
    assert isinstance(s, DraftModel) and s.model == "qwen2.5-coder-0.5b-instruct" and s.num_tokens == 5
    assert build_strategy(s.spec()) == s
    c = build_strategy("draft_model:model=qwen2.5-coder-0.5b-instruct,compress=snapkv:budget=64")
    assert isinstance(c.compress, SnapKV) and c.compress.budget == 64
    assert c.spec()["compress"] == SnapKV(budget=64).spec() and build_strategy(c.spec()) == c
    m = build_strategy({"name": "draft_model", "model": "default", "compress": {"name": "snapkv", "budget": 64}})
    assert m.compress == SnapKV(budget=64)
    loaded = DraftModel(model=make_tiny_model())
    assert loaded.spec()["model"] == "<LlamaForCausalLM>" and "LlamaForCausalLM>" in repr(loaded)
    q = build_strategy("draft_model:model=default,quantize=int8,stop_below=0.5")
    assert (q.quantize, q.stop_below, q.num_tokens) == ("int8", 0.5, 8) and build_strategy(q.spec()) == q
    assert DraftModel(model="default").quantize == "auto"
    for bad, field in [({"num_tokens": 0}, "num_tokens"), ({"stop_below": 1.5}, "stop_below"),
                       ({"compress": "prompt_lookup"}, "compress"), ({"model": "no-such-model"}, "model"),
                       ({"model": 3}, "model"), ({"quantize": "int4"}, "quantize")]:
        with pytest.raises(StrategyError, match=f"draft_model.{field}"):
            build_strategy({"name": "draft_model", "model": "default", **bad})


# --------------------------------------------------------------------------- lossless sampling

V = 16  # a small vocabulary, so the emitted tokens' frequencies can be compared bin by bin
TINY = dict(SMALL_DRAFT, vocab_size=V)
PROMPT = torch.tensor([[2, 5, 7, 3]])


def _peaked(seed: int):
    model = make_tiny_model(seed=seed, **TINY)
    with torch.no_grad():
        model.lm_head.weight.mul_(12)  # far from uniform, so a wrong rule shows
    return model


def _marginals(model, prompt: torch.Tensor) -> list[torch.Tensor]:
    """The target's own distribution of the 1st, 2nd and 3rd new token (marginalised over
    the tokens before), from full forwards without any cache."""
    with torch.no_grad():
        p1 = torch.softmax(model(prompt).logits[0, -1].double(), -1)  # [V]
        one = torch.cat([prompt.expand(V, -1), torch.arange(V).unsqueeze(1)], 1)
        p2_given = torch.softmax(model(one).logits[:, -1].double(), -1)  # [V(t1), V]
        two = torch.cat([one.repeat_interleave(V, 0), torch.arange(V).repeat(V).unsqueeze(1)], 1)
        p3_given = torch.softmax(model(two).logits[:, -1].double(), -1).reshape(V, V, V)
    p12 = p1[:, None] * p2_given  # [V, V]
    return [p1, p12.sum(0), (p12[..., None] * p3_given).sum((0, 1))]


class AcceptEverything(AcceptanceRule):
    """WRONG on purpose: accept every draft, then sample the bonus token from p."""

    name: ClassVar[str] = "accept_everything_test"

    def accept(self, tree, probs, generator):
        path = [0]
        while tree.children[path[-1]]:
            path.append(tree.children[path[-1]][0])
        return Acceptance(path=path, next_token=int(torch.multinomial(probs[path[-1]], 1, generator=generator)))


@pytest.fixture
def sampled_drafts(monkeypatch):
    """Count the drafts that carried q (sampled) and those that did not (greedy), and check
    that every DraftContext the engine builds for a sampled request has the request's warp and
    a generator."""
    seen: dict[str, Any] = {"sampled": 0, "greedy": 0, "no_warp": 0}
    propose = DraftModel.propose

    def counting(self, state, ctx):
        prop = propose(self, state, ctx)
        seen["sampled" if prop is not None and prop.probs is not None else "greedy"] += 1
        seen["no_warp"] += ctx.warp is None or ctx.generator is None
        return prop

    monkeypatch.setattr(DraftModel, "propose", counting)
    return seen


def _emitted(target, strategies, runs: int, seed: int) -> torch.Tensor:
    counts = torch.zeros(3, V)
    for i in range(runs):
        out = accel.generate(target, PROMPT, strategies=strategies, max_new_tokens=3, temperature=1.0,
                             seed=seed + i, eos_token_id=[])
        for j, t in enumerate(out.sequences[0, PROMPT.shape[1]:].tolist()):
            counts[j, t] += 1
    return counts


@pytest.mark.parametrize("quantize", ["none", "int8"])
def test_sampling_with_a_draft_model_is_lossless(sampled_drafts, quantize):
    """With int8 draft weights too: q is then the quantized draft's, and what is emitted
    still follows the target."""
    target, draft = _peaked(3), _peaked(4)
    marginals = _marginals(target, PROMPT)
    strategy = DraftModel(model=draft, num_tokens=2, quantize=quantize)
    counts = _emitted(target, [strategy], runs=800, seed=0)
    assert sampled_drafts["sampled"] > 0 and sampled_drafts["greedy"] == sampled_drafts["no_warp"] == 0
    for j in range(3):
        assert not chi2_fails(counts[j], marginals[j].float()), f"new token {j + 1}"

    # the same check catches a rule that accepts every draft (emitted tokens then follow q)
    wrong = _emitted(target, [strategy, AcceptEverything()], runs=200, seed=10_000)
    assert chi2_fails(wrong[1], marginals[1].float()) and chi2_fails(wrong[2], marginals[2].float())


# --------------------------------------------------------------------------- real models

CODE_PROMPTS = [
    "Write a Python function `is_prime(n)` that returns True when n is a prime number.",
    "Complete this function:\ndef fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
]


@pytest.mark.models
def test_qwen_coder_0_5b_drafts_itself_and_refuses_another_vocabulary(default_model):
    draft, tok = load_packaged("qwen2.5-coder-0.5b-instruct")
    ids = accel.models.chat_ids(tok, CODE_PROMPTS[0])
    ref = accel.generate(draft, ids, max_new_tokens=32)
    s = DraftModel(model="qwen2.5-coder-0.5b-instruct", num_tokens=5, compress=SnapKV(budget=32, window=8))
    out = accel.generate(draft, ids, strategies=[s], max_new_tokens=32)
    assert torch.equal(out.sequences, ref.sequences) and out.stats.mean_accepted > 3
    smol, _ = default_model
    with pytest.raises(ValueError, match="tokenizer"):
        s.check(smol)


@pytest.mark.models
@pytest.mark.parametrize("i", range(len(CODE_PROMPTS)))
def test_qwen_coder_pair_greedy_is_exact(i):
    target, tok = load_packaged("qwen2.5-coder-1.5b-instruct")
    load_packaged("qwen2.5-coder-0.5b-instruct")
    ids = accel.models.chat_ids(tok, CODE_PROMPTS[i])
    ref = accel.generate(target, ids, max_new_tokens=48)
    out = accel.generate(target, ids, strategies=["draft_model:model=qwen2.5-coder-0.5b-instruct"], max_new_tokens=48)
    assert torch.equal(out.sequences, ref.sequences)
    assert out.stats.mean_accepted > 1.5
