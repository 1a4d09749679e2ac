"""Eagle: an EAGLE draft layer over the target's own hidden states. Greedy output is plain
greedy decoding's whatever a (random) draft proposes, in a batch, over SnapKV, merged with
prompt lookup, in the Engine; the draft reads the target's features incrementally as a full
pass would; sampling reproduces the target's distribution (and the check catches a wrong
rule); the EAGLE-3 format round-trips, EAGLE-1 checkpoints load, bad checkpoints are refused
naming what differs; training lowers the loss, resumes, and its draft is accepted."""

from __future__ import annotations

import json
import re
from typing import ClassVar

import pytest
import torch

import accel
from accel.acceptance import Acceptance
from accel.strategy import FINAL_HIDDEN, AcceptanceRule, DraftContext
from helpers import SMALL_DRAFT, chi2_fails, engine_held, make_tiny_model, make_tiny_tokenizer, random_prompt, repetitive_prompt
from snapkv import SnapKV
from speculative import Eagle, PromptLookup
from speculative.eagle import EagleLayer, EagleSpec, new_layer, read_eagle, save_eagle
from speculative.eagle.train import EagleTrainConfig, train_eagle

LAYERS = 4  # the target's layers: EAGLE-3 reads layers (2, 2, 1)


@pytest.fixture(scope="module")
def target():
    return make_tiny_model(num_hidden_layers=LAYERS)


@pytest.fixture(scope="module")
def draft_dir(target, tmp_path_factory):
    """A random EAGLE-3 draft for ``target`` over the even token ids."""
    folder = tmp_path_factory.mktemp("eagle")
    save_eagle(new_layer(target, vocab_ids=torch.arange(0, target.config.vocab_size, 2), seed=1), folder)
    return str(folder)


def _prompts():
    return [random_prompt(1, 30)[0], repetitive_prompt(2, 17)[0], random_prompt(3, 45)[0]]


def _same(a, b):
    assert a.sequences.shape == b.sequences.shape
    assert torch.equal(a.sequences, b.sequences)


# --------------------------------------------------------------------------- greedy: exact


def test_greedy_batch_is_plain_greedy(target, draft_dir):
    plain = accel.generate(target, _prompts(), strategies=[], max_new_tokens=24, eos_token_id=[])
    out = accel.generate(target, _prompts(), strategies=[Eagle(draft=draft_dir)], max_new_tokens=24,
                         eos_token_id=[], max_draft_tokens=12)
    _same(plain, out)
    assert out.stats.drafted_tokens > 0


def test_greedy_over_snapkv_and_with_prompt_lookup(target, draft_dir):
    snap = SnapKV(budget=16, window=4)
    alone = accel.generate(target, _prompts(), strategies=[snap], max_new_tokens=20, eos_token_id=[])
    out = accel.generate(target, _prompts(), strategies=[snap, Eagle(draft=draft_dir)], max_new_tokens=20,
                         eos_token_id=[], max_draft_tokens=12)
    _same(alone, out)
    assert out.stats.drafted_tokens > 0
    plain = accel.generate(target, _prompts(), strategies=[], max_new_tokens=20, eos_token_id=[])
    merged = accel.generate(target, _prompts(), strategies=[Eagle(draft=draft_dir), PromptLookup()],
                            max_new_tokens=20, eos_token_id=[], max_draft_tokens=12)
    _same(plain, merged)
    assert merged.stats.drafted_tokens > 0


