"""How each configuration runs a batch of items, and requests arriving over time.

A batched call returns a :class:`BatchMeasurement`: the call's wall time and, per row, the
new tokens, time to first token and latency (both from the call's start), KV bytes and
acceptance. An arrivals run returns the same, with times counted from each request's submit.

- accel runs: ``accel.generate`` on the left-padded batch with its attention mask (per-row
  times from ``result.row_stats``); arrivals: ``accel.Engine(max_batch=...)``, a client
  thread submitting, one consumer thread per request timestamping its stream.
- ``hf_generate``: one ``model.generate`` call on the left-padded batch; a streamer
  timestamps every step, so a row's first token and its last (its eos, or max_new_tokens)
  each have a time. Arrivals: static batching, the requests that have arrived (up to
  ``max_batch``) run as one such call while later ones wait for it.
- ``hf_generate_batch``: transformers' continuous batching, the ``init_continuous_batching``
  manager that ``model.generate_batch`` wraps: a batch is every request queued at once,
  arrivals ``add_request`` from a client thread; per-token timestamps (``record_timestamps``)
  give first-token times. The manager's setup and stop are kept out of the timed window
  (``overhead_s``). Its paged cache is sized to the workload (``num_blocks``): left to itself
  on CPU it would allocate 60% of the machine's RAM.
"""

from __future__ import annotations

import math
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

from .. import adapter
from ..strategy import Strategy
from .schema import Arrivals, HFGenerateBatch
from .tasks import TaskItem

__all__ = [
    "RowResult",
    "BatchMeasurement",
    "ChunkTimer",
    "cut_at_eos",
    "sync_device",
    "left_pad",
    "percentile",
    "hf_generate_batched",
    "hf_static_batches",
    "cb_batch",
    "cb_arrivals",
    "cb_probe",
    "accel_batched",
    "accel_arrivals",
]


@dataclass
class RowResult:
    """One row of a batched call (or one request of an arrivals run)."""

    new_ids: list[int]
    first_token_s: float | None  # call start (arrivals: submit) -> first new token
    latency_s: float | None  # call start (arrivals: submit) -> last new token
    kv_bytes_kept: int = 0
    kv_bytes_full: int = 0
    verify_steps: int = 0
    accepted_per_step: list[int] = field(default_factory=list)
    error: str | None = None


@dataclass
class BatchMeasurement:
    """One batched call (or one arrivals run).

    e2e_s: the whole call (arrivals: first submit -> last completion). prefill_s / decode_s:
    until every row has its first token / after that (None where the method has no such
    split); decode_tokens: the tokens emitted in decode_s.
    """

    rows: list[RowResult]
    e2e_s: float
    prefill_s: float | None = None
    decode_s: float | None = None
    decode_tokens: int | None = None
    overhead_s: float | None = None  # set-up / tear-down outside e2e_s (hf_generate_batch's manager)

    @property
    def new_tokens(self) -> int:
        return sum(len(r.new_ids) for r in self.rows)


# --------------------------------------------------------------------------- helpers


def sync_device(device: torch.device) -> None:
    """Wait for queued CUDA work, so wall-clock times include it (no-op elsewhere)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cut_at_eos(ids: list[int], eos: list[int]) -> list[int]:
    """``ids`` up to and including the first eos (``model.generate`` pads finished rows)."""
    for k, t in enumerate(ids):
        if t in eos:
            return ids[: k + 1]
    return ids


def percentile(xs: list[float], q: float) -> float | None:
    """The q-th percentile (0-100) of ``xs``, linearly interpolated; None if empty."""
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


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


def _error(err: BaseException) -> str:
    return f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"


class ChunkTimer:
    """A transformers streamer that timestamps each step's new tokens, for any batch size.

    ``model.generate`` puts the prompt first ([B, n]), then each step's tokens ([B] for greedy
    decoding, [B, k] for assisted decoding): ``chunks`` holds (seconds since ``start()``,
    tokens per row) for every step.
    """

    def __init__(self, rows: int = 1) -> None:
        self.rows = rows
        self.t0 = 0.0
        self.chunks: list[tuple[float, int]] = []
        self._prompt_seen = False

    def start(self) -> None:
        self.t0 = time.perf_counter()

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.chunks.append((time.perf_counter() - self.t0, max(1, int(value.numel()) // self.rows)))

    def end(self) -> None:
        pass

    def time_of_token(self, k: int) -> float | None:
        """When a row's k-th new token (0-based) came out, or None if it never did."""
        seen = 0
        for t, n in self.chunks:
            seen += n
            if seen > k:
                return t
        return None


