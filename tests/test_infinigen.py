"""InfiniGen (``infinigen``): the whole cache in a slow tier (memory-mapped files), each decode
step fetching, per KV head and token, the entries its predicted partial scores rank highest
plus its recent window. What a step fetches is exactly what its mask lets each token see;
the choice follows the scores; greedy drafting on a tiered cache emits plain decoding's
tokens on it, whatever the drafter proposes; a row of a batch decodes as alone; nothing is
dropped (a budget above the length is plain decoding); bad settings name their field."""

from __future__ import annotations

import os

import pytest
import torch

import accel
from accel import adapter
from accel.strategy import StrategyError, build_strategy, plan_strategies
from accel.tier import TieredCache
from accel.steps import prefill, forward_tokens
from helpers import Scripted, TINY_VOCAB, make_tiny_model
from snapkv import InfiniGen, SnapKV
from snapkv.infinigen import partial_projections
from speculative import PromptLookup


@pytest.fixture(scope="module", autouse=True)
def own_cache_folder(tmp_path_factory):
    """The partial projections are written under ACCEL_CACHE: a folder of this module's."""
    old = os.environ.get("ACCEL_CACHE")
    os.environ["ACCEL_CACHE"] = str(tmp_path_factory.mktemp("accel-cache"))
    yield
    if old is None:
        del os.environ["ACCEL_CACHE"]
    else:
        os.environ["ACCEL_CACHE"] = old


@pytest.fixture(scope="module")
def model():
    return make_tiny_model(seed=3)


