"""The one module that touches transformers internals.

Everything accel needs from a Hugging Face causal LM goes through here: the cache base
classes the model's forward accepts, the backbone forward with explicit position ids and
masks, the output head, the model's geometry, the logits warpers, and the attention hook
that captures the observation-window queries during the prefill. A transformers upgrade
should be this file's work alone.
"""

from __future__ import annotations

import functools
import inspect
import math
import sys
import threading
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import Cache, DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import AttentionInterface
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

__all__ = [
    "Geometry",
    "TransformersCache",
    "check_causal_lm",
    "geometry",
    "backbone_forward",
    "replace_embeddings",
    "output_logits",
    "make_warpers",
    "QueryLayout",
    "query_layout",
    "check_window_queries",
    "capture_window_queries",
    "capture_step_queries",
    "capture_queries_at",
    "capture_layer_states",
    "rotary_embedding",
    "per_layer_masks",
    "layer_windows",
    "query_groups",
    "packed_gqa_attention",
    "ordered_attention",
    "ordered_capable",
    "default_eos",
    "context_length",
    "DecoderWeights",
    "decoder_weights",
    "has_hooks",
]


# --------------------------------------------------------------------------- model facts


@dataclass(frozen=True)
class Geometry:
    """Shapes of a decoder's KV cache."""

    num_layers: int
    num_kv_heads: int
    num_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device

    def entry_bytes(self, batch: int = 1) -> int:
        """Bytes of one token's K and V over all layers and KV heads."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * batch * self.num_kv_heads * self.head_dim * itemsize


def check_causal_lm(model: Any, where: str | None = None) -> None:
    """Raise a ValueError naming the class unless ``model`` is, or describes, a decoder-only
    causal LM. The one such check: loaders call it on a config before loading any weights
    and on the model they built, ``generate`` on the model it is given.

    model: a loaded model, or a transformers ``PretrainedConfig`` (checked by its
        ``model_type`` and ``architectures``: AutoModelForCausalLM must know them, and it
        must not be an encoder).
    where: how the message names the source, e.g. ``"'/path/to/checkpoint'"``.
    """
    from transformers import PretrainedConfig

    if isinstance(model, PretrainedConfig):
        _check_causal_config(model, where or "the config")
        return
    name = type(model).__name__
    src = f"{where} holds a {name}: " if where else ""
    if not isinstance(model, PreTrainedModel):
        raise ValueError(f"{src}accel needs a transformers PreTrainedModel causal LM, got {name}")
    config = model.config
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"{src}{name} is an encoder-decoder model; accel handles decoder-only causal LMs")
    if model.get_output_embeddings() is None or not hasattr(model, "get_decoder"):
        raise ValueError(f"{src}{name} is not a causal language model (it has no output head); load it with AutoModelForCausalLM")
    if not getattr(model, "can_generate", lambda: False)():
        raise ValueError(f"{src}{name} cannot generate text; load a causal LM with AutoModelForCausalLM")


def _causal_lm_class_names() -> set[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    names: set[str] = set()
    for value in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        names.update([value] if isinstance(value, str) else value)
    return names


def _check_causal_config(config: Any, where: str) -> None:
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


def geometry(model: PreTrainedModel) -> Geometry:
    cfg = model.config.get_text_config(decoder=True)
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    param = next(model.parameters())
    return Geometry(
        num_layers=cfg.num_hidden_layers,
        num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
        num_heads=heads,
        head_dim=head_dim,
        dtype=param.dtype,
        device=param.device,
    )


def context_length(model: PreTrainedModel) -> int | None:
    """The most positions the model was built for (``max_position_embeddings``), or None."""
    cfg = model.config.get_text_config(decoder=True)
    limit = getattr(cfg, "max_position_embeddings", None)
    return int(limit) if limit else None


def default_eos(model: PreTrainedModel, tokenizer: Any = None) -> list[int]:
    """End-of-sequence ids as ``model.generate`` would use them."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if eos is None:
        return []
    return [int(e) for e in eos] if isinstance(eos, (list, tuple)) else [int(eos)]


# --------------------------------------------------------------------------- the cache


class _Layer(DynamicLayer):
    """A transformers cache layer whose storage is owned by :class:`TransformersCache`.

    It holds its owner by a weak proxy: a strong reference would make every cache a reference
    cycle (cache -> layers -> cache), which only Python's cyclic collector frees, so a dropped
    cache's KV tensors would stay allocated until its next full collection."""

    def __init__(self, owner: "TransformersCache", idx: int):
        super().__init__()
        self._owner = weakref.proxy(owner)
        self._idx = idx

    def update(self, key_states, value_states, *args, **kwargs):
        return self._owner._store(self._idx, key_states, value_states)

    def get_seq_length(self) -> int:
        return self._owner.physical_length(self._idx)

    def lazy_initialization(self, key_states, value_states) -> None:  # storage is lazy already
        self.is_initialized = True


class TransformersCache(Cache):
    """A transformers ``Cache`` whose layers delegate storage to two methods.

    Subclasses implement ``_store(layer_idx, keys, values) -> (keys_all, values_all)``
    (called inside each attention layer with the new ``[B, H_kv, T, D]`` entries; returns
    what that layer attends to) and ``physical_length(layer_idx)`` (entries stored). Masks
    built by transformers index the physical entries, so a causal mask stays right for
    compressed caches; position ids always come from the caller.
    """

    def __init__(self, num_layers: int):
        super().__init__(layers=[_Layer(self, i) for i in range(num_layers)])

    def _store(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor):
        raise NotImplementedError

    def physical_length(self, layer_idx: int = 0) -> int:
        raise NotImplementedError

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.physical_length(layer_idx)


# --------------------------------------------------------------------------- forward


