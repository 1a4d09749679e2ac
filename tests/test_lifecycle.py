"""The Engine's lifecycle, driven from several threads: cancel while queued and mid-prefill,
close() with requests in flight, a failed step and a failed prefill, max_new_tokens=0, and
cancel / metrics() / on_delta racing the steps.

Every test is deterministic by construction: the loop thread is held at a known point (a
:class:`helpers.Gate` drafter in an admission, a compressor inside a prefill, an on_delta
callback between steps) while other threads act, and released by an event; no sleep races a
step. Where threads do race (the last test), only what holds for every interleaving is checked.
"""

from __future__ import annotations

import threading
from typing import Any, ClassVar

import pytest
import torch

import accel
from accel.serving.service import Delta
from accel.strategy import Drafter
from helpers import TINY_VOCAB, gate, make_tiny_model
from snapkv import SnapKV
from speculative import PromptLookup

LENGTHS = (23, 41, 30, 52, 17, 36, 45, 28)
TIMEOUT = 120


def _prompt(i: int) -> torch.Tensor:
    n = LENGTHS[i % len(LENGTHS)]
    base = torch.randint(2, TINY_VOCAB, (max(4, n // 3),), generator=torch.Generator().manual_seed(300 + i))
    return base.repeat(4)[:n]


def _alone(model, prompt: torch.Tensor, new: int, strategies=()) -> list[int]:
    out = accel.generate(model, prompt.unsqueeze(0), strategies=list(strategies), max_new_tokens=new, eos_token_id=[])
    return out.sequences[0, prompt.numel():].tolist()


@pytest.fixture(scope="module")
def model():
    return make_tiny_model(seed=51)


def _held(engine, max_new_tokens: int = 1):
    """Submit a one-token request whose admission holds the loop; returns (its handle, gate)
    once the loop is held. Requests submitted meanwhile are admitted together after it."""
    hold = gate()
    handle = engine.submit(_prompt(7)[:9], max_new_tokens=max_new_tokens, strategies=[hold])
    assert hold.entered.wait(TIMEOUT)
    return handle, hold


class GatedSnapKV(SnapKV):
    """SnapKV whose first ``select`` (layer 0, inside the prefill forward) sets ``entered`` and
    waits for ``proceed``: the loop is held mid-prefill."""

    entered: Any = None
    proceed: Any = None

    def select(self, layer_idx, queries, keys, values, tokens=None):
        if not self.entered.is_set():
            self.entered.set()
            assert self.proceed.wait(TIMEOUT), "the test never let the prefill go on"
        return super().select(layer_idx, queries, keys, values, tokens)


class ExplodingSnapKV(SnapKV):
    """SnapKV that raises in the prefill, at its second layer (the first one compressed)."""

    def select(self, layer_idx, queries, keys, values, tokens=None):
        if layer_idx == 1:
            raise RuntimeError("compressor exploded")
        return super().select(layer_idx, queries, keys, values, tokens)


class ExplodingStart(Drafter):
    """A drafter whose start() raises: in the admission, after the prefill emitted the first tokens."""

    name: ClassVar[str] = "exploding_start_test"

    def start(self, model, prompt):
        raise RuntimeError("drafter start exploded")

    def propose(self, state, ctx):
        return None


SNAP = dict(budget=16, window=4, kernel=3)


def _deltas(handle) -> list[Delta]:
    return list(handle.stream(timeout=TIMEOUT))


# --------------------------------------------------------------------------- cancel


def test_cancel_while_queued_ends_it_without_a_prefill(model):
    with accel.Engine(model, max_batch=2, eos_token_id=[]) as engine:
        held, hold = _held(engine)
        queued = engine.submit(_prompt(1), max_new_tokens=20)
        other = engine.submit(_prompt(2), max_new_tokens=8)
        queued.cancel()
        assert engine.metrics()["requests_waiting"] == 2 and not queued.done
        hold.opened.set()
        r = queued.result(timeout=TIMEOUT)
        assert (r.finish_reason, r.tokens, r.error) == ("cancelled", [], None)
        assert _deltas(queued) == [Delta([], None, True, "cancelled")]
        assert r.stats.verify_steps == 0 and r.prompt_tokens == LENGTHS[1]
        assert other.result(timeout=TIMEOUT).tokens == _alone(model, _prompt(2), 8)
        assert held.result(timeout=TIMEOUT).finish_reason == "length"
        m = engine.metrics()
        assert m["prefills"] == 2  # the held request's and `other`'s: the cancelled one never ran
        assert m["requests_running"] == 0 and m["requests_waiting"] == 0


def test_cancel_mid_prefill_frees_the_row_before_any_step(model):
    snap = GatedSnapKV(**SNAP, entered=threading.Event(), proceed=threading.Event())
    with accel.Engine(model, max_batch=2, eos_token_id=[]) as engine:
        doomed = engine.submit(_prompt(3), max_new_tokens=30, strategies=[snap])
        assert snap.entered.wait(TIMEOUT)  # the loop is inside doomed's prefill forward
        doomed.cancel()
        waiting = engine.submit(_prompt(4), max_new_tokens=6)
        m = engine.metrics()  # answers while a prefill runs
        assert m["requests_running"] == 0 and m["requests_waiting"] == 1
        snap.proceed.set()
        r = doomed.result(timeout=TIMEOUT)
        assert r.finish_reason == "cancelled" and r.error is None
        assert r.stats.verify_steps == 0  # retired before the next step
        ref = _alone(model, _prompt(3), 30, [SnapKV(**SNAP)])
        assert len(r.tokens) <= 1 and r.tokens == ref[: len(r.tokens)]  # at most the prefill's token
        deltas = _deltas(doomed)
        assert deltas[-1].finished and deltas[-1].finish_reason == "cancelled"
        assert [t for d in deltas for t in d.tokens] == r.tokens
        assert waiting.result(timeout=TIMEOUT).tokens == _alone(model, _prompt(4), 6)
        m = engine.metrics()
        assert m["requests_running"] == 0 and m["kv_bytes"] == 0  # the cancelled row's entries are gone


# --------------------------------------------------------------------------- close


def test_close_with_requests_in_flight_cancels_each_and_says_so(model):
    engine = accel.Engine(model, max_batch=2, eos_token_id=[])
    held, hold = _held(engine)
    running = [engine.submit(_prompt(i), max_new_tokens=200) for i in (0, 1)]  # admitted together
    seen: list[Delta | None] = []
    between_steps, go_on = threading.Event(), threading.Event()

    def on_delta(delta):  # runs on the loop thread; holds it after the second step
        seen.append(delta)
        if len(seen) == 3 and not between_steps.is_set():
            between_steps.set()
            assert go_on.wait(TIMEOUT)

    running[0].on_delta(on_delta)
    hold.opened.set()
    assert between_steps.wait(TIMEOUT)
    queued = [engine.submit(_prompt(i), max_new_tokens=10) for i in (2, 3)]
    engine.close(timeout=0)  # the loop stops after the step it is in
    assert not engine.alive
    with pytest.raises(RuntimeError, match="closed"):
        engine.submit(_prompt(4))
    go_on.set()
    engine.close()  # joins the loop thread: every request has ended by the time it returns
    handles = running + queued
    assert all(h.done for h in handles)
    results = [h.result(timeout=0) for h in handles]
    assert all(r.finish_reason == "cancelled" and r.error is None for r in results)
    for h, r in zip(running, results):  # what they had, exactly their alone tokens so far
        assert 3 <= len(r.tokens) < 200 and r.tokens == _alone(model, h.row.prompt, len(r.tokens))
    assert [r.tokens for r in results[2:]] == [[], []]
    assert seen[-1] is None and seen[-2].finished and seen[-2].finish_reason == "cancelled"
    assert [t for d in seen[:-1] for t in d.tokens] == results[0].tokens
    for h in running[1:] + queued:
        deltas = _deltas(h)
        assert deltas[-1] == Delta([], None, True, "cancelled")
        assert [t for d in deltas for t in d.tokens] == h.result().tokens
    assert held.result(timeout=0).finish_reason == "length"


def test_a_submit_racing_close_is_refused_or_ends_cancelled(model, monkeypatch):
    """submit() passes its closed check, then close() runs and the loop drains the queue,
    then submit() queues: the handle must still end (cancelled), not wait forever."""
    import accel.serving.service as service

    make_rows = service.make_rows
    inside, go_on = threading.Event(), threading.Event()

    def held_make_rows(*args, **kwargs):
        if threading.current_thread().name == "racer":
            inside.set()
            assert go_on.wait(TIMEOUT)
        return make_rows(*args, **kwargs)

    monkeypatch.setattr(service, "make_rows", held_make_rows)
    engine = accel.Engine(model, max_batch=2, eos_token_id=[])
    got: dict[str, Any] = {}

    def racer():
        try:
            got["handle"] = engine.submit(_prompt(0), max_new_tokens=5)
        except RuntimeError as err:
            got["error"] = err

    thread = threading.Thread(target=racer, name="racer")
    thread.start()
    assert inside.wait(TIMEOUT)
    engine.close()  # the loop has ended and drained its queue
    go_on.set()
    thread.join(TIMEOUT)
    if "error" in got:
        assert "closed" in str(got["error"])
    else:
        r = got["handle"].result(timeout=10)
        assert r.finish_reason == "cancelled" and r.tokens == []


# --------------------------------------------------------------------------- failures


def test_a_failed_step_fails_the_rows_in_it_and_the_queue_is_served(model, monkeypatch):
    import accel.engine as engine_module

    verify_logits = engine_module.verify_logits
    fired: list[int] = []

    def failing(model_, cache, trees, *args, **kwargs):
        if len(trees) == 2 and not fired:  # the first step of the two rows admitted together
            fired.append(cache.batch_size)
            raise RuntimeError("verify exploded")
        return verify_logits(model_, cache, trees, *args, **kwargs)

    monkeypatch.setattr(engine_module, "verify_logits", failing)
    with accel.Engine(model, max_batch=2, eos_token_id=[]) as engine:
        _, hold = _held(engine)
        failed = [engine.submit(_prompt(i), max_new_tokens=20) for i in (1, 2)]
        queued = engine.submit(_prompt(3), max_new_tokens=12, strategies=[PromptLookup()])
        hold.opened.set()
        for i, h in zip((1, 2), failed):
            r = h.result(timeout=TIMEOUT)
            assert r.finish_reason == "error" and "RuntimeError: verify exploded" in r.error
            assert r.tokens == _alone(model, _prompt(i), 1)  # the prefill's token, nothing after
            deltas = _deltas(h)
            assert deltas[-1].finished and deltas[-1].finish_reason == "error"
        assert fired == [2]
        assert queued.result(timeout=TIMEOUT).tokens == _alone(model, _prompt(3), 12)  # a fresh batch
        after = engine.submit(_prompt(4), max_new_tokens=6)
        assert after.result(timeout=TIMEOUT).tokens == _alone(model, _prompt(4), 6)
        assert engine.alive and engine.metrics()["requests_running"] == 0


FAILURES = {"compressor": (lambda: ExplodingSnapKV(**SNAP), "RuntimeError: compressor exploded"),
            "drafter_start": (lambda: ExplodingStart(), "RuntimeError: drafter start exploded")}


@pytest.mark.parametrize("failure", list(FAILURES))
def test_a_failed_prefill_fails_only_its_request(model, failure):
    """A request whose prefill raises (its compressor inside the forward, or its drafter's start
    after the first tokens were sampled) ends with the error; the running batch goes on
    untouched, and the requests admitted in the same prefill, a sampled one too, get exactly
    what they get alone."""
    strategy, message = FAILURES[failure]
    with accel.Engine(model, max_batch=5, eos_token_id=[]) as engine:
        _, outer = _held(engine)
        running = engine.submit(_prompt(0), max_new_tokens=40)
        inner = gate()
        engine.submit(_prompt(6)[:9], max_new_tokens=1, strategies=[inner])
        outer.opened.set()
        assert inner.entered.wait(TIMEOUT)  # `running` is admitted with the inner gate, which holds the loop
        bad = engine.submit(_prompt(1), max_new_tokens=20, strategies=[strategy()])
        plain = engine.submit(_prompt(2), max_new_tokens=20)
        snap = engine.submit(_prompt(3), max_new_tokens=20, strategies=[SnapKV(**SNAP)])
        sampled = engine.submit(_prompt(4), max_new_tokens=20, temperature=1.0, seed=5)
        inner.opened.set()  # the four above are prefilled together, while `running` is live
        r = bad.result(timeout=TIMEOUT)
        assert (r.finish_reason, r.tokens) == ("error", []) and message in r.error
        assert _deltas(bad) == [Delta([], None, True, "error")]
        assert plain.result(timeout=TIMEOUT).tokens == _alone(model, _prompt(2), 20)
        assert snap.result(timeout=TIMEOUT).tokens == _alone(model, _prompt(3), 20, [SnapKV(**SNAP)])
        alone = accel.generate(model, _prompt(4).unsqueeze(0), max_new_tokens=20, temperature=1.0, seed=5,
                               eos_token_id=[]).sequences[0, LENGTHS[4]:].tolist()
        assert sampled.result(timeout=TIMEOUT).tokens == alone
        assert running.result(timeout=TIMEOUT).tokens == _alone(model, _prompt(0), 40)
        assert engine.alive and engine.metrics()["requests_running"] == 0


# --------------------------------------------------------------------------- max_new_tokens=0


def test_max_new_tokens_zero_ends_at_once(model):
    prompts = [_prompt(0), _prompt(1)]
    res = accel.generate(model, prompts, max_new_tokens=0, eos_token_id=[])
    width = max(LENGTHS[:2])
    assert res.sequences.shape == (2, width)
    assert [s.new_tokens for s in res.row_stats] == [0, 0]
    assert [s.prompt_tokens for s in res.row_stats] == [LENGTHS[0], LENGTHS[1]]
    deltas = list(accel.stream(model, prompts, max_new_tokens=0, eos_token_id=[]))
    assert sorted((d.row, d.tokens, d.finished, d.finish_reason) for d in deltas) == [
        (0, [], True, "length"), (1, [], True, "length")]  # every row says it finished

    with accel.Engine(model, max_batch=2, eos_token_id=[]) as engine:
        _, hold = _held(engine)
        zero = engine.submit(_prompt(2), max_new_tokens=0)
        other = engine.submit(_prompt(3), max_new_tokens=5)
        called: list[Delta | None] = []
        quiet = engine.submit(_prompt(4), max_new_tokens=0)
        quiet.on_delta(called.append)
        hold.opened.set()
        r = zero.result(timeout=TIMEOUT)
        assert (r.finish_reason, r.tokens, r.error, r.prompt_tokens) == ("length", [], None, LENGTHS[2])
        assert _deltas(zero) == [Delta([], None, True, "length")]
        assert quiet.result(timeout=TIMEOUT).finish_reason == "length"
        assert called == [Delta([], None, True, "length"), None]
        assert other.result(timeout=TIMEOUT).tokens == _alone(model, _prompt(3), 5)
        assert engine.metrics()["prefills"] == 2  # the held request's and `other`'s


# --------------------------------------------------------------------------- races


def test_cancel_metrics_and_on_delta_racing_the_steps(model):
    """Eight requests; other threads read metrics() all along, register on_delta callbacks or
    stream, and cancel some requests while they decode. Whatever the interleaving: every
    request ends, its deltas are its tokens, the uncancelled ones are exactly their alone
    output, the cancelled ones a prefix of it, and the counters add up."""
    n, new = 8, 24
    strategies = [[PromptLookup()] if i % 2 else [] for i in range(n)]
    refs = [_alone(model, _prompt(i), new, strategies[i]) for i in range(n)]
    cancel_by_reader = {1, 3}  # by its stream's reader after its second delta: may race the last step
    cancel_by_main = {5}  # as soon as the loop runs: queued, mid-prefill or decoding
    cancel_in_callback = {6}  # by its own callback, on the loop thread: always before its end
    errors: list[BaseException] = []
    stop = threading.Event()
    polled: list[list[dict]] = [[], []]

    def poll(out):
        while not stop.is_set():
            try:
                out.append(engine.metrics())
            except BaseException as err:  # noqa: BLE001 - reported below
                errors.append(err)
                return

    with accel.Engine(model, max_batch=4, eos_token_id=[]) as engine:
        held, hold = _held(engine)
        handles = [engine.submit(_prompt(i), max_new_tokens=new, strategies=strategies[i]) for i in range(n)]
        got: dict[int, list] = {i: [] for i in range(n)}
        ended = {i: threading.Event() for i in range(n)}

        def callback(delta, i):
            got[i].append(delta)
            if i in cancel_in_callback and len(got[i]) == 2:
                handles[i].cancel()
            if delta is None:
                ended[i].set()

        for i in cancel_in_callback:  # registered before the loop runs: every delta comes on its thread
            handles[i].on_delta(lambda delta, i=i: callback(delta, i))
        barrier = threading.Barrier(n + 1)

        def consume(i):
            try:
                barrier.wait(TIMEOUT)
                h = handles[i]
                if i % 2 == 0:  # on_delta, registered while the request may be anywhere
                    if i not in cancel_in_callback:
                        h.on_delta(lambda delta: callback(delta, i))
                    assert ended[i].wait(TIMEOUT)
                else:
                    for delta in h.stream(timeout=TIMEOUT):
                        got[i].append(delta)
                        if i in cancel_by_reader and len(got[i]) == 2:
                            h.cancel()
                    got[i].append(None)
            except BaseException as err:  # noqa: BLE001 - reported below
                errors.append(err)

        threads = [threading.Thread(target=poll, args=(out,)) for out in polled]
        threads += [threading.Thread(target=consume, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        hold.opened.set()
        barrier.wait(TIMEOUT)
        for i in cancel_by_main:
            handles[i].cancel()
        results = [h.result(timeout=TIMEOUT) for h in handles]
        stop.set()
        for t in threads:
            t.join(TIMEOUT)
        final = engine.metrics()
    assert errors == []
    for i, (r, deltas) in enumerate(zip(results, got.values())):
        assert deltas[-1] is None and deltas[-2].finished and not any(d.finished for d in deltas[:-2]), i
        assert deltas[-2].finish_reason == r.finish_reason and r.error is None
        assert [t for d in deltas[:-1] for t in d.tokens] == r.tokens, i
        if i in cancel_in_callback:
            assert r.finish_reason == "cancelled" and 2 <= len(r.tokens) < new
        if i in cancel_in_callback | cancel_by_reader | cancel_by_main and r.finish_reason == "cancelled":
            assert r.tokens == refs[i][: len(r.tokens)], i
        else:
            assert (r.finish_reason, r.tokens) == ("length", refs[i]), i
    assert held.result().finish_reason == "length"
    assert final["requests_total"] == n + 1 and final["requests_running"] == 0 and final["requests_waiting"] == 0
    assert final["tokens_generated"] == sum(len(r.tokens) for r in results) + 1
    assert final["kv_bytes"] == 0
    for snapshots in polled:  # each poller's reads: sane, and counters never go back
        assert snapshots and all(0 <= m["requests_running"] <= 4 for m in snapshots)
        for name in ("tokens_generated", "verify_steps", "prefills"):
            assert [m[name] for m in snapshots] == sorted(m[name] for m in snapshots), name
