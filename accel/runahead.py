"""KV-Runahead (Cho et al. 2024): the prefill of a long prompt over several processes.

The prompt is cut into contiguous chunks, one per rank. Rank r runs its chunk through the
model on top of the entries of the chunks before it, which rank r - 1 hands it layer by layer:
as soon as rank r - 1 has run decoder layer l it sends that layer's keys and values of every
position up to its chunk's end, and rank r, which has computed its own chunk's input to layer l
meanwhile, copies them in before its layer l attends. The ranks thus run at once, each a layer
or so behind the one before. The last rank is the calling process: its cache ends up holding
the whole prompt, and decoding goes on from it as after any prefill (prompt compressors select
on it, with the observation window's queries taken in its chunk, as a chunked prefill does:
:func:`accel.steps.prefill`).

Chunk boundaries come from :func:`partition`: ``"balanced"`` gives every rank the same work
by the attention cost model (a token's linear layers cost the same anywhere; its attention
grows with its position, so later chunks are shorter), ``"even"`` the same number of tokens.

Helper ranks are processes started once per :class:`PrefillRanks` (``spawn``; the model's
weights are shared with them through shared memory, not copied), joined by a gloo process
group of their own (the caller's default group, if any, is left alone). ``accel.generate(...,
prefill_ranks=N)`` keeps one group per model and N; a rank that dies or fails ends the call
with a RuntimeError within ``timeout_s``, and the next call starts a new group.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import queue
import sys
import time
import weakref
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from . import adapter
from .cache import SharedCache
from .steps import forward_tokens

__all__ = ["SPLITS", "PrefillRanks", "RankReport", "chunk_cost", "partition", "check_prefill_ranks", "shared_ranks"]

SPLITS = ("balanced", "even")

_HOST = "127.0.0.1"


@dataclass(frozen=True)
class RankReport:
    """What one rank did in the last prefill: its chunk [start, end) of the prompt, its seconds
    (from receiving the job to its last send), and the bytes of keys and values it sent on."""

    rank: int
    start: int
    end: int
    seconds: float
    bytes_sent: int


def check_prefill_ranks(prefill_ranks: Any) -> None:
    """Raise a ValueError naming ``prefill_ranks`` unless it is None, a :class:`PrefillRanks`
    or an integer from 1 to the threads torch runs here (each rank needs one of its own)."""
    if prefill_ranks is None or isinstance(prefill_ranks, PrefillRanks):
        return
    _check_count(prefill_ranks)


def _check_count(prefill_ranks: Any) -> None:
    if isinstance(prefill_ranks, bool) or not isinstance(prefill_ranks, int) or prefill_ranks < 1:
        raise ValueError(f"prefill_ranks must be an integer >= 1 (processes the prefill runs over), None or a "
                         f"PrefillRanks, got {prefill_ranks!r}")
    threads = torch.get_num_threads()
    if prefill_ranks > threads:
        raise ValueError(f"prefill_ranks={prefill_ranks}: at most {threads} ranks can start here (each rank runs "
                         f"on a thread of its own and torch has {threads}: torch.get_num_threads())")


def _layer_costs(model) -> tuple[float, float]:
    """(a, b): the FLOPs of one decoder layer for one token, a for its linear layers and b
    for its attention per key it sees (QK and PV), from the model's config."""
    cfg = model.config.get_text_config(decoder=True)
    geo = adapter.geometry(model)
    hidden = cfg.hidden_size
    inner = getattr(cfg, "intermediate_size", None) or 4 * hidden
    q, kv = geo.num_heads * geo.head_dim, geo.num_kv_heads * geo.head_dim
    linear = 2 * (hidden * q + 2 * hidden * kv + q * hidden + 3 * hidden * inner)
    return float(linear), float(4 * q)


def chunk_cost(costs: tuple[float, float], start: int, end: int) -> float:
    """The work of running tokens [start, end) on top of the first ``start``, by the attention
    cost model: each token's linear layers (``a``) and, per key its query is scored against,
    ``b``. The first chunk runs causal attention, whose kernel skips the keys a query does not
    see (token i: i + 1 keys); a later chunk's runs through a mask (its own chunk causal, the
    prefix whole), and the kernel computes every query against all ``end`` keys."""
    a, b = costs
    m = end - start
    return a * m + (b * m * (m + 1) / 2 if not start else b * m * end)