def test_engine_serves_on_when_a_draft_goes_bad(target, draft_dir, tmp_path):
    """A missing draft is refused at submit; one whose files vanish before its prefill ends
    that request with an error while the others are served, exactly."""
    import shutil

    prompts = _prompts()
    expected = [accel.generate(target, [p], strategies=[], max_new_tokens=16, eos_token_id=[]).sequences[0, p.numel():]
                for p in prompts]
    doomed = tmp_path / "doomed"
    shutil.copytree(draft_dir, doomed)
    with accel.Engine(target, strategies=[Eagle(draft=draft_dir)]) as engine:
        with pytest.raises(ValueError, match="does not exist"):
            engine.submit(prompts[0], max_new_tokens=4, strategies=[Eagle(draft=str(tmp_path / "missing"))])
        with engine_held(engine, prompts[0]):
            bad = engine.submit(prompts[0], max_new_tokens=16, eos_token_id=[], strategies=[Eagle(draft=str(doomed))])
            handles = [engine.submit(p, max_new_tokens=16, eos_token_id=[]) for p in prompts]
            shutil.rmtree(doomed)
        results = [h.result(timeout=120) for h in handles]
        failed = bad.result(timeout=120)
    assert [r.tokens for r in results] == [e.tolist() for e in expected]
    assert failed.finish_reason == "error" and "doomed" in failed.error


# --------------------------------------------------------------------------- the draft's own cache


def test_features_read_in_pieces_draft_as_one_full_pass(target, draft_dir):
    """What the drafter proposes after reading the features in two steps is what one causal
    pass of the layer over all of them predicts (its cache and positions are right)."""
    drafter = Eagle(draft=draft_dir, top_k=1, depth=1)
    layer = read_eagle(draft_dir)
    state = drafter.start(target, random_prompt(0, 4)[0])
    ids = random_prompt(5, 16)[0]
    layer_ids = drafter.feature_layers(target)
    with torch.no_grad():
        hs = target(ids.unsqueeze(0), output_hidden_states=True).hidden_states  # [k]: input of layer k
    feats = {k: hs[k][0] for k in set(layer_ids)}
    first = DraftContext(tokens=ids[:11], hidden=None, max_tokens=1, features={k: f[:10] for k, f in feats.items()})
    second = DraftContext(tokens=ids[:16], hidden=None, max_tokens=1, features={k: f[10:15] for k, f in feats.items()})
    drafter.propose(state, first)
    got = drafter.propose(state, second)
    with torch.no_grad():  # the reference: positions 0..14 read at once
        f = torch.cat([feats[k][:15] for k in layer_ids], -1).unsqueeze(0)
        emb = target.get_input_embeddings().weight[ids[1:16]].unsqueeze(0)
        q, k, v, res = layer.project(layer.fuse(f), emb, torch.arange(15).unsqueeze(0))
        out = layer.finish(q, k, v, torch.ones(15, 15, dtype=torch.bool).tril().unsqueeze(0), res)
        want = layer.draft_to_target(layer.logits(out[0, -1]).argmax())
    assert int(got.tokens[0]) == int(want)
    assert state.cache.n == 15 and state.seen == 15
    # a dynamic tree of the budget's size: branching at the root and deeper than one level
    wide = Eagle(draft=draft_dir, top_k=4, depth=3)
    tree = wide.propose(wide.start(target, ids[:4]), DraftContext(tokens=ids[:16], hidden=None, max_tokens=10,
                                                                    features={k: f[:15] for k, f in feats.items()}))
    parents = tree.parents.tolist()
    assert len(tree) == 10 and parents.count(0) >= 2 and max(parents) > 0
    assert all(p <= i for i, p in enumerate(parents))


# --------------------------------------------------------------------------- sampling: lossless

V = 16  # a small vocabulary, so the emitted tokens' frequencies can be compared bin by bin
PROMPT = torch.tensor([[2, 5, 7, 3]])


class AcceptAllEagle(AcceptanceRule):
    """WRONG on purpose: accept every draft, then sample the bonus token from p."""

    name: ClassVar[str] = "accept_all_eagle_test"

    def accept(self, tree, probs, generator):
        path = [0]
        while tree.children[path[-1]]:
            path.append(tree.children[path[-1]][0])
        return Acceptance(path=path, next_token=int(torch.multinomial(probs[path[-1]], 1, generator=generator)))


def _marginals(model, prompt):
    with torch.no_grad():
        p1 = torch.softmax(model(prompt).logits[0, -1].double(), -1)
        one = torch.cat([prompt.expand(V, -1), torch.arange(V).unsqueeze(1)], 1)
        p2_given = torch.softmax(model(one).logits[:, -1].double(), -1)
    return [p1, (p1[:, None] * p2_given).sum(0)]


