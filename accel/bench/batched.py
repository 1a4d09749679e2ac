"""How a configuration runs a batch of items, and requests arriving over time.

A batched call returns a :class:`~.measurement.BatchMeasurement`: the call's wall time and,
per row, the new tokens, time to first token and latency (both from the call's start), KV
bytes and acceptance. An arrivals run returns the same, with times counted from each
request's submit.

- accel runs: ``accel.generate`` on the left-padded batch with its attention mask (per-row
  times from ``result.row_stats``); arrivals: ``accel.Engine(max_batch=...)``, a client
  thread submitting, one consumer thread per request timestamping its stream.
- ``hf_generate``: one ``model.generate`` call on the left-padded batch; a streamer
  timestamps every step, so a row's first token and its last (its eos, or max_new_tokens)
  each have a time. Arrivals: static batching, the requests that have arrived (up to
  ``max_batch``) run as one such call while later ones wait for it.
- ``hf_generate_batch``: transformers' continuous batching, in :mod:`.continuous_batching`.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

import torch

from .. import adapter
from ..strategy import Strategy
from .measurement import BatchMeasurement, ChunkTimer, RowResult, cut_at_eos, error_line, sync_device
from .schema import Arrivals
from .tasks import TaskItem

__all__ = [
    "left_pad",
    "schedule_times",
    "start_client",
    "hf_generate_batched",
    "hf_static_batches",
    "accel_batched",
    "accel_arrivals",
]


# --------------------------------------------------------------------------- helpers


def left_pad(items: list[TaskItem], pad: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The items' prompts, left-padded with ``pad``: (input_ids [B, n], attention_mask [B, n])."""
    n = max(i.prompt_tokens for i in items)
    ids = torch.full((len(items), n), pad, dtype=torch.long, device=device)
    mask = torch.zeros((len(items), n), dtype=torch.long, device=device)
    for b, item in enumerate(items):
        p = item.prompt_tokens
        ids[b, n - p:] = item.input_ids[0].to(device)
        mask[b, n - p:] = 1
    return ids, mask


# --------------------------------------------------------------------------- hf_generate


def hf_generate_batched(model: Any, eos: list[int], pad: int) -> Callable[[list[TaskItem], int], BatchMeasurement]:
    """One ``model.generate`` call on the left-padded batch (greedy)."""
    geo = adapter.geometry(model)

    def run(items: list[TaskItem], max_new_tokens: int) -> BatchMeasurement:
        ids, mask = left_pad(items, pad, geo.device)
        timer = ChunkTimer(rows=len(items))
        sync_device(geo.device)
        timer.start()
        out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens,
                             eos_token_id=eos or None, pad_token_id=pad, streamer=timer)
        sync_device(geo.device)
        e2e = time.perf_counter() - timer.t0
        n = ids.shape[1]
        steps = out.shape[1] - n
        rows = []
        for b, item in enumerate(items):
            new = cut_at_eos(out[b, n:].tolist(), eos)
            full = geo.entry_bytes() * (item.prompt_tokens + max(len(new) - 1, 0))
            rows.append(RowResult(
                new_ids=new, first_token_s=timer.time_of_token(0) if new else None,
                latency_s=timer.time_of_token(len(new) - 1) if new else None,
                # The padded cache holds every row at the batch's length for every step.
                kv_bytes_kept=geo.entry_bytes() * (n + max(steps - 1, 0)), kv_bytes_full=full,
                verify_steps=max(len(new) - 1, 0), accepted_per_step=[0] * max(len(new) - 1, 0),
            ))
        first = timer.chunks[0][0] if timer.chunks else e2e
        return BatchMeasurement(rows=rows, e2e_s=e2e, prefill_s=first, decode_s=e2e - first,
                                decode_tokens=sum(max(len(r.new_ids) - 1, 0) for r in rows))

    return run


def schedule_times(requests: int, interval_s: float) -> list[float]:
    return [k * interval_s for k in range(requests)]


def start_client(t0: float, offsets: list[float], submitted: list[float | None],
            submit: Callable[[int], None]) -> threading.Thread:
    """A started client thread that calls ``submit(k)`` at ``t0 + offsets[k]`` (perf-counter
    seconds), stamping ``submitted[k]`` just before."""

    def replay() -> None:
        for k, at in enumerate(offsets):
            wait = t0 + at - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            submitted[k] = time.perf_counter()
            submit(k)

    thread = threading.Thread(target=replay, name="bench-client", daemon=True)
    thread.start()
    return thread


def hf_static_batches(model: Any, eos: list[int], pad: int) -> Callable[[list[TaskItem], Arrivals, int], BatchMeasurement]:
    """Arrivals for ``model.generate``: static batching.

    Whenever the model is free, the requests that have arrived (at most ``max_batch``) run as
    one left-padded ``model.generate`` call; requests arriving meanwhile wait for it to end.
    The bench plays the client (arrival times are fixed in advance), so no thread is needed.
    """
    batched = hf_generate_batched(model, eos, pad)

    def run(items: list[TaskItem], arrivals: Arrivals, max_new_tokens: int) -> BatchMeasurement:
        max_batch = arrivals.max_batch or len(items)
        offsets = schedule_times(len(items), arrivals.interval_s)
        rows: list[RowResult | None] = [None] * len(items)
        t0 = time.perf_counter()
        k = 0
        while k < len(items):
            wait = t0 + offsets[k] - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            now = time.perf_counter() - t0
            take = [k] + [j for j in range(k + 1, len(items)) if offsets[j] <= now][: max_batch - 1]
            start = time.perf_counter() - t0
            try:
                m = batched([items[j] for j in take], max_new_tokens)
                for j, row in zip(take, m.rows):
                    shift = start - offsets[j]  # waiting since its arrival
                    row.first_token_s = None if row.first_token_s is None else row.first_token_s + shift
                    row.latency_s = None if row.latency_s is None else row.latency_s + shift
                    rows[j] = row
            except Exception as err:  # the batch fails, the run goes on
                for j in take:
                    rows[j] = RowResult(new_ids=[], first_token_s=None, latency_s=None, error=error_line(err))
            k += len(take)
        e2e = time.perf_counter() - t0
        return BatchMeasurement(rows=[r for r in rows if r is not None], e2e_s=e2e)

    return run



