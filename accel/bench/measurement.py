"""What a timed call records, the instruments that time it, and what it ran on.

- :class:`Measurement`: one timed generation of one item (new tokens, prefill / decode /
  end-to-end seconds, verify steps, accepted drafts per step, KV bytes).
- :class:`BatchMeasurement`: one batched call or one arrivals run: the call's wall time and,
  per row (:class:`RowResult`), the new tokens, time to first token and latency (both from
  the call's start; arrivals: from each request's submit), KV bytes and acceptance.
- :class:`ChunkTimer`: a transformers streamer that timestamps each step's new tokens;
  :func:`sync_device` makes wall-clock times include queued CUDA work.
- :func:`cut_at_eos`, :func:`percentile`, :func:`error_line`: small helpers every form of a
  configuration shares.
- :class:`PeakMemory`: ``peak_rss_mib``, the process's peak resident memory during a call
  (the kernel's high-water mark, reset before each call; a sampling thread where that is
  not possible), model weights included. ``peak_gpu_mib`` on CUDA is
  ``torch.cuda.max_memory_allocated``.
- :func:`machine_info`: the machine, library versions and model of a run, for summary.md.
"""

from __future__ import annotations

import math
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import adapter
from ..kernels.cpu import is_prepacked, is_transposed
from .schema import Experiment

__all__ = [
    "Measurement",
    "RowResult",
    "BatchMeasurement",
    "ChunkTimer",
    "PeakMemory",
    "cut_at_eos",
    "error_line",
    "machine_info",
    "percentile",
    "sync_device",
]


@dataclass
class Measurement:
    """One timed generation."""

    new_ids: list[int]
    prefill_s: float
    decode_s: float
    e2e_s: float
    decode_tokens: int  # tokens after the first one(s) that came with the prefill
    verify_steps: int
    accepted_per_step: list[int]
    kv_bytes_full: int
    kv_bytes_kept: int

    @property
    def decode_tok_s(self) -> float | None:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 and self.decode_tokens else None

    @property
    def mean_accepted(self) -> float | None:
        """Tokens per verify step, bonus included (1.0 for plain decoding)."""
        if not self.verify_steps:
            return None
        return (sum(self.accepted_per_step) + self.verify_steps) / self.verify_steps


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


def error_line(err: BaseException) -> str:
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



def resident_mib() -> float | None:
    """This process's resident memory now (MiB): ``VmRSS`` on Linux, else ``psutil``'s."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    try:
        import psutil

        return psutil.Process().memory_info().rss / 2**20
    except Exception:
        return None


class PeakMemory:
    """Peak resident memory (MiB) of this process during a ``with`` block.

    Linux: resets the kernel's high-water mark (``/proc/self/clear_refs``) and reads
    ``VmHWM`` afterwards. Elsewhere, or if that is refused, a thread samples ``psutil``'s RSS
    every 5 ms.
    """

    def __init__(self) -> None:
        self.peak_mib: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._samples: list[int] = []

    @staticmethod
    def _hwm_kib() -> int | None:
        try:
            with open("/proc/self/status") as fh:
                for line in fh:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1])
        except OSError:
            return None
        return None

    @staticmethod
    def _reset_hwm() -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as fh:
                fh.write("5")
            return True
        except OSError:
            return False

    def __enter__(self) -> "PeakMemory":
        self._kernel = self._reset_hwm() and self._hwm_kib() is not None
        if not self._kernel:
            import psutil

            proc = psutil.Process()

            def sample() -> None:
                while not self._stop.is_set():
                    self._samples.append(proc.memory_info().rss)
                    self._stop.wait(0.005)

            self._thread = threading.Thread(target=sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._kernel:
            kib = self._hwm_kib()
            self.peak_mib = kib / 1024 if kib is not None else None
        else:
            self._stop.set()
            assert self._thread is not None
            self._thread.join()
            self.peak_mib = max(self._samples) / 2**20 if self._samples else None


def cpu_model() -> str:
    """This CPU's model name (/proc/cpuinfo's "model name"), else what ``platform`` knows."""
    import platform

    try:
        with open("/proc/cpuinfo") as fh:
            return next(line.split(":", 1)[1].strip() for line in fh if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def machine_info(model: Any, experiment: Experiment) -> dict[str, Any]:
    """What the run ran on, for summary.md and results."""
    import platform

    import transformers

    from ..models import DEFAULT_MODEL_NAME

    info = {
        "platform": platform.platform(), "cpu": cpu_model(), "cpu_count": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "python": platform.python_version(), "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
        "transformers": transformers.__version__, "device": str(adapter.geometry(model).device),
        "gpu": torch.cuda.get_device_name(adapter.geometry(model).device)
        if adapter.geometry(model).device.type == "cuda" else None,
        "model": experiment.model, "model_class": type(model).__name__,
        "model_name": DEFAULT_MODEL_NAME if experiment.model == "default" else (getattr(model.config, "name_or_path", "") or ""),
        "parameters": _parameters(model), "dtype": experiment.dtype,
        "quantize": None if experiment.quantize is None else str(experiment.quantize),
        "precisions": list(experiment.precisions),
        "prepacked": is_prepacked(model), "transposed": is_transposed(model),
    }
    return info


def _parameters(model: Any) -> int:
    """The model's parameter count, quantized weights included (held as buffers)."""
    from ..kernels.lowbit import quantization_of

    quant = quantization_of(model)
    return sum(p.numel() for p in model.parameters()) + (quant.weights if quant is not None else 0)
