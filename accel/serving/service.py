"""``accel.Engine``: the service form — continuous batching behind a thread-safe submit().

One loop thread owns the model and a :class:`~accel.engine.Batch`. Between steps it admits
waiting requests (one batched prefill for all of them, then they join the running batch)
and retires finished or cancelled ones; every step is one verify forward for all live rows.
With ``prefill_chunk`` an admission that finds requests running is spread over loop turns,
one prefill chunk per turn, the running rows stepping once between chunks.
Callers on any thread get a :class:`RequestHandle` whose :meth:`~RequestHandle.stream`
yields each step's newly accepted tokens.

    with accel.Engine(model, strategies=["prompt_lookup"], max_batch=8, tokenizer=tok) as engine:
        handle = engine.submit("Write a haiku about caches.", max_new_tokens=64)
        for delta in handle.stream():
            print(delta.text, end="")
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch

from .. import adapter
from ..api import _as_rows, check_prefill_chunk, check_sampling, make_rows
from ..engine import DEFAULT_MAX_DRAFT, Batch, Plan, Row, Stats, plan_strategies
from ..kernels.compiled import enable as enable_compiled
from ..logprobs import TokenLogprob, check_logprobs
from .prefix import PrefixStore
from ..strategy import Strategy, build_strategies
from ..text import TextStream

#: MiB of prompt entries an Engine keeps for reuse by default (about 5,700 prompt tokens of
#: the default model in float32, 4,600 of Qwen2.5-Coder-1.5B; a prompt larger than this is not kept).
DEFAULT_PREFIX_CACHE_MB = 256

__all__ = ["Engine", "RequestHandle", "Delta", "RequestResult"]


@dataclass
class Delta:
    """What one request gained in one step.

    tokens: the newly accepted token ids; text: their text (incremental, complete
    characters only) when the engine knows a tokenizer, else None; finished / finish_reason
    ("stop", "length", "cancelled" or "error") on the request's last delta; logprobs: the
    tokens' :class:`~accel.logprobs.TokenLogprob` when submitted with ``logprobs=``.
    """

    tokens: list[int]
    text: str | None = None
    finished: bool = False
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token of ``tokens`` when the request asked for them


@dataclass
class RequestResult:
    """A finished request: its generated tokens (and text), why it ended, and its stats."""

    tokens: list[int]
    text: str | None
    finish_reason: str
    prompt_tokens: int
    stats: Stats
    error: str | None = None
    logprobs: list[TokenLogprob] | None = None  # of ``tokens``, when submitted with ``logprobs=``
    prompt_logprobs: list[TokenLogprob | None] | None = None  # of the prompt (None first), with ``prompt_logprobs=``


_END = object()


@dataclass
class _Admission:
    """Requests being prefilled chunk by chunk between the running batch's steps."""

    handles: list["RequestHandle"]
    generators: list[torch.Tensor | None]  # their samplers' states before the prefill (to retry)
    steps: Any  # Batch.admitting(...): one prefill forward per next()


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None where the C library has none (not glibc)."""
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None


def _trim_heap() -> None:
    """Hand the C heap's free pages back to the system. Tensors a batch frees (activations,
    retired rows' caches) otherwise stay in glibc's heap, so an idle engine's resident memory
    keeps the high-water mark of its busiest batches (hundreds of MiB for the default model at
    16 rows). The Engine calls it each time its last request ends."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def _unadmitted(row: Row, generator_state: torch.Tensor | None) -> None:
    """Undo what a failed :meth:`Batch.admit` may have done to ``row`` (its first token, stats,
    drafter states, random draws), so that it can be admitted again."""
    row.generated.clear()
    row.generated_logprobs = []
    row.finish_reason = None
    row.tokens = row.hidden = row.features = None
    row.states = []
    row.stats = Stats()
    if generator_state is not None:
        row.generator.set_state(generator_state)


def _ignore(item: Any) -> None:  # the callback of a request whose own callback raised
    pass