# --------------------------------------------------------------------------- accel


def accel_batched(model: Any, strategies: list[Strategy], eos: list[int], pad: int,
                  max_draft: int | None, prefill_chunk: int | None = None
                  ) -> Callable[[list[TaskItem], int], BatchMeasurement]:
    """``accel.generate`` on the left-padded batch with its attention mask."""
    import accel

    geo = adapter.geometry(model)

    def run(items: list[TaskItem], max_new_tokens: int) -> BatchMeasurement:
        ids, mask = left_pad(items, pad, geo.device)
        sync_device(geo.device)
        t0 = time.perf_counter()
        result = accel.generate(model, ids, attention_mask=mask, strategies=strategies, max_new_tokens=max_new_tokens,
                                eos_token_id=eos, max_draft_tokens=max_draft, prefill_chunk=prefill_chunk)
        sync_device(geo.device)
        e2e = time.perf_counter() - t0
        n = ids.shape[1]  # new tokens start after the longest prompt
        rows = []
        for b, rs in enumerate(result.row_stats):
            rows.append(RowResult(
                new_ids=result.sequences[b, n:n + rs.new_tokens].tolist(), first_token_s=rs.first_token_s,
                latency_s=rs.latency_s, kv_bytes_kept=rs.kv_bytes_kept, kv_bytes_full=rs.kv_bytes_full,
                verify_steps=rs.verify_steps, accepted_per_step=list(rs.accepted_per_step),
            ))
        st = result.stats
        return BatchMeasurement(rows=rows, e2e_s=e2e, prefill_s=st.prefill_s, decode_s=st.decode_s,
                                decode_tokens=st.decode_tokens)

    return run


def accel_arrivals(model: Any, strategies: list[Strategy], eos: list[int], max_draft: int | None,
                   prefill_chunk: int | None = None) -> Callable[[list[TaskItem], Arrivals, int], BatchMeasurement]:
    """``accel.Engine``: a client thread submits at each arrival; a consumer thread per
    request timestamps its first tokens and its end, as a service's caller would see them."""
    import accel

    def run(items: list[TaskItem], arrivals: Arrivals, max_new_tokens: int) -> BatchMeasurement:
        max_batch = arrivals.max_batch or len(items)
        offsets = schedule_times(len(items), arrivals.interval_s)
        submitted: list[float | None] = [None] * len(items)
        first: list[float | None] = [None] * len(items)
        ended: list[float | None] = [None] * len(items)
        results: list[Any] = [None] * len(items)
        errors: list[str | None] = [None] * len(items)
        consumers: list[threading.Thread] = []

        def consume(k: int, handle: Any) -> None:
            try:
                for delta in handle.stream():
                    if delta.tokens and first[k] is None:
                        first[k] = time.perf_counter()
                ended[k] = time.perf_counter()
                results[k] = handle.result()
            except Exception as err:
                errors[k] = error_line(err)

        with accel.Engine(model, strategies=strategies, max_batch=max_batch, eos_token_id=eos,
                          max_draft_tokens=max_draft, prefill_chunk=prefill_chunk) as engine:
            def submit(k: int) -> None:
                try:
                    handle = engine.submit(items[k].input_ids[0], max_new_tokens=max_new_tokens)
                except Exception as err:
                    errors[k] = error_line(err)
                    return
                thread = threading.Thread(target=consume, args=(k, handle), name=f"bench-consumer-{k}", daemon=True)
                consumers.append(thread)
                thread.start()

            t0 = time.perf_counter()
            start_client(t0, offsets, submitted, submit).join()
            for thread in consumers:
                thread.join()
            end = max((t for t in ended if t is not None), default=time.perf_counter())
        rows = []
        for k in range(len(items)):
            res = results[k]
            if res is None or submitted[k] is None:
                rows.append(RowResult(new_ids=[], first_token_s=None, latency_s=None, error=errors[k] or "no result"))
                continue
            error = errors[k] or res.error
            if error is None and res.finish_reason not in ("stop", "length"):
                error = f"finished: {res.finish_reason}"
            st = res.stats
            rows.append(RowResult(
                new_ids=list(res.tokens), first_token_s=first[k] - submitted[k] if first[k] is not None else None,
                latency_s=ended[k] - submitted[k] if ended[k] is not None else None,
                kv_bytes_kept=st.kv_bytes_kept, kv_bytes_full=st.kv_bytes_full, verify_steps=st.verify_steps,
                accepted_per_step=list(st.accepted_per_step), error=error,
            ))
        return BatchMeasurement(rows=rows, e2e_s=end - t0)

    return run
