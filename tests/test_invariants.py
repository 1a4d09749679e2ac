"""Invariants across features: garbage drafts over a SnapKV / AdaSnapKV cache in a batch are
exactly plain decoding on that compressed cache, row by row; a prompt longer than the model's
context is refused with a ValueError naming the lengths, in every entry point."""

from __future__ import annotations

from typing import Any, ClassVar

import pytest
import torch

import accel
from accel.strategy import DraftContext, DraftProposal, Drafter
from helpers import TINY_VOCAB, gate, make_tiny_model, make_tiny_tokenizer
from snapkv import AdaSnapKV, SnapKV

LENGTHS = (37, 52, 20, 45, 29)
NEW = 24


def _prompts(seed: int = 0) -> list[torch.Tensor]:
    """Repetitive prompts of different lengths."""
    out = []
    for i, n in enumerate(LENGTHS):
        base = torch.randint(2, TINY_VOCAB, (max(4, n // 3),), generator=torch.Generator().manual_seed(seed + i))
        out.append(base.repeat(4)[:n])
    return out


def _alone(model, prompt: torch.Tensor, strategies, new: int = NEW) -> list[int]:
    out = accel.generate(model, prompt.unsqueeze(0), strategies=list(strategies), max_new_tokens=new, eos_token_id=[])
    return out.sequences[0, prompt.numel():].tolist()


class Garbage(Drafter):
    """Adversarial drafts. Every step: a chain of the row's true continuation whose last
    token is wrong (from ``references``: prompt -> plain output on the compressed cache; the
    chain is 1-3 tokens long, varying by step), and random tokens in a random tree below and
    beside it, up to the budget. So rows accept different numbers of tokens each step, and
    most of what is verified is garbage."""

    name: ClassVar[str] = "garbage_invariants_test"
    references: dict[str, tuple[int, ...]] = {}

    @staticmethod
    def key(prompt: torch.Tensor) -> str:
        return ",".join(map(str, prompt.tolist()))

    def start(self, model: Any, prompt: torch.Tensor) -> dict:
        return {"prompt": int(prompt.numel()), "truth": self.references.get(self.key(prompt), ()),
                "gen": torch.Generator().manual_seed(int(prompt.numel()))}

    def propose(self, state: dict, ctx: DraftContext) -> DraftProposal | None:
        g, budget = state["gen"], ctx.max_tokens
        done = len(ctx.tokens) - state["prompt"]  # tokens emitted; the root is the last of them
        truth = list(state["truth"][done : done + int(torch.randint(1, 4, (1,), generator=g))])
        if truth:
            truth[-1] = (truth[-1] + 1 + int(torch.randint(0, TINY_VOCAB - 1, (1,), generator=g))) % TINY_VOCAB
        tokens = truth[:budget]
        parents = list(range(len(tokens)))
        while len(tokens) < budget:
            parents.append(int(torch.randint(0, len(tokens) + 1, (1,), generator=g)))
            tokens.append(int(torch.randint(0, TINY_VOCAB, (1,), generator=g)))
        return DraftProposal(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long))


@pytest.fixture(scope="module")
def model():
    return make_tiny_model(seed=47)


COMPRESSORS = {"snapkv": SnapKV(budget=16, window=4, kernel=3), "ada_snapkv": AdaSnapKV(budget=16, window=4, kernel=3)}


@pytest.mark.parametrize("name", list(COMPRESSORS))
def test_garbage_drafts_in_a_compressed_batch_equal_plain_decoding_on_that_cache(model, name):
    compressor = COMPRESSORS[name]
    prompts = _prompts(seed=10)
    ref = [_alone(model, p, [compressor]) for p in prompts]
    # the compressed reference is not the full-cache output: the test sees the compression
    assert ref != [_alone(model, p, []) for p in prompts]
    garbage = Garbage(references={Garbage.key(p): tuple(r) for p, r in zip(prompts, ref)})
    out = accel.generate(model, prompts, strategies=[compressor, garbage], max_new_tokens=NEW, eos_token_id=[])
    width = max(LENGTHS)
    rows = [out.sequences[b, width:].tolist() for b in range(len(prompts))]
    assert rows == ref
    assert out.stats.drafted_tokens > 3 * out.stats.accepted_tokens > 0  # mostly garbage, some accepted
    assert len({s.verify_steps for s in out.row_stats}) > 1  # ragged acceptance across rows
    assert out.stats.kv_bytes_kept < out.stats.kv_bytes_full


def test_garbage_with_snapkv_and_ada_snapkv_rows_in_one_engine_batch(model):
    """Rows of different compressors (and none) in one Engine batch, all with garbage drafts:
    each equals plain decoding on its own compressed cache."""
    prompts = _prompts(seed=20)
    snap, ada = COMPRESSORS["snapkv"], COMPRESSORS["ada_snapkv"]
    kinds = [[snap], [ada], [], [snap], [ada]]
    ref = [_alone(model, p, k) for p, k in zip(prompts, kinds)]
    garbage = Garbage(references={Garbage.key(p): tuple(r) for p, r in zip(prompts, ref)})
    hold = gate()
    with accel.Engine(model, max_batch=len(prompts), eos_token_id=[]) as engine:
        first = engine.submit(prompts[0][:9], max_new_tokens=1, strategies=[hold])
        assert hold.entered.wait(60)  # the loop is held: the requests below are admitted together
        handles = [engine.submit(p, max_new_tokens=NEW, strategies=k + [garbage]) for p, k in zip(prompts, kinds)]
        hold.opened.set()
        results = [h.result(timeout=300) for h in handles]
        assert first.result(timeout=60).finish_reason == "length" and first.result().error is None
        assert engine.metrics()["prefills"] == 2  # the gate's, then the five together
    assert [r.tokens for r in results] == ref
    assert all(r.finish_reason == "length" for r in results)
    assert sum(r.stats.drafted_tokens for r in results) > 3 * sum(r.stats.accepted_tokens for r in results) > 0


# --------------------------------------------------------------------------- the context


@pytest.fixture(scope="module")
def short_model():
    return make_tiny_model(seed=48, max_position_embeddings=64)


LONG = torch.arange(2, 82) % (TINY_VOCAB - 2) + 2  # 80 tokens


def test_generate_refuses_a_prompt_longer_than_the_context(short_model):
    with pytest.raises(ValueError, match=r"80 tokens .* context of 64 tokens"):
        accel.generate(short_model, LONG.unsqueeze(0), max_new_tokens=1)
    with pytest.raises(ValueError, match=r"prompt 1 has 80 tokens .* context of 64 tokens"):  # the row is named
        accel.generate(short_model, [LONG[:10], LONG], max_new_tokens=1)
    with pytest.raises(ValueError, match=r"60 tokens and max_new_tokens=8: 68 exceeds the model's context of 64"):
        accel.generate(short_model, LONG[:60].unsqueeze(0), strategies=[SnapKV(budget=16, window=4)], max_new_tokens=8)
    stream = accel.stream(short_model, LONG.unsqueeze(0), max_new_tokens=1)
    with pytest.raises(ValueError, match=r"80 tokens .* context of 64 tokens"):
        next(stream)
    # up to the context is fine
    fits = accel.generate(short_model, LONG[:60].unsqueeze(0), max_new_tokens=4, eos_token_id=[])
    assert fits.sequences.shape == (1, 64)


def test_the_engine_refuses_a_prompt_longer_than_the_context_at_submit(short_model):
    tok = make_tiny_tokenizer()
    with accel.Engine(short_model, max_batch=2, tokenizer=tok, eos_token_id=[]) as engine:
        with pytest.raises(ValueError, match=r"80 tokens .* context of 64 tokens"):
            engine.submit(LONG, max_new_tokens=1)
        with pytest.raises(ValueError, match=r"70 tokens .* context of 64 tokens"):
            engine.submit(" ".join(["cat"] * 70), max_new_tokens=1)  # text, tokenized to 70 words
        assert engine.metrics()["requests_total"] == 0  # nothing was queued
        ok = engine.submit(LONG[:30], max_new_tokens=5)
        assert ok.result(timeout=60).tokens == _alone(short_model, LONG[:30], [], 5)
        assert engine.alive
