"""Calibration: what verify passes cost on this machine, measured once and cached.

Whatever accel chooses by cost (packed or plain linear kernels, how many draft tokens a step
verifies) comes from a :class:`~accel.cost_model.CostTable` measured for one (model, device,
dtype, torch threads, machine) by :func:`accel.timing.measure` and cached as JSON in
``$ACCEL_CACHE/calibration/``, never from constants fitted on another machine.

- :func:`cost_table` -- the table for a model: read from the cache, else measured (a notice
  goes to stderr) and written atomically. A corrupt file, or one measured for something
  else, is ignored and measured again. ``ACCEL_CALIBRATION=off`` returns
  :func:`~accel.cost_model.static_table` without measuring.
- :func:`calibration_key` / :func:`calibration_path` -- what a table is keyed by and where it
  lives; :func:`load_table` / :func:`save_table` read and write one file.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from . import adapter, timing
from .cost_model import CostTable, static_table

__all__ = ["calibration_enabled", "calibration_key", "calibration_path", "cost_table", "load_table", "save_table"]

_FORMAT = 2  # bump when the measurement changes meaning: older files are then re-measured
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
    config fields that set its sizes), device (and GPU name), dtype, torch threads, machine."""
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
        "threads": torch.get_num_threads(),
        "machine": _machine(),
    }


def _digest(key: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:20]


def calibration_path(key: dict[str, Any]) -> Path:
    """``$ACCEL_CACHE/calibration/<digest of key>.json`` (see :func:`accel.models.cache_dir`)."""
    from .models import cache_dir

    return cache_dir() / "calibration" / f"{_digest(key)}.json"


def load_table(path: Path, key: dict[str, Any]) -> CostTable | None:
    """The table cached at ``path`` if it is readable, well formed and measured for ``key``;
    else None."""
    try:
        table = CostTable.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    key_json = json.loads(json.dumps(key, default=str))  # as it reads back from a file
    return table if table.measured and table.key == key_json else None


def save_table(path: Path, table: CostTable) -> None:
    """Write ``table`` as JSON at ``path`` atomically (a temporary file, then a rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(table.to_dict(), fh, indent=1, default=str)
            fh.write("\n")
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


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
    on this machine: cached, else measured with :func:`accel.timing.measure` and cached. ``force``
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
    table = replace(table, key=json.loads(json.dumps(key, default=str)))
    save_table(path, table)
    return table
