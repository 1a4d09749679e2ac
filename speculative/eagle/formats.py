"""Files of EAGLE drafts: the EAGLE-3 format vLLM and SGLang read, and EAGLE-1 checkpoints.

- EAGLE-3: ``config.json`` (``architectures: ["LlamaForCausalLMEagle3"]``, the Llama fields
  of the one layer, ``vocab_size`` of the target, ``draft_vocab_size``, optionally
  ``target_hidden_size``, and the target layers read in
  ``eagle_config.eagle_aux_hidden_state_layer_ids``; absent, vLLM's default ``(2, L // 2, L - 3)``)
  and ``model.safetensors`` (or ``pytorch_model.bin``) with ``fc.weight`` [H, 3 H_t],
  ``midlayer.{self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj, input_layernorm,
  hidden_norm, post_attention_layernorm}.weight``, ``norm.weight``, ``lm_head.weight``
  [V_d, H], ``d2t`` [V_d] (target id = draft id + d2t), ``t2d`` [V] (bool: in the draft
  vocabulary; ignored on reading), optionally ``embed_tokens.weight``. ``layers.0.`` for
  ``midlayer.`` is read too. :func:`save_eagle` writes this format.
- EAGLE-1: ``config.json`` (a one-layer Llama config) and weights ``fc.weight`` [H, 2 H]
  (optionally ``fc.bias``), ``layers.0.{self_attn.*, mlp.*, post_attention_layernorm}.weight``,
  optionally ``embed_tokens.weight``; read only.

Readers raise FileNotFoundError for a missing folder or file and ValueError naming the file and
the problem for a malformed one. Weights come back float32. Pickled weights are read with
``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from accel.files import atomic_path, write_text_atomic
from accel.strategy import FINAL_HIDDEN

from .layer import EagleLayer, EagleSpec

__all__ = ["CONFIG_NAME", "WEIGHTS_NAME", "EAGLE3_ARCH", "DEFAULT_DRAFT_DIR", "resolve_draft_dir", "read_eagle",
           "save_eagle", "read_spec"]

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
WEIGHT_FILES = (WEIGHTS_NAME, "pytorch_model.bin")
EAGLE3_ARCH = "LlamaForCausalLMEagle3"
# Where the default model's draft goes (``accel train-eagle --model default``; its config's
# ``accel_training`` says how it was made). None ships yet: docs/EAGLE.md.
DEFAULT_DRAFT_DIR = Path(__file__).resolve().parent.parent / "heads" / "eagle"


def resolve_draft_dir(draft: str | os.PathLike) -> Path:
    """The folder named by ``draft``: ``"default"`` is :data:`DEFAULT_DRAFT_DIR` (an error naming
    ``accel train-eagle`` where no draft is there), anything else a path (checked when read)."""
    if os.fspath(draft) == "default":
        if not (DEFAULT_DRAFT_DIR / CONFIG_NAME).is_file():
            raise FileNotFoundError(f"no EAGLE draft is shipped in '{DEFAULT_DRAFT_DIR}'; train one with "
                                    "`accel train-eagle --model default --out DIR` and pass draft=DIR")
        return DEFAULT_DRAFT_DIR
    return Path(draft).expanduser()


def _read_config(folder: Path) -> dict[str, Any]:
    if not folder.is_dir():
        raise FileNotFoundError(f"EAGLE draft folder '{folder}' does not exist")
    file = folder / CONFIG_NAME
    if not file.is_file():
        raise FileNotFoundError(f"'{folder}' holds no {CONFIG_NAME}; an EAGLE draft needs one")
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise ValueError(f"{file}: unreadable JSON ({err})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{file}: expected a JSON object")
    return config


def _read_weights(folder: Path) -> tuple[dict[str, torch.Tensor], Path]:
    file = next((folder / n for n in WEIGHT_FILES if (folder / n).is_file()), None)
    if file is None:
        raise FileNotFoundError(f"'{folder}' holds no weights ({' or '.join(WEIGHT_FILES)})")
    try:
        if file.suffix == ".safetensors":
            from safetensors.torch import load_file

            state = load_file(str(file))
        else:
            state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - any reader error is a bad file
        raise ValueError(f"{file}: unreadable weights ({type(err).__name__}: {err})") from None
    if not isinstance(state, dict):
        raise ValueError(f"{file}: expected a state dict")
    out = {}
    for key, value in state.items():
        key = key[len("model."):] if key.startswith("model.") else key
        key = "midlayer." + key[len("layers.0."):] if key.startswith("layers.0.") else key
        out[key] = value
    return out, file


def _int(config: dict[str, Any], key: str, file: Path, default: Any = None) -> int:
    value = config.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{file}: '{key}' must be a positive integer, got {value!r}")
    return value


def read_spec(config: dict[str, Any], state: dict[str, torch.Tensor], where: Path) -> EagleSpec:
    """The draft's shape from its config and weights (ValueError naming what is wrong)."""
    file = where / CONFIG_NAME
    H = _int(config, "hidden_size", file)
    heads = _int(config, "num_attention_heads", file)
    kv = _int(config, "num_key_value_heads", file, heads)
    head_dim = _int(config, "head_dim", file, H // heads if H % heads == 0 else None)
    vocab = _int(config, "vocab_size", file)
    fc = state.get("fc.weight")
    if fc is None or fc.dim() != 2:
        raise ValueError(f"{where}: the weights hold no 2-D 'fc.weight'; not an EAGLE draft")
    archs = [str(a) for a in config.get("architectures") or []]
    eagle3 = any("eagle3" in a.lower() for a in archs) or "midlayer.hidden_norm.weight" in state or "d2t" in state
    if eagle3:
        eagle_config = config.get("eagle_config") or {}
        ids = eagle_config.get("eagle_aux_hidden_state_layer_ids", config.get("eagle_aux_hidden_state_layer_ids"))
        if ids is not None and (not isinstance(ids, (list, tuple)) or len(ids) != 3
                                or not all(isinstance(i, int) and i >= 0 for i in ids)):
            raise ValueError(f"{file}: eagle_aux_hidden_state_layer_ids must be three layer ids, got {ids!r}")
        target_hidden = _int(config, "target_hidden_size", file, H)
        if tuple(fc.shape) != (H, 3 * target_hidden):
            raise ValueError(f"{where}: fc.weight has shape {tuple(fc.shape)}, expected [{H}, {3 * target_hidden}] "
                             f"(hidden_size {H}, three target layers of {target_hidden})")
        draft_vocab = _int(config, "draft_vocab_size", file, vocab)
        layer_ids = tuple(ids) if ids is not None else ()
    else:
        target_hidden, draft_vocab, layer_ids = H, vocab, (FINAL_HIDDEN,)
        if tuple(fc.shape) != (H, 2 * H):
            raise ValueError(f"{where}: fc.weight has shape {tuple(fc.shape)}; an EAGLE-1 draft of hidden size {H} "
                             f"has [{H}, {2 * H}] and an EAGLE-3 one names {EAGLE3_ARCH} in its config")
    return EagleSpec(
        kind="eagle3" if eagle3 else "eagle1", hidden_size=H, intermediate_size=_int(config, "intermediate_size", file),
        num_heads=heads, num_kv_heads=kv, head_dim=head_dim, vocab_size=vocab, draft_vocab_size=draft_vocab,
        target_hidden_size=target_hidden, layer_ids=layer_ids, rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        norm_before_residual=bool(config.get("norm_before_residual", False)),
        attention_bias=bool(config.get("attention_bias", False)), fc_bias="fc.bias" in state, config=config)


def read_eagle(folder: str | os.PathLike) -> EagleLayer:
    """The EAGLE draft in ``folder`` (EAGLE-3 or EAGLE-1), float32, in eval mode."""
    folder = Path(folder).expanduser()
    config = _read_config(folder)
    state, file = _read_weights(folder)
    spec = read_spec(config, state, folder)
    state.pop("t2d", None)
    if spec.kind == "eagle3" and "d2t" not in state:
        if spec.draft_vocab_size != spec.vocab_size:
            raise ValueError(f"{file}: a draft vocabulary of {spec.draft_vocab_size} of {spec.vocab_size} tokens "
                             "needs a 'd2t' table")
        state["d2t"] = torch.zeros(spec.draft_vocab_size, dtype=torch.long)
    layer = EagleLayer(spec, own_embed="embed_tokens.weight" in state)
    expected = layer.state_dict()
    missing = sorted(set(expected) - set(state))
    extra = sorted(set(state) - set(expected))
    if missing or extra:
        raise ValueError(f"{file}: weights do not match an {spec.kind.upper()} layer"
                         + (f"; missing {missing}" if missing else "") + (f"; unexpected {extra}" if extra else ""))
    for key, value in expected.items():
        if tuple(state[key].shape) != tuple(value.shape):
            raise ValueError(f"{file}: '{key}' has shape {tuple(state[key].shape)}, the config implies {tuple(value.shape)}")
    d2t = state["d2t"] if spec.kind == "eagle3" else None
    if d2t is not None:
        targets = torch.arange(d2t.numel()) + d2t.long()
        if d2t.dtype.is_floating_point or int(targets.min()) < 0 or int(targets.max()) >= spec.vocab_size:
            raise ValueError(f"{file}: 'd2t' maps draft ids outside the target vocabulary of {spec.vocab_size}")
        state["d2t"] = d2t.long()
    layer.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()})
    layer.source = str(folder)
    return layer.eval()


