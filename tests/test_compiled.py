"""Compiled verify steps (accel.kernels.compiled): the lean decoder step serves plain and
drafted steps, agrees with transformers' forward, keeps greedy drafting equal to plain
decoding (float32, and bf16 with ordered attention), compiles with torch.compile, falls back
with a warning, and refuses bad input by name."""

from __future__ import annotations

import pytest
import torch

import accel
from accel import adapter
from accel.kernels import compiled, invariance
from helpers import left_padded, make_tiny_model, make_tiny_qwen2, repetitive_prompt
from snapkv import SnapKV
from speculative import PromptLookup

NEW = 24


def _prompts():
    return torch.cat([repetitive_prompt(3, 30), repetitive_prompt(4, 30)])


def _tokens(model, ids, strategies=(), **kw):
    return accel.generate(model, ids, max_new_tokens=NEW, strategies=list(strategies), **kw).sequences


@pytest.mark.parametrize("make", [lambda: make_tiny_model(seed=3), make_tiny_qwen2], ids=["llama", "qwen2_bias"])
def test_lean_step_matches_transformers_forward(make):
    model = make()
    ids = _prompts()
    ref = _tokens(model, ids)
    step = compiled.enable(model, "on", compiled=False)
    try:
        assert _tokens(model, ids).equal(ref)
        assert step.calls >= NEW - 1  # it served the decode steps
        calls = step.calls
        assert _tokens(model, ids, [PromptLookup()]).equal(ref)
        assert step.calls > calls
    finally:
        compiled.disable(model)


def test_lean_step_serves_a_left_padded_batch():
    model = make_tiny_model(seed=5)
    ids, mask = left_padded([repetitive_prompt(3, 21)[0], repetitive_prompt(6, 34)[0]])
    plain = _tokens(model, ids, attention_mask=mask)
    step = compiled.enable(model, "on", compiled=False)
    try:
        lean = _tokens(model, ids, attention_mask=mask)
        drafted = _tokens(model, ids, [PromptLookup()], attention_mask=mask)
    finally:
        compiled.disable(model)
    assert step.calls > 0 and lean.equal(plain) and drafted.equal(plain)


def test_bf16_ordered_drafting_equals_plain_on_the_lean_step():
    model = make_tiny_model(seed=3).to(torch.bfloat16)
    if not invariance.ordered(model):
        pytest.skip("this machine's float32 products fail accel.kernels.ordered.probe: no ordered attention")
    ids = _prompts()
    step = compiled.enable(model, "on", compiled=False)
    try:
        plain = _tokens(model, ids)
        assert step.calls > 0
        for strategies in ([PromptLookup()], [SnapKV(budget=24, window=4, kernel=3), PromptLookup()]):
            ref = plain if len(strategies) == 1 else _tokens(model, ids, strategies[:1])
            assert _tokens(model, ids, strategies).equal(ref), strategies
    finally:
        compiled.disable(model)


def test_compiled_step_is_exact_and_agrees_with_the_eager_one():
    """torch.compile of the whole step (the slow test of this file: one compile per shape kind)."""
    model = make_tiny_model(seed=7)
    ids = _prompts()
    compiled.enable(model, "on", compiled=False)
    eager = _tokens(model, ids)
    compiled.disable(model)
    step = compiled.enable(model, "on")
    try:
        assert step.compiled
        plain = _tokens(model, ids)
        drafted = _tokens(model, ids, [PromptLookup()])
        assert step.failure is None, step.failure
    finally:
        compiled.disable(model)
    assert plain.equal(eager) and drafted.equal(plain)


def test_a_failed_compile_warns_once_and_runs_eagerly():
    model = make_tiny_model(seed=3)
    ids = _prompts()
    ref = _tokens(model, ids)
    step = compiled.enable(model, "on")

    def broken(*args):
        raise RuntimeError("inductor exploded")

    step._fn = broken
    try:
        with pytest.warns(RuntimeWarning, match="compiling the decode step failed .*inductor exploded") as rec:
            out = _tokens(model, ids)
        assert len([w for w in rec if "compiling the decode step" in str(w.message)]) == 1
        assert out.equal(ref) and "inductor exploded" in step.failure
    finally:
        compiled.disable(model)


def test_steps_with_hooks_or_ragged_caches_keep_transformers_forward():
    model = make_tiny_model(seed=3)
    ids = _prompts()
    step = compiled.enable(model, "on", compiled=False)
    try:
        handle = model.model.layers[0].self_attn.register_forward_pre_hook(lambda *a: None)
        try:
            _tokens(model, ids)
            assert step.calls == 0  # a user's hook must run: the lean step stands aside
        finally:
            handle.remove()
        assert not adapter.has_hooks(model)
        ref = _tokens(model, ids, [SnapKV(budget=24, window=4, kernel=3, decode_budget=12, decode_slack=4)])
        compiled.disable(model)
        assert _tokens(model, ids, [SnapKV(budget=24, window=4, kernel=3, decode_budget=12, decode_slack=4)]).equal(ref)
    finally:
        compiled.disable(model)


def test_unsupported_models_and_bad_modes():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    gemma = Gemma2ForCausalLM(Gemma2Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=2, num_key_value_heads=1, head_dim=16)).eval()
    with pytest.warns(RuntimeWarning, match=r"compile='on' but Gemma2ForCausalLM .*architecture \(gemma2\)"):
        assert compiled.enable(gemma, "on") is None
    assert compiled.enable(gemma, "auto") is None and compiled.step_of(gemma) is None
    model = make_tiny_model()
    with pytest.raises(ValueError, match="compile must be one of auto, on, off, got 'fast'"):
        compiled.enable(model, "fast")
    with pytest.raises(ValueError, match="compile must be one of"):
        accel.load_model("default", compile="yes")
    with pytest.raises(ValueError, match="compile must be one of"):
        accel.Engine(model, compile="always")
    from accel.kernels.cpu import prepack, prepack_supported

    if prepack_supported():
        packed = prepack(make_tiny_model())
        with pytest.warns(RuntimeWarning, match="not torch.nn.Linear"):
            assert compiled.enable(packed, "on") is None
