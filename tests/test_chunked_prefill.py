"""Chunked prefill (``prefill_chunk=``): the prompt runs N tokens per forward on top of the
entries of the chunks before it, and the result is the one-forward prefill's: the same cache,
the same compressor selection (SnapKV's observation-window queries are taken from the chunks
they fall in), the same hidden state, the same greedy tokens."""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch
import transformers

import accel
from accel import adapter
from accel.bench import ConfigError, load_config
from accel.bench.configurations import build_configurations
from accel.bench.tasks import TaskItem
from accel.cache import SharedCache
from accel.serving.prefix import PrefixStore
from accel.steps import prefill, prefill_rest
from snapkv import H2O, AdaSnapKV, FastGen, SnapKV
from speculative import Medusa, PromptLookup

from helpers import (CharTokenizer, alone_tokens, engine_held, left_padded, make_tiny_config, make_tiny_model, random_prompt,
                     repetitive_prompt, write_yaml)

TOL = dict(rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def model():
    return make_tiny_model(seed=3)


def sliding_model(window: int = 16, layer_types=None):
    """A tiny Mistral (every layer sliding) or, with ``layer_types``, Gemma3 (mixed) model."""
    fields = {k: v for k, v in make_tiny_config().to_dict().items()
              if k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                       "num_key_value_heads", "max_position_embeddings", "bos_token_id", "eos_token_id",
                       "pad_token_id", "tie_word_embeddings")}
    if layer_types is None:
        config = transformers.MistralConfig(**fields, sliding_window=window)
        cls = transformers.MistralForCausalLM
    else:
        config = transformers.Gemma3TextConfig(**fields, head_dim=16, sliding_window=window, query_pre_attn_scalar=32,
                                               layer_types=layer_types)
        cls = transformers.Gemma3ForCausalLM
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(5)
        return cls(config).to(torch.float32).eval()


