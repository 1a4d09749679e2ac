"""Files of Medusa heads: accel's format and the official Medusa format.

- accel's format: ``medusa_heads.safetensors`` + ``medusa_config.json`` (num_heads,
  num_layers, hidden_size, vocab_size, own_lm_head, sequential, vocab_subset_size,
  base_model, measured per-head top-1..top-10 accuracies, training info), written by
  :func:`save_heads` (``MedusaHeads.save_pretrained``) and by ``accel train-heads``.
  ``"default"`` names the heads shipped for the default model (:data:`DEFAULT_HEADS_DIR`).
- the official Medusa format: ``config.json`` with ``medusa_num_heads`` and
  ``medusa_num_layers`` plus ``medusa_lm_head.pt`` (or ``.safetensors``), a state dict with,
  per head k, ``k.{l}.linear.weight/bias`` for each residual block l and ``k.{L}.weight``
  (the head's own vocabulary projection, no bias). :func:`read_official` reads it directly,
  pickles only through ``torch.load(weights_only=True)``. The ``medusa-llm`` package (0.1)
  does import with transformers 5.24, but its only loader, ``MedusaModel.from_pretrained``,
  rebuilds the base model and tokenizer from the hub by name (a download) and unpickles
  without ``weights_only``, so it cannot attach heads to a model we already hold; the format
  is a plain state dict, read here as it is.

Readers raise FileNotFoundError for a missing folder or file and ValueError, naming the file
and the problem, for a malformed one. Weights always come back float32.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, TypeVar

import torch

from accel.files import atomic_path, write_text_atomic

# The heads' class (speculative.medusa.heads.MedusaHeads) is passed in by its class methods,
# so this module does not import it.
Heads = TypeVar("Heads", bound=torch.nn.Module)

__all__ = [
    "WEIGHTS_NAME",
    "CONFIG_NAME",
    "OFFICIAL_CONFIG",
    "OFFICIAL_WEIGHTS",
    "DEFAULT_HEADS_DIR",
    "resolve_heads_dir",
    "heads_config",
    "save_heads",
    "read_heads",
    "read_ours",
    "read_official",
]

WEIGHTS_NAME = "medusa_heads.safetensors"
CONFIG_NAME = "medusa_config.json"
OFFICIAL_CONFIG = "config.json"
OFFICIAL_WEIGHTS = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")
FORMAT = "accel-medusa"
FORMAT_VERSION = 1

#: The heads trained for the default model (SmolLM2-135M-Instruct), shipped in the package.
DEFAULT_HEADS_DIR = Path(__file__).resolve().parent.parent / "heads" / "default"


def resolve_heads_dir(heads: str | os.PathLike) -> Path:
    """The folder named by ``heads``: ``"default"`` is the shipped heads, else a path."""
    if os.fspath(heads) == "default":
        if not (DEFAULT_HEADS_DIR / CONFIG_NAME).is_file():
            raise FileNotFoundError(
                f"no Medusa heads are shipped in '{DEFAULT_HEADS_DIR}'; train some with "
                f"`accel train-heads --model default --out DIR` and pass heads=DIR"
            )
        return DEFAULT_HEADS_DIR
    path = Path(heads).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"Medusa heads folder '{path}' does not exist")
    return path.resolve()


# --------------------------------------------------------------------------- accel's format


def heads_config(heads: torch.nn.Module) -> dict[str, Any]:
    """The JSON config saved beside the weights."""
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "num_heads": heads.num_heads,
        "num_layers": heads.num_layers,
        "hidden_size": heads.hidden_size,
        "vocab_size": heads.vocab_size,
        "own_lm_head": heads.own_lm_head,
        "sequential": heads.sequential,
        "vocab_subset_size": int(heads.vocab_subset.numel()) if heads.vocab_subset is not None else None,
        **heads.info,
    }


def save_heads(heads: torch.nn.Module, folder: str | os.PathLike, dtype: torch.dtype | None = None) -> Path:
    """Write ``medusa_heads.safetensors`` (in ``dtype``, default as held) and
    ``medusa_config.json`` into ``folder``, each atomically. Returns the folder."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).detach().cpu().contiguous()
             for k, v in heads.state_dict().items()}
    with atomic_path(folder / WEIGHTS_NAME) as tmp:
        save_file(state, str(tmp), metadata={"format": FORMAT})
    write_text_atomic(folder / CONFIG_NAME, json.dumps(heads_config(heads), indent=2) + "\n")
    return folder


