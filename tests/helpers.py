"""Shared test helpers: tiny random models that build in milliseconds."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

__all__ = ["TINY_VOCAB", "SMALL_DRAFT", "make_tiny_config", "make_tiny_model"]

#: Vocabulary size of the tiny models (ids 0..96; 0 = bos/pad, 1 = eos).
TINY_VOCAB = 97

#: ``make_tiny_model`` overrides for a smaller model of the same vocabulary (a draft model).
SMALL_DRAFT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_kv_heads=1)


def make_tiny_config(num_kv_heads: int = 2, **overrides) -> LlamaConfig:
    """A small ``LlamaConfig`` (2 layers, 4 query heads, ``num_kv_heads`` KV heads, head_dim 16).

    Any keyword in ``overrides`` replaces the matching config field.
    """
    fields = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=512,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    fields.update(overrides)
    attn = fields.pop("attn_implementation", "sdpa")
    config = LlamaConfig(**fields)
    config._attn_implementation = attn
    return config


def make_tiny_model(seed: int = 0, num_kv_heads: int = 2, **overrides) -> LlamaForCausalLM:
    """A random tiny ``LlamaForCausalLM`` in eval mode, float32, on CPU, seeded by ``seed``.

    The global torch RNG state is left as it was.
    """
    config = make_tiny_config(num_kv_heads=num_kv_heads, **overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.to(torch.float32)
    model.eval()
    return model