@contextlib.contextmanager
def forward_widths(model):
    """Record the number of new tokens of every decoder forward (each prefill chunk's width)."""
    widths: list[int] = []

    def hook(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        widths.append(int(ids.shape[1]))

    handle = model.get_decoder().register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield widths
    finally:
        handle.remove()


def _prefilled(model, prompts, compressors, chunk):
    cache = SharedCache(adapter.geometry(model).num_layers, adapter.layer_windows(model))
    queries: dict = {}
    kept: dict = {}
    with torch.inference_mode():
        hidden = prefill(model, cache, prompts, compressors, queries, kept, chunk=chunk)
    return cache, hidden, queries, kept


def assert_same_prefill(a, b, rows: int, sliding=()):
    cache_a, hidden_a, queries_a, kept_a = a
    cache_b, hidden_b, queries_b, kept_b = b
    torch.testing.assert_close(hidden_b, hidden_a, **TOL)
    assert cache_b.logical_lengths == cache_a.logical_lengths
    assert sorted(queries_b) == sorted(queries_a)
    for layer, q in queries_a.items():
        torch.testing.assert_close(queries_b[layer], q, **TOL)
    assert sorted(kept_b) == sorted(kept_a)
    for key, idx in kept_a.items():
        assert torch.equal(kept_b[key], idx), key
    for layer in range(cache_a.num_layers):
        if layer in sliding:  # a window layer trims lazily: it may hold older entries, masked out
            continue
        assert cache_b.row_lengths(layer) == cache_a.row_lengths(layer)
        for row in range(rows):
            torch.testing.assert_close(cache_b.keys(layer, row), cache_a.keys(layer, row), **TOL)
            torch.testing.assert_close(cache_b.values(layer, row), cache_a.values(layer, row), **TOL)
            va, vb = cache_a.entry_valid(layer, row), cache_b.entry_valid(layer, row)
            assert (va is None) == (vb is None) and (va is None or torch.equal(va, vb))


# ----------------------------------------------------------------------------- the cache


COMPRESSORS = {
    "none": lambda: None,
    "snapkv": lambda: SnapKV(budget=12, window=6, kernel=3),
    "ada": lambda: AdaSnapKV(budget=12, window=6, kernel=3),  # per-head counts: padded, masked entries
    "h2o": lambda: H2O(budget=12),  # its observation window is the whole prompt
    "fastgen": lambda: FastGen(window=4, recovery=0.3, frequent=0.2, local=0.2, punctuation_ids=(5, 17, 30)),
}


@pytest.mark.parametrize("name", list(COMPRESSORS))
@pytest.mark.parametrize("chunk", [1, 5, 16])
def test_chunked_prefill_fills_the_cache_one_forward_fills(model, name, chunk):
    # rows of different lengths (right-padded inside): a row ends before the last chunk, one
    # row's observation window straddles a chunk boundary, one row is shorter than a chunk
    prompts = [random_prompt(1, 37)[0], random_prompt(2, 23)[0], random_prompt(3, 4)[0]]
    compressor = COMPRESSORS[name]()
    one = _prefilled(model, prompts, compressor, None)
    with forward_widths(model) as widths:
        chunked = _prefilled(model, prompts, compressor, chunk)
    assert widths == [min(chunk, 37 - s) for s in range(0, 37, chunk)]  # it really ran chunk by chunk
    if compressor is not None:
        assert one[3], "the compressor kept everything: the test would not see a wrong selection"
        assert max(one[0].row_lengths(0)) < 37
    assert_same_prefill(one, chunked, rows=3)


def test_a_row_per_compressor_and_none(model):
    prompts = [random_prompt(4, 30)[0], random_prompt(5, 41)[0]]
    compressors = [None, SnapKV(budget=10, window=8, kernel=3)]
    assert_same_prefill(_prefilled(model, prompts, compressors, None), _prefilled(model, prompts, compressors, 7), 2)


@pytest.mark.parametrize("arch", ["mistral_sliding", "gemma3"])
def test_sliding_window_layers(arch):
    model = sliding_model(layer_types=["sliding_attention", "full_attention"] if arch == "gemma3" else None)
    prompts = [random_prompt(6, 50)[0], random_prompt(7, 33)[0]]
    compressor = SnapKV(budget=12, window=4, kernel=3)
    sliding = [i for i, w in enumerate(adapter.layer_windows(model)) if w is not None]
    assert sliding
    assert_same_prefill(_prefilled(model, prompts, compressor, None), _prefilled(model, prompts, compressor, 8), 2,
                        sliding=sliding)
    for strategies in ([], [compressor]):
        for p in prompts:
            want = alone_tokens(model, p, 12, strategies)
            assert alone_tokens(model, p, 12, strategies, prefill_chunk=8) == want


def test_prefill_rest_in_chunks_equals_one_forward(model):
    geo = adapter.geometry(model)
    system = random_prompt(8, 12)[0]
    prompts = [torch.cat([system, random_prompt(9, 19)[0]]), torch.cat([system, random_prompt(10, 3)[0]]),
               random_prompt(11, 26)[0]]
    whole = SharedCache(geo.num_layers)
    sys_cache = SharedCache(geo.num_layers)
    with torch.inference_mode():
        full_hidden = prefill(model, whole, prompts)
        prefill(model, sys_cache, [system])
    store = PrefixStore(2**30, min_tokens=4)
    store.add(system, sys_cache, 0)
    matches = [store.match(p) for p in prompts[:2]] + [None]
    caches, hiddens = [], []
    for chunk in (None, 4):
        cache = SharedCache(geo.num_layers)
        cache.load_prefixes([(m.keys, m.values, m.length) if m else None for m in matches])
        with torch.inference_mode(), forward_widths(model) as widths:
            hiddens.append(prefill_rest(model, cache, prompts, geo.dtype, chunk=chunk))
        caches.append(cache)
        assert widths == ([26] if chunk is None else [4] * 6 + [2])
    for cache, hidden in zip(caches, hiddens):
        torch.testing.assert_close(hidden, full_hidden, **TOL)
        assert cache.logical_lengths == [31, 15, 26]
        for layer in range(geo.num_layers):
            for row in range(3):
                torch.testing.assert_close(cache.keys(layer, row), whole.keys(layer, row), **TOL)
                torch.testing.assert_close(cache.values(layer, row), whole.values(layer, row), **TOL)


# ----------------------------------------------------------------------------- generate


STRATEGIES = {
    "plain": lambda h: [],
    "snapkv": lambda h: [SnapKV(budget=16, window=4, kernel=3)],
    "lookup": lambda h: [PromptLookup()],
    "snapkv+lookup+medusa": lambda h: [SnapKV(budget=16, window=4, kernel=3), PromptLookup(),
                                       Medusa(heads=h, max_nodes=8)],
}


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_generate_chunked_equals_one_forward_left_padded_batch(model, name, heads_dir):
    prompts = [repetitive_prompt(12, 45)[0], repetitive_prompt(13, 20)[0], repetitive_prompt(14, 33)[0]]
    ids, mask = left_padded(prompts)
    kw = dict(attention_mask=mask, max_new_tokens=16, eos_token_id=[])
    one = accel.generate(model, ids, strategies=STRATEGIES[name](heads_dir), **kw)
    chunked = accel.generate(model, ids, strategies=STRATEGIES[name](heads_dir), prefill_chunk=8, **kw)
    assert torch.equal(chunked.sequences, one.sequences)
    for a, b in zip(one.row_stats, chunked.row_stats):  # the same drafts (Medusa reads the prefill's hidden state)
        assert (b.accepted_per_step, b.drafted_tokens, b.kv_bytes_kept) == (a.accepted_per_step, a.drafted_tokens,
                                                                             a.kv_bytes_kept)
    if name.startswith("snapkv"):
        assert one.stats.kv_bytes_kept < one.stats.kv_bytes_full
    if name != "plain" and name != "snapkv":
        assert one.stats.drafted_tokens > 0
    for p, row in zip(prompts, chunked.sequences):
        assert row[ids.shape[1]:].tolist() == alone_tokens(model, p, 16, STRATEGIES[name](heads_dir))


def test_stream_takes_prefill_chunk(model):
    p = random_prompt(15, 40)
    want = alone_tokens(model, p, 10, [SnapKV(budget=16, window=4, kernel=3)])
    with forward_widths(model) as widths:
        got = [t for d in accel.stream(model, p, strategies=[SnapKV(budget=16, window=4, kernel=3)], max_new_tokens=10,
                                       eos_token_id=[], prefill_chunk=16) for t in d.tokens]
    assert got == want
    assert widths[:3] == [16, 16, 8]


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "8"])
def test_bad_prefill_chunk_is_named(model, bad):
    with pytest.raises(ValueError, match="prefill_chunk"):
        accel.generate(model, random_prompt(0, 8), prefill_chunk=bad)
    with pytest.raises(ValueError, match="prefill_chunk"):
        list(accel.stream(model, random_prompt(0, 8), prefill_chunk=bad))
    with pytest.raises(ValueError, match="prefill_chunk"):
        accel.Engine(model, prefill_chunk=bad)