@functools.lru_cache(maxsize=None)
def _cache_kwarg(decoder_cls: type) -> str:
    """transformers renamed ``past_key_values`` to ``cache`` during 5.x."""
    params = inspect.signature(decoder_cls.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def backbone_forward(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    cache: Cache,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run the decoder stack (no output head).

    input_ids: [B, T]; position_ids: [B, T] (from the cache's logical length);
    attention_mask: None (causal over the cache) or an additive float mask
    [B, 1, T, P + T] over the P stored entries and the T new ones.
    Returns the final (normed) hidden states [B, T, H].
    """
    decoder = model.get_decoder()
    kwargs = {_cache_kwarg(type(decoder)): cache}
    out = decoder(
        input_ids=input_ids,
        position_ids=position_ids,
        attention_mask=attention_mask,
        use_cache=True,
        **kwargs,
    )
    return out.last_hidden_state


class _FlatLayer(tuple):
    """One decoder layer's parts for :func:`flat_forward`: (input norm, attention module,
    q, k, v, o linears, post-attention norm, gate, up, down linears, activation)."""


def flat_layers(model: PreTrainedModel) -> tuple[list[_FlatLayer] | None, str]:
    """The decoder layers of ``model`` as the parts :func:`flat_forward` calls, or (None, why
    not): Llama-family layers (:data:`LEAN_ARCHITECTURES`: RMS norms, rotary attention with
    q/k/v/o projections, a gated MLP) on sdpa (or accel's packed sdpa, which
    :func:`packed_gqa_attention` switches sdpa and flash-attention models to), without sliding
    windows. The projections may be any modules (``nn.Linear``,
    :class:`accel.kernels.cpu.PackedLinear`, quantized layers)."""
    cfg = model.config.get_text_config(decoder=True)
    kind = getattr(cfg, "model_type", None)
    if kind not in LEAN_ARCHITECTURES:
        return None, f"its architecture ({kind}) is not one of {', '.join(LEAN_ARCHITECTURES)}"
    if any(w is not None for w in layer_windows(model)):
        return None, "it has sliding-window layers"
    impl = getattr(cfg, "_attn_implementation", None)
    if impl not in ("sdpa", _PACKED) or AttentionInterface._global_mapping.get(impl) is None:
        # flash-attention takes no additive masks; accel's calls run it as packed sdpa (packed_gqa_attention)
        return None, f"its attention is {impl}, not sdpa"
    layers, why, _ = _structure(model)
    return layers, why


def _walk_layers(decoder: torch.nn.Module) -> tuple[list[_FlatLayer] | None, str]:
    if not all(hasattr(decoder, name) for name in ("embed_tokens", "rotary_emb", "norm", "layers")):
        return None, "its decoder lacks embed_tokens, rotary_emb, norm or layers"
    out = []
    for layer in decoder.layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        parts = [getattr(layer, "input_layernorm", None), attn]
        parts += [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        parts.append(getattr(layer, "post_attention_layernorm", None))
        parts += [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj", "act_fn")]
        if any(p is None for p in parts) or not all(type(n).__name__.endswith("RMSNorm") for n in (parts[0], parts[6])):
            return None, f"its decoder layers ({type(layer).__name__}) are not Llama-shaped"
        foreign = [type(m).__name__ for m in (layer, attn, mlp, parts[0], parts[6]) if not _transformers_class(m)]
        if foreign:  # a subclass of the user's may compute something else: run its own forward
            return None, f"its {foreign[0]} is not transformers' own class"
        out.append(_FlatLayer(parts))
    return out, ""


def flat_forward(
    model: PreTrainedModel,
    layers: list[_FlatLayer],
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    cache: Cache,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`backbone_forward` of a model :func:`flat_layers` covers, without transformers'
    module calls between the operations (``nn.Module.__call__`` of each layer, attention,
    MLP, norm and projection, the mask and cache plumbing): the same operations in the same
    order, so the same numbers (tested, bit for bit), 1.08-1.15x the tokens per second of
    transformers' forward on the default model (docs/COMPILED.md).

    layers: :func:`flat_layers` of ``model``; the rest as :func:`backbone_forward`. Masks
    that differ per layer come from the cache (:meth:`accel.cache.SharedCache.layer_mask`),
    as :func:`per_layer_masks` hands them to transformers' layers.
    """
    decoder = model.get_decoder()
    b, t = input_ids.shape
    attention = AttentionInterface._global_mapping[model.config.get_text_config(decoder=True)._attn_implementation]
    uniform = getattr(cache, "uniform_masks", True)
    plan = getattr(cache, "query_plan", None)
    if plan is not None and not plan.active():
        plan = None
    x = decoder.embed_tokens.forward(input_ids)
    cos, sin = decoder.rotary_emb(x, position_ids=position_ids)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    for idx, (norm1, attn, q_proj, k_proj, v_proj, o_proj, norm2, gate, up, down, act) in enumerate(layers):
        h = norm1.forward(x)
        shape = (b, t, -1, attn.head_dim)
        q = q_proj.forward(h).view(shape).transpose(1, 2)
        k = k_proj.forward(h).view(shape).transpose(1, 2)
        v = v_proj.forward(h).view(shape).transpose(1, 2)
        q = (q * cos) + (rotate_half(q) * sin)
        k = (k * cos) + (rotate_half(k) * sin)
        if plan is not None:  # what predict_queries' hooks do on transformers' forward
            if idx == 0 or not plan.ahead:
                plan.plan(idx, q)
            if plan.ahead and idx + 1 < len(layers):
                nq = layers[idx + 1][2].forward(h).view(shape).transpose(1, 2)
                plan.plan(idx + 1, (nq * cos) + (rotate_half(nq) * sin))
        k, v = cache.update(k, v, idx)
        mask = attention_mask if uniform else cache.layer_mask(idx)
        out, _ = attention(attn, q, k, v, mask, dropout=0.0, scaling=attn.scaling)
        x = x + o_proj.forward(out.reshape(b, t, -1).contiguous())
        h = norm2.forward(x)
        x = x + down.forward(act(gate.forward(h)) * up.forward(h))
    return decoder.norm.forward(x)


def _transformers_class(module: torch.nn.Module) -> bool:
    return type(module).__module__.startswith("transformers.")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] -> [-x2, x1] of its two halves: rotary embeddings as Llama applies them."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def output_logits(model: PreTrainedModel, hidden: torch.Tensor) -> torch.Tensor:
    """The model's output head on hidden states [..., H] -> float32 logits [..., V]."""
    logits = model.get_output_embeddings()(hidden)
    cfg = model.config.get_text_config(decoder=True)
    scale = logits_scale(model)  # Granite divides its logits
    if scale != 1:
        logits = logits / scale
    cap = getattr(cfg, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits.float()


def final_norm_weight(model: PreTrainedModel) -> torch.Tensor | None:
    """The weight of the norm the decoder applies before the output head ([H]), or None when
    the decoder has no RMS/LayerNorm-style ``norm`` with a weight."""
    norm = getattr(model.get_decoder(), "norm", None)
    weight = getattr(norm, "weight", None)
    return weight if isinstance(weight, torch.Tensor) else None


def logits_scale(model: PreTrainedModel) -> float:
    """What the model divides its output head's logits by (Granite's ``logits_scaling``; 1 else)."""
    scale = getattr(model.config.get_text_config(decoder=True), "logits_scaling", None)
    return float(scale) if scale else 1.0


def make_warpers(temperature: float, top_k: int | None, top_p: float | None) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """transformers' temperature / top-k / top-p warpers as one function on logits [N, V].

    Returns None for greedy decoding (temperature == 0).
    """
    if temperature == 0:
        return None
    procs = LogitsProcessorList()
    if temperature != 1.0:
        procs.append(TemperatureLogitsWarper(temperature))
    if top_k is not None and top_k > 0:
        procs.append(TopKLogitsWarper(top_k))
    if top_p is not None and top_p < 1.0:
        procs.append(TopPLogitsWarper(top_p))

    def warp(logits: torch.Tensor) -> torch.Tensor:
        dummy = torch.zeros((logits.shape[0], 1), dtype=torch.long, device=logits.device)
        return procs(dummy, logits)

    return warp


# --------------------------------------------------------------------------- attention modules

#: Keyword under which an attention layer receives the cache: ``cache`` (transformers 5.x),
#: ``past_key_values`` (before the rename), ``layer_past`` (GPT-NeoX).
_CACHE_KWARGS = ("cache", "past_key_values", "layer_past")


def _layer_index(module: torch.nn.Module) -> int | None:
    idx = getattr(module, "layer_idx", None)
    return idx if isinstance(idx, int) and not isinstance(idx, bool) else None


def _attention_modules(model: PreTrainedModel) -> list[torch.nn.Module]:
    """The attention module of every decoder layer, in layer order.

    An attention module is an innermost module that carries a ``layer_idx`` (some decoder
    layers carry one too, e.g. Gemma3's; their attention sits inside them). Raises a
    ValueError naming the model class unless there is exactly one per layer.
    """
    name = type(model).__name__
    tagged = [m for m in model.modules() if _layer_index(m) is not None]
    inner = [m for m in tagged if not any(c is not m and _layer_index(c) is not None for c in m.modules())]
    if not inner:
        raise ValueError(f"{name}: found no attention modules (modules with a layer_idx); accel cannot hook its layers")
    num_layers = model.config.get_text_config(decoder=True).num_hidden_layers
    found = sorted(_layer_index(m) for m in inner)
    if found != list(range(num_layers)):
        raise ValueError(
            f"{name}: expected one attention module per layer 0..{num_layers - 1}, found layer indices {found}"
        )
    return sorted(inner, key=_layer_index)


# --------------------------------------------------------------------------- window queries


@dataclass(frozen=True)
class QueryLayout:
    """How one attention layer computes its queries, read off the module's attributes.

    projection: the attribute holding the query projection, one of
        ``"q_proj"`` (Llama family, with or without bias): output [.., H_q * D];
        ``"qkv_proj"`` (Phi3): fused [q | k | v], queries are the first H_q * D outputs;
        ``"query_key_value"`` (GPT-NeoX / Pythia): per head [q | k | v], [.., H_q, 3 * D].
    num_heads: H_q. head_dim: D.
    norm: where the layer's ``q_norm`` runs: None (no q_norm), ``"head"`` (over each head's
        D features: Qwen3, Gemma3) or ``"projection"`` (over all H_q * D features, before
        the head split: OLMo2).
    scale: factor on the captured queries so that ``q k^T / sqrt(D)``, the logit SnapKV
        scores with, is the layer's own logit ``q k^T * module.scaling``; it is
        ``module.scaling * sqrt(D)``, 1.0 for the usual ``1 / sqrt(D)`` (Gemma2/3 scale by
        ``query_pre_attn_scalar``, Granite by ``attention_multiplier``).
    rope: the modeling module's ``apply_rotary_pos_emb(q, k, cos, sin)``. Partial rotary
        (``cos`` narrower than D, GPT-NeoX ``rotary_ndims``) rotates the first features only.
    """

    projection: str
    num_heads: int
    head_dim: int
    norm: str | None
    scale: float
    rope: Callable


_PROJECTIONS = ("q_proj", "qkv_proj", "query_key_value")


@functools.lru_cache(maxsize=None)
def _rotary_function(attention_cls: type) -> tuple[Callable | None, str]:
    """The ``apply_rotary_pos_emb(q, k, cos, sin)`` an attention class uses, or (None, why)."""
    params = inspect.signature(attention_cls.forward).parameters
    if "position_embeddings" not in params:
        return None, "its forward takes no position_embeddings (rotary (cos, sin) pairs)"
    rope = getattr(sys.modules[attention_cls.__module__], "apply_rotary_pos_emb", None)
    if rope is None:
        return None, f"its module {attention_cls.__module__} has no apply_rotary_pos_emb"
    if list(inspect.signature(_kernelized_function(rope)).parameters)[:4] != ["q", "k", "cos", "sin"]:
        return None, "its apply_rotary_pos_emb does not take (q, k, cos, sin)"
    return rope, ""


def _kernelized_function(rope: Callable) -> Callable:
    """The Python function behind ``rope``, for reading its signature.

    With the ``kernels`` package installed, transformers >= 5.25 decorates each modeling
    module's ``apply_rotary_pos_emb`` with ``use_kernel_forward_from_hub``, which replaces the
    function by an ``nn.Module`` instance whose ``forward(*args, **kwargs)`` calls a Hub kernel
    when the model was kernelized and the original function otherwise. accel calls ``rope``
    itself (so its queries are rotated by whatever the model's own attention runs) and reads
    the signature of the function the module closes over.
    """
    if not isinstance(rope, torch.nn.Module):
        return rope
    wrapped = inspect.getclosurevars(type(rope).forward).nonlocals.get("func")
    return wrapped if callable(wrapped) else rope


def _out_features(layer: torch.nn.Module) -> int | None:
    weight = getattr(layer, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 2:
        return int(weight.shape[0])
    out = getattr(layer, "out_features", None)  # a layer that holds its weight otherwise (int8 / int4 codes)
    return out if isinstance(out, int) else None


def query_layout(module: torch.nn.Module, owner: str) -> QueryLayout:
    """Read how ``module`` (one attention layer of model class ``owner``) computes its queries.

    Raises a ValueError naming ``owner``, the layer and what is missing when the layer's
    queries cannot be reproduced exactly (an unknown projection, a query norm other than
    ``q_norm``, no rotary position embeddings, head counts that do not fit the projection).
    """
    where = f"{owner}: prompt compression needs each layer's queries, but layer {_layer_index(module)} ({type(module).__name__})"
    cfg = getattr(module, "config", None)
    heads = getattr(cfg, "num_attention_heads", None)
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    dim = getattr(module, "head_dim", None) or getattr(module, "head_size", None)
    if not heads or not dim:
        raise ValueError(f"{where} has no head_dim / head_size or no config.num_attention_heads")
    projection = next((p for p in _PROJECTIONS if hasattr(module, p)), None)
    if projection is None:
        raise ValueError(f"{where} has none of the query projections accel reads ({', '.join(_PROJECTIONS)})")
    width = {"q_proj": heads * dim, "qkv_proj": (heads + 2 * kv_heads) * dim, "query_key_value": 3 * heads * dim}[projection]
    if _out_features(getattr(module, projection)) != width or (projection == "query_key_value" and kv_heads != heads):
        raise ValueError(
            f"{where}: its {projection} has {_out_features(getattr(module, projection))} outputs, not the {width} "
            f"that {heads} query heads ({kv_heads} KV heads) of size {dim} make"
        )
    others = [n for n, _ in module.named_children() if n.startswith("q") and "norm" in n and n != "q_norm"]
    if others:
        raise ValueError(f"{where} normalises its queries with {', '.join(others)}, which accel does not mirror")
    norm = None
    q_norm = getattr(module, "q_norm", None)
    if q_norm is not None:
        size = getattr(q_norm, "weight", None)
        size = int(size.shape[-1]) if isinstance(size, torch.Tensor) and size.dim() >= 1 else None
        if size == dim:
            norm = "head"
        elif size == heads * dim and projection != "query_key_value":
            norm = "projection"
        else:
            raise ValueError(f"{where} has a q_norm over {size} features, neither a head ({dim}) nor all heads ({heads * dim})")
    rope, why = _rotary_function(type(module))
    if rope is None:
        raise ValueError(f"{where}: {why}")
    scaling = getattr(module, "scaling", None)
    scale = 1.0 if scaling is None else float(scaling) * math.sqrt(dim)
    if math.isclose(scale, 1.0, rel_tol=1e-9):
        scale = 1.0
    return QueryLayout(projection, int(heads), int(dim), norm, scale, rope)


def check_window_queries(model: PreTrainedModel) -> None:
    """Raise a ValueError (naming the model class and what is missing) unless
    :func:`capture_window_queries` can reproduce every layer's queries of ``model``."""
    for module in _attention_modules(model):
        query_layout(module, type(model).__name__)


def _window_queries(module: torch.nn.Module, layout: QueryLayout, hidden: torch.Tensor, pos_emb: Any,
                    window: int) -> torch.Tensor:
    """The last ``window`` queries of one attention layer, as its forward computes them.

    hidden: [B, L, H] the attention input; pos_emb: the layer's (cos, sin), each [B or 1, L, R]
    with R <= D rotary features. Returns [B, H_q, w, D]: projected, q-normed, rotated, and
    multiplied by ``layout.scale``. The model's attention logit softcapping (Gemma2's
    ``attn_logit_softcapping``) is not applied: SnapKV's votes use the uncapped logits.
    """
    x = hidden[:, -window:]  # [B, w, H]; projections and norms act per token
    b, w = x.shape[:2]
    h, d = layout.num_heads, layout.head_dim
    out = getattr(module, layout.projection)(x)
    if layout.projection == "query_key_value":
        q = out.view(b, w, h, 3 * d)[..., :d]  # [B, w, H_q, D]
    else:
        q = out[..., : h * d]  # [B, w, H_q * D]
        if layout.norm == "projection":
            q = module.q_norm(q)
        q = q.reshape(b, w, h, d)
    if layout.norm == "head":
        q = module.q_norm(q)
    q = q.transpose(1, 2)  # [B, H_q, w, D]
    if not (isinstance(pos_emb, (tuple, list)) and len(pos_emb) == 2):
        raise ValueError(f"{type(module).__name__} layer {module.layer_idx}: expected position_embeddings (cos, sin), "
                         f"got {type(pos_emb).__name__}")
    cos, sin = (t[:, -window:] for t in pos_emb)  # [B or 1, w, R]
    r = cos.shape[-1]
    if r < d:  # partial rotary: the last D - R features pass through unrotated
        q = torch.cat([layout.rope(q[..., :r], q[..., :r], cos, sin)[0], q[..., r:]], dim=-1)
    else:
        q = layout.rope(q, q, cos, sin)[0]
    return q * layout.scale if layout.scale != 1.0 else q


@contextmanager
def capture_window_queries(
    model: PreTrainedModel, cache: Cache, window: int, sink: dict[int, torch.Tensor], ends: torch.Tensor | None = None
) -> Iterator[None]:
    """While active, each attention layer's last ``window`` queries land in ``sink[layer_idx]``
    ([B, H_q, w, D], see :func:`_window_queries`) before the layer stores its keys in ``cache``.

    ends: LongTensor [B], each row's prompt length when the rows are right-padded (the
        window of row b is positions ``ends[b] - window .. ends[b] - 1``, clamped at 0);
        None: every row ends at the last position.
    Raises a ValueError on entry, before any forward, when the model's queries cannot be
    reproduced (:func:`check_window_queries`). The hooks only act on forwards that carry
    this very ``cache``, so concurrent requests on the same model do not see each other;
    they are removed on exit.
    """
    if window <= 0:
        yield
        return
    layouts = {_layer_index(m): query_layout(m, type(model).__name__) for m in _attention_modules(model)}

    def hook(module, hidden, kwargs):
        layout = layouts[module.layer_idx]
        pos_emb = kwargs.get("position_embeddings")
        if ends is not None:
            idx = (ends.to(hidden.device).unsqueeze(1) - window + torch.arange(window, device=hidden.device)).clamp(min=0)
            hidden, pos_emb = _at_positions(hidden, pos_emb, idx)
        sink[module.layer_idx] = _window_queries(module, layout, hidden, pos_emb, window)
        return None

    with _pre_attention_hook(model, cache, hook):
        yield


@contextmanager
def capture_step_queries(model: PreTrainedModel, cache: Cache, sink: dict[int, torch.Tensor]) -> Iterator[None]:
    """While active, each attention layer's queries of every new token of a forward that
    carries ``cache`` land in ``sink[layer_idx]`` ([B, H_q, T, D], computed as
    :func:`capture_window_queries` computes the prompt's): a decode step's queries, which
    eviction during decoding scores with (:mod:`accel.maintenance`). Removed on exit."""
    layouts = {_layer_index(m): query_layout(m, type(model).__name__) for m in _attention_modules(model)}

    def hook(module, hidden, kwargs):
        sink[module.layer_idx] = _window_queries(module, layouts[module.layer_idx], hidden,
                                                 kwargs.get("position_embeddings"), hidden.shape[1])
        return None

    with _pre_attention_hook(model, cache, hook):
        yield


@dataclass(frozen=True)
class QueryPlan:
    """What :func:`predict_queries` hands a cache's forwards: ``plan(layer, queries)``,
    whether layer l + 1's queries are predicted from layer l's input (``ahead``), and whether
    this forward plans at all (``active()``). :func:`flat_forward` reads it off the cache
    (``cache.query_plan``) and does what the hooks do, from the queries it computes anyway."""

    plan: Callable[[int, torch.Tensor], None]
    ahead: bool
    active: Callable[[], bool]


@contextmanager
def predict_queries(model: PreTrainedModel, cache: Cache, plan: Callable[[int, torch.Tensor], None],
                    active: Callable[[], bool], ahead: bool = True) -> Iterator[None]:
    """While active, before each attention layer l of a forward that carries ``cache`` (when
    ``active()`` says so), ``plan(l + 1, queries)`` gets the queries layer l + 1 would compute
    from layer l's attention input (InfiniGen's prediction: consecutive layers' inputs are
    alike), and before layer 0 also ``plan(0, queries)`` with layer 0's own: each ``[B, H_q,
    T, D]``, computed as :func:`capture_step_queries` computes them (projected, q-normed,
    rotated at the new tokens' positions). ``ahead=False``: ``plan(l, queries)`` with layer
    l's own queries, before layer l attends. These hooks run before any other pre-hook of the
    layer, so that a mask the plan sets is the one the layer gets; :func:`flat_forward` does
    the same itself (``cache.query_plan``), so they do not keep a forward off the flat path.
    Removed on exit."""
    modules = {_layer_index(m): m for m in _attention_modules(model)}
    layouts = {k: query_layout(m, type(model).__name__) for k, m in modules.items()}

    def hook(module, hidden, kwargs):
        if not active():
            return None
        k = module.layer_idx
        pos_emb = kwargs.get("position_embeddings")
        t = hidden.shape[1]
        if k == 0 or not ahead:
            plan(k, _window_queries(module, layouts[k], hidden, pos_emb, t))
        if ahead and k + 1 in modules:
            plan(k + 1, _window_queries(modules[k + 1], layouts[k + 1], hidden, pos_emb, t))
        return None

    cache.query_plan = QueryPlan(plan, ahead, active)
    try:
        with _pre_attention_hook(model, cache, hook, masks_only=True, prepend=True):
            yield
    finally:
        cache.query_plan = None


@contextmanager
def capture_queries_at(model: PreTrainedModel, cache: Cache, index: torch.Tensor,
                       sink: dict[int, torch.Tensor]) -> Iterator[None]:
    """While active, each attention layer's queries of chosen tokens of a forward that carries
    ``cache`` land in ``sink[layer_idx]`` ([B, H_q, w, D], computed as
    :func:`capture_window_queries` computes the prompt's).

    index: LongTensor [B, w], per row the positions (within the forward's T tokens) whose
        queries to take: a chunked prefill (:func:`accel.steps.prefill`) collects each row's
        observation window from the chunks it falls in. Removed on exit.
    """
    layouts = {_layer_index(m): query_layout(m, type(model).__name__) for m in _attention_modules(model)}

    def hook(module, hidden, kwargs):
        picked, pos_emb = _at_positions(hidden, kwargs.get("position_embeddings"), index.to(hidden.device))
        sink[module.layer_idx] = _window_queries(module, layouts[module.layer_idx], picked, pos_emb, index.shape[1])
        return None

    with _pre_attention_hook(model, cache, hook):
        yield


def _at_positions(hidden: torch.Tensor, pos_emb: Any, idx: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """The attention input [B, L, H] and its (cos, sin) at per-row positions idx [B, w]."""
    hidden = _take_rows(hidden, idx)
    if pos_emb is not None:
        pos_emb = tuple(_take_rows(p, idx) if p.shape[0] == hidden.shape[0] else p[:, idx[0]] for p in pos_emb)
    return hidden, pos_emb


@contextmanager
def replace_embeddings(model: PreTrainedModel, where: torch.Tensor | None, vectors: torch.Tensor | None) -> Iterator[None]:
    """While active, a forward's input embeddings [B, T, H] take ``vectors`` [n, H] at the n
    places where ``where`` [B, T] (bool) is True, in row-major order: what PaSS's look-ahead
    positions feed instead of a token's embedding. ``where`` None: nothing changes. The
    forward hook makes compiled steps step aside (:func:`has_hooks`). Removed on exit."""
    if where is None or not bool(where.any()):
        yield
        return
    embed = model.get_input_embeddings()

    def swap(_module, _args, out):
        if out.shape[:2] != where.shape:  # another forward (a drafter's own) passes through
            return out
        out = out.clone()
        out[where] = vectors.to(dtype=out.dtype, device=out.device)
        return out

    handle = embed.register_forward_hook(swap)
    try:
        yield
    finally:
        handle.remove()


@contextmanager
def capture_layer_states(model: PreTrainedModel, cache: Cache, layers: tuple[int, ...],
                         sink: dict[int, torch.Tensor]) -> Iterator[None]:
    """While active, the hidden states of every new token of a forward that carries ``cache``
    land in ``sink[k]`` ([B, T, H]) for each k of ``layers``: k >= 0 the input of decoder
    layer k (the residual stream after k layers), -1 the final normed hidden state (what the
    output head reads). What EAGLE drafters read (:meth:`accel.strategy.Drafter.feature_layers`);
    the forward itself is unchanged; several forwards (a chunked prefill) concatenate along T. Raises a ValueError naming the model on entry when a
    layer does not exist. Removed on exit."""
    if not layers:
        yield
        return
    decoder = model.get_decoder()
    blocks = decoder_blocks(model, "accel cannot read its hidden states")
    count = len(blocks)
    bad = [k for k in layers if not -1 <= k < count]
    if bad:
        raise ValueError(f"{type(model).__name__} has {count} decoder layers; it has no hidden states of layer(s) {bad}")

    def before(k: int):
        def hook(module, args, kwargs):
            if _cache_argument(kwargs) is cache:
                _gather_state(sink, k, kwargs.get("hidden_states", args[0] if args else None))
            return None
        return hook

    def after(module, args, kwargs, output):
        if _cache_argument(kwargs) is cache:
            _gather_state(sink, -1, output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0])
        return None

    handles = [blocks[k].register_forward_pre_hook(before(k), with_kwargs=True) for k in layers if k >= 0]
    if -1 in layers:
        handles.append(decoder.register_forward_hook(after, with_kwargs=True))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def decoder_blocks(model: PreTrainedModel, why: str = "accel needs its layers") -> list[torch.nn.Module]:
    """The decoder layers of ``model``, in order; a ValueError naming the model (and ``why``
    it needs them) where it has no layer list."""
    blocks = getattr(model.get_decoder(), "layers", None)
    count = model.config.get_text_config(decoder=True).num_hidden_layers
    if not isinstance(blocks, torch.nn.ModuleList) or len(blocks) < count:
        raise ValueError(f"{type(model).__name__}: found no decoder layer list; {why}")
    return list(blocks)[:count]


@contextmanager
def around_layers(model: PreTrainedModel, cache: Cache, before: Callable[[int], None] | None,
                  after: Callable[[int], None] | None) -> Iterator[None]:
    """While active, a forward that carries ``cache`` calls ``before(k)`` as decoder layer k
    starts and ``after(k)`` once it has run (its entries then stand in ``cache``): what the
    prefill over several processes (:mod:`accel.runahead`) fills and hands on each layer's
    entries with. Raises a ValueError naming the model on entry when it has no decoder layer
    list. Removed on exit."""
    blocks = decoder_blocks(model, "accel cannot run its layers one by one")
    handles = []
    for k, block in enumerate(blocks):
        if before is not None:
            def pre(module, args, kwargs, k=k):
                if _cache_argument(kwargs) is cache:
                    before(k)
                return None
            handles.append(block.register_forward_pre_hook(pre, with_kwargs=True))
        if after is not None:
            def post(module, args, kwargs, output, k=k):
                if _cache_argument(kwargs) is cache:
                    after(k)
                return None
            handles.append(block.register_forward_hook(post, with_kwargs=True))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _gather_state(sink: dict[int, torch.Tensor], k: int, states: torch.Tensor) -> None:
    """States of a forward join those of earlier forwards in the same capture (the chunks of a
    chunked prefill), along the token dimension."""
    sink[k] = states if k not in sink else torch.cat([sink[k], states], dim=1)


def rotary_embedding(config: Any) -> torch.nn.Module:
    """The rotary position embedding of a Llama-style ``config`` (every RoPE scaling type
    transformers knows): a module mapping ``(x [B, T, ...], position_ids [B, T])`` to
    ``(cos, sin)``, each [B, T, head_dim], in x's dtype. For draft layers that keep their own
    cache (EAGLE), apply with ``q * cos + rotate_half(q) * sin``."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    return LlamaRotaryEmbedding(config=config)


def _take_rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x [B, L, ...] at per-row positions idx [B, w] -> [B, w, ...]."""
    shape = idx.shape + (1,) * (x.dim() - 2)
    return x.gather(1, idx.view(shape).expand(*idx.shape, *x.shape[2:]))


# --------------------------------------------------------------------------- layer hooks


def _cache_argument(kwargs: dict[str, Any]) -> Any:
    return next((kwargs[k] for k in _CACHE_KWARGS if k in kwargs), None)


@contextmanager
def _pre_attention_hook(model: PreTrainedModel, cache: Any, fn: Callable, masks_only: bool = False,
                        prepend: bool = False) -> Iterator[None]:
    """Run ``fn(module, hidden_states, kwargs) -> new kwargs | None`` before every attention
    layer of the forwards that carry ``cache`` (others are untouched); removed on exit.
    ``masks_only``: ``fn`` only does what :func:`flat_forward` does itself (swaps masks, hands
    the cache its queries), so :func:`has_hooks` does not count it; ``prepend``: ``fn`` runs
    before the pre-hooks registered earlier."""

    def hook(module, args, kwargs):
        if _cache_argument(kwargs) is not cache:
            return None
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        new = fn(module, hidden, kwargs)
        return None if new is None else (args, new)

    hook.masks_only = masks_only
    handles = [m.register_forward_pre_hook(hook, with_kwargs=True, prepend=prepend) for m in _attention_modules(model)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextmanager
def per_layer_masks(model: PreTrainedModel, cache: Any) -> Iterator[None]:
    """While active, each attention layer of a forward that carries ``cache`` gets the mask
    ``cache.layer_mask(layer_idx)`` instead of the shared one, whenever the cache built masks
    that differ between layers (rows of different lengths per layer, per-head padding,
    sliding windows): transformers builds one mask for all layers of a type.
    """

    def hook(module, hidden, kwargs):
        if cache.uniform_masks:
            return None
        kwargs["attention_mask"] = cache.layer_mask(_layer_index(module))
        return kwargs

    cache.mask_hook = True
    try:
        with _pre_attention_hook(model, cache, hook, masks_only=True):
            yield
    finally:
        cache.mask_hook = False


def layer_windows(model: PreTrainedModel) -> list[int | None]:
    """Per decoder layer, its sliding-window size (a query at position p sees keys at
    positions > p - window, as transformers' sliding masks do) or None for full attention."""
    cfg = model.config.get_text_config(decoder=True)
    window = getattr(cfg, "sliding_window", None)
    layers = cfg.num_hidden_layers
    types = getattr(cfg, "layer_types", None)
    if types is not None:
        return [window if t == "sliding_attention" and window else None for t in types]
    return [window if window else None] * layers


def query_groups(model: PreTrainedModel) -> int:
    """Query heads per KV head."""
    geo = geometry(model)
    return geo.num_heads // geo.num_kv_heads


# --------------------------------------------------------------------------- verify attention

_PACKED = "accel_packed_sdpa"
_switch_lock = threading.Lock()
_switched: dict[int, list] = {}  # id(config) -> [active requests, original implementation]


def _packed_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    """transformers' sdpa, except that several query tokens with a 4-D mask over
    grouped-query heads attend without copying K and V per query head.

    transformers repeats K and V ``G`` times whenever a mask is given and more than one
    token is queried (a draft tree), which on a CPU costs as much as the attention itself
    at 4K tokens. The query heads sharing one KV head are folded into the query length
    instead: query [B, H_kv * G, T, D] -> [B, H_kv, G * T, D], mask rows repeated to match.
    Same arithmetic, no copies.
    """
    cache = getattr(_ordered, "cache", None)
    if cache is not None and attention_mask is not None and attention_mask.dim() == 4 \
            and attention_mask.dtype != torch.bool and query.shape[2] <= _ORDERED_MAX_TOKENS:
        from .kernels.ordered import attend

        return attend(query, key, value, attention_mask, cache.layout(_layer_index(module)),
                      scaling if scaling is not None else query.shape[-1] ** -0.5), None
    groups = getattr(module, "num_key_value_groups", 1)
    q_len = query.shape[2]
    mask = attention_mask
    if groups == 1 or q_len == 1 or mask is None or mask.dim() != 4 or mask.dtype == torch.bool:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    b, hq, _, d = query.shape
    hkv = hq // groups
    kv_len = key.shape[2]
    q = query.reshape(b, hkv, groups * q_len, d)
    if mask.shape[1] == 1:
        mask = _grouped_mask(mask, b, q_len, kv_len, groups)
    else:  # per query head (per-layer masks of padded caches): [B, H_q, T, K]
        mask = mask.expand(b, hq, q_len, kv_len).reshape(b, hkv, groups * q_len, kv_len)
    out = torch.nn.functional.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scaling)
    out = out.reshape(b, hq, q_len, d).transpose(1, 2).contiguous()
    return out, None


_mask_memo = threading.local()
_ordered = threading.local()
# Ordered attention gathers every query's tail of keys: sized for draft trees, not prompts
# (a longer forward runs sdpa: prompts are prefilled alike for plain and drafted decoding).
_ORDERED_MAX_TOKENS = 256


@contextmanager
def ordered_attention(cache: Any) -> Iterator[None]:
    """While active (in this thread), attention layers of a model inside
    :func:`packed_gqa_attention` compute :func:`accel.kernels.ordered.attend` over ``cache``'s
    layout (``cache.layout(layer_idx)``) instead of sdpa."""
    outer = getattr(_ordered, "cache", None)
    _ordered.cache = cache
    try:
        yield
    finally:
        _ordered.cache = outer


def ordered_capable(model: PreTrainedModel) -> bool:
    """Whether accel's forwards of ``model`` can run ordered attention: its attention is one
    :func:`packed_gqa_attention` replaces (sdpa or flash-attention; eager is the model's own)
    and has no logit soft-capping or attention sinks (which ordered attention does not compute)."""
    cfg = model.config.get_text_config(decoder=True)
    if getattr(cfg, "attn_logit_softcapping", None) or any("sinks" in name for name, _ in model.named_parameters()):
        return False
    return _switchable(loaded_attention(model) or "")


def _grouped_mask(mask: torch.Tensor, b: int, q_len: int, kv_len: int, groups: int) -> torch.Tensor:
    """``mask`` [B or 1, 1, T, K] with its rows repeated for ``groups`` query heads,
    [B, 1, G * T, K]. Every layer of a forward gets the same mask object, so the copy is made
    once per forward (remembered per thread, for as long as that mask lives)."""
    memo = getattr(_mask_memo, "last", None)
    if memo is not None and memo[0]() is mask and memo[1] == (b, groups):
        return memo[2]
    grouped = mask.expand(b, 1, q_len, kv_len).repeat(1, 1, groups, 1)
    _mask_memo.last = (weakref.ref(mask), (b, groups), grouped)
    return grouped


def loaded_attention(model: PreTrainedModel) -> str | None:
    """The model's own attention implementation, also while :func:`packed_gqa_attention`
    has switched it."""
    entry = _switched.get(id(model.config))
    return entry[1] if entry is not None else getattr(model.config, "_attn_implementation", None)


def _switchable(impl: str) -> bool:
    """Attention implementations accel replaces by packed sdpa while it runs."""
    return impl == "sdpa" or "flash" in impl


@contextmanager
def packed_gqa_attention(model: PreTrainedModel) -> Iterator[None]:
    """While active, a model on transformers' ``sdpa`` or on flash-attention uses
    :func:`_packed_sdpa`.

    The attention implementation is a per-model setting, so it is switched for the duration
    of the call and restored afterwards (counted, so overlapping calls on one model restore
    it once the last one ends). The packed path is the same arithmetic as ``sdpa``; a
    foreign forward that runs meanwhile gets the same results, only without the K/V copies.
    Flash-attention kernels take no additive 4-D masks (draft trees, per-row padding), so a
    flash-attention model runs accel's calls on sdpa arithmetic too. Eager models are left
    alone (their masks are additive already).
    """
    config = model.config
    with _switch_lock:
        entry = _switched.get(id(config))
        impl = getattr(config, "_attn_implementation", None) or ""
        if entry is None and not _switchable(impl):
            entry = None
            active = False
        else:
            active = True
            if entry is None:
                AttentionInterface.register(_PACKED, _packed_sdpa)
                AttentionMaskInterface.register(_PACKED, sdpa_mask)
                entry = _switched[id(config)] = [0, config._attn_implementation]
                config._attn_implementation = _PACKED
            entry[0] += 1
    try:
        yield
    finally:
        if active:
            with _switch_lock:
                entry[0] -= 1
                if entry[0] == 0:
                    config._attn_implementation = entry[1]
                    del _switched[id(config)]


# --------------------------------------------------------------------------- lean decoders

#: Architectures whose decoder layer is exactly: RMSNorm, q/k/v projections (biases allowed),
#: rotary embeddings, attention, o projection, residual, RMSNorm, a SiLU-gated MLP, residual.
LEAN_ARCHITECTURES = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class DecoderWeights:
    """A Llama-family decoder as plain tensors (views of the model's own parameters), for
    :mod:`accel.kernels.compiled`.

    layers: per decoder layer (input norm, q weight, q bias, k weight, k bias, v weight, v
        bias, o weight, o bias, post-attention norm, gate weight, up weight, down weight);
        a bias is None where the layer has none.
    rotary: ``rotary(like, positions [B, T]) -> (cos, sin)`` each [B, T, D] of ``like``'s dtype.
    """

    embed: torch.Tensor
    layers: tuple[tuple[torch.Tensor | None, ...], ...]
    norm: torch.Tensor
    eps: float
    heads: int
    kv_heads: int
    head_dim: int
    scaling: float
    rotary: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def decoder_weights(model: PreTrainedModel) -> tuple[DecoderWeights | None, str]:
    """``model``'s decoder as :class:`DecoderWeights`, or (None, why not): only the
    architectures of :data:`LEAN_ARCHITECTURES` with plain ``nn.Linear`` projections (not
    prepacked or quantized), SiLU MLPs and no sliding windows qualify."""
    cfg = model.config.get_text_config(decoder=True)
    kind = getattr(cfg, "model_type", None)
    if kind not in LEAN_ARCHITECTURES:
        return None, f"its architecture ({kind}) is not one the compiled step covers ({', '.join(LEAN_ARCHITECTURES)})"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return None, f"its MLP activation is {cfg.hidden_act}, not silu"
    if any(w is not None for w in layer_windows(model)):
        return None, "it has sliding-window layers"
    decoder = model.get_decoder()
    rotary = getattr(decoder, "rotary_emb", None)
    if rotary is None or getattr(decoder, "embed_tokens", None) is None:
        return None, "its decoder has no rotary_emb or embed_tokens"
    layers = []
    for layer in decoder.layers:
        attn, mlp = layer.self_attn, layer.mlp
        linears = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj)
        odd = [type(m).__name__ for m in linears if type(m) is not torch.nn.Linear]
        if odd:
            return None, f"its linear layers are {odd[0]} (prepacked or quantized), not torch.nn.Linear"
        if any(m.bias is not None for m in linears[4:]):
            return None, "its MLP has biases"
        layers.append((layer.input_layernorm.weight, attn.q_proj.weight, attn.q_proj.bias, attn.k_proj.weight,
                       attn.k_proj.bias, attn.v_proj.weight, attn.v_proj.bias, attn.o_proj.weight, attn.o_proj.bias,
                       layer.post_attention_layernorm.weight, mlp.gate_proj.weight, mlp.up_proj.weight,
                       mlp.down_proj.weight))
    geo = geometry(model)
    eps = getattr(cfg, "rms_norm_eps", None)
    if eps is None:
        return None, "its config has no rms_norm_eps"
    scaling = getattr(decoder.layers[0].self_attn, "scaling", geo.head_dim ** -0.5)
    return DecoderWeights(
        embed=decoder.embed_tokens.weight, layers=tuple(layers), norm=decoder.norm.weight, eps=float(eps),
        heads=geo.num_heads, kv_heads=geo.num_kv_heads, head_dim=geo.head_dim, scaling=float(scaling),
        rotary=lambda like, positions: rotary(like, position_ids=positions),
    ), ""


def has_hooks(model: PreTrainedModel) -> bool:
    """Whether any module of ``model``'s decoder carries forward hooks (accel's own capture
    contexts, a user's): a forward that bypasses the modules would skip them. The hook of
    :func:`per_layer_masks` does not count (it only swaps masks that differ between layers)."""
    glob = torch.nn.modules.module
    if glob._global_forward_hooks or glob._global_forward_pre_hooks:  # torch's hooks on every module
        return True
    for module in _structure(model)[2]:
        if module._forward_hooks or any(not getattr(h, "masks_only", False) for h in module._forward_pre_hooks.values()):
            return True
    return False


# Module assignments anywhere in the process (``parent.child = module``, ``register_module``)
# count here, so that what is derived from a model's module tree is remembered until one happens.
_registrations = 0


def _count_registration(parent, name, module):
    global _registrations
    _registrations += 1


torch.nn.modules.module.register_module_module_registration_hook(_count_registration)


def _structure(model: PreTrainedModel) -> tuple[list[_FlatLayer] | None, str, tuple[torch.nn.Module, ...]]:
    """(:func:`flat_layers`' walk of the decoder layers, why not, every module of the decoder),
    remembered on the model until a module is assigned anywhere (a decode step asks for them
    each time; the walk takes about 0.3 ms on the default model's 30 layers)."""
    memo = model.__dict__.get("_accel_structure")
    if memo is not None and memo[0] == _registrations:
        return memo[1:]
    decoder = model.get_decoder()
    layers, why = _walk_layers(decoder)
    model.__dict__["_accel_structure"] = (_registrations, layers, why, tuple(decoder.modules()))
    return layers, why, model.__dict__["_accel_structure"][3]