def read_heads(cls: type[Heads], folder: str | os.PathLike) -> Heads:
    """Heads of class ``cls`` from ``folder`` in either format, or the shipped heads with
    ``"default"``."""
    path = resolve_heads_dir(folder)
    if (path / CONFIG_NAME).is_file():
        return read_ours(cls, path)
    if (path / OFFICIAL_CONFIG).is_file() and any((path / n).is_file() for n in OFFICIAL_WEIGHTS):
        return read_official(cls, path)
    raise ValueError(
        f"'{path}' holds no Medusa heads: expected {CONFIG_NAME} + {WEIGHTS_NAME} (accel's format) or "
        f"{OFFICIAL_CONFIG} + {OFFICIAL_WEIGHTS[1]} (the official Medusa format)"
    )


def read_ours(cls: type[Heads], folder: Path) -> Heads:
    """Heads saved by :func:`save_heads` in ``folder``."""
    cfg_file = folder / CONFIG_NAME
    cfg = _read_json(cfg_file)
    ints = {}
    for key in ("num_heads", "num_layers", "hidden_size", "vocab_size"):
        value = cfg.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < (0 if key == "num_layers" else 1):
            raise ValueError(f"{cfg_file}: '{key}' must be a {'non-negative' if key == 'num_layers' else 'positive'} integer, got {value!r}")
        ints[key] = value
    own = cfg.get("own_lm_head", False)
    if not isinstance(own, bool):
        raise ValueError(f"{cfg_file}: 'own_lm_head' must be true or false, got {own!r}")
    sequential = cfg.get("sequential", False)
    if not isinstance(sequential, bool):
        raise ValueError(f"{cfg_file}: 'sequential' must be true or false, got {sequential!r}")
    if sequential and ints["num_layers"] < 1:
        raise ValueError(f"{cfg_file}: sequential heads need 'num_layers' >= 1, got {ints['num_layers']}")
    acc = cfg.get("topk_accuracy")
    if acc is not None and not (
        isinstance(acc, list) and len(acc) == ints["num_heads"]
        and all(isinstance(r, list) and all(isinstance(x, (int, float)) for x in r) for r in acc)
    ):
        raise ValueError(f"{cfg_file}: 'topk_accuracy' must be a list of {ints['num_heads']} lists of numbers")
    subset_size = cfg.get("vocab_subset_size")
    if subset_size is not None and (not isinstance(subset_size, int) or isinstance(subset_size, bool)
                                    or not 0 < subset_size <= ints["vocab_size"]):
        raise ValueError(f"{cfg_file}: 'vocab_subset_size' must be null or an integer in 1..vocab_size, got {subset_size!r}")
    info = {k: v for k, v in cfg.items()
            if k not in {"format", "format_version", "own_lm_head", "sequential", "vocab_subset_size", *ints}}
    heads = cls(own_lm_head=own, info=info, sequential=sequential, **ints)
    if subset_size:
        heads.vocab_subset = torch.zeros(subset_size, dtype=torch.long)  # shape placeholder, loaded below
    weights_file = folder / WEIGHTS_NAME
    state = _read_safetensors(weights_file)
    _load_state(heads, state, weights_file)
    return heads


# --------------------------------------------------------------------------- the official format


