"""accel on the packaged real models (``make models``; run with ``pytest -m models``).

- ``gemma3-270m``: Gemma 3 270M base, 18 layers, a global layer after every five
  sliding-window (512) layers; prompts are raw text (it has no chat template).
- ``qwen2.5-coder-0.5b-instruct``: prompts through its chat template.

For each: plain ``accel.generate`` equals ``model.generate`` (greedy); prompt lookup (and,
for Gemma 3, SnapKV + prompt lookup) gives the greedy output of the same cache; a batch of
three prompts gives the row-by-row output; and a ~2K-token pass-key needle (built by
``accel.bench.tasks``) that the full cache finds is found with SnapKV at budget 512 too.

Each model is converted once into ``$ACCEL_CACHE`` on its first load (minutes); then the
file runs in a few minutes on two CPU cores.
"""

from __future__ import annotations

import pytest
import torch

import accel
from accel.bench.schema import NeedleTask
from accel.bench.tasks import _needle_items, score
from accel.models import chat_ids
from helpers import left_padded, load_packaged
from snapkv import SnapKV
from speculative import PromptLookup

pytestmark = pytest.mark.models

GEMMA = "gemma3-270m"
QWEN = "qwen2.5-coder-0.5b-instruct"
MODELS = [GEMMA, QWEN]

PROMPTS = {
    GEMMA: [  # raw text for the base model
        "The capital of France is",
        'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
        "Alice said: the quick brown fox jumps over the lazy dog. Bob said: the quick brown",
    ],
    QWEN: [  # user turns through the chat template
        "What is the capital of France?",
        "Write a Python function `is_prime(n)` that returns True when n is a prime number.",
        "Repeat this sentence twice: the quick brown fox jumps over the lazy dog.",
    ],
}
NEW = 40
# Budget below the short prompts' lengths, so the compressed cache differs from the full one.
SMALL_SNAP = dict(budget=12, window=4, kernel=5)


def _strategies(kind: str) -> list:
    return {
        "plain": [],
        "prompt_lookup": [PromptLookup()],
        "snapkv": [SnapKV(**SMALL_SNAP)],
        "snapkv+prompt_lookup": [SnapKV(**SMALL_SNAP), PromptLookup()],
    }[kind]


SPECULATIVE = {GEMMA: [("plain", "prompt_lookup"), ("snapkv", "snapkv+prompt_lookup")],
               QWEN: [("plain", "prompt_lookup")]}
BATCHED = {GEMMA: ["plain", "prompt_lookup", "snapkv+prompt_lookup"], QWEN: ["plain", "prompt_lookup"]}


def _prompt_ids(name: str, tok, prompt: str) -> torch.Tensor:
    if name == GEMMA:
        return tok(prompt, return_tensors="pt").input_ids  # <bos> + text
    return chat_ids(tok, prompt)


_RUNS: dict[tuple, accel.GenerateResult] = {}


def _alone(name: str, i: int, kind: str):
    """``accel.generate`` on prompt i alone (memoised across tests)."""
    key = (name, i, kind)
    if key not in _RUNS:
        model, tok = load_packaged(name)
        ids = _prompt_ids(name, tok, PROMPTS[name][i])
        _RUNS[key] = accel.generate(model, ids, strategies=_strategies(kind), max_new_tokens=NEW, tokenizer=tok)
    return _RUNS[key]


# ----------------------------------------------------------------------------- the models


def test_gemma3_is_a_sliding_window_causal_lm_that_writes_sensible_text():
    model, tok = load_packaged(GEMMA)
    assert type(model).__name__ == "Gemma3ForCausalLM" and model.config.model_type == "gemma3_text"
    types = model.config.layer_types
    assert len(types) == model.config.num_hidden_layers == 18
    assert set(types) == {"sliding_attention", "full_attention"}
    assert types.count("full_attention") == 3 and types[5] == "full_attention"
    assert model.config.sliding_window == 512
    assert tok.bos_token_id == 2 and model.generation_config.eos_token_id == tok.eos_token_id == 1
    ids = _prompt_ids(GEMMA, tok, PROMPTS[GEMMA][1])
    assert ids[0, 0].item() == tok.bos_token_id
    code = _alone(GEMMA, 1, "plain").text[0]
    assert "return" in code and "if n" in code, code
    facts = {"The capital of France is Paris. The capital of Germany is": "Berlin",
             "The first five planets from the sun are Mercury, Venus,": "Earth, Mars and Jupiter"}
    for prompt, expected in facts.items():
        text = accel.generate(model, prompt, tokenizer=tok, max_new_tokens=8).text[0]
        assert expected in text, (prompt, text)


# ------------------------------------------------------------------------------ exactness


@pytest.mark.parametrize("i", range(3))
@pytest.mark.parametrize("name", MODELS)
def test_plain_decoding_equals_model_generate(name, i):
    model, tok = load_packaged(name)
    ids = _prompt_ids(name, tok, PROMPTS[name][i])
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW)
    res = _alone(name, i, "plain")
    assert torch.equal(res.sequences, ref), (res.text[0], tok.decode(ref[0, ids.shape[1]:]))


