"""PaSS: look-ahead embeddings in the verify pass. Greedy output is plain greedy decoding's
whatever the (random) embeddings propose, in a batch, over SnapKV, merged with prompt lookup,
in the Engine beside rows without them; the look-ahead outputs are what one causal pass over
the text and the vectors computes; sampling keeps the target's distribution; embeddings for
another model, or none, are refused naming the training command; training lowers the loss
and its drafts are accepted."""

from __future__ import annotations

import pytest
import torch

import accel
from accel.steps import chain_anchors
from accel.strategy import DraftContext
from accel.tree import DraftTree
from accel.calibration import calibrate
from helpers import SMALL_DRAFT, chi2_fails, fake_table, make_tiny_model, make_tiny_tokenizer, random_prompt, repetitive_prompt
from snapkv import SnapKV
from speculative import PaSS, PromptLookup
from speculative.lookahead import load_pass, save_pass
from speculative.eagle.train import answer_prompts
from speculative.lookahead.train import PassTrainConfig, lookahead_batch, lookahead_loss, train_pass


@pytest.fixture
def drafting_pays(monkeypatch):
    """A flat cost table: every row may draft and carries its look-ahead positions, so that
    exactness is tested with them in the pass (what they cost in the allocation is tested in
    test_calibrate.py and test_batch.py)."""
    flat = fake_table([1, 64], [1.0, 1.0])
    monkeypatch.setattr(calibrate, "step_costs", lambda model: flat)


@pytest.fixture(scope="module")
def target():
    return make_tiny_model(num_hidden_layers=2)