@dataclass(eq=False)
class RequestHandle:
    """A submitted request. Thread-safe; its deltas go to one reader: ``stream()``, or a
    callback given to :meth:`on_delta`."""

    id: int
    row: Row = field(repr=False)
    _text: TextStream | None = field(default=None, repr=False)
    _queue: "queue.Queue[Any]" = field(default_factory=queue.Queue, repr=False)
    _done: threading.Event = field(default_factory=threading.Event, repr=False)
    _cancel: threading.Event = field(default_factory=threading.Event, repr=False)
    _result: RequestResult | None = field(default=None, repr=False)
    _listener: Callable[[Delta | None], None] | None = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def stream(self, timeout: float | None = None) -> Iterator[Delta]:
        """Yield :class:`Delta` objects as the engine accepts tokens, until the request ends.

        timeout: seconds to wait for the next delta at most (None: no limit); raises
        ``TimeoutError`` when it passes. Not after :meth:`on_delta` (RuntimeError).
        """
        if self._listener is not None:
            raise RuntimeError(f"request {self.id}: its deltas go to an on_delta callback")
        while True:
            try:
                item = self._queue.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"request {self.id}: no tokens within {timeout} s") from None
            if item is _END:
                return
            yield item

    def on_delta(self, callback: Callable[[Delta | None], None]) -> None:
        """Hand this request's deltas to ``callback`` instead of :meth:`stream`: each
        :class:`Delta` as the engine produces it (those produced before this call at once, in
        order), then ``None`` once the request has ended. It runs on the engine's thread, between
        steps, so it must be quick: hand the delta over (``loop.call_soon_threadsafe`` into an
        asyncio queue) rather than work on it. A callback that raises cancels the request (its
        reader is gone) and gets nothing more. One callback per request; a server uses it
        instead of a thread per request blocked in ``stream()``.
        """
        with self._lock:
            if self._listener is not None:
                raise RuntimeError(f"request {self.id} already has an on_delta callback")
            self._listener = callback
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if not self._call(item):
                    break

    def _put(self, item: Any) -> None:
        """Deliver one delta (or the end): to the callback if there is one, else to ``stream()``."""
        with self._lock:
            if self._listener is None:
                self._queue.put(item)
                return
        self._call(item)

    def _call(self, item: Any) -> bool:
        try:
            self._listener(None if item is _END else item)
            return True
        except Exception:  # the reader is gone: stop the request, deliver nothing more
            self._listener = _ignore
            self._cancel.set()
            return False

    def result(self, timeout: float | None = None) -> RequestResult:
        """Wait for the request to end and return its :class:`RequestResult`."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.id} did not finish within {timeout} s")
        return self._result

    def cancel(self) -> None:
        """Stop the request; its rows are freed before the next step."""
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    @property
    def done(self) -> bool:
        return self._done.is_set()


class Engine:
    """Continuous batching for services.

    Args:
        model: a transformers causal LM; the engine's thread runs every forward on it.
        strategies: the default strategies of every request (a request may give its own).
        max_batch: the most requests decoded together; more wait for a free row.
        tokenizer: lets requests be text and deltas carry text.
        max_draft_tokens: the most draft nodes a row verifies per step (None: sized to the
            cache and the batch).
        eos_token_id: default stop token(s); default the model's generation config.
        prefix_cache_mb: MiB of recent prompts' KV entries kept, so that a prompt that starts
            like an earlier one (the chat template's system turn, the previous turn of a
            conversation, a retry) is prefilled only past the shared tokens (see
            :mod:`accel.serving.prefix`; float32 models, rows without prompt compression); 0: off.
        compile: ``"on"``, ``"auto"`` or ``"off"``: decode and verify steps as one compiled
            graph (:func:`accel.kernels.compiled.enable`); None (default): as the model was
            loaded (``load_model(..., compile=)``).
        prefill_chunk: prompt tokens per prefill forward (None: each admission's prompts in one
            forward), see :func:`accel.steps.prefill`. Requests arriving while others run are
            then prefilled one chunk per loop turn, each turn also stepping the running
            requests once: a long prompt no longer stalls the streams for its whole prefill.
    """

    def __init__(self, model: Any, strategies: Sequence[Strategy | str | dict] | None = (), *, max_batch: int = 8,
                 tokenizer: Any = None, max_draft_tokens: int | None = DEFAULT_MAX_DRAFT,
                 eos_token_id: int | list[int] | None = None, prefix_cache_mb: float = DEFAULT_PREFIX_CACHE_MB,
                 compile: str | None = None, prefill_chunk: int | None = None):
        adapter.check_causal_lm(model)
        check_prefill_chunk(prefill_chunk)
        if compile is not None:  # else as the model was loaded
            enable_compiled(model, compile)
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be an integer >= 1, got {max_batch!r}")
        if isinstance(prefix_cache_mb, bool) or not isinstance(prefix_cache_mb, (int, float)) or not (
                0 <= prefix_cache_mb < float("inf")):
            raise ValueError(f"prefix_cache_mb must be a number >= 0, got {prefix_cache_mb!r}")
        self.prefixes = PrefixStore(int(prefix_cache_mb * 2**20)) if prefix_cache_mb else None
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch = max_batch
        self.plan = self._plan(strategies)
        self.eos = adapter.default_eos(model, tokenizer) if eos_token_id is None else (
            [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id))
        self._batch = Batch(model, max_draft=max_draft_tokens, row_capacity=max_batch, prefixes=self.prefixes,
                            prefill_chunk=prefill_chunk)
        self._waiting: "queue.Queue[RequestHandle]" = queue.Queue()
        self._live: list[RequestHandle] = []
        self._admission: _Admission | None = None  # a chunked admission under way (prefill_chunk)
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = threading.Event()
        self._counters = dict(requests_total=0, tokens_generated=0, verify_steps=0, accepted_tokens=0,
                              batch_rows_stepped=0, prefills=0, prefill_seconds=0.0, step_seconds=0.0)
        self._thread = threading.Thread(target=self._loop, name="accel-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ public

    def _plan(self, strategies) -> Plan:
        plan = plan_strategies(build_strategies(strategies))
        if plan.tier is not None:
            raise ValueError(f"strategies: {plan.tier.name} (a tiered cache) is not served by accel.Engine yet; "
                             "use accel.generate / accel.stream")
        plan.check(self.model)
        return plan

    def submit(self, prompt: str | Sequence[int] | torch.Tensor, *, max_new_tokens: int = 128,
               temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
               seed: int | None = None, eos_token_id: int | list[int] | None = None,
               strategies: Sequence[Strategy | str | dict] | None = None, logprobs: int | None = None,
               prompt_logprobs: int | None = None) -> RequestHandle:
        """Queue one request; safe from any thread. Bad input raises here (ValueError /
        ``StrategyError`` naming the field), before anything is queued.

        prompt: text (needs the engine's tokenizer), token ids, or a LongTensor [n].
        strategies: this request's strategies instead of the engine's (None: the engine's).
        logprobs: report each generated token's log-probability and this many alternatives
            (0..20) in its :class:`Delta` and the result (None: off). See :mod:`accel.logprobs`.
        prompt_logprobs: the same for the prompt's tokens, in the result (None for the first
            token); such a prompt reuses no cached prefix.
        """
        if self._closed.is_set():
            raise RuntimeError("the engine is closed")
        check_sampling(max_new_tokens, temperature, top_k, top_p)
        check_logprobs(logprobs, "logprobs")
        check_logprobs(prompt_logprobs, "prompt_logprobs")
        plan = self.plan if strategies is None else self._plan(strategies)
        if isinstance(prompt, torch.Tensor) and prompt.dim() == 1:
            prompt = prompt.unsqueeze(0)
        rows = _as_rows(prompt, self.tokenizer, None)
        if len(rows) != 1:
            raise ValueError(f"submit() takes one prompt, got {len(rows)}; submit each one")
        eos = self.eos if eos_token_id is None else ([eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id))
        (row,) = make_rows(self.model, rows, plan, max_new_tokens=max_new_tokens, temperature=temperature,
                           top_k=top_k, top_p=top_p, eos=eos, seed=seed)
        row.logprobs, row.prompt_logprobs = logprobs, prompt_logprobs
        handle = RequestHandle(id=next(self._ids), row=row,
                               _text=TextStream(self.tokenizer) if self.tokenizer is not None else None)
        row.tag = handle
        with self._lock:  # with close(): queued before the loop's last drain, or refused
            if self._closed.is_set():
                raise RuntimeError("the engine is closed")
            self._counters["requests_total"] += 1
            self._waiting.put(handle)
        self._wake.set()
        return handle

    @property
    def alive(self) -> bool:
        """Whether the loop thread is running (False once closed)."""
        return self._thread.is_alive() and not self._closed.is_set()

    def metrics(self) -> dict[str, Any]:
        """Counters for monitoring: requests, tokens, steps, acceptance, occupancy, KV bytes."""
        with self._lock:
            c = dict(self._counters)
            live = len(self._live)
        steps = c["verify_steps"]
        c.update(
            requests_running=live,
            requests_waiting=self._waiting.qsize(),
            mean_accepted=(c["accepted_tokens"] + c["batch_rows_stepped"]) / c["batch_rows_stepped"]
            if c["batch_rows_stepped"] else 0.0,
            batch_occupancy=c["batch_rows_stepped"] / (steps * self.max_batch) if steps else 0.0,
            kv_bytes=self._batch.cache.kept_bytes(),
            max_batch=self.max_batch,
            prefix_hits=self.prefixes.hits if self.prefixes is not None else 0,
            prefix_tokens_reused=self.prefixes.reused_tokens if self.prefixes is not None else 0,
            prefix_cache_bytes=self.prefixes.nbytes if self.prefixes is not None else 0,
        )
        return c

    def close(self, timeout: float | None = 30.0) -> None:
        """Stop the loop thread; requests still running or waiting end as 'cancelled'."""
        with self._lock:
            self._closed.set()
        self._wake.set()
        self._thread.join(timeout)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ the loop

    def _loop(self) -> None:
        try:
            while not self._closed.is_set():
                try:
                    self._serve()
                except Exception as err:  # a failed step fails the requests in it, not the service
                    message = f"{type(err).__name__}: {err}"
                    for h in list(self._live) + self._admitting():
                        self._finish(h, "error", error=message)
                    with self._lock:
                        self._live.clear()
                    if self.prefixes is not None:  # entries of the failed step's prompts are not trusted
                        self.prefixes.clear()
                    self._batch = Batch(self.model, max_draft=self._batch.max_draft, row_capacity=self.max_batch,
                                        costs=self._batch.costs, prefixes=self.prefixes,
                                        prefill_chunk=self._batch.prefill_chunk)
        finally:
            for h in self._live + self._admitting() + self._drain():
                self._finish(h, "cancelled")

    def _serve(self) -> None:
        """Admit, step and retire until the engine closes (or a step raises)."""
        stepped = False  # since the engine last went idle
        with adapter.packed_gqa_attention(self.model), adapter.per_layer_masks(self.model, self._batch.cache):
            while not self._closed.is_set():
                self._drop_cancelled()
                admitted = self._admit()
                self._drop_cancelled()  # cancelled during their prefill: freed before any step
                if not self._live:
                    if not admitted:
                        if stepped:  # the last request just ended: give back what the batch freed
                            _trim_heap()
                            stepped = False
                        self._wake.wait(0.05)
                        self._wake.clear()
                    continue
                stepped = True
                t0 = time.perf_counter()
                with torch.inference_mode():
                    new = self._batch.step()
                self._count("step_seconds", time.perf_counter() - t0)
                self._deliver(list(zip(self._batch.rows, new)))

    def _drain(self) -> list[RequestHandle]:
        out = []
        while True:
            try:
                out.append(self._waiting.get_nowait())
            except queue.Empty:
                return out

    def _admitting(self) -> list[RequestHandle]:
        """The requests of the admission under way (none after this call)."""
        admission, self._admission = self._admission, None
        return admission.handles if admission is not None else []

    def _admit(self) -> bool:
        """Admit waiting requests, or advance the admission under way by one prefill forward;
        returns whether it did any work.

        With ``prefill_chunk`` and requests running, new requests are prefilled one chunk per
        call, and the loop steps the running batch between calls (:meth:`Batch.admitting`):
        running streams keep stepping while a long prompt prefills. Otherwise an admission
        runs whole in one call."""
        if self._admission is not None:
            return self._advance()
        room = self.max_batch - len(self._live)
        new: list[RequestHandle] = []
        while room > len(new):
            try:
                h = self._waiting.get_nowait()
            except queue.Empty:
                break
            if h.cancelled:
                self._finish(h, "cancelled")
                continue
            if h.row.max_new_tokens == 0 and h.row.prompt_logprobs is None:  # nothing to compute
                h.row.stats.prompt_tokens = int(h.row.prompt.numel())
                self._finish(h, "length")
                continue
            h.row.started = time.perf_counter()
            new.append(h)
        if not new:
            return False
        if self._batch.prefill_chunk is not None and self._live:
            generators = [h.row.generator.get_state() if h.row.generator is not None else None for h in new]
            self._admission = _Admission(new, generators, self._batch.admitting([h.row for h in new]))
            return self._advance()
        self._join(self._prefill(new))
        return True

    def _advance(self) -> bool:
        """One prefill forward of the admission under way; at its end the requests join."""
        admission = self._admission
        t0 = time.perf_counter()
        try:
            with torch.inference_mode():
                next(admission.steps)
            self._count("prefill_seconds", time.perf_counter() - t0)
            return True
        except StopIteration:
            self._admission = None
            self._count("prefill_seconds", time.perf_counter() - t0)
            self._count("prefills", 1)
            self._join(admission.handles)
        except Exception as err:  # as _prefill: the running batch is untouched; each request is tried alone
            self._admission = None
            for h, state in zip(admission.handles, admission.generators):
                _unadmitted(h.row, state)
            if len(admission.handles) > 1:
                self._join([h for one in admission.handles for h in self._prefill([one])])
            else:
                self._finish(admission.handles[0], "error", error=f"{type(err).__name__}: {err}")
        return True

    def _join(self, new: list[RequestHandle]) -> None:
        """Requests whose prefill ended join the running ones; their first tokens go out."""
        with self._lock:
            self._live.extend(new)
        self._deliver([(h.row, list(h.row.generated)) for h in new], count_step=False)

    def _prefill(self, new: list[RequestHandle]) -> list[RequestHandle]:
        """Prefill ``new`` together into the batch; returns those admitted. If that raises, the
        running batch is untouched and each request is tried alone, so a request whose prefill
        fails (its compressor or drafter raising, a prompt too large for memory) ends with its
        error and the requests that arrived with it are served."""
        generators = [h.row.generator.get_state() if h.row.generator is not None else None for h in new]
        t0 = time.perf_counter()
        try:
            with torch.inference_mode():
                self._batch.admit([h.row for h in new])
        except Exception as err:
            for h, state in zip(new, generators):  # back as submitted: the prefill may have emitted
                _unadmitted(h.row, state)
            if len(new) > 1:
                return [h for one in new for h in self._prefill([one])]
            self._finish(new[0], "error", error=f"{type(err).__name__}: {err}")
            return []
        self._count("prefill_seconds", time.perf_counter() - t0)
        self._count("prefills", 1)
        return new

    def _count(self, name: str, amount: float) -> None:
        with self._lock:
            self._counters[name] += amount

    def _deliver(self, pairs: list[tuple[Row, list[int]]], count_step: bool = True) -> None:
        accepted = 0
        for row, new in pairs:
            h: RequestHandle = row.tag
            if new:
                text = h._text.push(new, final=row.done) if h._text is not None else None
                lps = row.generated_logprobs[-len(new):] if row.logprobs is not None else None
                h._put(Delta(list(new), text, logprobs=lps))
            if count_step:
                accepted += row.stats.accepted_per_step[-1] if row.stats.accepted_per_step else 0
        with self._lock:
            self._counters["tokens_generated"] += sum(len(n) for _, n in pairs)
            if count_step:
                self._counters["verify_steps"] += 1
                self._counters["batch_rows_stepped"] += len(pairs)
                self._counters["accepted_tokens"] += accepted
        for row, _ in pairs:
            if row.done:
                error = None if row.error is None else f"{type(row.error).__name__}: {row.error}"
                self._retire(row.tag, row.finish_reason, error)

    def _drop_cancelled(self) -> None:
        for h in [h for h in self._live if h.cancelled]:
            self._retire(h, "cancelled")

    def _retire(self, h: RequestHandle, reason: str, error: str | None = None) -> None:
        with torch.inference_mode():
            self._batch.retire(h.row)
        with self._lock:
            self._live.remove(h)
        self._finish(h, reason, error)

    def _finish(self, h: RequestHandle, reason: str, error: str | None = None) -> None:
        if h.done:
            return
        row = h.row
        if row.finish_reason is None:
            row.finish_reason = reason
        row.stats.new_tokens = len(row.generated)
        text = h._text.text if h._text is not None else None
        if h._text is not None:
            tail = h._text.push([], final=True)
            if tail:
                h._put(Delta([], tail))
        h._result = RequestResult(tokens=list(row.generated), text=text, finish_reason=row.finish_reason,
                                  prompt_tokens=int(row.prompt.numel()), stats=row.stats, error=error,
                                  logprobs=list(row.generated_logprobs) if row.logprobs is not None else None,
                                  prompt_logprobs=row.prompt_logprob_list)
        h._put(Delta([], "" if h._text is not None else None, True, row.finish_reason))
        h._put(_END)
        row.tag = None  # break the row <-> handle cycle: a finished request is freed by reference counting
        h._done.set()
