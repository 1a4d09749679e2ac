"""Calibration: what verify passes cost on this machine, measured once and cached.

Whatever accel chooses by cost (packed or plain linear kernels, how many draft tokens a step
verifies) comes from a :class:`~accel.calibration.cost_model.CostTable` measured for one (model, device,
dtype, weight quantization, torch threads, machine) by :func:`accel.calibration.timing.measure` and cached as JSON in
``$ACCEL_CACHE/calibration/``, never from constants fitted on another machine.

- :func:`cost_table` -- the table for a model: read from the cache, else measured (a notice
  goes to stderr) and written atomically. A corrupt file, or one measured for something
  else, is ignored and measured again. ``ACCEL_CALIBRATION=off`` returns
  :func:`~accel.calibration.cost_model.static_table` without measuring.
- :func:`prefer_int8` -- whether a model's one-token step runs faster with int8 weights
  (:mod:`accel.kernels.quant`; for draft models), measured once and cached the same way.
- :func:`calibration_key` / :func:`calibration_path` -- what a table is keyed by and where it
  lives; :func:`load_table` / :func:`save_table` read and write one file.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import sys
import threading
import weakref
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from .. import adapter
from ..files import cache_dir, write_text_atomic
from . import timing
from .cost_model import CostTable, static_table

__all__ = ["calibration_enabled", "calibration_key", "calibration_path", "cost_table", "load_table",
           "prefer_int8", "save_table", "step_costs"]

_FORMAT = 9  # 9: batch passes (CostTable.batch_ms); 8: steps on the flat forward (adapter.flat_forward); 7: passes timed as verify runs them (ordered attention in bf16). Bump when the measurement changes meaning: older files are then re-measured
_OFF = {"off", "0", "false", "no"}
_ON = {"", "on", "1", "true", "yes", "auto"}

_CONFIG_FIELDS = (  # what decides a model's costs (not its weights)
    "model_type", "architectures", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings",
    "sliding_window", "layer_types", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
)


# ---------------------------------------------------------------------------- keys and files


def calibration_enabled() -> bool:
    """False when ``ACCEL_CALIBRATION`` is ``off`` (or 0 / false / no); unset means on."""
    value = os.environ.get("ACCEL_CALIBRATION", "").strip().lower()
    if value in _OFF:
        return False
    if value in _ON:
        return True
    raise ValueError(f"ACCEL_CALIBRATION={value!r}: use 'off' to disable calibration, or leave it unset")


def _machine() -> dict[str, Any]:
    """CPU model name and a digest of its flags, core count, platform, torch version."""
    info: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:  # the first processor's entries
                field, _, value = line.partition(":")
                info.setdefault(field.strip(), value.strip())
    except OSError:
        pass
    flags = " ".join(sorted((info.get("flags") or info.get("Features") or "").split()))
    return {
        "cpu": info.get("model name") or platform.processor() or platform.machine(),
        "cpu_flags": hashlib.sha256(flags.encode()).hexdigest()[:16],
        "cores": os.cpu_count(),
        "platform": f"{platform.system()} {platform.machine()}",
        "torch": torch.__version__,
    }


def calibration_key(model) -> dict[str, Any]:
    """What a table is measured for: model identity (class, attention implementation and the
    config fields that set its sizes), device (and GPU name), dtype, weight quantization (None,
    or the scheme, group size, whether the output layer is quantized and how many layers are:
    :meth:`accel.kernels.lowbit.QuantizationInfo.key`), torch threads, machine. Each
    quantization of a model so gets its own table, measured on the kernels it runs."""
    from ..kernels.lowbit import quantization_of

    cfg = model.config.get_text_config(decoder=True)
    # the implementation the model was loaded with, also while accel runs it on packed sdpa
    identity = {"class": type(model).__name__, "attn": adapter.loaded_attention(model)}
    for name in _CONFIG_FIELDS:
        value = getattr(cfg, name, None)
        if value is None:
            value = getattr(model.config, name, None)
        if value is not None:
            identity[name] = list(value) if isinstance(value, (list, tuple)) else value
    param = next(model.parameters())
    device = {"type": param.device.type}
    if param.device.type == "cuda":
        device["name"] = torch.cuda.get_device_name(param.device)
    return {
        "format": _FORMAT,
        "model": identity,
        "device": device,
        "dtype": str(param.dtype).removeprefix("torch."),
        "quantize": None if (quant := quantization_of(model)) is None else quant.key(),
        "threads": torch.get_num_threads(),
        "machine": _machine(),
    }


def _as_json(key: dict[str, Any]) -> dict[str, Any]:
    """``key`` as it reads back from a JSON file."""
    return json.loads(json.dumps(key, default=str))


def _digest(key: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:20]


def calibration_path(key: dict[str, Any]) -> Path:
    """``$ACCEL_CACHE/calibration/<digest of key>.json`` (see :func:`accel.files.cache_dir`)."""
    return cache_dir() / "calibration" / f"{_digest(key)}.json"


def load_table(path: Path, key: dict[str, Any]) -> CostTable | None:
    """The table cached at ``path`` if it is readable, well formed and measured for ``key``;
    else None."""
    try:
        table = CostTable.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return table if table.measured and table.key == _as_json(key) else None


def save_table(path: Path, table: CostTable) -> None:
    """Write ``table`` as JSON at ``path`` atomically (a temporary file, then a rename)."""
    _save_json(path, table.to_dict())


def _save_json(path: Path, data: dict[str, Any]) -> None:
    write_text_atomic(path, json.dumps(data, indent=1, default=str) + "\n")


def cost_table(
    model,
    *,
    force: bool = False,
    tokens: tuple[int, ...] = timing.DEFAULT_TOKENS,
    cache_lens: tuple[int, ...] = timing.DEFAULT_CACHE_LENS,
    repeats: int = 3,
    budget_s: float = 20.0,
) -> CostTable:
    """The cost table of ``model`` as it runs now (device, dtype, ``torch.get_num_threads()``)
    on this machine: cached, else measured with :func:`accel.calibration.timing.measure` and cached. ``force``
    measures again. With ``ACCEL_CALIBRATION=off`` it is :func:`static_table`."""
    if not calibration_enabled():
        return static_table()
    key = calibration_key(model)
    path = calibration_path(key)
    if not force:
        table = load_table(path, key)
        if table is not None:
            return table
    print(f"accel: measuring verify costs of this model on this machine (once, cached in {path.parent})...",
          file=sys.stderr, flush=True)
    table = timing.measure(model, tokens=tokens, cache_lens=cache_lens, repeats=repeats, budget_s=budget_s)
    table = replace(table, key=_as_json(key))
    save_table(path, table)
    return table


def step_costs(model) -> CostTable:
    """:func:`cost_table` for ``model`` with the linear kernels it runs now
    (:meth:`CostTable.run_with`: column-major weights or not, its packed and split windows):
    what the engine sizes drafts by. Only a model loaded by :func:`accel.load_model` runs the
    kernels the measurement chose; one loaded by plain transformers runs plain ones."""
    from ..kernels.cpu import is_transposed, packed_window, split_rows

    return cost_table(model).run_with(is_transposed(model), packed_window(model), split_rows(model))


# ---------------------------------------------------------------------------- int8 drafts

_INT8: "weakref.WeakKeyDictionary[Any, bool]" = weakref.WeakKeyDictionary()
_INT8_LOCK = threading.Lock()


def prefer_int8(model, *, force: bool = False, repeats: int = 5) -> bool:
    """Whether a one-token step of ``model`` is faster with int8 linear weights
    (:func:`accel.kernels.quant.int8_copy`) than as loaded, on this machine.

    Measured once per model kind and machine (a one-token pass over 256 cached entries,
    float and int8 alternating, median of ``repeats`` each; about a second for a 0.5B
    model) and cached beside the cost tables; kept per model object in the process. False
    without measuring where int8 does not apply (not float32 on a CPU, no int8 kernel) and
    with ``ACCEL_CALIBRATION=off``.
    """
    from ..kernels.quant import int8_available

    param = next(model.parameters())
    if not calibration_enabled() or param.device.type != "cpu" or param.dtype != torch.float32 \
            or not int8_available():
        return False
    with _INT8_LOCK:
        if not force and model in _INT8:
            return _INT8[model]
        key = _as_json({**calibration_key(model), "measure": "int8 one-token step"})
        path = calibration_path(key)
        found = None
        if not force:
            try:
                data = json.loads(path.read_text())
                if data.get("key") == key:
                    found = bool(data["int8_ms"] < data["float_ms"])
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                found = None
        if found is None:
            float_ms, int8_ms = _time_int8(model, repeats)
            _save_json(path, {"key": key, "float_ms": round(float_ms, 3), "int8_ms": round(int8_ms, 3)})
            found = int8_ms < float_ms
        _INT8[model] = found
        return found


def _time_int8(model, repeats: int) -> tuple[float, float]:
    """Median ms of a one-token pass over 256 cached entries, as loaded and in int8 (the int8
    copy is kept only if it wins, for the drafter that asked)."""
    from ..kernels.quant import int8_copy, release_int8_copy

    quantized = int8_copy(model)
    cache = timing.filled_cache(model, 256)
    times: dict[str, list[float]] = {"float": [], "int8": []}
    for i in range(repeats):
        for name, m in (("float", model), ("int8", quantized)):
            times[name] += timing.time_pass(m, cache, 1, repeats=1, warmup=1 if i == 0 else 0)
    float_ms, int8_ms = statistics.median(times["float"]), statistics.median(times["int8"])
    if int8_ms >= float_ms:
        release_int8_copy(model)
    return float_ms, int8_ms
