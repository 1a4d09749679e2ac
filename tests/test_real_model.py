"""accel.generate on the real default model (SmolLM2-135M-Instruct): exactness on chat prompts."""

import pytest
import torch

import accel
from accel.models import chat_ids
from helpers import Scripted, left_padded
from snapkv import SnapKV
from speculative import PromptLookup

pytestmark = pytest.mark.real_model

CHAT = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three uses of a paperclip.",
    "Repeat this sentence twice: the quick brown fox jumps over the lazy dog.",
]


@pytest.fixture(scope="module")
def chats(default_model):
    _, tok = default_model
    return [chat_ids(tok, c) for c in CHAT]


def test_answers_paris(default_model):
    model, tok = default_model
    res = accel.generate(model, chat_ids(tok, "What is the capital of France?"), max_new_tokens=20, tokenizer=tok)
    assert "Paris" in res.text[0]


@pytest.mark.parametrize("i", range(len(CHAT)))
def test_plain_decoding_equals_model_generate(default_model, chats, i):
    model, tok = default_model
    ids = chats[i]
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=40)
    res = accel.generate(model, ids, strategies=[], max_new_tokens=40, tokenizer=tok)
    assert torch.equal(res.sequences, ref)
    s = res.stats
    assert s.new_tokens == ref.shape[1] - ids.shape[1]
    assert s.prefill_s > 0 and s.decode_s > 0 and s.verify_steps == s.new_tokens - 1
    assert s.mean_accepted == 1.0 and s.kv_bytes_full == s.kv_bytes_kept > 0


@pytest.mark.parametrize("compressed", [False, True])
def test_drafters_keep_greedy_output(default_model, chats, compressed):
    model, tok = default_model
    ids = chats[3]
    base = [SnapKV(budget=40, window=8, kernel=5)] if compressed else []
    ref = accel.generate(model, ids, strategies=base, max_new_tokens=40).sequences
    for drafters in ([PromptLookup()], [Scripted(mode="random", size=8)], [PromptLookup(), Scripted(mode="random")]):
        out = accel.generate(model, ids, strategies=base + drafters, max_new_tokens=40)
        assert torch.equal(out.sequences, ref), [d.name for d in drafters]


@pytest.mark.parametrize("strategies", [[], [PromptLookup()], [SnapKV(budget=40, window=8, kernel=5), PromptLookup()]],
                         ids=["plain", "prompt_lookup", "snapkv+prompt_lookup"])
def test_batch_of_four_chat_prompts_equals_row_by_row(default_model, chats, strategies):
    model, tok = default_model
    ids, mask = left_padded(chats, tok.pad_token_id)
    batch = accel.generate(model, ids, attention_mask=mask, strategies=strategies, max_new_tokens=40, tokenizer=tok)
    for i, c in enumerate(chats):
        alone = accel.generate(model, c, strategies=strategies, max_new_tokens=40, tokenizer=tok)
        assert batch.text[i] == alone.text[0], CHAT[i]
        assert batch.row_stats[i].new_tokens == alone.stats.new_tokens
