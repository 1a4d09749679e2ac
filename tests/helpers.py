"""Shared test helpers: tiny random models that build in milliseconds, and what several test
files need alike.

- models and tokenizers: :func:`make_tiny_model`, :func:`make_tiny_tokenizer` (word level, a
  chat template), :class:`CharTokenizer` (character level, plain-text chat), :func:`random_heads`
  (Medusa heads for the tiny models), :func:`load_packaged` (the packaged real models);
- prompts: :func:`repetitive_prompt` (prompt lookup finds matches), :func:`random_prompt`,
  :func:`left_padded` (a batch of prompts of different lengths);
- the reference a batched, drafted or served run is compared with: :func:`generate_alone`,
  :func:`alone_tokens`;
- the chi-square check of the sampling tests: :func:`chi2_fails`;
- drafters: :class:`Scripted` (random, oracle, right-then-wrong or empty proposals) and
  :class:`Gate` with :func:`engine_held` (hold an Engine's loop thread, so a test orders
  what the engine sees by construction, not by sleeping).

Test files import from here (and get fixtures from conftest.py), never from each other.
"""

from __future__ import annotations

import math
from pathlib import Path
import threading
from contextlib import contextmanager
from typing import Any, ClassVar, Iterator, Sequence

import pytest
import torch
import yaml
from pydantic import ConfigDict, Field
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

import accel
from accel import adapter
from accel.calibration.cost_model import CostTable
from accel.engine import Batch, Row, plan_strategies
from accel.strategy import DraftContext, DraftProposal, Drafter

__all__ = ["CONFIGS", "TINY_VOCAB", "TINY_HIDDEN", "SMALL_DRAFT", "CharTokenizer", "Gate", "Scripted", "alone_tokens", "assert_same_caches", "chi2_fails", "decode_snapshots", "gate",
           "engine_held", "fake_measure", "fake_table", "generate_alone", "left_padded", "load_packaged", "make_tiny_config", "make_tiny_model",
           "make_tiny_tokenizer", "random_heads", "random_prompt", "repetitive_prompt", "write_yaml"]

#: Vocabulary size of the tiny models (ids 0..96; 0 = bos/pad, 1 = eos).
TINY_VOCAB = 97

#: Hidden size of the tiny models.
TINY_HIDDEN = 64

#: ``make_tiny_model`` overrides for a smaller model of the same vocabulary (a draft model).
SMALL_DRAFT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_kv_heads=1)


def make_tiny_config(num_kv_heads: int = 2, **overrides) -> LlamaConfig:
    """A small ``LlamaConfig`` (2 layers, 4 query heads, ``num_kv_heads`` KV heads, head_dim 16).

    Any keyword in ``overrides`` replaces the matching config field.
    """
    fields = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=TINY_HIDDEN,
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


def make_tiny_qwen2() -> Qwen2ForCausalLM:
    """A random tiny ``Qwen2ForCausalLM`` (q/k/v projections with biases, set far from zero so
    that a forward that skipped them would show), eval mode, float32."""
    cfg = Qwen2Config(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(4)
        model = Qwen2ForCausalLM(cfg)
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    return model.eval()


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


class CharTokenizer:
    """A character-level stand-in for a tokenizer, sized for the tiny models (97 ids).

    id 0 = pad/bos, 1 = eos; printable ASCII but '~' is ``2 + ord(c) % 95``, newline takes
    '~''s id (2..96 in all); other characters become '?'.
    The chat template is plain text: ``<user>\\n...\\n<assistant>\\n``. A list of texts is a
    batch, padded on ``padding_side`` with an attention mask.
    """

    pad_token_id = 0
    eos_token_id = 1
    padding_side = "right"
    index = {chr(c): 2 + c % 95 for c in range(32, 126)} | {"\n": 2 + 126 % 95}
    chars = {i: c for c, i in index.items()}

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False):
        text = "".join(f"<{m['role']}>\n{m['content']}\n" for m in messages)
        return text + ("<assistant>\n" if add_generation_prompt else "")

    def __call__(self, text, add_special_tokens=False, return_tensors=None, padding=False):
        if isinstance(text, str):
            ids = [self.index.get(c, self.index["?"]) for c in text]
            return {"input_ids": torch.tensor([ids]) if return_tensors == "pt" else ids}
        rows = [self(t)["input_ids"] for t in text]
        n = max(map(len, rows))
        ids = torch.full((len(rows), n), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(rows):
            at = slice(n - len(r), n) if self.padding_side == "left" else slice(0, len(r))
            ids[i, at], mask[i, at] = torch.tensor(r, dtype=torch.long), 1
        return {"input_ids": ids, "attention_mask": mask}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.chars[i] for i in ids if i >= 2)