@pytest.mark.parametrize("name", MODELS)
def test_speculative_decoding_is_greedy_on_the_same_cache(name):
    for base, drafted in SPECULATIVE[name]:
        for i in range(3):
            ref, out = _alone(name, i, base), _alone(name, i, drafted)
            assert torch.equal(out.sequences, ref.sequences), (drafted, i, out.text[0], ref.text[0])
            if "snapkv" in base and out.stats.prompt_tokens > SMALL_SNAP["budget"]:  # it did compress
                assert out.stats.kv_bytes_kept < out.stats.kv_bytes_full, (drafted, i)
    assert any(_alone(name, i, "prompt_lookup").stats.mean_accepted > 1.2 for i in range(3))


@pytest.mark.parametrize("name", MODELS)
def test_batch_of_three_prompts_equals_row_by_row(name):
    model, tok = load_packaged(name)
    rows = [_prompt_ids(name, tok, p)[0] for p in PROMPTS[name]]
    ids, mask = left_padded(rows, tok.pad_token_id)
    n = ids.shape[1]
    for kind in BATCHED[name]:
        batch = accel.generate(model, ids, attention_mask=mask, strategies=_strategies(kind), max_new_tokens=NEW,
                               tokenizer=tok)
        for i, r in enumerate(rows):
            alone = _alone(name, i, kind)
            k = alone.stats.new_tokens
            assert batch.row_stats[i].new_tokens == k, (kind, i)
            assert torch.equal(batch.sequences[i, n:n + k], alone.sequences[0, len(r):len(r) + k]), (kind, i)
            assert batch.text[i] == alone.text[0], (kind, i)


# --------------------------------------------------------------------------------- needle

NEEDLE_LENGTH = 2048
NEEDLE_DEPTHS = [0.1, 0.5, 0.9]
NEEDLE_BUDGET = 512
NEEDLE_NEW = {GEMMA: 10, QWEN: 24}


class _PlainText:
    """A base model's tokenizer as ``accel.bench.tasks`` sees it: its "chat template" is
    ``<bos>`` + the user text + an answer cue (the base model has no turn markers)."""

    def __init__(self, tokenizer, cue: str):
        self._tok, self._cue = tokenizer, cue

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False):
        assert not tokenize and add_generation_prompt and messages[-1]["role"] == "user"
        return self._tok.bos_token + messages[-1]["content"] + self._cue

    def __call__(self, *args, **kwargs):
        return self._tok(*args, **kwargs)


def _needles(name: str, tok):
    """The bench's needle items at ~2K tokens, depths 0.1 / 0.5 / 0.9 (classic filler)."""
    task = NeedleTask(lengths=[NEEDLE_LENGTH], depths=NEEDLE_DEPTHS)
    view = _PlainText(tok, " The pass key is") if name == GEMMA else tok
    items = _needle_items(task, "needle", 0, view, None)
    for item in items:
        assert NEEDLE_LENGTH - 64 < item.prompt_tokens <= NEEDLE_LENGTH
    return items


@pytest.mark.parametrize("name", MODELS)
def test_needle_found_by_snapkv_wherever_the_full_cache_finds_it(name):
    model, tok = load_packaged(name)
    snap = SnapKV(budget=NEEDLE_BUDGET)
    found: dict[str, list[bool]] = {"full": [], "snapkv": []}
    report = []
    for item in _needles(name, tok):
        full = accel.generate(model, item.input_ids, max_new_tokens=NEEDLE_NEW[name], tokenizer=tok)
        comp = accel.generate(model, item.input_ids, strategies=[snap], max_new_tokens=NEEDLE_NEW[name],
                              tokenizer=tok)
        assert comp.stats.kv_bytes_kept < comp.stats.kv_bytes_full
        ok_full, ok_snap = score(item, full.text[0])[0], score(item, comp.text[0])[0]
        found["full"].append(ok_full)
        found["snapkv"].append(ok_snap)
        report.append(f"{item.item_id} key={item.expected} n={item.prompt_tokens} "
                      f"full={ok_full} {full.text[0]!r} snapkv{NEEDLE_BUDGET}={ok_snap} {comp.text[0]!r}")
        if name == GEMMA and item.meta["depth"] == 0.5:
            # Beyond the 512-token sliding window: plain equals model.generate, and prompt
            # lookup keeps the compressed cache's greedy output.
            ids = item.input_ids
            ref = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=NEEDLE_NEW[name])
            assert torch.equal(full.sequences, ref)
            drafted = accel.generate(model, ids, strategies=[snap, PromptLookup()],
                                     max_new_tokens=NEEDLE_NEW[name])
            assert torch.equal(drafted.sequences, comp.sequences)
    print(f"\n{name} needle ({NEEDLE_LENGTH} tokens):\n  " + "\n  ".join(report))
    for i, (ok_full, ok_snap) in enumerate(zip(found["full"], found["snapkv"])):
        assert ok_snap or not ok_full, report[i]
    if name == QWEN:
        assert all(found["full"]), report


def test_qwen_in_bf16_drafting_is_exact_with_ordered_attention():
    # a real model in bfloat16: ordered attention, claimed exact, prompt lookup equal to plain bf16
    from accel.kernels import invariance

    model, tok = load_packaged(QWEN, torch.bfloat16)
    assert invariance.ordered(model) and invariance.is_exact(model)
    for prompt in PROMPTS[QWEN]:
        ids = _prompt_ids(QWEN, tok, prompt)
        ref = accel.generate(model, ids, strategies=[], max_new_tokens=NEW, tokenizer=tok)
        out = accel.generate(model, ids, strategies=[PromptLookup()], max_new_tokens=NEW, tokenizer=tok)
        assert out.stats.exact_verify and torch.equal(out.sequences, ref.sequences), (out.text[0], ref.text[0])