def _emitted(model, strategies, runs, seed, drafted=None):
    counts = torch.zeros(2, V)
    for i in range(runs):
        out = accel.generate(model, PROMPT, strategies=strategies, max_new_tokens=2, temperature=1.0, seed=seed + i,
                             eos_token_id=[], max_draft_tokens=4)
        for j, t in enumerate(out.sequences[0, PROMPT.shape[1]:].tolist()):
            counts[j, t] += 1
        if drafted is not None:
            drafted.append(out.stats.drafted_tokens)
    return counts


def test_sampling_is_lossless(tmp_path):
    model = make_tiny_model(seed=3, **dict(SMALL_DRAFT, vocab_size=V, num_hidden_layers=LAYERS))
    with torch.no_grad():
        model.lm_head.weight.mul_(12)  # far from uniform, so a wrong rule shows
    layer = new_layer(model, vocab_ids=torch.arange(0, V, 2), seed=2)
    with torch.no_grad():
        layer.lm_head.weight.mul_(20)  # confident drafts, often wrong
    save_eagle(layer, tmp_path)
    eagle = Eagle(draft=str(tmp_path))
    marginals = _marginals(model, PROMPT)
    drafted: list[int] = []
    counts = _emitted(model, [eagle], runs=400, seed=0, drafted=drafted)
    assert sum(drafted) > 100  # the second token was drafted (sampled, q recorded) in most runs
    for j in range(2):
        assert not chi2_fails(counts[j], marginals[j].float()), f"new token {j + 1}"
    wrong = _emitted(model, [eagle, AcceptAllEagle()], runs=150, seed=10_000)
    assert chi2_fails(wrong[1], marginals[1].float())


# --------------------------------------------------------------------------- formats


def test_eagle3_format_round_trip(target, tmp_path):
    layer = new_layer(target, vocab_ids=torch.tensor([0, 1, 5, 9, 40, 96]), layer_ids=(0, 2, 3), seed=4)
    save_eagle(layer, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 6
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 3]
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "model.safetensors"))
    assert {"fc.weight", "midlayer.hidden_norm.weight", "midlayer.self_attn.q_proj.weight", "norm.weight",
            "lm_head.weight", "d2t", "t2d"} <= set(saved)
    assert saved["t2d"].nonzero().reshape(-1).tolist() == [0, 1, 5, 9, 40, 96]
    back = read_eagle(tmp_path)
    assert back.spec == layer.spec
    for key, value in layer.state_dict().items():
        assert torch.equal(back.state_dict()[key], value), key
    assert back.draft_to_target(torch.arange(6)).tolist() == [0, 1, 5, 9, 40, 96]
    # vLLM also reads layers.0.* for midlayer.*
    renamed = {k.replace("midlayer.", "layers.0."): v for k, v in saved.items()}
    from safetensors.torch import save_file

    save_file(renamed, str(tmp_path / "model.safetensors"))
    assert torch.equal(read_eagle(tmp_path).midlayer.self_attn.q_proj.weight, layer.midlayer.self_attn.q_proj.weight)


