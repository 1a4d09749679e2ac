"""accel.Engine: continuous batching behind a thread-safe submit()."""

from __future__ import annotations

import threading

import pytest
import torch

import accel
from helpers import alone_tokens, make_tiny_model, repetitive_prompt
from speculative import PromptLookup

LENGTHS = (23, 41, 30, 52, 17, 36, 45, 28)


def _prompt(i: int) -> torch.Tensor:
    return repetitive_prompt(100 + i, LENGTHS[i % len(LENGTHS)])[0]


@pytest.fixture(scope="module")
def model():
    return make_tiny_model(seed=41)


def test_eight_threads_submitting_at_once_each_get_their_own_answer(model):
    prompts = [_prompt(i) for i in range(8)]
    results: dict[int, list[int]] = {}
    with accel.Engine(model, strategies=[PromptLookup()], max_batch=4, eos_token_id=[]) as engine:
        barrier = threading.Barrier(8)

        def client(i):
            barrier.wait()
            results[i] = engine.submit(prompts[i], max_new_tokens=20).result(timeout=120).tokens

        threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        m = engine.metrics()
    assert {i: results[i] for i in range(8)} == {i: alone_tokens(model, p, 20) for i, p in enumerate(prompts)}
    assert m["requests_total"] == 8 and m["tokens_generated"] == 8 * 20
    assert 0 < m["batch_occupancy"] <= 1 and m["mean_accepted"] >= 1


def test_stream_yields_tokens_then_the_final_delta(model):
    with accel.Engine(model, max_batch=2, eos_token_id=[]) as engine:
        handle = engine.submit(_prompt(0).tolist(), max_new_tokens=9)
        deltas = list(handle.stream(timeout=60))
    assert [t for d in deltas for t in d.tokens] == alone_tokens(model, _prompt(0), 9)
    assert deltas[-1].finished and deltas[-1].finish_reason == "length"
    assert not any(d.finished for d in deltas[:-1])
    assert handle.result().finish_reason == "length" and handle.result().prompt_tokens == LENGTHS[0]


def test_a_request_admitted_while_others_decode_gets_exactly_its_alone_tokens(model):
    with accel.Engine(model, strategies=[PromptLookup()], max_batch=4, eos_token_id=[]) as engine:
        early = [engine.submit(_prompt(i), max_new_tokens=40) for i in range(3)]
        next(early[0].stream(timeout=60))  # the batch is decoding
        late = engine.submit(_prompt(5), max_new_tokens=15)
        got = late.result(timeout=120).tokens
        first = [h.result(timeout=120).tokens for h in early]
    assert got == alone_tokens(model, _prompt(5), 15)
    assert first == [alone_tokens(model, _prompt(i), 40) for i in range(3)]


def test_cancel_mid_stream_frees_the_row_and_others_finish(model):
    with accel.Engine(model, max_batch=2, eos_token_id=[]) as engine:
        doomed = engine.submit(_prompt(1), max_new_tokens=400)
        other = engine.submit(_prompt(2), max_new_tokens=12)
        stream = doomed.stream(timeout=60)
        next(stream)
        doomed.cancel()
        rest = list(stream)
        assert rest[-1].finished and rest[-1].finish_reason == "cancelled"
        assert doomed.result(timeout=60).finish_reason == "cancelled"
        assert len(doomed.result().tokens) < 400
        assert other.result(timeout=60).tokens == alone_tokens(model, _prompt(2), 12)
        # a third request takes the freed row
        third = engine.submit(_prompt(3), max_new_tokens=5)
        assert third.result(timeout=60).tokens == alone_tokens(model, _prompt(3), 5)
        assert engine.metrics()["requests_running"] == 0


def test_per_request_strategies_and_bad_input(model):
    with accel.Engine(model, max_batch=2, eos_token_id=[]) as engine:
        h = engine.submit(_prompt(4), max_new_tokens=10, strategies=["prompt_lookup"])
        assert h.result(timeout=60).tokens == alone_tokens(model, _prompt(4), 10)
        assert h.result().stats.drafted_tokens > 0
        with pytest.raises(accel.StrategyError, match="unknown strategy"):
            engine.submit(_prompt(4), strategies=["nope"])
        with pytest.raises(ValueError, match="max_new_tokens"):
            engine.submit(_prompt(4), max_new_tokens=-1)
        with pytest.raises(ValueError, match="tokenizer"):
            engine.submit("text needs a tokenizer")
        with pytest.raises(ValueError, match="context"):
            engine.submit(_prompt(4), max_new_tokens=10_000)
    with pytest.raises(RuntimeError, match="closed"):
        engine.submit(_prompt(4))


def test_hooks_removed_and_the_batch_emptied_after_many_requests(model):
    # (the resident memory over many requests is measured by benchmarks/serve_memory.sh)
    attention = [m for m in model.modules() if hasattr(m, "q_proj")]
    with accel.Engine(model, strategies=[PromptLookup()], max_batch=8, eos_token_id=[]) as engine:
        for wave in range(2):
            handles = [engine.submit(_prompt(i), max_new_tokens=3) for i in range(100)]
            assert all(len(h.result(timeout=300).tokens) == 3 for h in handles)
        assert engine._batch.cache.batch_size == 0
        assert engine.metrics()["requests_total"] == 200
    assert all(not m._forward_pre_hooks for m in attention)
    assert model.config._attn_implementation == "sdpa"


