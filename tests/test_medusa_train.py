"""Medusa head training: self-distilled data, the loss going down, checkpoints and resuming."""

from __future__ import annotations

import json

import pytest
import torch

import accel
from helpers import TINY_VOCAB, CharTokenizer, make_tiny_model, make_tiny_tokenizer
from speculative import Medusa, MedusaHeads
from speculative.medusa import CONFIG_NAME, WEIGHTS_NAME
from speculative.train import (
    EVAL_PROMPTS,
    TRAIN_PROMPTS,
    Sequences,
    TrainConfig,
    evaluate_heads,
    example_positions,
    generate_batch,
    load_prompts,
    make_examples,
    medusa_loss,
    self_prompts,
    train_heads,
)


PROMPTS = [f"tell me about thing number {i} and why it matters" for i in range(12)]


def _cfg(tmp_path, **kw) -> TrainConfig:
    base = dict(out=str(tmp_path), num_heads=2, max_new_tokens=20, gen_batch_size=5, epochs=3, batch_size=32,
                lr=3e-3, warmup_steps=2, checkpoint_every=3, holdout=0.2, seed=0)
    base.update(kw)
    return TrainConfig(**base)


def test_generated_hidden_states_are_the_ones_that_chose_each_token():
    model = make_tiny_model(seed=31)
    toks, states = generate_batch(model, CharTokenizer(), PROMPTS[:3], max_new_tokens=10, eos=[1])
    for t, h in zip(toks, states):
        assert t.numel() == h.shape[0] > 0 and h.shape[1] == 64
        with torch.no_grad():
            assert torch.equal(model.get_output_embeddings()(h).argmax(-1), t)


def test_make_examples_targets_are_the_following_tokens():
    seqs = Sequences(tokens=torch.tensor([10, 11, 12, 13, 20, 21]), hidden=torch.arange(6.0).unsqueeze(1),
                     lengths=torch.tensor([4, 2]), prompt_index=torch.tensor([0, 1]))
    x, y = make_examples(seqs, num_heads=2)
    assert x.flatten().tolist() == [0.0, 1.0, 2.0, 4.0]  # the last state of a row has no target
    # column 0: the token the state chose (the root); column k: head k's target
    assert y.tolist() == [[10, 11, 12], [11, 12, 13], [12, 13, -100], [20, 21, -100]]