def read_official(cls: type[Heads], folder: str | os.PathLike) -> Heads:
    """Heads saved in the official Medusa format (see the module docstring) in ``folder``, as
    heads of class ``cls`` with their own output layers."""
    folder = Path(folder)
    cfg_file = folder / OFFICIAL_CONFIG
    cfg = _read_json(cfg_file)
    num_heads, num_layers = cfg.get("medusa_num_heads"), cfg.get("medusa_num_layers")
    for key, value in (("medusa_num_heads", num_heads), ("medusa_num_layers", num_layers)):
        if not isinstance(value, int) or isinstance(value, bool) or value < (1 if key == "medusa_num_heads" else 0):
            raise ValueError(f"{cfg_file}: '{key}' must be a {'positive' if key == 'medusa_num_heads' else 'non-negative'} integer, got {value!r}")
    weights_file = next((folder / n for n in OFFICIAL_WEIGHTS if (folder / n).is_file()), None)
    if weights_file is None:
        raise FileNotFoundError(f"'{folder}' has {OFFICIAL_CONFIG} but no {' or '.join(OFFICIAL_WEIGHTS)}")
    if weights_file.suffix == ".pt":
        try:
            raw = torch.load(weights_file, map_location="cpu", weights_only=True)
        except Exception as err:  # pickle errors come in many types
            raise ValueError(
                f"{weights_file}: not a plain state dict that torch.load(weights_only=True) can read "
                f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})"
            ) from None
    else:
        raw = _read_safetensors(weights_file)
    if not isinstance(raw, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in raw.items()):
        raise ValueError(f"{weights_file}: expected a state dict (names -> tensors), got {type(raw).__name__}")
    prefix = "medusa_head."
    if raw and all(k.startswith(prefix) for k in raw):
        raw = {k[len(prefix):]: v for k, v in raw.items()}
    final = f"0.{num_layers}.weight"
    if final not in raw or raw[final].dim() != 2:
        raise ValueError(
            f"{weights_file}: missing '{final}' (head 0's vocabulary projection after {num_layers} residual "
            f"block(s), per {cfg_file.name}'s medusa_num_layers={num_layers})"
        )
    vocab_size, hidden_size = raw[final].shape
    state = {}
    for k in range(num_heads):
        for l in range(num_layers):
            for part in ("weight", "bias"):
                state[f"heads.{k}.blocks.{l}.linear.{part}"] = _take(raw, f"{k}.{l}.linear.{part}", weights_file)
        state[f"heads.{k}.lm_head.weight"] = _take(raw, f"{k}.{num_layers}.weight", weights_file)
    if raw:
        extra = sorted(raw)
        raise ValueError(
            f"{weights_file}: {len(extra)} unexpected tensors (e.g. '{extra[0]}'); does {cfg_file.name} "
            f"(medusa_num_heads={num_heads}, medusa_num_layers={num_layers}) describe this file?"
        )
    info = {"base_model": cfg.get("base_model_name_or_path"), "source": f"official Medusa format ({weights_file.name})"}
    heads = cls(num_heads, hidden_size, vocab_size, num_layers, own_lm_head=True, info=info)
    _load_state(heads, state, weights_file)
    return heads


# --------------------------------------------------------------------------- reading and checking


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"'{path}' does not exist") from None
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise ValueError(f"{path}: not a readable JSON file ({err})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    if not path.is_file():
        raise FileNotFoundError(f"'{path}' does not exist")
    try:
        return load_file(str(path))
    except Exception as err:  # SafetensorError, OSError, ...
        raise ValueError(f"{path}: not a readable safetensors file ({err})") from None


def _take(raw: dict[str, torch.Tensor], key: str, where: Path) -> torch.Tensor:
    if key not in raw:
        raise ValueError(f"{where}: missing tensor '{key}'")
    return raw.pop(key)


def _describe(heads: torch.nn.Module) -> str:
    return (f"config: {heads.num_heads} {'sequential' if heads.sequential else 'independent'} heads x "
            f"{heads.num_layers} layers, own_lm_head={heads.own_lm_head}")


def _load_state(heads: torch.nn.Module, state: dict[str, torch.Tensor], where: Path) -> None:
    """Check names and shapes against ``heads`` and load (as float32); ValueError otherwise."""
    expected = heads.state_dict()
    missing = [k for k in expected if k not in state]
    if missing:
        raise ValueError(f"{where}: missing tensor '{missing[0]}'" + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")
                         + f" ({_describe(heads)})")
    extra = [k for k in state if k not in expected]
    if extra:
        raise ValueError(f"{where}: unexpected tensor '{extra[0]}'" + (f" and {len(extra) - 1} more" if len(extra) > 1 else "")
                         + f" ({_describe(heads)})")
    for k, v in expected.items():
        if tuple(state[k].shape) != tuple(v.shape):
            raise ValueError(f"{where}: tensor '{k}' has shape {tuple(state[k].shape)}, expected {tuple(v.shape)} "
                             f"(hidden_size={heads.hidden_size}, vocab_size={heads.vocab_size}, {_describe(heads)})")
        if state[k].is_floating_point() != v.is_floating_point():
            raise ValueError(f"{where}: tensor '{k}' has dtype {state[k].dtype}, expected {'a floating point' if v.is_floating_point() else 'an integer'} type")
    subset = state.pop("vocab_subset", None)
    heads.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    if subset is not None:
        subset = subset.long()
        if subset.numel() and (int(subset.min()) < 0 or int(subset.max()) >= heads.vocab_size
                               or not bool((subset[1:] > subset[:-1]).all())):
            raise ValueError(f"{where}: 'vocab_subset' must hold sorted, distinct token ids in 0..{heads.vocab_size - 1}")
        heads.vocab_subset = subset
