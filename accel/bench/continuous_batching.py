"""``hf_generate_batch``: transformers' continuous batching, as a baseline.

The ``init_continuous_batching`` manager that ``model.generate_batch`` wraps: a batch is every
request queued at once, arrivals ``add_request`` from a client thread; per-token timestamps
(``record_timestamps``) give first-token times. The manager's setup and stop are kept out of
the timed window (``overhead_s``). Its paged cache is sized to the workload (``num_blocks``):
left to itself on CPU it would allocate 60% of the machine's RAM. The model's attention
implementation is restored afterwards.
"""

from __future__ import annotations

import math
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch

from .. import adapter
from .batched import schedule_times, start_client
from .measurement import BatchMeasurement, RowResult, error_line, sync_device
from .schema import Arrivals, HFGenerateBatch
from .tasks import TaskItem

__all__ = ["cb_batch", "cb_arrivals", "cb_probe"]


@contextmanager
def _attention_restored(model: Any) -> Iterator[None]:
    """Whatever continuous batching switches the attention to, put the model's own back."""
    original = model.config._attn_implementation
    try:
        yield
    finally:
        if model.config._attn_implementation != original:
            model.set_attn_implementation(original)


def _generation_config(eos: list[int], pad: int, max_new_tokens: int) -> Any:
    from transformers import GenerationConfig

    return GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos or -1, pad_token_id=pad)


def _cb_config(spec: HFGenerateBatch, prompt_lengths: list[int], max_new_tokens: int, max_batch: int) -> Any:
    """A continuous-batching config whose cache holds the whole workload at once (plus a
    page per request), instead of a share of the machine's free memory."""
    from transformers import ContinuousBatchingConfig

    pages = sum(math.ceil((p + max_new_tokens) / spec.page_size) + 1 for p in prompt_lengths)
    return ContinuousBatchingConfig(num_blocks=pages, max_batch_tokens=spec.max_batch_tokens,
                                    page_size=spec.page_size, max_requests_per_batch=max_batch)


def _cb_row(out: Any, started: float, prompt_tokens: int, page_size: int, geo: adapter.Geometry) -> RowResult:
    """A continuous-batching result as a row; times from ``started`` (a perf_counter reading).
    KV bytes kept: the row's tokens rounded up to whole pages."""
    new = list(out.generated_tokens)
    stamps = out.timestamps or []
    full = geo.entry_bytes() * (prompt_tokens + max(len(new) - 1, 0))
    kept = geo.entry_bytes() * math.ceil((prompt_tokens + len(new)) / page_size) * page_size
    return RowResult(
        new_ids=new, first_token_s=stamps[0] - started if stamps else None,
        latency_s=stamps[-1] - started if stamps else None, kv_bytes_kept=kept, kv_bytes_full=full,
        verify_steps=max(len(new) - 1, 0), accepted_per_step=[0] * max(len(new) - 1, 0),
        error=str(out.error) if out.error is not None else None,
    )


def cb_probe(model: Any, eos: list[int], pad: int, spec: HFGenerateBatch) -> tuple[str | None, str | None]:
    """Run transformers' continuous batching once on a 2-token prompt.

    Returns ``(attention implementation it ran with, None)`` or ``(None, why it does not run)``.
    """
    if not hasattr(model, "init_continuous_batching"):
        return None, f"{type(model).__name__} has no continuous batching (transformers' ContinuousMixin)"
    probe = TaskItem(task="probe", kind="probe", item_id="probe", input_ids=torch.tensor([[pad, pad]]))
    errors: list[str | None] = [None]
    try:
        with torch.inference_mode(), _cb_manager(model, eos, pad, spec, [2], 1, 1) as (manager, _):
            impl = model.config._attn_implementation
            _cb_submit(manager, 0, probe, 1, errors)
            finished = _cb_collect(manager, errors, None)
    except Exception as err:
        return None, f"continuous batching does not run here ({error_line(err)})"
    out = finished.get("r0", (None, 0))[0]
    if out is None:
        return None, f"continuous batching gave no result on a 2-token prompt ({errors[0] or 'nothing came back'})"
    if out.error is not None:
        return None, f"continuous batching failed on a 2-token prompt: {str(out.error).splitlines()[0]}"
    if len(out.generated_tokens) != 1:
        return None, f"continuous batching returned {len(out.generated_tokens)} tokens for max_new_tokens=1"
    return impl, None


@contextmanager
def _cb_manager(model: Any, eos: list[int], pad: int, spec: HFGenerateBatch, prompt_lengths: list[int],
                max_new_tokens: int, max_batch: int) -> Iterator[tuple[Any, list[float]]]:
    """A started continuous-batching manager with its cache sized to the workload; stopped,
    destroyed and the model's attention restored on exit. Yields (manager, overhead): overhead[0]
    is the seconds spent setting up and (after the block) stopping it."""
    overhead = [0.0]
    with _attention_restored(model):
        t = time.perf_counter()
        manager = model.init_continuous_batching(
            generation_config=_generation_config(eos, pad, max_new_tokens),
            continuous_batching_config=_cb_config(spec, prompt_lengths, max_new_tokens, max_batch))
        manager.start()
        overhead[0] += time.perf_counter() - t
        try:
            yield manager, overhead
        finally:
            t = time.perf_counter()
            manager.stop(block=True, timeout=30)
            manager.destroy()
            overhead[0] += time.perf_counter() - t


