"""The prefill over several processes (KV-Runahead, ``prefill_ranks=``): rank r runs chunk r on
top of the entries rank r - 1 hands on layer by layer, the last rank is this process, and the
result is a prefill's in one process: the same cache (within float tolerance), the same
compressor selection, the same greedy tokens. Chunk boundaries balance the attention cost
model; a rank that dies or fails ends the call with an error, not a hang."""

from __future__ import annotations

import time

import pytest
import torch

import accel
from accel import runahead
from accel.cache import SharedCache
from accel.runahead import PrefillRanks, check_prefill_ranks, chunk_cost, partition
from accel.steps import prefill
from snapkv import SnapKV

from helpers import make_tiny_model, random_prompt, repetitive_prompt

TOL = dict(rtol=1e-4, atol=1e-5)



@pytest.fixture(scope="module", autouse=True)
def two_threads():
    """Each rank needs a torch thread of its own (whatever an earlier test left set; on one core
    the tiny model runs oversubscribed)."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(2, before))
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model():
    return make_tiny_model(seed=3, max_position_embeddings=1024)


@pytest.fixture(scope="module")
def ranks(model, two_threads):
    with PrefillRanks(model, 2) as group:
        yield group


def cost(costs, start, end):
    """Token by token: the first chunk's query i scores i + 1 keys, a later chunk's every key
    up to its end (its kernel runs through a mask)."""
    a, b = costs
    return sum(a + b * (i + 1 if not start else end) for i in range(start, end))


# ----------------------------------------------------------------------------- partition


@pytest.mark.parametrize("n,count", [(4000, 2), (7500, 4), (37, 3)])
def test_balanced_chunks_cost_the_same(n, count):
    costs = (1000.0, 3.0)
    bounds = partition(n, count, costs)
    assert bounds[0] == 0 and bounds[-1] == n and bounds == sorted(bounds)
    work = [cost(costs, s, e) for s, e in zip(bounds, bounds[1:])]
    assert work == pytest.approx([chunk_cost(costs, s, e) for s, e in zip(bounds, bounds[1:])])
    token = costs[0] + costs[1] * n  # the dearest token
    assert max(work) - min(work) <= 2 * token
    sizes = [e - s for s, e in zip(bounds, bounds[1:])]
    assert sizes == sorted(sizes, reverse=True)  # later tokens attend to more: later chunks are shorter


def test_even_split_and_limits():
    assert partition(10, 2, (1.0, 1.0), split="even") == [0, 5, 10]
    assert partition(100, 2, (1.0, 1.0), last_min=80)[1] == 20  # the observation window stays in the last chunk
    assert partition(3, 4, (1.0, 1.0)) == [0, 0, 1, 2, 3]  # too short for every rank: the first ones idle
    assert partition(5, 3, (1.0, 1.0), last_min=5) == [0, 0, 0, 5]
    with pytest.raises(ValueError, match="split"):
        partition(10, 2, (1.0, 1.0), split="uneven")


def test_prefill_ranks_errors_name_the_field(model):
    for bad in (0, -1, True, 2.0, "2"):
        with pytest.raises(ValueError, match="prefill_ranks"):
            check_prefill_ranks(bad)
    with pytest.raises(ValueError, match="prefill_ranks=.*at most"):
        check_prefill_ranks(torch.get_num_threads() + 1)
    with pytest.raises(ValueError, match="prefill_ranks"):
        PrefillRanks(model, None)
    with pytest.raises(ValueError, match="split"):
        PrefillRanks(model, 2, split="uneven")
    prompt = random_prompt(0, 40)
    with pytest.raises(ValueError, match="prefill_ranks"):
        accel.generate(model, prompt, max_new_tokens=2, prefill_ranks=torch.get_num_threads() + 1)
    with pytest.raises(ValueError, match="prefill_chunk and prefill_ranks"):
        accel.generate(model, prompt, max_new_tokens=2, prefill_ranks=1, prefill_chunk=8)


# ----------------------------------------------------------------------------- the same prefill


def test_cache_equals_one_process(model, ranks):
    prompt = random_prompt(1, 300)
    one, two = SharedCache(2), SharedCache(2)
    with torch.inference_mode():
        h1 = prefill(model, one, prompt)
        h2 = prefill(model, two, prompt, ranks=ranks)
    assert two.logical_lengths == [300] and two.row_lengths(0) == [300]
    for layer in range(2):
        torch.testing.assert_close(two.keys(layer), one.keys(layer), **TOL)
        torch.testing.assert_close(two.values(layer), one.values(layer), **TOL)
    torch.testing.assert_close(h2, h1, **TOL)
    report = ranks.last
    assert [(r.rank, r.start, r.end) for r in report] == [(0, 0, report[0].end), (1, report[0].end, 300)]
    assert 0 < report[0].end < 300
    entry = 2 * 2 * 16 * 4  # one token's K and V in one layer: 2 KV heads, head dim 16, float32
    assert report[0].bytes_sent == 2 * report[0].end * entry and report[1].bytes_sent == 0  # 2 layers


def test_the_wrong_chunk_changes_the_cache(model, ranks, monkeypatch):
    """The equality above could fail: hand rank 1 a prefix of the wrong positions and it does."""
    prompt = random_prompt(1, 300)
    good, bad = SharedCache(2), SharedCache(2)
    with torch.inference_mode():
        prefill(model, good, prompt)
        real = runahead._chunk

        def shifted(model_, pg, rank, size, prompt_, bounds, cache, timeout, tap=None):
            if rank == size - 1:  # this process: its chunk placed one position late
                return real(model_, pg, rank, size, torch.cat([prompt_[:1], prompt_[:-1]]), bounds, cache, timeout, tap)
            return real(model_, pg, rank, size, prompt_, bounds, cache, timeout, tap)

        monkeypatch.setattr(runahead, "_chunk", shifted)
        prefill(model, bad, prompt, ranks=ranks)
    assert not torch.allclose(bad.keys(1), good.keys(1), **TOL)


@pytest.mark.parametrize("strategies", [[], ["snapkv:budget=64,window=16"], ["snapkv:budget=64", "prompt_lookup"]])
def test_greedy_output_equals_one_process(model, ranks, strategies):
    prompts = [repetitive_prompt(2, 320), repetitive_prompt(3, 200)]
    for rows in ([prompts[0]], prompts):
        plain = accel.generate(model, rows, strategies=strategies, max_new_tokens=24)
        spread = accel.generate(model, rows, strategies=strategies, max_new_tokens=24, prefill_ranks=ranks)
        assert torch.equal(spread.sequences, plain.sequences)


def test_snapkv_selects_the_same_entries(model, ranks):
    prompt = random_prompt(4, 400)
    kept_one, kept_two = {}, {}
    compressor = SnapKV(budget=96, window=24)
    with torch.inference_mode():
        prefill(model, SharedCache(2), prompt, compressor, kept=kept_one)
        prefill(model, SharedCache(2), prompt, compressor, kept=kept_two, ranks=ranks)
    assert kept_one.keys() == kept_two.keys()
    for key in kept_one:
        assert torch.equal(kept_two[key], kept_one[key])
    assert ranks.last[-1].end - ranks.last[-1].start >= 24  # the window's queries were this process's


def test_three_ranks_hand_entries_down_the_chain(model, monkeypatch):
    threads = torch.get_num_threads()
    torch.set_num_threads(3)  # each rank a thread (oversubscribed on 2 cores: the tiny model does not care)
    try:
        with PrefillRanks(model, 3, split="even") as group:
            prompt = repetitive_prompt(5, 300)
            plain = accel.generate(model, prompt, max_new_tokens=16)
            spread = accel.generate(model, prompt, max_new_tokens=16, prefill_ranks=group)
            assert [(r.start, r.end) for r in group.last] == [(0, 100), (100, 200), (200, 300)]
            assert group.last[1].bytes_sent == 2 * group.last[0].bytes_sent  # the middle rank sends both chunks
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(spread.sequences, plain.sequences)


def test_generate_keeps_one_group_per_model(model):
    prompt = repetitive_prompt(6, 120)
    accel.generate(model, prompt, max_new_tokens=2, prefill_ranks=2)
    first = runahead.shared_ranks(model, 2)
    accel.generate(model, prompt, max_new_tokens=2, prefill_ranks=2)
    assert runahead.shared_ranks(model, 2) is first and first.alive()
    first.close()
    assert runahead.shared_ranks(model, 2) is not first  # a closed group is replaced
    runahead.shared_ranks(model, 2).close()


# ----------------------------------------------------------------------------- failures


def test_a_dead_rank_ends_the_call_with_an_error(model):
    group = PrefillRanks(model, 2, timeout_s=20)
    group._procs[0].kill()
    group._procs[0].join()
    t = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 0 is not running"):
        accel.generate(model, repetitive_prompt(7, 200), max_new_tokens=2, prefill_ranks=group)
    assert time.monotonic() - t < 20
    assert not group.alive()
    with pytest.raises(RuntimeError, match="closed"):
        accel.generate(model, repetitive_prompt(7, 200), max_new_tokens=2, prefill_ranks=group)


def test_a_rank_failing_mid_prefill_is_reported(model):
    prompt = random_prompt(8, 200)
    prompt[0, 3] = 10**6  # no such token: rank 0's embedding lookup fails inside its chunk
    with PrefillRanks(model, 2, timeout_s=20) as group:
        t = time.monotonic()
        with pytest.raises(RuntimeError, match="rank 0 failed: IndexError"), torch.inference_mode():
            prefill(model, SharedCache(2), prompt, ranks=group)
        assert time.monotonic() - t < 20
        assert not group.alive()


def test_another_model_is_refused(model, ranks):
    with pytest.raises(ValueError, match="prefill_ranks: a PrefillRanks runs the model"):
        accel.generate(make_tiny_model(seed=4), random_prompt(0, 40), max_new_tokens=2,
                       prefill_ranks=ranks)


def test_cli_generate_prefill_ranks(monkeypatch, capsys):
    import accel.models
    from accel.cli import main
    from helpers import make_tiny_tokenizer

    loads = []

    def fake_load(name, **kw):
        loads.append(name)
        return make_tiny_model(seed=2), make_tiny_tokenizer()

    monkeypatch.setattr(accel.models, "load_model", fake_load)
    assert main(["generate", "--prefill-ranks", "0", "hello"]) == 2
    assert "prefill_ranks" in capsys.readouterr().err and not loads  # refused before loading
    assert main(["generate", "--raw", "--prefill-ranks", "2", "--max-new-tokens", "4", "hello world " * 20]) == 0
    assert "starting 1 prefill rank" in capsys.readouterr().err