@contextmanager
def _attention_restored(model: Any) -> Iterator[None]:
    """Whatever continuous batching switches the attention to, put the model's own back."""
    original = model.config._attn_implementation
    try:
        yield
    finally:
        if model.config._attn_implementation != original:
            model.set_attn_implementation(original)


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


def _schedule_times(requests: int, interval_s: float) -> list[float]:
    return [k * interval_s for k in range(requests)]


def _client(t0: float, offsets: list[float], submitted: list[float | None],
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
        offsets = _schedule_times(len(items), arrivals.interval_s)
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
                    rows[j] = RowResult(new_ids=[], first_token_s=None, latency_s=None, error=_error(err))
            k += len(take)
        e2e = time.perf_counter() - t0
        return BatchMeasurement(rows=[r for r in rows if r is not None], e2e_s=e2e)

    return run


# --------------------------------------------------------------------------- hf_generate_batch


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
        return None, f"continuous batching does not run here ({_error(err)})"
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
        errors[k] = _error(err)


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
        offsets = _schedule_times(len(items), arrivals.interval_s)
        submitted: list[float | None] = [None] * len(items)
        errors: list[str | None] = [None] * len(items)
        with _cb_manager(model, eos, pad, spec, [i.prompt_tokens for i in items], max_new_tokens,
                         arrivals.max_batch or len(items)) as (manager, overhead):
            t0 = time.perf_counter()
            thread = _client(t0, offsets, submitted,
                             lambda k: _cb_submit(manager, k, items[k], max_new_tokens, errors))
            finished = _cb_collect(manager, errors, thread)
            thread.join()
            end = max((t for _, t in finished.values()), default=time.perf_counter())
        rows = _cb_rows(items, finished, submitted, errors, spec, geo)
        return BatchMeasurement(rows=rows, e2e_s=end - t0, overhead_s=overhead[0])

    return run


# --------------------------------------------------------------------------- accel


def accel_batched(model: Any, strategies: list[Strategy], eos: list[int], pad: int,
                  max_draft: int | None) -> Callable[[list[TaskItem], int], BatchMeasurement]:
    """``accel.generate`` on the left-padded batch with its attention mask."""
    import accel

    geo = adapter.geometry(model)

    def run(items: list[TaskItem], max_new_tokens: int) -> BatchMeasurement:
        ids, mask = left_pad(items, pad, geo.device)
        sync_device(geo.device)
        t0 = time.perf_counter()
        result = accel.generate(model, ids, attention_mask=mask, strategies=strategies, max_new_tokens=max_new_tokens,
                                eos_token_id=eos, max_draft_tokens=max_draft)
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


def accel_arrivals(model: Any, strategies: list[Strategy], eos: list[int],
                   max_draft: int | None) -> Callable[[list[TaskItem], Arrivals, int], BatchMeasurement]:
    """``accel.Engine``: a client thread submits at each arrival; a consumer thread per
    request timestamps its first tokens and its end, as a service's caller would see them."""
    import accel

    def run(items: list[TaskItem], arrivals: Arrivals, max_new_tokens: int) -> BatchMeasurement:
        max_batch = arrivals.max_batch or len(items)
        offsets = _schedule_times(len(items), arrivals.interval_s)
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
                errors[k] = _error(err)

        with accel.Engine(model, strategies=strategies, max_batch=max_batch, eos_token_id=eos,
                          max_draft_tokens=max_draft) as engine:
            def submit(k: int) -> None:
                try:
                    handle = engine.submit(items[k].input_ids[0], max_new_tokens=max_new_tokens)
                except Exception as err:
                    errors[k] = _error(err)
                    return
                thread = threading.Thread(target=consume, args=(k, handle), name=f"bench-consumer-{k}", daemon=True)
                consumers.append(thread)
                thread.start()

            t0 = time.perf_counter()
            _client(t0, offsets, submitted, submit).join()
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