def save_eagle(layer: EagleLayer, folder: str | os.PathLike, dtype: torch.dtype | None = None,
               extra: dict[str, Any] | None = None) -> Path:
    """Write an EAGLE-3 draft to ``folder`` in the format vLLM and SGLang read (see the
    module docstring): ``config.json`` and ``model.safetensors`` with ``t2d`` derived from
    ``d2t``. ``dtype``: the floating weights' dtype (default: as they are). ``extra``: more
    config fields (training facts). Returns the folder."""
    from safetensors.torch import save_file

    spec = layer.spec
    if spec.kind != "eagle3":
        raise ValueError("only EAGLE-3 drafts are saved (an EAGLE-1 draft reads other features)")
    folder = Path(folder)
    state = {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).detach().contiguous().cpu()
             for k, v in layer.state_dict().items()}
    t2d = torch.zeros(spec.vocab_size, dtype=torch.bool)
    t2d[torch.arange(spec.draft_vocab_size) + state["d2t"]] = True
    state["t2d"] = t2d
    config = dict(spec.config)
    config.update(
        architectures=[EAGLE3_ARCH], model_type="llama", hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size, num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads, head_dim=spec.head_dim, num_hidden_layers=1,
        vocab_size=spec.vocab_size, draft_vocab_size=spec.draft_vocab_size,
        target_hidden_size=spec.target_hidden_size, rms_norm_eps=spec.rms_norm_eps, hidden_act="silu",
        tie_word_embeddings=False, attention_bias=spec.attention_bias, norm_before_residual=spec.norm_before_residual,
    )
    eagle_config = dict(config.get("eagle_config") or {})
    eagle_config["use_aux_hidden_state"] = True
    if spec.layer_ids:
        eagle_config["eagle_aux_hidden_state_layer_ids"] = list(spec.layer_ids)
    config["eagle_config"] = eagle_config
    if dtype is not None:
        config["torch_dtype"] = str(dtype).replace("torch.", "")
    config.update(extra or {})
    folder.mkdir(parents=True, exist_ok=True)
    with atomic_path(folder / WEIGHTS_NAME) as tmp:
        save_file(state, str(tmp))
    write_text_atomic(folder / CONFIG_NAME, json.dumps(config, indent=2, sort_keys=True) + "\n")
    return folder