def test_distillation_learns_the_base_models_distribution_at_each_target():
    model = make_tiny_model(seed=34)
    toks, states = generate_batch(model, CharTokenizer(), PROMPTS, max_new_tokens=24, eos=[])
    seqs = Sequences(torch.cat(toks), torch.cat(states), torch.tensor([t.numel() for t in toks]), torch.arange(len(toks)))
    x, y = make_examples(seqs, num_heads=2)
    pos = example_positions(seqs)
    assert torch.equal(x, seqs.hidden[pos])
    rows = (pos.unsqueeze(1) + torch.arange(1, 3)).clamp(max=seqs.hidden.shape[0] - 1)
    lm = model.get_output_embeddings().weight.detach()
    valid = y[:, 1:] >= 0
    # the state at positions[p] + k chose head k's target: its argmax is that token
    assert torch.equal((seqs.hidden[rows] @ lm.T).argmax(-1)[valid], y[:, 1:][valid])
    heads = MedusaHeads(2, 64, TINY_VOCAB, sequential=True)
    embed = model.get_input_embeddings().weight.detach()
    opt = torch.optim.AdamW(heads.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        loss, _ = medusa_loss(heads, x, y, lm, embed=embed, teacher=seqs.hidden[rows])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    # cross-entropy against soft targets = their entropy + KL: the KL part must shrink
    probs = (seqs.hidden[rows] @ lm.T).softmax(-1)
    ent = -(probs * probs.clamp_min(1e-30).log()).sum(-1)  # [P, 2]
    floor = sum(0.8 ** k * float(ent[valid[:, k], k].mean()) for k in range(2))
    assert losses[-1] - floor < 0.8 * (losses[0] - floor)


def _train_on(model, num_heads: int, sequential: bool, steps: int):
    """Heads trained ``steps`` AdamW steps on ``model``'s greedy continuations of PROMPTS (the
    examples in the model's dtype, as train_heads hands them over). Returns (heads, x, y,
    output weight, input embeddings or None, the loss of each step)."""
    toks, states = generate_batch(model, CharTokenizer(), PROMPTS, max_new_tokens=24, eos=[])
    seqs = Sequences(torch.cat(toks), torch.cat(states), torch.tensor([t.numel() for t in toks]), torch.arange(len(toks)))
    x, y = make_examples(seqs, num_heads=num_heads)
    x = x.to(model.dtype)
    heads = MedusaHeads(num_heads, 64, TINY_VOCAB, sequential=sequential)
    lm_weight = model.get_output_embeddings().weight.detach()
    embed = model.get_input_embeddings().weight.detach() if sequential else None
    opt = torch.optim.AdamW(heads.parameters(), lr=3e-3)
    losses = []
    for _ in range(steps):
        loss, _ = medusa_loss(heads, x, y, lm_weight, embed=embed)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return heads, x, y, lm_weight, embed, losses


@pytest.mark.parametrize("sequential", [False, True])
def test_a_few_training_steps_lower_the_loss(sequential):
    heads, x, y, lm_weight, embed, losses = _train_on(make_tiny_model(seed=32), 3, sequential, steps=30)
    assert losses[-1] < 0.8 * losses[0]
    acc = evaluate_heads(heads, x, y, lm_weight, topk=5, embed=embed)
    assert len(acc) == 3 and all(len(r) == 5 and r == sorted(r) for r in acc)
    if sequential:
        with pytest.raises(ValueError, match="input embeddings"):
            medusa_loss(heads, x, y, lm_weight)


@pytest.mark.parametrize("sequential", [False, True])
def test_float32_heads_train_on_a_bfloat16_models_states(sequential):
    # a bfloat16 model hands over bfloat16 hidden states, embeddings and output rows; the
    # heads keep float32 weights and the projection runs in the output rows' dtype
    model = make_tiny_model(seed=32).to(torch.bfloat16)
    heads, x, y, lm_weight, embed, losses = _train_on(model, 2, sequential, steps=20)
    assert x.dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in heads.parameters())
    assert losses[-1] < 0.9 * losses[0]
    acc = evaluate_heads(heads, x, y, lm_weight, topk=3, embed=embed)
    assert len(acc) == 2 and all(len(r) == 3 for r in acc)


def test_train_heads_pipeline_writes_heads_and_resumes_exactly(tmp_path):
    model, tok = make_tiny_model(seed=33), CharTokenizer()
    full = train_heads(_cfg(tmp_path / "full"), model, tok, prompts=PROMPTS, progress=False)
    assert (tmp_path / "full" / WEIGHTS_NAME).is_file() and not (tmp_path / "full" / "checkpoint").exists()
    cfg = json.loads((tmp_path / "full" / CONFIG_NAME).read_text())
    assert cfg["num_heads"] == 2 and len(cfg["topk_accuracy"]) == 2 and len(cfg["topk_accuracy"][0]) == 10
    info = cfg["training"]
    assert info["sequences"] == 12 and info["heldout_sequences"] == 2 and info["steps"] >= 6
    assert info["final_loss"] < info["first_loss"]
    assert full.vocab_subset is not None and cfg["vocab_subset_size"] == full.vocab_subset.numel() < TINY_VOCAB

    # interrupted after 4 steps, then resumed: the same heads as the uninterrupted run
    assert train_heads(_cfg(tmp_path / "split"), model, tok, prompts=PROMPTS, progress=False, stop_after=4) is None
    assert (tmp_path / "split" / "checkpoint" / "trainer_state.pt").is_file()
    chunks = sorted((tmp_path / "split" / "data").iterdir())
    assert len(chunks) == 3  # 12 prompts in chunks of 5, cached
    resumed = train_heads(_cfg(tmp_path / "split"), model, tok, prompts=PROMPTS, progress=False)
    assert resumed.info["training"]["cached_chunks"] == 3  # no second generation
    for a, b in zip(full.state_dict().values(), resumed.state_dict().values()):
        torch.testing.assert_close(a, b)

    # a checkpoint from another run is refused with a clear message
    train_heads(_cfg(tmp_path / "other"), model, tok, prompts=PROMPTS, progress=False, stop_after=2)
    with pytest.raises(ValueError, match="different run .*lr"):
        train_heads(_cfg(tmp_path / "other", lr=1e-2), model, tok, prompts=PROMPTS, progress=False)

    # the trained heads draft, and decoding stays exact
    ids = tok(tok.apply_chat_template([{"role": "user", "content": PROMPTS[3]}]), return_tensors="pt")["input_ids"]
    ref = accel.generate(model, ids, max_new_tokens=20, eos_token_id=[])
    out = accel.generate(model, ids, strategies=[Medusa(heads=str(tmp_path / "full"))], max_new_tokens=20, eos_token_id=[])
    assert torch.equal(out.sequences, ref.sequences)
    assert out.stats.drafted_tokens > 0 and out.stats.accepted_tokens > 0


