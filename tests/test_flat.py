"""The flat decoder forward (accel.adapter.flat_forward): a Llama-family step without
transformers' module calls. It must compute transformers' numbers bit for bit (float32 and
bf16, sdpa and ordered attention, one token and draft trees, padded batches, q/k/v biases),
serve the engine's steps, and step aside for hooks and for layers it does not know."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaMLP

import accel
from accel import adapter
from accel.cache import SharedCache
from accel.kernels import invariance
from accel.steps import prefill, verify
from accel.strategy import DraftProposal
from accel.tree import DraftTree
from helpers import make_tiny_model, make_tiny_qwen2, repetitive_prompt
from speculative import PromptLookup


def _hidden(model, dtype, ordered, flat, monkeypatch):
    """Hidden states of a one-token step and of a draft tree over a padded batch of two rows."""
    with monkeypatch.context() as m:
        if not flat:
            m.setattr(adapter, "flat_layers", lambda model: (None, "off in this test"))
        calls = []
        real = adapter.flat_forward
        m.setattr(adapter, "flat_forward", lambda *a, **k: calls.append(1) or real(*a, **k))
        cache = SharedCache(model.config.num_hidden_layers)
        cache.ordered = ordered
        prompts = [repetitive_prompt(3, 21)[0], repetitive_prompt(6, 34)[0] % 90]
        out = []
        with torch.inference_mode():
            prefill(model, cache, prompts, None)
            one = [DraftTree.from_proposal(5, None), DraftTree.from_proposal(7, None)]
            out.append(verify(model, cache, one, dtype))
            cache.commit([[0], [0]])
            proposal = DraftProposal(torch.tensor([6, 7, 8, 9]), torch.tensor([0, 1, 0, 3]))
            trees = [DraftTree.from_proposal(11, proposal), DraftTree.from_proposal(12, proposal)]
            out.append(verify(model, cache, trees, dtype))
        assert bool(calls) == flat  # the flat forward served both steps, or none
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bf16"])
@pytest.mark.parametrize("make", [lambda: make_tiny_model(seed=3), make_tiny_qwen2], ids=["llama", "qwen2_bias"])
def test_flat_forward_computes_transformers_numbers_bit_for_bit(make, dtype, monkeypatch):
    model = make().to(dtype)
    modes = [False] + ([True] if dtype == torch.bfloat16 and invariance.ordered(model) else [])
    for ordered in modes:
        flat = _hidden(model, dtype, ordered, True, monkeypatch)
        ref = _hidden(model, dtype, ordered, False, monkeypatch)
        for a, b in zip(flat, ref):
            assert a.shape == b.shape and torch.equal(a, b), f"ordered={ordered}"


def test_generation_runs_flat_steps_and_drafting_stays_exact(monkeypatch):
    model = make_tiny_model(seed=5)
    ids = repetitive_prompt(4, 30)
    calls = []
    real = adapter.flat_forward
    monkeypatch.setattr(adapter, "flat_forward", lambda *a, **k: calls.append(a[2].shape) or real(*a, **k))
    plain = accel.generate(model, ids, max_new_tokens=12, eos_token_id=[]).sequences
    assert len(calls) == 11 and all(shape == (1, 1) for shape in calls)
    calls.clear()
    drafted = accel.generate(model, ids, max_new_tokens=12, strategies=[PromptLookup()], eos_token_id=[]).sequences
    assert drafted.equal(plain) and any(shape[1] > 1 for shape in calls)


def test_a_hooked_model_runs_transformers_forward_and_its_hooks_fire(monkeypatch):
    model = make_tiny_model(seed=5)
    ids = repetitive_prompt(4, 30)
    ref = accel.generate(model, ids, max_new_tokens=6, eos_token_id=[]).sequences
    monkeypatch.setattr(adapter, "flat_forward", lambda *a, **k: pytest.fail("flat forward ran past a hook"))
    fired = []
    handle = model.model.layers[1].mlp.register_forward_hook(lambda *a: fired.append(1))
    try:
        assert accel.generate(model, ids, max_new_tokens=6, eos_token_id=[]).sequences.equal(ref)
    finally:
        handle.remove()
    assert len(fired) == 6  # the prefill and five steps


class _ScaledMLP(LlamaMLP):
    def forward(self, x):
        return 2 * super().forward(x)


def test_layers_of_a_users_own_class_are_not_flattened():
    model = make_tiny_model(seed=5)
    assert adapter.flat_layers(model)[0] is not None
    old = model.model.layers[0].mlp
    new = _ScaledMLP(model.config)
    new.load_state_dict(old.state_dict())
    model.model.layers[0].mlp = new
    layers, why = adapter.flat_layers(model)
    assert layers is None and "_ScaledMLP" in why


def test_a_global_forward_hook_keeps_transformers_forward():
    model = make_tiny_model(seed=5)
    assert not adapter.has_hooks(model)
    handle = torch.nn.modules.module.register_module_forward_hook(lambda *a: None)
    try:
        assert adapter.has_hooks(model)
    finally:
        handle.remove()
    assert not adapter.has_hooks(model)


def test_a_replaced_layer_is_seen_by_the_next_step():
    model = make_tiny_model(seed=5)
    ids = repetitive_prompt(4, 30)
    ref = accel.generate(model, ids, max_new_tokens=6, eos_token_id=[]).sequences
    new = torch.nn.ModuleList([*model.model.layers])  # the same layers, one replaced by a fresh one
    fresh = type(model.model.layers[1])(model.config, 1)
    new[1] = fresh
    model.model.layers = new
    assert adapter.flat_layers(model)[0][1][1] is fresh.self_attn
    assert not accel.generate(model, ids, max_new_tokens=6, eos_token_id=[]).sequences.equal(ref)
