"""Nothing accel builds for a request is left to Python's cyclic collector.

An object in a reference cycle is freed only when the collector's oldest generation runs,
which in a service may be hundreds of requests later; a cycle that reaches a cache's KV
tensors keeps them allocated until then (on the default model that was ~13 MiB per layer
cache of a 16-row batch, and the server's memory grew for ~1,000 requests). These tests save
what the collector finds (``gc.DEBUG_SAVEALL``) while requests run and assert that no tensor
is among it, for every strategy combination, in ``accel.generate`` and in the Engine.
"""

from __future__ import annotations

import gc
import weakref
from contextlib import contextmanager

import pytest
import torch

import accel
from accel.cache import SharedCache
from helpers import SMALL_DRAFT, engine_held, make_tiny_model, repetitive_prompt
from snapkv import AdaSnapKV, SnapKV
from speculative import DraftModel, Medusa, PromptLookup


@contextmanager
def _collector_finds():
    """Yields a list that, on exit, holds what the cyclic collector found meanwhile."""
    found: list = []
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        yield found
        gc.collect()
        found.extend(gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()


def _tensors(objects: list) -> list[tuple]:
    return [(type(o).__name__, tuple(o.shape)) for o in objects if isinstance(o, torch.Tensor)]


def _prompt(i: int) -> torch.Tensor:
    return repetitive_prompt(70 + i, 3 * (8 + i), period=8 + i)[0]


@pytest.fixture(scope="module")
def model():
    return make_tiny_model(seed=43)


COMBOS = {
    "plain": lambda h: [],
    "snapkv+lookup": lambda h: [SnapKV(budget=16, window=4, kernel=3), PromptLookup()],
    "ada+medusa": lambda h: [AdaSnapKV(budget=20, window=4, kernel=3), Medusa(heads=h, max_nodes=8)],
    "draft_model": lambda h: [DraftModel(model=make_tiny_model(seed=5, **SMALL_DRAFT), num_tokens=3, stop_below=None)],
}


def test_a_dropped_cache_is_freed_by_reference_counting():
    cache = SharedCache(num_layers=3)
    gone = []
    weakref.finalize(cache, gone.append, True)
    del cache
    assert gone == [True]  # freed at once, not when the collector next runs


@pytest.mark.parametrize("combo", list(COMBOS))
def test_generate_leaves_no_tensor_to_the_cyclic_collector(model, heads_dir, combo):
    strategies = COMBOS[combo](heads_dir)
    ids = torch.stack([_prompt(0), _prompt(0).flip(0)])
    accel.generate(model, ids, strategies=strategies, max_new_tokens=6, eos_token_id=[])  # warm caches, imports
    with _collector_finds() as found:
        accel.generate(model, ids, strategies=strategies, max_new_tokens=6, eos_token_id=[])
    assert _tensors(found) == []


@pytest.mark.parametrize("combo", list(COMBOS))
def test_engine_requests_leave_no_tensor_to_the_cyclic_collector(model, heads_dir, combo):
    strategies = COMBOS[combo](heads_dir)
    with accel.Engine(model, strategies=strategies, max_batch=3, eos_token_id=[]) as engine:
        engine.submit(_prompt(0), max_new_tokens=4).result(timeout=120)  # warm up
        with _collector_finds() as found:
            with engine_held(engine, _prompt(0)):  # nothing runs until all are queued
                handles = [engine.submit(_prompt(i), max_new_tokens=64 if i == 1 else 5 + i) for i in range(6)]
                handles[1].on_delta(lambda delta: handles[1].cancel())  # cancelled live, after its first token
                handles[2].cancel()  # cancelled while queued
            results = [h.result(timeout=120) for h in handles]
    assert [r.finish_reason for r in results] == ["length", "cancelled", "cancelled", "length", "length", "length"]
    assert len(results[1].tokens) < 64 and results[2].tokens == []
    assert _tensors(found) == []


def test_stream_leaves_no_tensor_to_the_cyclic_collector(model):
    ids = torch.stack([_prompt(1), _prompt(1).flip(0)])
    list(accel.stream(model, ids, strategies=[PromptLookup()], max_new_tokens=4, eos_token_id=[]))
    with _collector_finds() as found:
        deltas = list(accel.stream(model, ids, strategies=[PromptLookup()], max_new_tokens=6, eos_token_id=[]))
    assert deltas and _tensors(found) == []
