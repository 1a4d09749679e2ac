"""Devices and attention kernels: flash-attention models, CUDA (marked ``cuda``), and the
greedy reduction of the lossy typical acceptance on a one-hot target."""

from __future__ import annotations

import pytest
import torch

import accel
from helpers import make_tiny_model, repetitive_prompt
from snapkv import SnapKV
from speculative import PromptLookup, TypicalAcceptance

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _prompt(n=45, seed=0):
    return repetitive_prompt(seed, n)


def test_flash_attention_model_verifies_trees_on_sdpa_and_is_restored():
    flash = make_tiny_model(seed=3)
    flash.config._attn_implementation = "flash_attention_2"  # no CUDA needed: accel never calls the kernel
    sdpa = make_tiny_model(seed=3)
    ids = _prompt()
    strategies = [SnapKV(budget=16, window=4, kernel=3), PromptLookup()]
    out = accel.generate(flash, ids, strategies=strategies, max_new_tokens=20, eos_token_id=[])
    ref = accel.generate(sdpa, ids, strategies=strategies[:1], max_new_tokens=20, eos_token_id=[])
    assert torch.equal(out.sequences, ref.sequences)
    assert out.stats.drafted_tokens > 0
    assert flash.config._attn_implementation == "flash_attention_2"


def test_typical_acceptance_on_a_one_hot_target_is_greedy(monkeypatch):
    # at temperature 0 the engine accepts greedily without asking the rule; sampling with
    # top_k=1 makes the target one-hot, and there the rule runs and must reduce to greedy
    calls: list[int] = []
    accept = TypicalAcceptance.accept
    monkeypatch.setattr(TypicalAcceptance, "accept", lambda self, *a, **kw: calls.append(1) or accept(self, *a, **kw))
    model = make_tiny_model(seed=5)
    ids = _prompt(seed=1)
    ref = accel.generate(model, ids, max_new_tokens=20, eos_token_id=[])
    out = accel.generate(model, ids, strategies=[PromptLookup(), TypicalAcceptance()], max_new_tokens=20,
                         temperature=1.0, top_k=1, seed=0, eos_token_id=[])
    assert torch.equal(out.sequences, ref.sequences)
    assert calls and out.stats.drafted_tokens > 0 and out.stats.accepted_tokens > 0


@pytest.mark.cuda
@cuda
def test_cuda_rows_are_exact_and_every_tensor_stays_on_the_gpu():
    model = make_tiny_model(seed=7).to("cuda")
    ids = torch.cat([_prompt(seed=2), _prompt(seed=3)]).to("cuda")
    ref = [accel.generate(model, ids[i : i + 1], max_new_tokens=16, eos_token_id=[]).sequences for i in range(2)]
    out = accel.generate(model, ids, strategies=[SnapKV(budget=16, window=4, kernel=3), PromptLookup()],
                         max_new_tokens=16, eos_token_id=[])
    snap = [accel.generate(model, ids[i : i + 1], strategies=[SnapKV(budget=16, window=4, kernel=3)],
                           max_new_tokens=16, eos_token_id=[]).sequences for i in range(2)]
    assert out.sequences.device.type == "cuda"
    assert all(torch.equal(out.sequences[i : i + 1], snap[i]) for i in range(2))
    assert all(r.device.type == "cuda" for r in ref)


@pytest.mark.cuda
@cuda
def test_cuda_bfloat16_sampling_runs_on_the_gpu():
    model = make_tiny_model(seed=8).to("cuda", torch.bfloat16)
    out = accel.generate(model, _prompt(seed=4).to("cuda"), strategies=[PromptLookup()], max_new_tokens=12,
                         temperature=0.8, seed=0, eos_token_id=[])
    assert out.sequences.device.type == "cuda" and out.stats.new_tokens == 12