# ----------------------------------------------------------------------------- Engine, serve, bench


def test_engine_prefills_in_chunks(model):
    prompts = [repetitive_prompt(16, 37)[0], repetitive_prompt(17, 29)[0]]
    strategies = [SnapKV(budget=16, window=4, kernel=3), PromptLookup()]
    with forward_widths(model) as widths:
        with accel.Engine(model, strategies=strategies, max_batch=2, eos_token_id=[], prefill_chunk=10) as engine:
            handles = [engine.submit(p, max_new_tokens=12) for p in prompts]
            results = [h.result(timeout=120) for h in handles]
    assert max(widths) <= 10
    for p, r in zip(prompts, results):
        assert r.tokens == alone_tokens(model, p, 12, strategies)


def test_engine_prefix_reuse_in_chunks(model):
    system = random_prompt(18, 20)[0]
    prompts = [torch.cat([system, random_prompt(19, 14)[0]]), torch.cat([system, random_prompt(20, 9)[0]])]
    with accel.Engine(model, max_batch=2, eos_token_id=[], prefill_chunk=6) as engine:
        first = engine.submit(prompts[0], max_new_tokens=8).result(timeout=120)
        with forward_widths(model) as widths:
            second = engine.submit(prompts[1], max_new_tokens=8).result(timeout=120)
        assert engine.metrics()["prefix_tokens_reused"] >= 20
    assert widths[:2] == [6, 3]  # only the 9 tokens past the stored prefix, in chunks
    assert first.tokens == alone_tokens(model, prompts[0], 8)
    assert second.tokens == alone_tokens(model, prompts[1], 8)


def test_serve_rejects_a_bad_prefill_chunk_before_loading(capsys):
    from accel.cli import build_parser, main

    assert build_parser().parse_args(["serve", "--prefill-chunk", "512"]).prefill_chunk == 512
    assert main(["serve", "--prefill-chunk", "0"]) == 2
    assert "--prefill-chunk" in capsys.readouterr().err


