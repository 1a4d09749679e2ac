"""Shared test helpers: tiny random models that build in milliseconds, the chi-square check of
the sampling tests, and a drafter that holds the Engine's thread for lifecycle tests."""

from __future__ import annotations

import math
import threading
from typing import Any, ClassVar

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from accel.strategy import Drafter

__all__ = ["TINY_VOCAB", "SMALL_DRAFT", "make_tiny_config", "make_tiny_model", "make_tiny_tokenizer", "chi2_fails",
           "Gate", "gate"]

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


# Words of the tiny tokenizer, after its 6 special tokens; TINY_VOCAB ids in all.
_TINY_WORDS = (
    "the a an and or of to in on at is are was be it this that with for as by from not no yes "
    "hello world what how why who when where which you me we they he she i my your our "
    "cat dog bird fish tree sun moon star sky sea rain snow wind fire stone road house door "
    "red blue green black white big small old new good bad hot cold fast slow one two three "
    "four five six seven eight nine ten up down left right"
).split()

#: ChatML-like template over the tiny tokenizer's specials.
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def make_tiny_tokenizer():
    """A word-level ``PreTrainedTokenizerFast`` over the tiny models' vocabulary, built offline.

    Ids: 0 ``<s>`` (bos/pad), 1 ``</s>`` (eos), 2-4 the chat roles ``<|system|>``, ``<|user|>``,
    ``<|assistant|>``, 5 ``<unk>``, then plain words; decoding joins words with spaces. It has
    a chat template, so ``accel.models.chat_ids`` works on it.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<unk>"]
    vocab = {tok: i for i, tok in enumerate(specials + list(_TINY_WORDS))}
    assert len(vocab) == TINY_VOCAB, len(vocab)
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<s>", unk_token="<unk>",
        additional_special_tokens=specials[2:5],
    )
    tok.chat_template = TINY_CHAT_TEMPLATE
    return tok


def chi2_fails(counts: torch.Tensor, p: torch.Tensor, z: float = 3.719, min_expected: float = 5.0) -> bool:
    """True if ``counts`` [K] are NOT plausibly a multinomial sample of the distribution ``p``
    [K]: Pearson's chi-square test at level 1e-4 (Wilson-Hilferty critical value for ``z``).

    Any count in a bin that ``p`` gives zero probability fails outright (a token that top-k /
    top-p excludes, or that the target forbids). Bins expected to hold fewer than
    ``min_expected`` samples are pooled into one (Pearson's statistic is unreliable on sparse
    bins, and a language model's tail is long), itself merged into the smallest other bin while
    it is still that sparse. ``p`` is normalised here, so it may be float32 softmax output.
    """
    counts = counts.double().reshape(-1)
    p = p.double().reshape(-1)
    if counts.shape != p.shape:
        raise ValueError(f"counts has {counts.numel()} bins, p {p.numel()}")
    if counts[p == 0].sum() > 0:
        return True
    p = p / p.sum()
    expected = counts.sum() * p
    dense = expected >= min_expected
    sparse = (p > 0) & ~dense
    obs, exp = counts[dense].tolist(), expected[dense].tolist()
    rest_obs, rest_exp = float(counts[sparse].sum()), float(expected[sparse].sum())
    if rest_exp > 0:
        if rest_exp < min_expected and exp:
            i = min(range(len(exp)), key=exp.__getitem__)
            obs[i] += rest_obs
            exp[i] += rest_exp
        else:
            obs.append(rest_obs)
            exp.append(rest_exp)
    df = len(exp) - 1
    if df < 1:  # one bin: nothing to test beyond the zero-probability bins
        return False
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp))
    crit = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat > crit


class Gate(Drafter):
    """Holds the Engine's loop thread at a known point: its ``start()`` (in the admission,
    after the prefill and the first token) sets ``entered`` and waits for ``proceed``, so a
    test knows where the loop is while it submits, cancels or closes from other threads.
    It drafts nothing. :func:`gate` builds one with fresh events."""

    name: ClassVar[str] = "gate_test"
    entered: Any = None  # threading.Event
    proceed: Any = None  # threading.Event (not `release`: that is a Drafter method)
    timeout: float = 120.0

    def start(self, model, prompt):
        self.entered.set()
        if not self.proceed.wait(self.timeout):
            raise TimeoutError("the test never opened the gate")
        return None

    def propose(self, state, ctx):
        return None


def gate() -> Gate:
    """A :class:`Gate` with its own ``entered`` / ``proceed`` events."""
    return Gate(entered=threading.Event(), proceed=threading.Event())
