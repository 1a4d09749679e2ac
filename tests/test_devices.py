"""Devices and attention kernels: flash-attention models, CUDA (marked ``cuda``), and the
greedy reduction of the lossy typical acceptance at temperature 0."""

from __future__ import annotations

import pytest
import torch

import accel
from helpers import TINY_VOCAB, make_tiny_model
from snapkv import SnapKV
from speculative import PromptLookup, TypicalAcceptance

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _prompt(n=45, seed=0):
    base = torch.randint(2, TINY_VOCAB, (n // 3,), generator=torch.Generator().manual_seed(seed))
    return base.repeat(3).unsqueeze(0)


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


def test_typical_acceptance_is_greedy_at_temperature_zero():
    model = make_tiny_model(seed=5)
    ids = _prompt(seed=1)
    ref = accel.generate(model, ids, max_new_tokens=20, eos_token_id=[])
    out = accel.generate(model, ids, strategies=[PromptLookup(), TypicalAcceptance()], max_new_tokens=20,
                         eos_token_id=[])
    assert torch.equal(out.sequences, ref.sequences)


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