_STALL_S = 300.0  # give up on a manager that has produced nothing for this long


def _cb_collect(manager: Any, errors: list[str | None], client: threading.Thread | None) -> dict[str, tuple[Any, float]]:
    """Finished outputs by request id, with the moment each was received, until every request
    has one (or failed to be submitted: ``errors``) or the manager stops producing."""
    finished: dict[str, tuple[Any, float]] = {}
    progress = time.perf_counter()
    while len(finished) + sum(e is not None for e in errors) < len(errors):
        out = manager.get_result(timeout=1)
        if out is not None:
            progress = time.perf_counter()
            if out.is_finished():
                finished[out.request_id] = (out, progress)
        elif (client is None or not client.is_alive()) and (
                not manager.is_running() or time.perf_counter() - progress > _STALL_S):
            break
    return finished


def _cb_submit(manager: Any, k: int, item: TaskItem, max_new_tokens: int, errors: list[str | None]) -> None:
    try:
        rid = manager.add_request(item.input_ids[0].tolist(), request_id=f"r{k}", max_new_tokens=max_new_tokens,
                                  record_timestamps=True)
        if rid is None:
            errors[k] = "the continuous-batching manager dropped the request"
    except Exception as err:
        errors[k] = error_line(err)


def _cb_rows(items: list[TaskItem], finished: dict[str, tuple[Any, float]], submitted: list[float | None],
             errors: list[str | None], spec: HFGenerateBatch, geo: adapter.Geometry) -> list[RowResult]:
    rows = []
    for k, item in enumerate(items):
        got = finished.get(f"r{k}")
        if got is None or submitted[k] is None:
            why = errors[k] or "no result from the continuous-batching manager"
            rows.append(RowResult(new_ids=[], first_token_s=None, latency_s=None, error=why))
            continue
        out, received = got
        row = _cb_row(out, submitted[k], item.prompt_tokens, spec.page_size, geo)
        row.latency_s = received - submitted[k]  # as the caller sees it
        rows.append(row)
    return rows


def cb_batch(model: Any, eos: list[int], pad: int, spec: HFGenerateBatch) -> Callable[[list[TaskItem], int], BatchMeasurement]:
    """The batch queued at once on the manager ``model.generate_batch`` builds.

    Timed from the first ``add_request`` to the last result; the manager's setup and stop
    (``generate_batch``'s fixed cost: cache allocation, thread start, join, ``gc.collect``)
    are reported as ``overhead_s`` instead, so small batches are not charged for them.
    """
    geo = adapter.geometry(model)

    def run(items: list[TaskItem], max_new_tokens: int) -> BatchMeasurement:
        errors: list[str | None] = [None] * len(items)
        with _cb_manager(model, eos, pad, spec, [i.prompt_tokens for i in items], max_new_tokens,
                         len(items)) as (manager, overhead):
            sync_device(geo.device)
            t0 = time.perf_counter()
            for k, item in enumerate(items):
                _cb_submit(manager, k, item, max_new_tokens, errors)
            finished = _cb_collect(manager, errors, None)
            sync_device(geo.device)
            end = max((t for _, t in finished.values()), default=time.perf_counter())
        rows = _cb_rows(items, finished, [t0] * len(items), errors, spec, geo)
        # Prefills are chunked and interleaved with decoding: "prefill" lasts until every row
        # has its first token, and decode counts the tokens stamped after that moment.
        stamps = [[t - t0 for t in (out.timestamps or [])] for out, _ in finished.values()]
        firsts = [s[0] for s in stamps if s]
        prefill = max(firsts) if firsts else None
        return BatchMeasurement(
            rows=rows, e2e_s=end - t0, prefill_s=prefill,
            decode_s=end - t0 - prefill if prefill is not None else None,
            decode_tokens=sum(1 for s in stamps for t in s if t > prefill) if prefill is not None else None,
            overhead_s=overhead[0],
        )

    return run


def cb_arrivals(model: Any, eos: list[int], pad: int, spec: HFGenerateBatch) -> Callable[[list[TaskItem], Arrivals, int], BatchMeasurement]:
    """The continuous-batching manager, ``add_request`` at each arrival from a client thread."""
    geo = adapter.geometry(model)

    def run(items: list[TaskItem], arrivals: Arrivals, max_new_tokens: int) -> BatchMeasurement:
        offsets = schedule_times(len(items), arrivals.interval_s)
        submitted: list[float | None] = [None] * len(items)
        errors: list[str | None] = [None] * len(items)
        with _cb_manager(model, eos, pad, spec, [i.prompt_tokens for i in items], max_new_tokens,
                         arrivals.max_batch or len(items)) as (manager, overhead):
            t0 = time.perf_counter()
            thread = start_client(t0, offsets, submitted,
                             lambda k: _cb_submit(manager, k, items[k], max_new_tokens, errors))
            finished = _cb_collect(manager, errors, thread)
            thread.join()
            end = max((t for _, t in finished.values()), default=time.perf_counter())
        rows = _cb_rows(items, finished, submitted, errors, spec, geo)
        return BatchMeasurement(rows=rows, e2e_s=end - t0, overhead_s=overhead[0])

    return run