def test_bench_generation_prefill_chunk(tmp_path, model, monkeypatch):
    base = {"model": "default", "tasks": [{"kind": "chat", "prompts": 1}], "runs": {"plain": []},
            "generation": {"max_new_tokens": 4}}
    with pytest.raises(ConfigError, match="generation.prefill_chunk"):
        load_config(write_yaml(tmp_path, dict(base, generation={"max_new_tokens": 4, "prefill_chunk": 0})))
    exp = load_config(write_yaml(tmp_path, dict(base, generation={"max_new_tokens": 4, "prefill_chunk": 16})))
    assert exp.generation.prefill_chunk == 16
    seen = []
    real = accel.generate

    def spy(*args, **kw):
        seen.append(kw.get("prefill_chunk"))
        return real(*args, **kw)

    monkeypatch.setattr(accel, "generate", spy)
    (config,) = [c for c in build_configurations(exp, model, CharTokenizer()) if c.name == "plain"]
    item = TaskItem(task="chat", kind="chat", item_id="0", input_ids=random_prompt(21, 30))
    config.generate(item, 4)
    config.batch([item, item], 4)
    assert seen == [16, 16]


# ----------------------------------------------------------------------------- the Engine's interleaved admission


@contextlib.contextmanager
def forward_log(model):
    """Record (rows, new tokens) of every decoder forward."""
    log: list[tuple[int, int]] = []

    def hook(module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        log.append((int(ids.shape[0]), int(ids.shape[1])))

    handle = model.get_decoder().register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield log
    finally:
        handle.remove()


@contextlib.contextmanager
def decoding(engine, prompt, new: int):
    """Start a request of ``new`` tokens and hold the engine's thread once it has emitted 3 of
    them (it is then running, with ``new - 3`` tokens to go); yields (handle, its tokens so
    far, a list), and lets the engine go on at the end of the block. Requests submitted in the
    block are admitted while it runs."""
    reached, go = threading.Event(), threading.Event()
    got: list[int] = []

    def on_delta(delta):  # on the engine's thread
        if delta is None:
            return
        got.extend(delta.tokens)
        if len(got) >= 3 and not reached.is_set():
            reached.set()
            go.wait(60)

    with engine_held(engine, random_prompt(24, 4)):  # so every delta comes on the engine's thread
        handle = engine.submit(prompt, max_new_tokens=new)
        handle.on_delta(on_delta)
    assert reached.wait(60)
    try:
        yield handle, got
    finally:
        go.set()


class ExplodingSnapKV(SnapKV):
    """SnapKV that raises when it compresses layer 1."""

    def select(self, layer_idx, queries, keys, values, tokens=None):
        if layer_idx == 1:
            raise RuntimeError("compressor exploded")
        return super().select(layer_idx, queries, keys, values, tokens)


@pytest.mark.parametrize("strategies", [[], [SnapKV(budget=16, window=4, kernel=3)]], ids=["plain", "snapkv"])
def test_a_long_prompt_prefills_between_the_running_rows_steps(model, strategies):
    running, long = repetitive_prompt(22, 20)[0], random_prompt(23, 50)[0]
    with accel.Engine(model, max_batch=4, eos_token_id=[], prefill_chunk=8) as engine, forward_log(model) as log:
        with decoding(engine, running, 40) as (first, got):
            log.clear()  # the engine's thread is held: nothing runs until the block ends
            second = engine.submit(long, max_new_tokens=10, strategies=strategies)
        first_result, second_result = first.result(timeout=120), second.result(timeout=120)
        assert engine.metrics()["prefills"] == 3  # the gate's, the running row's, the long prompt's
    # the new prompt's 7 chunks (6 x 8 tokens + 2), each of the first 6 followed by one step of
    # the running row; after the last one the new row joins and the two step together
    assert log[:14] == [(1, 8), (1, 1)] * 6 + [(1, 2), (2, 1)]
    assert first_result.tokens == got == alone_tokens(model, running, 40)
    assert second_result.tokens == alone_tokens(model, long, 10, strategies)
    if strategies:
        assert second_result.stats.kv_bytes_kept < second_result.stats.kv_bytes_full


def test_a_failing_chunked_admission_ends_only_its_own_request(model):
    running, good, bad = repetitive_prompt(25, 20)[0], random_prompt(26, 30)[0], random_prompt(27, 30)[0]
    with accel.Engine(model, max_batch=4, eos_token_id=[], prefill_chunk=8) as engine:
        with decoding(engine, running, 40) as (first, got):
            failing = engine.submit(bad, max_new_tokens=6, strategies=[ExplodingSnapKV(budget=16, window=4)])
            fine = engine.submit(good, max_new_tokens=6)  # admitted with it, then retried alone
        results = [h.result(timeout=120) for h in (first, failing, fine)]
    assert results[1].finish_reason == "error" and "compressor exploded" in results[1].error
    assert results[0].tokens == got == alone_tokens(model, running, 40)
    assert results[2].tokens == alone_tokens(model, good, 6)