def partition(n: int, ranks: int, costs: tuple[float, float], split: str = "balanced", last_min: int = 1) -> list[int]:
    """Chunk boundaries of an ``n``-token prompt over ``ranks`` ranks: ``bounds`` of length
    ranks + 1, rank r running tokens ``bounds[r]:bounds[r + 1]``.

    costs: (a, b) of the attention cost model (:func:`chunk_cost`).
    split: ``"balanced"``: every rank's chunk costs the same (within a token);
        ``"even"``: every rank gets n / ranks tokens.
    last_min: the last rank's chunk holds at least this many tokens (the observation window
        a compressor scores with is taken there).
    A prompt too short for every rank leaves the first ranks empty (their bounds 0, 0).
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if n < 1 or ranks < 1:
        raise ValueError(f"partition() of {n} tokens over {ranks} ranks")
    last_min = min(max(1, last_min), n)
    active = max(1, min(ranks, n - last_min + 1))

    def cut(budget: float) -> list[int]:  # each chunk but the last as long as ``budget`` allows
        ends, start = [], 0
        for _ in range(active - 1):
            lo, hi = start, n  # the longest chunk from start costing at most budget
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if chunk_cost(costs, start, mid) <= budget else (lo, mid - 1)
            ends.append(lo)
            start = lo
        return ends

    if split == "even":
        ends = [round(r * n / active) for r in range(1, active)]
    else:  # the least budget per chunk that leaves the last chunk within it
        lo, hi = 0.0, chunk_cost(costs, 0, n)
        for _ in range(100):
            mid = (lo + hi) / 2
            ends = cut(mid)
            last = ends[-1] if ends else 0
            lo, hi = (lo, mid) if chunk_cost(costs, last, n) <= mid else (mid, hi)
        ends = cut(hi)
    bounds = [0]
    for r, e in enumerate(ends):  # each chunk at least one token, the last at least last_min
        bounds.append(min(max(e, bounds[-1] + 1), n - last_min - (active - 2 - r)))
    bounds.append(n)
    return [0] * (ranks - active) + bounds


def _chunk(model, pg, rank: int, size: int, prompt: torch.Tensor, bounds: Sequence[int], cache: SharedCache,
           timeout: datetime.timedelta, tap: Any = None) -> tuple[torch.Tensor, int]:
    """Run rank ``rank``'s chunk of ``prompt`` [n] into the empty one-row ``cache``: its
    prefix entries come from rank - 1 layer by layer, and every layer's entries up to the
    chunk's end go on to rank + 1. Returns (final hidden states [1, m, H] of the chunk, bytes
    sent) with the chunk committed."""
    start, end = int(bounds[rank]), int(bounds[rank + 1])
    geo = adapter.geometry(model)
    heads, dim, layers = geo.num_kv_heads, geo.head_dim, geo.num_layers
    if start:  # placeholders the received entries overwrite, layer by layer
        zeros = torch.zeros((heads, start, dim), dtype=geo.dtype, device=geo.device)
        cache.load_prefixes([([zeros] * layers, [zeros] * layers, start)])
    incoming = []
    if start:
        for layer in range(layers):
            k = torch.empty((heads, start, dim), dtype=geo.dtype)
            v = torch.empty_like(k)
            incoming.append((k, v, pg.recv([k], rank - 1, 2 * layer), pg.recv([v], rank - 1, 2 * layer + 1)))
    sending: list[tuple[torch.Tensor, torch.Tensor, Any, Any]] = []
    hands_on = rank < size - 1

    def before(layer: int) -> None:
        if not start:
            return
        k, v, wk, wv = incoming[layer]
        wk.wait(timeout)
        wv.wait(timeout)
        keys, values = cache.storage(layer)
        keys[0, :, :start] = k.to(keys.device)
        values[0, :, :start] = v.to(values.device)
        incoming[layer] = None  # the buffers go once copied

    def after(layer: int) -> None:
        if not hands_on:
            return
        keys, values = cache.storage(layer)
        k = keys[0, :, :end].to("cpu").contiguous()
        v = values[0, :, :end].to("cpu").contiguous()
        sending.append((k, v, pg.send([k], rank + 1, 2 * layer), pg.send([v], rank + 1, 2 * layer + 1)))

    m = end - start
    device = geo.device
    ids = prompt[start:end].to(device).unsqueeze(0)
    positions = torch.arange(start, end, device=device).unsqueeze(0)
    with adapter.around_layers(model, cache, before, after), tap if tap is not None else contextlib.nullcontext():
        if not start:  # the first chunk: a prefill of its own (as a chunked prefill's first chunk)
            cache.begin_prefill([m])
            hidden = adapter.backbone_forward(model, ids, positions, cache, None)
            cache.end_prefill()
        else:
            cache.reserve(end)  # the chunk appends without growing the prefix's buffers
            visible = torch.ones((m, m), dtype=torch.bool, device=device).tril().unsqueeze(0) if m > 1 else None
            hidden = forward_tokens(model, cache, ids, positions, visible, geo.dtype)
            cache.commit([list(range(m))])
    for _, _, wk, wv in sending:
        wk.wait(timeout)
        wv.wait(timeout)
    return hidden, sum(2 * k.numel() * k.element_size() for k, _, _, _ in sending)


def _serve(rank: int, size: int, port: int, model, jobs, results, timeout_s: float, parent: int) -> None:
    """A helper rank's process: join the group, then run each job's chunk until told to stop
    (None), the parent goes, or a job fails (reported, then the process ends, so that its
    peers' transfers fail at once instead of waiting out the timeout)."""
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=timeout_s)
    results.put(("loaded", rank, None))
    try:
        store = dist.TCPStore(_HOST, port, size, False, timeout=timeout)
        pg = dist.ProcessGroupGloo(store, rank, size, timeout)
    except BaseException as error:  # noqa: BLE001 - reported to the caller, then this process ends
        results.put(("error", rank, f"{type(error).__name__}: {error}"))
        return
    geo = adapter.geometry(model)
    windows = adapter.layer_windows(model)
    while True:
        try:
            job = jobs.get(timeout=1.0)
        except queue.Empty:
            if os.getppid() != parent:
                return
            continue
        if job is None:
            return
        prompt, bounds, threads = job
        try:
            t0 = time.perf_counter()
            torch.set_num_threads(threads)
            with torch.inference_mode(), adapter.packed_gqa_attention(model):
                _, sent = _chunk(model, pg, rank, size, prompt, bounds, SharedCache(geo.num_layers, windows), timeout)
            results.put(("done", rank, (time.perf_counter() - t0, sent)))
        except BaseException as error:  # noqa: BLE001 - reported to the caller, then this process ends
            results.put(("error", rank, f"{type(error).__name__}: {error}"))
            return