def _prompt(n: int = 110) -> torch.Tensor:
    base = torch.randint(2, TINY_VOCAB, (40,), generator=torch.Generator().manual_seed(1))
    return base.repeat(n // 40 + 1)[:n]


def _new(result, row: int = 0, n: int | None = None) -> list[int]:
    out = result.sequences[row, -(n or result.row_stats[row].new_tokens):].tolist()
    return out


SMALL = InfiniGen(budget=24, window=8)


def test_a_budget_above_the_length_is_plain_decoding(model):
    """Nothing is dropped: with room for every entry no step is planned and the output is the
    plain cache's."""
    prompt = _prompt()
    plain = accel.generate(model, prompt, [], max_new_tokens=30)
    tiered = accel.generate(model, prompt, [InfiniGen(budget=400, window=8)], max_new_tokens=30)
    assert _new(tiered) == _new(plain)
    assert tiered.row_stats[0].kv_bytes_fetched == 0


def test_a_small_budget_fetches_a_fraction_and_changes_the_output(model):
    prompt = _prompt()
    plain = accel.generate(model, prompt, [], max_new_tokens=30)
    tiered = accel.generate(model, prompt, [SMALL], max_new_tokens=30)
    s = tiered.row_stats[0]
    assert 0 < s.kv_bytes_fetched < s.kv_bytes_fetch_full
    # each token reads at most budget entries per head of the 110..140 committed ones
    assert s.kv_bytes_fetched / s.kv_bytes_fetch_full < 24 / 110 + 1e-9
    assert _new(tiered) != _new(plain)  # the tiny model's attention is spread: 24 entries do not suffice


@pytest.mark.parametrize("drafters", [
    [PromptLookup()],
    "own_layer",
    [Scripted(mode="random", size=6)],  # garbage drafts, random trees
    [Scripted(mode="right_then_wrong", k=2, size=5)],
], ids=["prompt_lookup", "own_layer", "garbage", "right_then_wrong"])
def test_greedy_drafting_equals_plain_decoding_on_the_tiered_cache(model, drafters):
    prompt = _prompt()
    tier = SMALL
    if drafters == "own_layer":  # each layer choosing with its own queries
        tier, drafters = SMALL.model_copy(update={"predict": "own_layer"}), [PromptLookup()]
    plain = accel.generate(model, prompt, [tier], max_new_tokens=40)
    if drafters[0].name == "scripted_test" and drafters[0].mode != "random":
        drafters = [drafters[0].model_copy(update={"reference": tuple(plain.sequences[0].tolist())})]
    drafted = accel.generate(model, prompt, [tier, *drafters], max_new_tokens=40)
    assert _new(drafted) == _new(plain)
    if drafters[0].name == "prompt_lookup" or drafters[0].mode != "random":
        assert drafted.stats.mean_accepted > 1.0  # drafts were verified on the tiered cache, and accepted


def test_a_row_of_a_batch_decodes_as_alone(model):
    prompt = _prompt()
    short = prompt[:70]
    alone = [accel.generate(model, p, [SMALL], max_new_tokens=20) for p in (prompt, short)]
    batch = accel.generate(model, [prompt, short], [SMALL, PromptLookup()], max_new_tokens=20)
    for b in range(2):
        assert batch.sequences[b, -20:].tolist() == _new(alone[b])


def test_the_memory_tier_and_a_chunked_prefill_decode_alike(model):
    prompt = _prompt()
    files = accel.generate(model, prompt, [SMALL], max_new_tokens=30)
    memory = accel.generate(model, prompt, [SMALL.model_copy(update={"tier": "memory"})], max_new_tokens=30)
    chunked = accel.generate(model, prompt, [SMALL], max_new_tokens=30, prefill_chunk=32)
    assert _new(memory) == _new(files) == _new(chunked)


def _planned_cache(model, tier: InfiniGen, prompt: torch.Tensor, t: int = 1):
    """A tiered cache holding ``prompt``, with the next ``t`` tokens' step planned (hooks on)."""
    cache = TieredCache(model.config.num_hidden_layers, tier, tier.projections(model))
    prefill(model, cache, [prompt])
    n = int(prompt.numel())
    ids = torch.randint(2, TINY_VOCAB, (1, t), generator=torch.Generator().manual_seed(5))
    positions = torch.arange(n, n + t).unsqueeze(0)
    visible = torch.ones((1, t, t), dtype=torch.bool).tril() if t > 1 else None
    queries: dict[int, torch.Tensor] = {}
    with cache.planning(model), adapter.capture_step_queries(model, cache, queries):
        forward_tokens(model, cache, ids, positions, visible, torch.float32)
    return cache, queries


@torch.inference_mode()
def test_what_a_step_fetches_is_what_each_token_sees(model):
    tier = InfiniGen(budget=20, window=6)
    prompt = _prompt(90)
    cache, _ = _planned_cache(model, tier, prompt, t=3)
    groups = model.config.num_attention_heads // model.config.num_key_value_heads
    for layer in range(cache.num_layers):
        plan = cache._plans[layer]
        assert plan is not None
        u = plan.width
        assert torch.equal(plan.columns[0, :, u:], torch.arange(90, 93).expand(2, 3))  # the step's own entries
        fetched = plan.columns[0, :, :u]
        sees = plan.mask[0, :, :, :u] == 0  # [H_q, T, U] committed entries each token reads
        for h in range(2):  # a head's fetched entries first, ascending (a head fetching fewer is padded, unseen)
            n = int(sees[h * groups].any(0).sum())
            assert bool(sees[h * groups].any(0)[:n].all()) and int(fetched[h, :n].max()) < 90
            assert bool((fetched[h, 1:n] > fetched[h, : n - 1]).all())
        for j in range(3):
            # token j reads 14 fetched entries per head and the committed part of its window of
            # 6 (the rest of its window is its j ancestors in the step): what it reads decoded alone
            assert sees[:, j].sum(-1).tolist() == [20 - j] * sees.shape[0]
            window = set(range(90 + j - 6, 90))
            for hq in range(sees.shape[0]):
                read = set(fetched[hq // groups][sees[hq, j]].tolist())
                assert window <= read and len(read - window) == 14
        new = plan.mask[0, :, :, u:] == 0
        assert torch.equal(new[0], torch.ones(3, 3, dtype=torch.bool).tril())  # the step's own tree
        assert all(torch.equal(sees[g * groups], sees[g * groups + groups - 1]) for g in range(2))  # one choice per KV head


@pytest.mark.parametrize("gqa,predict", [("sum", "previous_layer"), ("max", "previous_layer"), ("max", "own_layer")])
@torch.inference_mode()
def test_the_choice_is_the_top_of_the_scores(model, gqa, predict):
    """With every dimension kept (partial=1) the scores are the exact q.k of a KV head's query
    heads, summed or the largest of their softmaxes: the fetched entries before the window are
    their top ones."""
    tier = InfiniGen(budget=16, window=4, partial=1.0, gqa=gqa, predict=predict)
    prompt = _prompt(80)
    cache, queries = _planned_cache(model, tier, prompt, t=1)
    groups = model.config.num_attention_heads // model.config.num_key_value_heads
    # layer 0 plans with its own queries; later layers too where predict="own_layer"
    for layer, h in [(layer, h) for layer in (range(cache.num_layers) if predict == "own_layer" else (0,))
                     for h in range(model.config.num_key_value_heads)]:
        q = queries[layer][0, :, 0]  # [H_q, D]
        keys = cache._k[layer][0, :, :80]  # [H, 80, D]
        plan = cache._plans[layer]
        assert plan.mask.shape == (1, 1, 1, 17) and bool((plan.mask == 0).all())  # one token: it sees all it fetched
        logits = keys[h, : 80 - 4] @ q[h * groups : (h + 1) * groups].T  # [76, G]
        score = logits.sum(-1) if gqa == "sum" else logits.softmax(0).amax(-1)
        top = set(score.topk(12).indices.tolist())
        assert set(plan.columns[0, h, :16].tolist()) == top | set(range(76, 80))


@torch.inference_mode()
def test_the_slow_tier_is_in_files_and_keeps_its_entries_after_release(model):
    tier = InfiniGen(budget=20, window=6)
    cache = TieredCache(model.config.num_hidden_layers, tier, tier.projections(model))
    prefill(model, cache, [_prompt(90)])
    before = cache._k[1][0, :, :90].clone()
    cache.release()
    assert torch.equal(cache._k[1][0, :, :90], before)
    assert cache._maps  # the entry buffers are memory-mapped
    memory = TieredCache(model.config.num_hidden_layers, tier.model_copy(update={"tier": "memory"}),
                         tier.projections(model))
    prefill(model, memory, [_prompt(90)])
    # in memory outside the slow tier: only the partial keys (a quarter of the keys' dimensions)
    assert cache.resident_bytes() == cache.partial.storage_bytes()
    assert cache.resident_bytes() < memory.resident_bytes()
    assert torch.equal(memory._k[1][0, :, :90], before)


def test_the_partial_projections_are_orthonormal_and_kept_on_disk(model, tmp_path, monkeypatch):
    monkeypatch.setenv("ACCEL_CACHE", str(tmp_path))
    other = make_tiny_model(seed=3)  # the same weights: a new object, nothing in memory yet
    first = partial_projections(other, 0.25)
    files = list((tmp_path / "infinigen").glob("*.pt"))
    assert len(files) == 1
    d = model.config.hidden_size // model.config.num_attention_heads
    assert first[0].shape == (model.config.num_key_value_heads, d, d // 4)
    for p in first:
        assert torch.allclose(p.transpose(1, 2) @ p, torch.eye(d // 4).expand(p.shape[0], -1, -1), atol=1e-5)
    again = partial_projections(make_tiny_model(seed=3), 0.25)  # read back from the file
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    changed = partial_projections(make_tiny_model(seed=4), 0.25)  # other weights: computed anew
    assert len(list((tmp_path / "infinigen").glob("*.pt"))) == 2
    assert not torch.equal(changed[0], first[0])


def test_bad_settings_name_their_field(model):
    with pytest.raises(StrategyError, match="window"):
        build_strategy("infinigen:budget=16,window=16")
    with pytest.raises(StrategyError, match="partial"):
        build_strategy({"name": "infinigen", "partial": 0})
    with pytest.raises(StrategyError, match="tier"):
        build_strategy("infinigen:tier=disk")
    with pytest.raises(ValueError, match="does not stack with snapkv"):
        plan_strategies([SMALL, SnapKV(budget=64)])
    with pytest.raises(ValueError, match="prefill_ranks"):
        accel.generate(model, _prompt(), [SMALL], max_new_tokens=2, prefill_ranks=2)
    cache = TieredCache(model.config.num_hidden_layers, SMALL, SMALL.projections(model))
    with pytest.raises(RuntimeError, match="keeps every entry"):
        cache.select(0, torch.zeros((1, 2, 1), dtype=torch.long))


def test_the_engine_refuses_a_tiered_request(model):
    with accel.Engine(model) as engine, pytest.raises(ValueError, match="infinigen"):
        engine.submit([1, 2, 3], strategies=[SMALL])