def test_shipped_prompt_sets_are_disjoint_from_each_other_and_the_benchmark():
    train, held_out = load_prompts(TRAIN_PROMPTS), load_prompts(EVAL_PROMPTS)
    assert len(train) >= 200 and len(set(train)) == len(train) and len(held_out) >= 10
    assert not set(train) & set(held_out)
    try:
        from accel.bench.prompts import CHAT_PROMPTS
    except ImportError:  # pragma: no cover - the benchmark package is optional here
        return
    norm = lambda s: " ".join(s.lower().split())  # noqa: E731
    assert not {norm(p) for p in train} & {norm(p) for p in CHAT_PROMPTS}
    assert not {norm(p) for p in held_out} & {norm(p) for p in CHAT_PROMPTS}


def test_cli_options_reach_the_config(tmp_path):
    from accel.cli import build_parser
    from speculative.train import _config_from_args

    args = build_parser().parse_args(["train-heads", "--out", str(tmp_path), "--heads", "3", "--epochs", "1.5", "--threads", "1"])
    cfg = _config_from_args(args)
    assert cfg.num_heads == 3 and cfg.epochs == 1.5 and cfg.threads == 1 and cfg.model == "default"
    assert cfg.max_new_tokens == TrainConfig(out="").max_new_tokens  # unset options keep the defaults
    assert cfg.self_prompts == 0
    args = build_parser().parse_args(["train-heads", "--out", str(tmp_path), "--self-prompts", "300"])
    assert _config_from_args(args).self_prompts == 300


def test_self_written_prompts_are_seeded_distinct_and_leave_the_global_rng_alone():
    model, tok = make_tiny_model(seed=5), make_tiny_tokenizer()
    rng = torch.random.get_rng_state()
    first = self_prompts(model, tok, 6, seed=1, batch_size=16, max_tokens=32)
    assert torch.equal(torch.random.get_rng_state(), rng)
    assert len(first) == 6 and len(set(first)) == 6 and all(len(p.split()) >= 3 for p in first)
    assert self_prompts(model, tok, 6, seed=1, batch_size=16, max_tokens=32) == first  # reproducible
    assert self_prompts(model, tok, 6, seed=2, batch_size=16, max_tokens=32) != first
    # what is excluded (e.g. the prompts the heads are measured on) is never returned
    again = self_prompts(model, tok, 6, seed=1, batch_size=16, max_tokens=32, exclude=[first[0].upper()])
    assert first[0] not in again and again[:5] == first[1:6]
    # asking for more later continues from the saved state: the same as asking for all at once
    state = {}
    assert self_prompts(model, tok, 3, seed=1, batch_size=16, max_tokens=32, state=state) == first[:3]
    assert state["batches"] >= 1 and state["prompts"][:3] == first[:3]
    assert self_prompts(model, tok, 6, seed=1, batch_size=16, max_tokens=32, state=state) == first


def test_self_written_prompts_fail_clearly_when_the_model_never_closes_a_usable_turn():
    model, tok = make_tiny_model(seed=5), make_tiny_tokenizer()
    with pytest.raises(ValueError, match="only 0 usable prompts"):
        self_prompts(model, tok, 3, batch_size=4, max_tokens=2)  # <= 1 word before the end of turn: none usable


def test_train_heads_adds_and_caches_self_written_prompts(tmp_path):
    model, tok = make_tiny_model(seed=33), make_tiny_tokenizer()
    cfg = _cfg(tmp_path, self_prompts=4, epochs=1)
    heads = train_heads(cfg, model, tok, prompts=PROMPTS, progress=False)
    assert heads.info["training"]["sequences"] == len(PROMPTS) + 4
    written = list((tmp_path / "data").glob("self_prompts_*.json"))
    assert len(written) == 1 and len(json.loads(written[0].read_text())["prompts"]) >= 4
    again = train_heads(cfg, model, tok, prompts=PROMPTS, progress=False)
    assert again.info["training"]["cached_chunks"] == 4 and again.info["training"]["generation_s"] == 0