def random_heads(num_heads: int = 3, num_layers: int = 1, own_lm_head: bool = False, seed: int = 0, std: float = 0.3,
                 sequential: bool = False):
    """Medusa heads for the tiny models with every parameter drawn from N(0, std^2) (seeded):
    they propose tokens, mostly wrong ones."""
    from speculative import MedusaHeads

    heads = MedusaHeads(num_heads, TINY_HIDDEN, TINY_VOCAB, num_layers, own_lm_head, sequential=sequential)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * std)
    return heads


def load_packaged(name: str, dtype: torch.dtype = torch.float32):
    """``(model, tokenizer)`` of a packaged model, the object ``DraftModel(model=name)`` uses.

    Tests on these models run only when selected (``pytest -m models``, see conftest.py); there
    a missing model fails the test, naming the command that installs it."""
    from accel.models import ModelNotAvailableError, load_shared

    try:
        return load_shared(name, dtype, "cpu")
    except ModelNotAvailableError as err:
        missing = str(err)  # (failed outside the handler: one message, not a chain of two)
    pytest.fail(f"{missing} (the tests marked `models` need the packaged models: `make models`)", pytrace=False)


# ----------------------------------------------------------------------------- prompts


def repetitive_prompt(seed: int, n: int, period: int | None = None) -> torch.Tensor:
    """[1, n] ids in 2..96: a random segment of ``period`` tokens (default ``max(4, n // 3)``)
    repeated, so prompt lookup finds matches."""
    period = max(4, n // 3) if period is None else period
    base = torch.randint(2, TINY_VOCAB, (period,), generator=torch.Generator().manual_seed(seed))
    return base.repeat(-(-n // period))[:n].unsqueeze(0)


def random_prompt(seed: int, n: int) -> torch.Tensor:
    """[1, n] random ids in 2..96."""
    return torch.randint(2, TINY_VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


def left_padded(prompts: Sequence[Any], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of prompts (each [n], [1, n] or a list of ids) padded on the left with
    ``pad_id``: (ids [B, N], attention mask [B, N]), N the longest prompt."""
    rows = [torch.as_tensor(p).reshape(-1) for p in prompts]
    n = max(r.numel() for r in rows)
    ids = torch.full((len(rows), n), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, n - r.numel():], mask[i, n - r.numel():] = r, 1
    return ids, mask


# ----------------------------------------------------------------------------- references


def generate_alone(model, prompt, new: int, strategies: Sequence[Any] = (), **kw) -> "accel.GenerateResult":
    """``accel.generate`` of one prompt ([n], [1, n] or a list of ids) on its own: the reference
    a batched, drafted or served run is compared with. No EOS stop unless ``eos_token_id`` is
    given."""
    kw.setdefault("eos_token_id", [])
    ids = torch.as_tensor(prompt).reshape(1, -1)
    return accel.generate(model, ids, strategies=list(strategies), max_new_tokens=new, **kw)


def alone_tokens(model, prompt, new: int, strategies: Sequence[Any] = (), **kw) -> list[int]:
    """The new tokens of :func:`generate_alone`."""
    n = torch.as_tensor(prompt).numel()
    return generate_alone(model, prompt, new, strategies, **kw).sequences[0, n:].tolist()


# ----------------------------------------------------------------------------- drafters


class Scripted(Drafter):
    """Test drafter. mode: 'random' tokens in a random tree, the 'oracle' continuation, the
    continuation 'right_then_wrong' after k tokens, or 'empty' proposals. ``reference``: the
    whole sequence (prompt and greedy continuation) the oracle reads from."""

    name: ClassVar[str] = "scripted_test"
    mode: str = "oracle"
    k: int = 3
    size: int = 6
    reference: tuple[int, ...] = ()

    def start(self, model: Any, prompt: torch.Tensor) -> dict:
        return {"gen": torch.Generator().manual_seed(len(prompt)), "feedback": []}

    def propose(self, state: dict, ctx: DraftContext) -> DraftProposal | None:
        n = min(self.size, ctx.max_tokens)
        if self.mode == "empty":
            empty = torch.empty(0, dtype=torch.long)
            return None if len(ctx.tokens) % 2 else DraftProposal(empty, empty)
        if self.mode == "random":
            tokens = torch.randint(0, TINY_VOCAB, (n,), generator=state["gen"])
            parents = torch.tensor([int(torch.randint(0, i + 1, (1,), generator=state["gen"])) for i in range(n)])
            return DraftProposal(tokens, parents)
        pos = len(ctx.tokens)
        truth = list(self.reference[pos : pos + n])
        if not truth:
            return None
        if self.mode == "right_then_wrong":
            truth = truth[: self.k] + [(t + 1) % TINY_VOCAB for t in truth[self.k :]]
        return DraftProposal(torch.tensor(truth), torch.arange(len(truth)))

    def feedback(self, state: dict, proposed: int, accepted: int) -> None:
        state["feedback"].append((proposed, accepted))


class Gate(Drafter):
    """A drafter whose :meth:`start` (run on the Engine's loop thread when a request carrying it
    is admitted) sets ``entered``, then waits until the test sets ``opened``. It proposes
    nothing. See :func:`engine_held`."""

    model_config = ConfigDict(arbitrary_types_allowed=True, frozen=True)
    name: ClassVar[str] = "gate_test"
    entered: threading.Event = Field(default_factory=threading.Event)
    opened: threading.Event = Field(default_factory=threading.Event)

    def start(self, model: Any, prompt: torch.Tensor) -> None:
        self.entered.set()
        if not self.opened.wait(120):
            raise TimeoutError("the test never opened the gate")

    def propose(self, state: Any, ctx: DraftContext) -> None:
        return None


def gate() -> Gate:
    """A :class:`Gate` with fresh ``entered`` / ``opened`` events."""
    return Gate()


@contextmanager
def engine_held(engine, prompt) -> Iterator[None]:
    """Hold ``engine``'s loop thread for the block: a one-token request carrying a :class:`Gate`
    is admitted and waits in its drafter's start until the block ends. Requests submitted
    inside the block wait in the engine's queue, in order; a request cancelled there ends
    cancelled before it runs a step."""
    gate = Gate()
    blocker = engine.submit(prompt, max_new_tokens=1, strategies=[gate])
    assert gate.entered.wait(60), "the engine did not admit the gate's request"
    try:
        yield
    finally:
        gate.opened.set()
        blocker.result(timeout=60)


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


# ---------------------------------------------------------------------------- cache snapshots


def decode_snapshots(model, prompts, strategies, new: int) -> tuple[list[Row], dict]:
    """Decode ``prompts`` together with ``strategies`` (greedy) through a Batch, and after
    the prefill and every step keep each row's cache entries: returns (the rows, with their
    generated tokens and stats, {(row, logical length): [(keys, values, valid) per layer]}).
    Asserts on the way that no step takes a row past its next cache event (eviction,
    quantization)."""
    plan = plan_strategies(list(strategies))
    rows = [Row(prompt=p, plan=plan, max_new_tokens=new, eos=frozenset()) for p in prompts]
    batch = Batch(model)
    snaps: dict = {}

    def keep():
        for b, row in enumerate(batch.rows):
            key = (rows.index(row), batch.cache.logical_lengths[b])
            if row.upkeep is not None and row.upkeep.compressor is not None:  # positions it tracks are right
                for layer in row.upkeep.layers:
                    held = row.upkeep.entry_positions(batch.cache, layer, b)
                    for h, real in enumerate(_valid(batch.cache, layer, b)):
                        p = held[h][real]
                        assert bool((p[1:] > p[:-1]).all()) and int(p[-1]) == key[1] - 1, (key, layer, h)
            snaps[key] = [(batch.cache.keys(layer, b).clone(), batch.cache.values(layer, b).clone(),
                           _valid(batch.cache, layer, b)) for layer in range(batch.cache.num_layers)]

    with adapter.packed_gqa_attention(model), adapter.per_layer_masks(model, batch.cache), torch.inference_mode():
        batch.admit(rows)
        keep()
        while batch.rows:
            before = {id(r): (batch.cache.logical_lengths[b], _room(batch.cache, b, r.upkeep))
                      for b, r in enumerate(batch.rows)}
            batch.step()
            for b, r in enumerate(batch.rows):
                length, room = before[id(r)]
                assert batch.cache.logical_lengths[b] - length <= room, (length, room)
            keep()
            batch.retire_done()
    return rows, snaps


def _room(cache, row: int, up) -> int:
    """Tokens a row may commit before its cache has to change: until it holds budget + slack
    entries per head (eviction; without a budget, slack tokens after the last one), or until a
    group of loose entries fills (quantization)."""
    room = 10**9
    if up.compressor is not None and up.budget is None:  # evicted every slack tokens
        room = up.since + up.slack - cache.logical_lengths[row]
    elif up.compressor is not None:
        room = up.budget + up.slack - max(cache.entries_per_head(layer, row) for layer in up.layers)
    if up.quantizer is not None:
        loose = max(cache.row_lengths(layer)[row] - cache.packed_columns(layer, row) for layer in up.layers)
        room = min(room, up.quantizer.group_size() - loose)
    return room


def _valid(cache, layer: int, row: int) -> torch.Tensor:
    """[H_kv, n] validity of one row's entries (all True where the cache keeps no padding)."""
    valid = cache.entry_valid(layer, row)
    return valid if valid is not None else torch.ones(cache.keys(layer, row).shape[1:3], dtype=torch.bool)


def assert_same_caches(drafted: dict, plain: dict) -> None:
    """Every cache state the drafted run went through is the plain run's at the same length
    (a drafted row's last step may accept tokens past its end, beyond what plain reached)."""
    common = drafted.keys() & plain.keys()
    assert len(common) >= len(drafted) - len({row for row, _ in drafted})
    for key in common:
        for (k, v, valid), (pk, pv, pvalid) in zip(drafted[key], plain[key]):
            assert k.shape == pk.shape and torch.equal(valid, pvalid), key
            assert torch.allclose(k, pk, atol=1e-5) and torch.allclose(v, pv, atol=1e-5), key


# ---------------------------------------------------------------------------- calibration and bench files


#: The shipped experiment files.
CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def write_yaml(tmp_path: Path, data: dict | str, name: str = "exp.yaml") -> Path:
    """Write an experiment file (a dict as YAML, or text as is) and return its path."""
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data, sort_keys=False))
    return path


def fake_table(tokens, ms, cache_lens=(256,), **kw) -> CostTable:
    """A hand-made cost table; ``ms`` is one row per cache length (or one row for all)."""
    rows = ms if isinstance(ms[0], (list, tuple)) else [ms] * len(cache_lens)
    return CostTable(tokens=tuple(tokens), cache_lens=tuple(cache_lens), ms=tuple(tuple(r) for r in rows), **kw)


def fake_measure(calls: list | None = None, packed: tuple[int, ...] = (), transposed: float = 2.0,
                 split: tuple[int, ...] = ()):
    """A stand-in for timing.measure whose packed kernels win at the ``packed`` ones of its
    token counts (1, 8, 64), whose transposed kernels take ``transposed`` ms against
    plain ones' 2 ms, and whose split kernels beat all of them at the ``split`` ones."""
    def measure(model, **kwargs):
        if calls is not None:
            calls.append(kwargs)
        tokens = (1, 8, 64)
        kernel_ms = {"plain": ((2.0,) * 3,), "transposed": ((transposed,) * 3,),
                     "packed": (tuple(1.0 if n in packed else 3.0 for n in tokens),),
                     "split": (tuple(0.5 if n in split else 4.0 for n in tokens),)}
        # a batch of 8 rows x 2 tokens measured 1.5x the grid's one-row pass of 16 tokens
        return fake_table(tokens, [1.0, 2.0, 3.0], kernel_tokens=tokens, kernel_ms=kernel_ms, batch_rows=(8,),
                          batch_tokens=(1, 2), batch_ms=((2.0, 1.5 * (2.0 + 8 / 56)),), batch_cache=256)

    return measure