def test_eagle1_checkpoint_drafts_from_the_final_hidden_state(target, tmp_path):
    H = target.config.hidden_size
    spec = EagleSpec(kind="eagle1", hidden_size=H, intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16,
                     vocab_size=target.config.vocab_size, draft_vocab_size=target.config.vocab_size,
                     target_hidden_size=H, layer_ids=(FINAL_HIDDEN,), fc_bias=True)
    torch.manual_seed(7)
    state = {("layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k): torch.randn_like(v) * 0.05
             for k, v in EagleLayer(spec).state_dict().items()}
    torch.save(state, tmp_path / "pytorch_model.bin")
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "hidden_size": H, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_hidden_layers": 1, "vocab_size": target.config.vocab_size, "rms_norm_eps": 1e-6}))
    eagle = Eagle(draft=str(tmp_path))
    assert eagle.feature_layers(target) == (FINAL_HIDDEN,)
    plain = accel.generate(target, _prompts(), strategies=[], max_new_tokens=16, eos_token_id=[])
    out = accel.generate(target, _prompts(), strategies=[eagle], max_new_tokens=16, eos_token_id=[], max_draft_tokens=8)
    _same(plain, out)
    assert out.stats.drafted_tokens > 0


@pytest.mark.parametrize("change, words", [
    (dict(hidden_size=32, intermediate_size=64, num_attention_heads=2, num_kv_heads=1), "hidden size 32"),
    (dict(vocab_size=50), "vocabulary of 97 tokens, but the model (LlamaForCausalLM) has 50"),
    (dict(num_hidden_layers=2), "has 2 layers (no layer 2)"),
])
def test_mismatched_checkpoints_are_refused_naming_what_differs(tmp_path, change, words):
    save_eagle(new_layer(make_tiny_model(num_hidden_layers=LAYERS), layer_ids=(1, 2, 3), seed=0), tmp_path)
    other = make_tiny_model(**dict(dict(num_hidden_layers=LAYERS), **change))
    with pytest.raises(ValueError, match=re.escape(words)):
        accel.generate(other, random_prompt(0, 8), strategies=[Eagle(draft=str(tmp_path))], max_new_tokens=4)


def test_unreadable_checkpoints_are_refused(target, tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        Eagle(draft=str(tmp_path / "none")).check(target)
    save_eagle(new_layer(target, seed=0), tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="unreadable weights"):
        Eagle(draft=str(tmp_path)).check(target)
    save_eagle(new_layer(target, seed=0), tmp_path)
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(ValueError, match="unreadable JSON"):
        Eagle(draft=str(tmp_path)).check(target)


# --------------------------------------------------------------------------- training


def test_training_lowers_the_loss_resumes_and_its_draft_is_accepted(tmp_path):
    from accel.models import chat_ids

    model, tok = make_tiny_model(num_hidden_layers=LAYERS), make_tiny_tokenizer()
    words = "the cat dog bird fish tree sun moon star sky sea rain".split()
    g = torch.Generator().manual_seed(0)
    prompts = [" ".join(words[int(i)] for i in torch.randint(0, len(words), (6,), generator=g)) for _ in range(16)]
    cfg = EagleTrainConfig(out=str(tmp_path), max_new_tokens=24, draft_vocab=64, batch_size=4, epochs=15, lr=3e-3,
                           warmup_steps=5, checkpoint_every=0, save_dtype="float32")
    lines: list[str] = []
    assert train_eagle(cfg, model, tok, prompts, log=lines.append, stop_after=20) is None
    assert (tmp_path / "checkpoint" / "trainer_state.pt").is_file()
    layer = train_eagle(cfg, model, tok, prompts, log=lines.append)
    assert any(line.startswith("resumed at step 20/60") for line in lines)
    assert len(layer.losses) == 60 and not (tmp_path / "checkpoint").exists()
    assert sum(layer.losses[-10:]) / 10 < 0.5 * sum(layer.losses[:5]) / 5
    ids = [chat_ids(tok, p)[0] for p in prompts[:4]]
    plain = accel.generate(model, ids, strategies=[], max_new_tokens=24)
    out = accel.generate(model, ids, strategies=[Eagle(draft=str(tmp_path))], max_new_tokens=24, max_draft_tokens=12)
    _same(plain, out)
    assert out.stats.mean_accepted > 1.5  # it learned the target's answers
    # what eagle_check.py prints: the trained draft's top-1 per depth on the target's own text
    from speculative.eagle.train import target_features, ttt_hits

    seq = plain.sequences[:1, : ids[0].numel() + plain.row_stats[0].new_tokens]
    learn = torch.zeros_like(seq, dtype=torch.bool)
    learn[0, ids[0].numel() + 1:] = True  # the tokens drafts are for: the first one is each step's root
    feats = target_features(model, seq, [seq.shape[1]], layer.spec.layer_ids)
    embed = model.get_input_embeddings().weight.float()
    trained = ttt_hits(layer, embed, feats, seq, learn, 3)
    fresh = ttt_hits(new_layer(model, vocab_ids=torch.arange(64), seed=0), embed, feats, seq, learn, 3)
    assert [n for _, n in trained] == [n for _, n in fresh] == [plain.row_stats[0].new_tokens - 1] * 3
    assert trained[0][0] / trained[0][1] > 0.6 > fresh[0][0] / fresh[0][1]


def test_a_warm_started_draft_reads_the_targets_head_off_its_high_features(target):
    """warm_start: the target's head and final norm, ``fc`` passing the high feature layer
    through and both residual branches zero: the fresh draft's step-0 logits are the target's
    own head on those features (a logit lens), over its draft vocabulary."""
    from accel import adapter
    from speculative.eagle import warm_start
    from speculative.eagle.train import target_features, ttt_hits, ttt_unroll

    V, H = target.config.vocab_size, target.config.hidden_size
    plain = accel.generate(target, [random_prompt(5, 12)[0]], strategies=[], max_new_tokens=20, eos_token_id=[])
    seq = plain.sequences.clone()
    embed = target.get_input_embeddings().weight.detach().float()
    vocab = torch.arange(0, V, 2)
    warm = warm_start(new_layer(target, vocab_ids=vocab, seed=3), target)
    cold = new_layer(target, vocab_ids=vocab, seed=3)
    feats = target_features(target, seq, [seq.shape[1]], warm.spec.layer_ids)
    with torch.no_grad():
        lens = adapter.output_logits(target, target.get_decoder().norm(feats[..., -H:]))[0, :-1, vocab]
        (_, got, _), (_, fresh, _) = next(ttt_unroll(warm, embed, feats, seq, 1)), next(ttt_unroll(cold, embed, feats, seq, 1))
    assert got.shape[1:] == lens[:-1].shape
    torch.testing.assert_close(got[0], lens[:-1], rtol=1e-4, atol=1e-4)
    assert not torch.allclose(fresh[0], lens[:-1], atol=1e-2)
    assert ttt_hits(warm, embed, feats, seq, torch.ones_like(seq, dtype=torch.bool), 1, top_k=V)[0] == \
        (int((seq[0, 2:] % 2 == 0).sum()), seq.shape[1] - 2)  # top V: every token of the draft vocabulary
    with pytest.raises(ValueError, match="EAGLE-3"):
        warm_start(EagleLayer(EagleSpec(kind="eagle1", hidden_size=H, intermediate_size=128, num_heads=4, num_kv_heads=2,
                                        head_dim=16, vocab_size=V, draft_vocab_size=V, target_hidden_size=H,
                                        layer_ids=(FINAL_HIDDEN,))), target)


# --------------------------------------------------------------------------- the default draft


def test_eagle_without_a_folder_names_the_default_draft_and_how_to_train_one(monkeypatch, tmp_path):
    """``Eagle()`` reads ``speculative/heads/eagle``; where no draft is there (none ships yet:
    docs/EAGLE.md), the check names the command that trains one."""
    from speculative.eagle import formats

    assert Eagle().draft == "default" == accel.build_strategy("eagle").draft
    assert formats.resolve_draft_dir(str(tmp_path)) == tmp_path
    monkeypatch.setattr(formats, "DEFAULT_DRAFT_DIR", tmp_path / "none")
    with pytest.raises(ValueError, match=r"eagle\.draft: no EAGLE draft is shipped .*accel train-eagle"):
        Eagle().check(make_tiny_model(num_hidden_layers=LAYERS))
    # a draft saved there is the default
    layer = new_layer(make_tiny_model(num_hidden_layers=LAYERS), vocab_ids=torch.arange(64), seed=0)
    save_eagle(layer, tmp_path / "none")
    assert formats.resolve_draft_dir("default") == tmp_path / "none"
    Eagle().check(make_tiny_model(num_hidden_layers=LAYERS))
