"""accel.kernels.cpu.transpose_weights: linear weights stored column-major (same values, no extra memory),
alone and with packed layers."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

import accel
from accel.kernels.cpu import (PackedLinear, is_prepacked, is_transposed, prepack, prepack_supported, transpose_weights,
                               untranspose_weights)
from helpers import make_tiny_model, random_prompt
from speculative import PromptLookup


def test_transposing_keeps_parameters_ties_values_and_state_dict():
    model = make_tiny_model(seed=1, tie_word_embeddings=True)
    params = dict(model.named_parameters())
    values = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ids = random_prompt(0, 12)
    with torch.inference_mode():
        before = model(ids).logits
    assert not is_transposed(model)
    assert transpose_weights(model) is model and is_transposed(model)
    assert dict(model.named_parameters()).keys() == params.keys()
    assert all(p is params[k] for k, p in model.named_parameters())  # the same Parameter objects
    assert model.lm_head.weight is model.model.embed_tokens.weight  # the tie survives
    for m in model.modules():
        if isinstance(m, nn.Linear):
            w = m.weight
            assert w.stride() == (1, w.shape[0]) and not w.is_contiguous()
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in values.items())
    with torch.inference_mode():
        torch.testing.assert_close(model(ids).logits, before, rtol=1e-4, atol=1e-5)
    transpose_weights(model)  # a second call changes nothing
    assert untranspose_weights(model) is model and not is_transposed(model)
    assert all(p.is_contiguous() for p in model.parameters())
    assert all(torch.equal(model.state_dict()[k], v) for k, v in values.items())


_NO_PACKING = pytest.mark.skipif(not prepack_supported(), reason="no oneDNN linear packing")


@pytest.mark.parametrize("kernels,packed", [
    (transpose_weights, False),
    pytest.param(prepack, True, marks=_NO_PACKING),
    pytest.param(lambda m: prepack(transpose_weights(m), min_rows=4, max_rows=8), True, marks=_NO_PACKING),
], ids=["transposed", "packed", "transposed+packed window"])
def test_plain_and_speculative_decoding_on_calibrated_kernels_equal_generate(kernels, packed):
    """accel.generate and model.generate run the same kernels on the same model, so plain
    and speculative decoding equal model.generate token for token."""
    model = kernels(make_tiny_model(seed=3))
    assert is_prepacked(model) == packed
    ids = random_prompt(1, 24)
    with torch.inference_mode():
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=30,
                             pad_token_id=0, eos_token_id=None)
    for strategies in ([], [PromptLookup()]):
        out = accel.generate(model, ids, strategies=strategies, max_new_tokens=30, eos_token_id=[])
        assert torch.equal(out.sequences, ref), strategies


def test_a_transposed_model_can_be_deep_copied_and_pickled():
    model = transpose_weights(make_tiny_model(seed=4))
    ids = random_prompt(2, 10)
    with torch.inference_mode():
        ref = model(ids).logits
    for other in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert is_transposed(other)
        with torch.inference_mode():
            torch.testing.assert_close(other(ids).logits, ref)


@pytest.mark.skipif(not prepack_supported(), reason="this torch build has no oneDNN linear packing")
def test_packed_layers_are_packed_again_after_a_layout_change():
    model = prepack(make_tiny_model(seed=5))
    ids = random_prompt(3, 9)
    with torch.inference_mode():
        ref = model(ids).logits
    calls = []
    for m in model.modules():
        if isinstance(m, PackedLinear):
            original = m._repack
            m._repack = lambda original=original: (calls.append(1), original())[1]
    transpose_weights(model)
    layers = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert layers and len(calls) == len(layers)  # every one, once
    assert all(m._packed is not None and m._packed_from == m._weight_key() for m in layers)
    with torch.inference_mode():
        torch.testing.assert_close(model(ids).logits, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("packed", [False, True])
def test_a_layout_change_inside_inference_mode_keeps_weights_trainable_and_tracked(packed):
    """The engine may calibrate (and so switch layouts) inside inference mode: the weights must
    stay normal tensors, so that the model can still be trained and packed layers still see
    in-place changes of their weights."""
    if packed and not prepack_supported():
        pytest.skip("no oneDNN packing")
    model = make_tiny_model(seed=6)
    reference = make_tiny_model(seed=6)
    if packed:
        prepack(model)
    assert is_prepacked(model) == packed
    with torch.inference_mode():
        transpose_weights(model)
        untranspose_weights(model)
        transpose_weights(model)
    weights = [m.weight for m in model.modules() if isinstance(m, (nn.Linear, PackedLinear))]
    assert is_transposed(model) and not any(w.is_inference() for w in weights)
    x = torch.randn(3, 64, requires_grad=True)
    model.model.layers[0].self_attn.q_proj(x).sum().backward()  # raises on an inference tensor
    assert x.grad is not None
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.mul_(2.0)
        reference.model.layers[0].mlp.up_proj.weight.mul_(2.0)
    ids = random_prompt(4, 7)
    with torch.inference_mode():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=1e-4, atol=1e-5)