def _vectors(model, size: int = 4, seed: int = 1, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(size, model.config.hidden_size, generator=g) * scale


@pytest.fixture(scope="module")
def pass_dir(target, tmp_path_factory):
    """Random look-ahead embeddings for ``target``."""
    folder = tmp_path_factory.mktemp("pass")
    save_pass(folder, _vectors(target), target)
    return str(folder)


def _prompts():
    return [random_prompt(1, 30)[0], repetitive_prompt(2, 17)[0], random_prompt(3, 45)[0]]


def _same(a, b):
    assert a.sequences.shape == b.sequences.shape
    assert torch.equal(a.sequences, b.sequences)


# --------------------------------------------------------------------------- greedy: exact


def test_greedy_batch_is_plain_greedy(target, pass_dir):
    plain = accel.generate(target, _prompts(), strategies=[], max_new_tokens=24, eos_token_id=[])
    out = accel.generate(target, _prompts(), strategies=[PaSS(embeddings=pass_dir, top_k=3)], max_new_tokens=24,
                         eos_token_id=[], max_draft_tokens=12)
    _same(plain, out)
    assert out.stats.drafted_tokens > 0


@pytest.mark.usefixtures("drafting_pays")
@pytest.mark.parametrize("anchors", [1, 3])
def test_greedy_exact_over_snapkv_and_merged_with_prompt_lookup(target, pass_dir, anchors):
    snap = SnapKV(budget=16, window=4, kernel=3)
    plain = accel.generate(target, _prompts(), strategies=[snap], max_new_tokens=20, eos_token_id=[])
    out = accel.generate(target, _prompts(), eos_token_id=[], max_new_tokens=20, max_draft_tokens=10,
                         strategies=[snap, PromptLookup(max_ngram=2, num_tokens=4), PaSS(embeddings=pass_dir, anchors=anchors)])
    _same(plain, out)
    assert out.stats.drafted_tokens > 0


@pytest.mark.usefixtures("drafting_pays")
def test_engine_rows_with_and_without_lookahead(target, pass_dir):
    prompts = _prompts()
    alone = [accel.generate(target, p.unsqueeze(0), strategies=[], max_new_tokens=16, eos_token_id=[]) for p in prompts]
    with accel.Engine(target, strategies=[], max_batch=4) as engine:
        handles = [engine.submit(p, max_new_tokens=16, eos_token_id=[],
                                 strategies=[PaSS(embeddings=pass_dir)] if i != 1 else []) for i, p in enumerate(prompts)]
        results = [h.result(timeout=120) for h in handles]
    for p, a, r in zip(prompts, alone, results):
        assert a.sequences[0, p.numel():].tolist() == r.tokens
    assert results[0].stats.drafted_tokens + results[2].stats.drafted_tokens > 0


def test_lookahead_outputs_are_one_causal_pass(target, pass_dir):
    """What the drafter reads after a step is the output head at the L positions one causal
    pass over [prompt, root, vectors] (positions continuing) computes."""
    seen: list[torch.Tensor | None] = []

    class Recording(PaSS):
        def read_lookahead(self, state, logits):
            seen.append(None if logits is None else logits.clone())
            super().read_lookahead(state, logits)

    prompt = random_prompt(5, 20)
    out = accel.generate(target, prompt, strategies=[Recording(embeddings=pass_dir)], max_new_tokens=2, eos_token_id=[])
    root = out.sequences[0, 20:21]  # the prefill's token: the first verify pass's root
    vectors = load_pass(pass_dir).vectors
    embed = target.get_input_embeddings()
    with torch.no_grad():
        inputs = torch.cat([embed(torch.cat([prompt[0], root])), vectors]).unsqueeze(0)
        want = target(inputs_embeds=inputs).logits[0, -4:].float()
        shifted = torch.cat([torch.arange(21), torch.arange(22, 26)]).unsqueeze(0)  # one position off
        off = target(inputs_embeds=inputs, position_ids=shifted).logits[0, -4:].float()
    assert seen and seen[0] is not None
    torch.testing.assert_close(seen[0], want, atol=2e-6, rtol=1e-5)
    assert (seen[0] - off).abs().max() > 1e-5  # the tolerance tells positions apart on this model
    # the training layout is the same: anchor t's slots at t + 1 .. t + L, seeing 0..t and each other causally
    positions, mask = lookahead_batch(6, [2, 4], 3)
    assert positions.tolist() == [0, 1, 2, 3, 4, 5, 3, 4, 5, 5, 6, 7]
    assert mask[6].tolist() == [True] * 3 + [False] * 3 + [True] + [False] * 5
    assert mask[11].tolist() == [True] * 5 + [False] * 4 + [True] * 3


def test_chain_anchors_and_proposal_tree(target, pass_dir):
    tree = DraftTree(torch.tensor([9, 1, 2, 3, 4]), torch.tensor([-1, 0, 0, 1, 3]))
    assert chain_anchors(tree, 1) == [0] and chain_anchors(tree, 3) == [0, 1, 3] and chain_anchors(tree, 9) == [0, 1, 3, 4]
    drafter = PaSS(embeddings=pass_dir, top_k=2, max_nodes=5)
    state = drafter.start(target, torch.tensor([1, 2, 3]))
    ctx = DraftContext(tokens=torch.tensor([1, 2, 3]), hidden=None, max_tokens=8)
    drafter.lookahead(state)
    assert drafter.propose(state, ctx) is None  # nothing read yet: nothing to draft
    logits = torch.full((3, 50), -10.0)
    logits[0, 7], logits[0, 8] = 5.0, 4.0
    logits[1, 11], logits[1, 12] = 5.0, 1.0
    logits[2, 20] = 5.0
    drafter.read_lookahead(state, logits)
    drafter.lookahead(state)  # the next step: what was read is drafted from
    prop = drafter.propose(state, ctx)
    assert prop.tokens.tolist()[:3] == [7, 11, 20] and prop.parents.tolist()[:3] == [0, 1, 2]  # the greedy chain first
    assert len(prop) == 5 and 8 in prop.tokens.tolist()
    drafter.read_lookahead(state, logits)
    drafter.lookahead(state)
    drafter.lookahead(state)  # a step passed without a read: what was read is stale
    assert drafter.propose(state, ctx) is None


# --------------------------------------------------------------------------- sampling: lossless

V = 16
PROMPT = torch.tensor([[2, 5, 7, 3]])


def _marginals(model):
    """Exact distributions of the 2nd and 3rd new tokens at temperature 1."""
    with torch.no_grad():
        p1 = torch.softmax(model(PROMPT).logits[0, -1].double(), -1)
        one = torch.cat([PROMPT.expand(V, -1), torch.arange(V).unsqueeze(1)], 1)
        p2 = torch.softmax(model(one).logits[:, -1].double(), -1)  # [t1, t2]
        two = torch.cat([PROMPT.expand(V * V, -1), torch.arange(V).repeat_interleave(V).unsqueeze(1),
                         torch.arange(V).repeat(V).unsqueeze(1)], 1)
        p3 = torch.softmax(model(two).logits[:, -1].double(), -1).reshape(V, V, V)
    joint = p1[:, None] * p2  # [t1, t2]
    return [joint.sum(0), (joint[:, :, None] * p3).sum((0, 1))]


def test_sampling_is_lossless(tmp_path):
    model = make_tiny_model(seed=3, **dict(SMALL_DRAFT, vocab_size=V, num_hidden_layers=2))
    with torch.no_grad():
        model.lm_head.weight.mul_(12)  # far from uniform, so a wrong rule shows
    save_pass(tmp_path, _vectors(model, seed=4, scale=3.0), model)
    drafter = PaSS(embeddings=str(tmp_path), top_k=2)
    marginals = _marginals(model)
    counts = torch.zeros(2, V)
    drafted = 0
    for i in range(400):
        out = accel.generate(model, PROMPT, strategies=[drafter], max_new_tokens=3, temperature=1.0, seed=i,
                             eos_token_id=[], max_draft_tokens=4)
        for j, t in enumerate(out.sequences[0, PROMPT.shape[1] + 1 :].tolist()):
            counts[j, t] += 1
        drafted += out.stats.drafted_tokens
    assert drafted > 200  # the third token was drafted in most runs
    for j in range(2):
        assert not chi2_fails(counts[j], marginals[j].float()), f"new token {j + 2}"


# --------------------------------------------------------------------------- bad input


def test_missing_and_foreign_embeddings_are_refused(target, pass_dir, tmp_path):
    with pytest.raises(ValueError, match="accel train-pass"):
        accel.generate(target, _prompts()[0].unsqueeze(0), strategies=[PaSS(embeddings=str(tmp_path / "none"))],
                       max_new_tokens=2)
    other = make_tiny_model(seed=7, num_hidden_layers=2)  # same shape, other weights
    with pytest.raises(ValueError, match="another model of the same shape"):
        PaSS(embeddings=pass_dir).check(other)
    wide = make_tiny_model(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    with pytest.raises(ValueError, match="trained for another model"):
        PaSS(embeddings=pass_dir).check(wide)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "pass_embeddings.safetensors").write_bytes(b"not a file")
    with pytest.raises(ValueError, match="cannot read PaSS embeddings"):
        PaSS(embeddings=str(tmp_path / "bad")).check(target)
    with pytest.raises(ValueError, match="positions"):
        PassTrainConfig(out=str(tmp_path), positions=0).check()


# --------------------------------------------------------------------------- training


@pytest.mark.usefixtures("drafting_pays")
def test_training_lowers_the_loss_and_its_drafts_are_accepted(tmp_path):
    from accel.models import chat_ids

    model, tok = make_tiny_model(num_hidden_layers=2), make_tiny_tokenizer()
    words = "the cat dog bird fish tree sun moon star sky sea rain".split()
    g = torch.Generator().manual_seed(0)
    prompts = [" ".join(words[int(i)] for i in torch.randint(0, len(words), (6,), generator=g)) for _ in range(16)]
    cfg = PassTrainConfig(out=str(tmp_path), max_new_tokens=24, batch_size=4, epochs=12, lr=3e-2, anchors=8,
                          max_prompts=None)
    lines: list[str] = []
    vectors, facts = train_pass(cfg, model, tok, prompts, log=lines.append)
    assert vectors.shape == (4, model.config.hidden_size) and facts["steps"] == 48
    assert len(facts["losses"]) == 48

    def data_loss(v):  # over every anchor of every answer (training samples 8 a sequence)
        with torch.no_grad():
            return sum(float(lookahead_loss(model, v, s, list(range(n, s.numel() - 6)))[0]) for s, n in seqs) / len(seqs)

    seqs = answer_prompts(model, tok, prompts, cfg, tmp_path / "data")  # cached by the training run
    start = model.get_input_embeddings().weight.mean(0, keepdim=True).repeat(4, 1)  # where training starts
    assert data_loss(vectors) < 0.98 * data_loss(start)
    assert load_pass(str(tmp_path)).positions == 4
    ids = [chat_ids(tok, p)[0] for p in prompts[:4]]
    plain = accel.generate(model, ids, strategies=[], max_new_tokens=24)
    out = accel.generate(model, ids, strategies=[PaSS(embeddings=str(tmp_path))], max_new_tokens=24, max_draft_tokens=12)
    _same(plain, out)
    assert out.stats.accepted_tokens > 0  # it learned something of the target's answers


def test_look_ahead_positions_are_left_out_where_only_they_do_not_pay(target, pass_dir, monkeypatch):
    # up to 8 query tokens cost one step, each token past them a whole step more: prompt
    # lookup's drafts fit, PaSS's 8 look-ahead positions on top of them do not
    monkeypatch.setattr(calibrate, "step_costs", lambda model: fake_table([1, 8, 64], [1.0, 1.0, 57.0]))
    from accel import engine

    carried = []
    real = engine.verify_logits
    monkeypatch.setattr(engine, "verify_logits",
                        lambda *a: carried.append(any(x is not None for x in (a[-1] or []))) or real(*a))
    ids = repetitive_prompt(2, 40)
    plain = accel.generate(target, ids, strategies=[], max_new_tokens=20, eos_token_id=[])
    out = accel.generate(target, ids, eos_token_id=[], max_new_tokens=20, max_draft_tokens=6,
                         strategies=[PromptLookup(max_ngram=2, num_tokens=4), PaSS(embeddings=pass_dir)])
    _same(plain, out)
    assert out.stats.drafted_tokens > 0 and carried and not any(carried)
