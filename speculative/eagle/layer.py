"""The EAGLE draft layer as an ``nn.Module``: what drafting runs and training trains.

EAGLE-3 (Li et al. 2025), as vLLM / SGLang run it:

    h   = fc(cat(f_low, f_mid, f_high))            # the target's features, [3 H_t] -> [H]
    x   = cat(input_layernorm(embed(t)), hidden_norm(h))                    # [2 H]
    h'  = h + o_proj(attention(q/k/v_proj(x)))      # one Llama layer, its own KV cache
    out = h' + mlp(post_attention_layernorm(h'))    # fed back as h for the next draft
    logits = lm_head(norm(out))                     # over the draft vocabulary
    target id = draft id + d2t[draft id]

EAGLE-1 (Li et al. 2024): ``h`` is the target's final normed hidden state, ``x = fc(cat(embed(t),
h))`` (no input norm), ``h' = x + attention(x)``, ``out`` as above, and the target's own output
head reads ``out`` (no norm, full vocabulary).

The layer attends to its own cache: per row, keys and values [H_kv, n, D] of the positions it
has read (:meth:`EagleLayer.attend` takes them padded, with a mask), so it drafts without the
target's cache. Rotary embeddings come from the draft config (:func:`accel.adapter.rotary_embedding`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from accel import adapter

__all__ = ["EagleSpec", "EagleLayer", "default_layer_ids", "new_layer", "rms_norm", "warm_start"]


def default_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's low / middle / high feature layers of a target of ``num_layers`` layers, as
    vLLM picks them when a checkpoint names none: ``(2, L // 2, L - 3)`` (clamped into range
    for very shallow targets)."""
    top = max(num_layers - 1, 0)
    return tuple(min(max(k, 0), top) for k in (2, num_layers // 2, num_layers - 3))  # type: ignore[return-value]


@dataclass(frozen=True)
class EagleSpec:
    """The shape of a draft layer (what its ``config.json`` says).

    kind: "eagle3" (fused features, draft vocabulary) or "eagle1" (final hidden state, the
        target's vocabulary and output head).
    layer_ids: the target layers it reads (EAGLE-3: low, mid, high; EAGLE-1: FINAL_HIDDEN).
    vocab_size: the target's vocabulary; draft_vocab_size: the rows of its own lm_head.
    config: the checkpoint's config mapping (rope settings and the rest, saved back as is).
    """

    kind: str
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    layer_ids: tuple[int, ...]
    rms_norm_eps: float = 1e-6
    norm_before_residual: bool = False
    attention_bias: bool = False
    fc_bias: bool = False
    config: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def rope_config(self) -> Any:
        from transformers import LlamaConfig

        keep = {k: v for k, v in self.config.items()
                if k in ("rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings")}
        return LlamaConfig(hidden_size=self.hidden_size, num_attention_heads=self.num_heads,
                           num_key_value_heads=self.num_kv_heads, head_dim=self.head_dim, **keep)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm (computed in float32, returned in x's dtype)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat([-b, a], dim=-1)


class EagleLayer(nn.Module):
    """One EAGLE draft layer (EAGLE-3 or EAGLE-1, see the module docstring).

    Parameters are named as the EAGLE-3 checkpoint keys are (``fc``, ``midlayer.*``,
    ``norm``, ``lm_head``; ``d2t`` a buffer), so ``state_dict()`` is the saved file.
    ``embed_tokens`` exists only when the checkpoint carries its own embeddings (else the
    target's are used).
    """

    def __init__(self, spec: EagleSpec, own_embed: bool = False):
        super().__init__()
        self.spec = spec
        H, D = spec.hidden_size, spec.head_dim
        eagle3 = spec.kind == "eagle3"
        fc_in = 3 * spec.target_hidden_size if eagle3 else 2 * H
        self.fc = nn.Linear(fc_in, H, bias=spec.fc_bias)
        attn_in = 2 * H if eagle3 else H
        mid = nn.Module()
        mid.self_attn = nn.Module()
        mid.self_attn.q_proj = nn.Linear(attn_in, spec.num_heads * D, bias=spec.attention_bias)
        mid.self_attn.k_proj = nn.Linear(attn_in, spec.num_kv_heads * D, bias=spec.attention_bias)
        mid.self_attn.v_proj = nn.Linear(attn_in, spec.num_kv_heads * D, bias=spec.attention_bias)
        mid.self_attn.o_proj = nn.Linear(spec.num_heads * D, H, bias=spec.attention_bias)
        mid.mlp = nn.Module()
        mid.mlp.gate_proj = nn.Linear(H, spec.intermediate_size, bias=False)
        mid.mlp.up_proj = nn.Linear(H, spec.intermediate_size, bias=False)
        mid.mlp.down_proj = nn.Linear(spec.intermediate_size, H, bias=False)
        mid.post_attention_layernorm = nn.Module()
        mid.post_attention_layernorm.weight = nn.Parameter(torch.ones(H))
        if eagle3:
            mid.input_layernorm = nn.Module()
            mid.input_layernorm.weight = nn.Parameter(torch.ones(H))
            mid.hidden_norm = nn.Module()
            mid.hidden_norm.weight = nn.Parameter(torch.ones(H))
        self.midlayer = mid
        if eagle3:
            self.norm = nn.Module()
            self.norm.weight = nn.Parameter(torch.ones(H))
            self.lm_head = nn.Linear(H, spec.draft_vocab_size, bias=False)
            self.register_buffer("d2t", torch.zeros(spec.draft_vocab_size, dtype=torch.long))
        self.embed_tokens = nn.Embedding(spec.vocab_size, H) if own_embed else None
        self.rotary = adapter.rotary_embedding(spec.rope_config())

    # ------------------------------------------------------------------ pieces

    @property
    def eagle3(self) -> bool:
        return self.spec.kind == "eagle3"

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """The target's features [..., len(layer_ids) * H_t] (layers concatenated in
        ``layer_ids`` order) -> the layer's hidden input [..., H] (EAGLE-1: unchanged)."""
        return self.fc(features) if self.eagle3 else features

    def draft_to_target(self, ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids -> target ids (``id + d2t[id]``; EAGLE-1: the same ids)."""
        return ids + self.d2t[ids] if self.eagle3 else ids

    def logits(self, out: torch.Tensor, target_head: nn.Module | None = None) -> torch.Tensor:
        """The layer's outputs [..., H] -> logits over the draft vocabulary [..., V_d]
        (EAGLE-1: the target's output head ``target_head`` over its vocabulary)."""
        if self.eagle3:
            return self.lm_head(rms_norm(out, self.norm.weight, self.spec.rms_norm_eps))
        return target_head(out)

    # ------------------------------------------------------------------ the layer

    def project(self, h: torch.Tensor, emb: torch.Tensor, positions: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The layer up to attention for new tokens: h, emb [R, T, H]; positions [R, T].
        Returns (queries [R, H_q, T, D] with RoPE, keys [R, H_kv, T, D] with RoPE, values
        [R, H_kv, T, D], residual [R, T, H])."""
        spec, mid = self.spec, self.midlayer
        eps = spec.rms_norm_eps
        if self.eagle3:
            normed = rms_norm(h, mid.hidden_norm.weight, eps)
            residual = normed if spec.norm_before_residual else h
            x = torch.cat([rms_norm(emb, mid.input_layernorm.weight, eps), normed], dim=-1)
        else:
            x = self.fc(torch.cat([emb, h], dim=-1))
            residual = x
        R, T, _ = x.shape
        attn = mid.self_attn
        q = attn.q_proj(x).view(R, T, spec.num_heads, spec.head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(R, T, spec.num_kv_heads, spec.head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(R, T, spec.num_kv_heads, spec.head_dim).transpose(1, 2)
        cos, sin = self.rotary(x, positions)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        return q, k, v, residual

    def finish(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor,
               residual: torch.Tensor) -> torch.Tensor:
        """Attention and the rest of the layer: q [R, H_q, T, D] over keys / values
        [R, H_kv, S, D] where ``visible`` [R, T, S] is True; residual [R, T, H] -> out [R, T, H]
        (pre-norm: the next draft's hidden input)."""
        spec, mid = self.spec, self.midlayer
        groups = spec.num_heads // spec.num_kv_heads
        if groups > 1:
            keys = keys.repeat_interleave(groups, dim=1)
            values = values.repeat_interleave(groups, dim=1)
        a = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible.unsqueeze(1),
                                           scale=1.0 / math.sqrt(spec.head_dim))
        R, _, T, _ = a.shape
        h = residual + mid.self_attn.o_proj(a.transpose(1, 2).reshape(R, T, -1))
        m = rms_norm(h, mid.post_attention_layernorm.weight, spec.rms_norm_eps)
        return h + mid.mlp.down_proj(F.silu(mid.mlp.gate_proj(m)) * mid.mlp.up_proj(m))


def new_layer(model: Any, vocab_ids: torch.Tensor | None = None, layer_ids: tuple[int, ...] | None = None,
              seed: int | None = None) -> EagleLayer:
    """A fresh EAGLE-3 layer for ``model`` (float32, CPU): the target's layer shape (hidden
    size, heads, MLP width, RoPE), reading ``layer_ids`` (default :func:`default_layer_ids`),
    drafting over ``vocab_ids`` (ascending target ids; default the whole vocabulary).
    Initialised as transformers initialises Llama linears (``seed``: reproducibly)."""
    cfg = model.config.get_text_config(decoder=True)
    heads = cfg.num_attention_heads
    vocab = int(cfg.vocab_size)
    ids = torch.arange(vocab) if vocab_ids is None else torch.as_tensor(vocab_ids, dtype=torch.long).sort().values
    config = {k: v for k, v in cfg.to_dict().items()
              if k in ("rope_parameters", "rope_theta", "rope_scaling", "max_position_embeddings", "rms_norm_eps")}
    spec = EagleSpec(
        kind="eagle3", hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size, num_heads=heads,
        num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads, vocab_size=vocab,
        draft_vocab_size=int(ids.numel()), target_hidden_size=cfg.hidden_size,
        layer_ids=tuple(layer_ids) if layer_ids is not None else default_layer_ids(cfg.num_hidden_layers),
        rms_norm_eps=float(getattr(cfg, "rms_norm_eps", 1e-6)), config=config)
    with torch.random.fork_rng(devices=[]):
        if seed is not None:
            torch.manual_seed(seed)
        layer = EagleLayer(spec)
        std = float(getattr(cfg, "initializer_range", 0.02))
        for m in layer.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
    layer.d2t.copy_(ids - torch.arange(ids.numel()))
    return layer.eval()


@torch.no_grad()
def warm_start(layer: EagleLayer, model: Any) -> EagleLayer:
    """Start an EAGLE-3 ``layer`` where the target ends (as Medusa heads start): its
    ``lm_head`` the target's output rows of the draft vocabulary, its ``norm`` the target's
    final norm, ``fc`` passing the highest feature layer through, and the layer's two
    residual branches (``o_proj``, ``down_proj``) zero, so the fresh draft reads the target's
    own next-token guess off its high features. Training then only has to learn the step
    ahead; a random head over the draft vocabulary has to learn the output space first.
    Parts whose shapes do not match the target stay as they are. Returns ``layer``."""
    if not layer.eagle3:
        raise ValueError("warm_start is for EAGLE-3 layers (EAGLE-1 reads the target's own head)")
    spec = layer.spec
    head = getattr(model.get_output_embeddings(), "weight", None)
    ids = layer.draft_to_target(torch.arange(spec.draft_vocab_size, device=layer.d2t.device))
    if head is not None and head.shape[1] == spec.hidden_size:
        layer.lm_head.weight.copy_(head.detach()[ids.to(head.device)].to(layer.lm_head.weight) / adapter.logits_scale(model))
    norm = adapter.final_norm_weight(model)
    if norm is not None and norm.shape == layer.norm.weight.shape:
        layer.norm.weight.copy_(norm.detach().to(layer.norm.weight))
    H, Ht, k = spec.hidden_size, spec.target_hidden_size, len(spec.layer_ids)
    if H == Ht and layer.fc.weight.shape == (H, k * Ht):
        layer.fc.weight.zero_()
        layer.fc.weight[:, (k - 1) * Ht :] = torch.eye(H, dtype=layer.fc.weight.dtype, device=layer.fc.weight.device)
    layer.midlayer.self_attn.o_proj.weight.zero_()
    layer.midlayer.mlp.down_proj.weight.zero_()
    return layer