class PrefillRanks:
    """``ranks`` processes that run a prefill together (this one the last rank).

    model: the model every rank runs (its weights are shared with the helper processes).
    split: ``"balanced"`` or ``"even"`` chunk boundaries (:func:`partition`).
    timeout_s: the longest a rank waits for another's entries (or a helper to start) before
        the call ends with a RuntimeError.
    Starting the helpers (spawned: they import torch and accel) takes a few seconds, once;
    :meth:`close` (or the end of the process) stops them. ``last`` has every rank's
    :class:`RankReport` of the latest prefill.
    """

    def __init__(self, model, ranks: int, split: str = "balanced", timeout_s: float = 120.0):
        _check_count(ranks)
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        if any(w is not None for w in adapter.layer_windows(model)):
            raise ValueError("prefill_ranks: the prefill over several ranks needs full attention in every layer "
                             f"({type(model).__name__} has sliding-window layers)")
        adapter.decoder_blocks(model, "prefill_ranks runs its layers one by one")
        self._model = weakref.ref(model)  # the helpers hold it; a shared group must not keep it alive
        self.ranks, self.split, self.timeout_s = ranks, split, timeout_s
        self.costs = _layer_costs(model)
        self.last: list[RankReport] = []
        self._procs: list[Any] = []
        self._jobs: list[Any] = []
        self._pg = None
        self.broken = False
        if ranks > 1:
            self._start(model)
        _open.add(self)

    @property
    def model(self):
        """The model the ranks run (None once it has gone)."""
        return self._model()

    def _start(self, model) -> None:
        ctx = mp.get_context("spawn")
        timeout = datetime.timedelta(seconds=self.timeout_s)
        store = dist.TCPStore(_HOST, 0, self.ranks, True, timeout=timeout, wait_for_workers=False)
        self._results = ctx.Queue()
        print(f"accel: starting {self.ranks - 1} prefill rank process(es) (prefill_ranks={self.ranks}; once)",
              file=sys.stderr, flush=True)
        try:
            for rank in range(self.ranks - 1):
                jobs = ctx.Queue()
                proc = ctx.Process(target=_serve, args=(rank, self.ranks, store.port, model, jobs, self._results,
                                                        self.timeout_s, os.getpid()), daemon=True)
                proc.start()
                self._procs.append(proc)
                self._jobs.append(jobs)
        except Exception as error:
            self.close()
            raise ValueError(f"prefill_ranks={self.ranks}: could not start the helper ranks with this model "
                             f"({type(error).__name__}: {error})") from error
        self._await("loaded", range(self.ranks - 1))
        self._store = store
        try:
            self._pg = dist.ProcessGroupGloo(store, self.ranks - 1, self.ranks, timeout)
        except Exception as error:  # noqa: BLE001 - a helper went between loading and joining
            self._fail(f"the ranks did not join ({type(error).__name__}: {error})", error)

    def _await(self, what: str, ranks) -> dict[int, Any]:
        """Each of ``ranks``' next message, which must be ``what``; a RuntimeError (the group
        closed) when a rank reports an error, dies, or says nothing within the timeout."""
        waiting, got = set(ranks), {}
        deadline = time.monotonic() + self.timeout_s
        while waiting:
            try:
                kind, rank, payload = self._results.get(timeout=0.5)
            except queue.Empty:
                dead = [r for r in waiting if not self._procs[r].is_alive()]
                if dead or time.monotonic() > deadline:
                    self._fail(f"rank {dead[0]} exited (code {self._procs[dead[0]].exitcode})" if dead
                               else f"no word from rank(s) {sorted(waiting)} within {self.timeout_s:g} s")
                continue
            if kind == "error":
                self._fail(f"rank {rank} failed: {payload}")
            if kind == what and rank in waiting:
                waiting.discard(rank)
                got[rank] = payload
        return got

    def _errors(self, seconds: float) -> list[str]:
        """The errors the helpers report within ``seconds`` (a failure of this rank's may be a
        helper's: it ended, and its transfers with it)."""
        said, deadline = [], time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                kind, rank, payload = self._results.get(timeout=0.2)
            except queue.Empty:
                if any(not p.is_alive() for p in self._procs) and said:
                    break
                continue
            if kind == "error":
                said.append(f"rank {rank} failed: {payload}")
        for r, p in enumerate(self._procs):
            if not p.is_alive() and not any(s.startswith(f"rank {r} ") for s in said):
                said.append(f"rank {r} exited (code {p.exitcode})")
        return said

    def _fail(self, why: str, cause: BaseException | None = None):
        self.close()
        raise RuntimeError(f"the prefill over {self.ranks} ranks failed: {why}") from cause

    def alive(self) -> bool:
        """Whether every helper rank is running (a group that failed is not)."""
        return not self.broken and all(p.is_alive() for p in self._procs)

    def prefill(self, cache: SharedCache, rows: Sequence[torch.Tensor], window: int,
                queries: dict[int, torch.Tensor]) -> torch.Tensor:
        """Prefill ``rows`` (LongTensors [n_b]) into the empty ``cache``, one row after
        another, each over the ranks. ``queries`` receives, per layer, each row's
        ``window`` last prompt queries [B, H_q, window, D] (what :func:`accel.steps.prefill`
        collects for compressors); the caller compresses. Returns the final hidden state at
        each row's last prompt position, [B, H]."""
        if self.broken:
            raise RuntimeError("this PrefillRanks failed earlier and was closed; start a new one")
        model = self.model
        if model is None:
            raise RuntimeError("the model of this PrefillRanks has gone")
        geo = adapter.geometry(model)
        windows = adapter.layer_windows(model)
        last, sinks = [], []
        for b, row in enumerate(rows):
            target = cache if len(rows) == 1 else SharedCache(geo.num_layers, windows)
            sink: dict[int, torch.Tensor] = {}
            last.append(self._row(model, target, row.reshape(-1), window, sink))
            sinks.append(sink)
            if target is not cache:
                cache.extend(target)
        for layer in sinks[0]:
            queries[layer] = torch.cat([s[layer] for s in sinks]) if len(sinks) > 1 else sinks[0][layer]
        return torch.stack(last)

    def _row(self, model, cache: SharedCache, prompt: torch.Tensor, window: int, sink: dict[int, torch.Tensor]) -> torch.Tensor:
        n = int(prompt.numel())
        bounds = partition(n, self.ranks, self.costs, self.split, last_min=max(window, 1))
        active = [r for r in range(self.ranks) if bounds[r + 1] > bounds[r]]
        threads = max(1, torch.get_num_threads() // len(active))  # this process's threads, shared out
        me = self.ranks - 1
        dead = [r for r in active[:-1] if not self._procs[r].is_alive()]
        if dead:
            self._fail(f"rank {dead[0]} is not running (exit code {self._procs[dead[0]].exitcode})")
        t0 = time.perf_counter()
        for r in active[:-1]:
            self._jobs[r].put((prompt.cpu(), bounds, threads))
        tap = None
        if window:
            slots = (n - window + torch.arange(window)).clamp(min=0) - bounds[me]  # within the last chunk
            tap = adapter.capture_queries_at(model, cache, slots.unsqueeze(0).to(prompt.device), sink)
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            hidden, _ = _chunk(model, self._pg, me, self.ranks, prompt, bounds, cache,
                               datetime.timedelta(seconds=self.timeout_s), tap)
        except Exception as error:  # noqa: BLE001 - a helper's own report says more than gloo's
            said = self._errors(2.0)
            self._fail("; ".join(said + [f"rank {me} (this process): {type(error).__name__}: {error}"]), error)
        finally:
            torch.set_num_threads(before)
        mine = time.perf_counter() - t0
        done = self._await("done", active[:-1])
        self.last = [RankReport(r, bounds[r], bounds[r + 1], *done[r]) for r in active[:-1]]
        self.last.append(RankReport(me, bounds[me], n, mine, 0))
        return hidden[0, -1]

    def close(self) -> None:
        """Stop the helper processes (idempotent); the group cannot run prefills afterwards."""
        self.broken = True
        _open.discard(self)
        for jobs, proc in zip(self._jobs, self._procs):
            if proc.is_alive():
                with contextlib.suppress(Exception):
                    jobs.put(None)
        for proc in self._procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        self._procs, self._jobs, self._pg = [], [], None

    def __enter__(self) -> "PrefillRanks":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_open: "weakref.WeakSet[PrefillRanks]" = weakref.WeakSet()
_shared: dict[tuple[int, int], PrefillRanks] = {}


def shared_ranks(model, ranks: int) -> PrefillRanks:
    """The group ``accel.generate(..., prefill_ranks=ranks)`` uses for ``model``: started on
    first use and kept (a failed one is replaced) until the model or the process goes."""
    key = (id(model), ranks)
    group = _shared.get(key)
    if group is None or not group.alive() or group.model is not model:
        if group is not None:
            group.close()
        group = PrefillRanks(model, ranks)
        _shared[key] = group
        weakref.finalize(model, _drop, key, group)
    return group


def _drop(key: tuple[int, int], group: PrefillRanks) -> None:
    if _shared.get(key) is group:
        del _shared[key]
    group.close()


@atexit.register
def _close_all() -> None:
    for group in list(_open):
        group.close()