class _Broken(accel.Drafter):
    """A drafter that fails on its third proposal."""

    name = "broken_test"

    def start(self, model, prompt):
        return {"calls": 0}

    def propose(self, state, ctx):
        state["calls"] += 1
        if state["calls"] == 3:
            raise RuntimeError("drafter exploded")
        return None


def test_a_failing_request_ends_alone_and_the_engine_serves_on(model):
    with accel.Engine(model, max_batch=4, eos_token_id=[]) as engine:
        bad = engine.submit(_prompt(1), max_new_tokens=30, strategies=[_Broken()])
        good = engine.submit(_prompt(2), max_new_tokens=30)
        r = bad.result(timeout=60)
        assert r.finish_reason == "error" and "drafter exploded" in r.error
        assert good.result(timeout=60).tokens == alone_tokens(model, _prompt(2), 30)
        after = engine.submit(_prompt(3), max_new_tokens=5)
        assert after.result(timeout=60).tokens == alone_tokens(model, _prompt(3), 5)
    with pytest.raises(RuntimeError, match="drafter exploded"):  # one call: the error is the caller's
        accel.generate(model, _prompt(1).unsqueeze(0), strategies=[_Broken()], max_new_tokens=30)


def test_on_delta_hands_every_delta_to_a_callback_on_the_engine_thread(model):
    with accel.Engine(model, max_batch=2, eos_token_id=[]) as engine:
        seen: list = []
        threads: set[str] = set()
        ended = threading.Event()

        def callback(delta):
            threads.add(threading.current_thread().name)
            seen.append(delta)
            if delta is None:
                ended.set()

        handle = engine.submit(_prompt(0), max_new_tokens=9)
        handle.result(timeout=60)  # finished before the callback: everything queued is handed over at once
        handle.on_delta(callback)
        assert ended.is_set() and seen[-1] is None
        with pytest.raises(RuntimeError, match="already has"):
            handle.on_delta(callback)
        with pytest.raises(RuntimeError, match="on_delta"):
            next(handle.stream())
        early = list(seen)

        seen.clear()
        ended.clear()
        live = engine.submit(_prompt(1), max_new_tokens=30)
        live.on_delta(callback)  # while it decodes
        assert ended.wait(60)
    for got, prompt, n in ((early, _prompt(0), 9), (seen, _prompt(1), 30)):
        assert got[-1] is None and got[-2].finished and not any(d.finished for d in got[:-2])
        assert [t for d in got[:-1] for t in d.tokens] == alone_tokens(model, prompt, n)
    assert "accel-engine" in threads  # the live request's deltas came on the engine's thread


def test_a_raising_on_delta_callback_cancels_its_request_only(model):
    with accel.Engine(model, max_batch=2, eos_token_id=[]) as engine:
        calls = []

        def gone(delta):
            calls.append(delta)
            raise ConnectionError("the reader went away")

        doomed = engine.submit(_prompt(2), max_new_tokens=400)
        other = engine.submit(_prompt(3), max_new_tokens=12)
        doomed.on_delta(gone)
        assert doomed.result(timeout=60).finish_reason == "cancelled"
        assert len(calls) == 1  # nothing more after it raised
        assert other.result(timeout=60).tokens == alone_tokens(model, _prompt(3), 12)
        assert engine.alive and engine.metrics()["requests_running"] == 0


class _CountedWaits(threading.Event):
    """The engine's wake-up event, counting the waits of its idle loop (each wait is one idle
    pass) so that a test can wait for passes instead of sleeping."""

    def __init__(self) -> None:
        super().__init__()
        self.waits = 0
        self.passed = threading.Condition()

    def wait(self, timeout=None):
        woken = super().wait(timeout)
        with self.passed:
            self.waits += 1
            self.passed.notify_all()
        return woken

    def wait_passes(self, n: int) -> None:
        """Return once the loop has waited ``n`` more times."""
        with self.passed:
            target = self.waits + n
            assert self.passed.wait_for(lambda: self.waits >= target, timeout=60)


def test_the_engine_gives_freed_memory_back_once_each_time_it_goes_idle(model, monkeypatch):
    import accel.serving.service as service

    trims: list[int] = []  # per trim: the tokens generated when it ran
    trimmed = threading.Semaphore(0)

    def trim():
        trims.append(engine.metrics()["tokens_generated"])
        trimmed.release()

    monkeypatch.setattr(service, "_trim_heap", trim)
    with accel.Engine(model, max_batch=2, eos_token_id=[]) as engine:
        idle = engine._wake = _CountedWaits()  # (before any request: the loop reads it each pass)
        first = [engine.submit(_prompt(i), max_new_tokens=6) for i in range(3)]
        assert all(h.result(timeout=60).finish_reason == "length" for h in first)
        assert trimmed.acquire(timeout=60)  # the engine went idle
        idle.wait_passes(3)  # and stayed idle for several passes of its loop
        assert trims == [3 * 6]  # one trim, once all three had ended
        engine.submit(_prompt(4), max_new_tokens=4).result(timeout=60)
        assert trimmed.acquire(timeout=60)
        idle.wait_passes(3)
        assert trims == [3 * 6, 3 * 6 + 4]


def test_the_heap_trim_is_glibcs_malloc_trim_where_the_c_library_is_glibc():
    import platform

    import accel.serving.service as service

    assert (service._malloc_trim() is not None) == (platform.libc_ver()[0] == "glibc")
    service._trim_heap()  # runs (or does nothing off glibc) without raising
