"""InfiniGen (Lee et al., OSDI 2024): the whole cache in a slow tier, each decode step reading
only the entries its queries are predicted to need.

Unlike SnapKV, nothing is dropped: a question about the start of a long document, asked
after the generation has moved on, may still fetch the entries it needs. The strategy is
configuration plus the model's *partial projections*; the cache that does the work is
:class:`accel.tier.TieredCache` (see there for a step's course).

Partial projections ("skewing"). InfiniGen scores the cached keys with a few columns of
queries and keys rotated so that those columns carry most of the product. Here, per layer
and KV head, ``P`` [D, r] (``r = ceil(partial * D)`` orthonormal columns) holds the
directions along which the head's post-RoPE queries (its query heads together) weigh most
where its keys differ most, over a calibration pass (:func:`_directions`), and the score of
key k for query q is ``(q @ P) . (k @ P)``: ``q . k`` restricted to those directions. The
projection applies to the post-RoPE vectors, so it holds at every position, as a fixed
rotation of the weights could not under RoPE. The calibration pass runs the model once over ``calibration_tokens`` seeded random
token ids (no data is read or downloaded) and its result is kept under the user cache
folder, keyed by the model's config, dtype and a fingerprint of its weights.
"""

from __future__ import annotations

import hashlib
import math
import weakref
from typing import Any, ClassVar, Literal

import torch
from pydantic import Field, model_validator

from accel import adapter
from accel.cache import SharedCache
from accel.files import atomic_path, cache_dir
from accel.steps import prefill
from accel.strategy import KVTier, register

__all__ = ["InfiniGen", "partial_projections"]

_CALIBRATION_SEED = 20240710
_memo: "weakref.WeakKeyDictionary[Any, dict[tuple, list[torch.Tensor]]]" = weakref.WeakKeyDictionary()


@register
class InfiniGen(KVTier):
    """The whole cache in a slow tier; each step fetches, per KV head and query token, the
    ``budget - window`` entries with the highest predicted scores and its last ``window``."""

    name: ClassVar[str] = "infinigen"

    budget: int = Field(1024, gt=0)
    """Entries each query token reads per KV head (fetched ones and its recent window): the
    fast tier's size, as SnapKV's ``budget`` is its cache's."""
    window: int = Field(32, ge=0)
    """Latest positions whose entries every query token reads, whatever the scores."""
    partial: float = Field(0.25, gt=0.0, le=1.0)
    """Fraction of each head's dimensions the partial keys keep (r = ceil(partial * D))."""
    tier: Literal["file", "memory"] = "file"
    """Where the full cache lives: memory-mapped files (the process keeps none of their pages
    between steps) or ordinary tensors."""
    folder: str | None = None
    """Folder of the slow tier's files (None: ``kv-tier`` in the user cache folder); they are
    unlinked at once and go with the cache."""
    calibration_tokens: int = Field(512, ge=16)
    """Tokens of the one calibration pass the partial projections come from."""
    predict: Literal["previous_layer", "own_layer"] = "previous_layer"
    """Whose input a layer's queries are predicted from: the layer before's (InfiniGen: the
    prediction is ready a layer early, so the fetch could overlap that layer's work) or its
    own (exact queries, computed just before it attends: nothing to overlap)."""
    gqa: Literal["max", "sum"] = "max"
    """How a KV head's query heads combine their scores: the largest of their softmaxes, or
    the sum of their logits."""

    @model_validator(mode="after")
    def _window_below_budget(self) -> "InfiniGen":
        if self.window >= self.budget:
            raise ValueError(f"window ({self.window}) must be below budget ({self.budget}): the budget holds the "
                             "window and the fetched entries")
        return self

    def fast_entries(self) -> tuple[int, int]:
        return self.budget - self.window, self.window

    def slow_tier(self) -> tuple[str, str | None]:
        return self.tier, self.folder

    def predicts_ahead(self) -> bool:
        return self.predict == "previous_layer"

    def head_pooling(self) -> str:
        return self.gqa

    def projections(self, model: Any) -> list[torch.Tensor]:
        return partial_projections(model, self.partial, self.calibration_tokens)


def partial_projections(model: Any, partial: float, tokens: int = 512) -> list[torch.Tensor]:
    """Per decoder layer, ``P`` [H_kv, D, r] (float32, orthonormal columns): each KV head's
    ``r = ceil(partial * D)`` leading eigenvectors of its post-RoPE queries' covariance over
    a calibration pass (see the module docstring). Computed once per model and kept, in
    memory and under the user cache folder."""
    geo = adapter.geometry(model)
    r = max(1, math.ceil(partial * geo.head_dim))
    key = (r, tokens)
    held = _memo.setdefault(model, {})
    if key in held:
        return held[key]
    path = cache_dir() / "infinigen" / f"{_fingerprint(model, r, tokens)}.pt"
    out = None
    if path.exists():
        try:
            out = torch.load(path, map_location=geo.device, weights_only=True)
        except Exception:  # noqa: BLE001 - a torn or foreign file is recomputed
            out = None
        if not (isinstance(out, list) and len(out) == geo.num_layers
                and all(tuple(p.shape) == (geo.num_kv_heads, geo.head_dim, r) for p in out)):
            out = None
    if out is None:
        out = _calibrate(model, r, tokens)
        with atomic_path(path) as tmp:
            torch.save(out, tmp)
    held[key] = out
    return out


def _calibrate(model: Any, r: int, tokens: int) -> list[torch.Tensor]:
    geo = adapter.geometry(model)
    vocab = int(model.config.get_text_config(decoder=True).vocab_size)
    g = torch.Generator().manual_seed(_CALIBRATION_SEED)
    ids = torch.randint(0, vocab, (tokens,), generator=g).to(geo.device)
    queries: dict[int, torch.Tensor] = {}
    cache = SharedCache(geo.num_layers)
    with torch.inference_mode(), adapter.capture_window_queries(model, cache, tokens, queries):
        prefill(model, cache, [ids])
    out = []
    for layer in range(geo.num_layers):
        q = queries[layer][0].float().cpu()  # [H_q, N, D]
        q = q.reshape(geo.num_kv_heads, -1, geo.head_dim)  # a KV head's query heads together
        k = cache.keys(layer, 0)[0].float().cpu()  # [H_kv, N, D]
        k = k - k.mean(1, keepdim=True)
        out.append(_directions(q.transpose(1, 2) @ q / q.shape[1], k.transpose(1, 2) @ k / k.shape[1], r)
                   .to(geo.device))
    return out


def _directions(cq: torch.Tensor, ck: torch.Tensor, r: int) -> torch.Tensor:
    """P [H, D, r], orthonormal columns, for queries' second moments ``cq`` and keys'
    covariance ``ck`` (each [H, D, D]).

    Which keys a query ranks first depends on how ``q . k`` varies from key to key; with
    ``R = I - P P^T`` the part of it the partial score misses has variance
    ``E_q Var_k(q^T R k) = tr(R Cq R Ck)``. The directions kept are ``S u_i`` (orthonormalised),
    ``S = Cq^(1/2)`` and ``u_i`` the leading eigenvectors of ``S Ck S``: those along which the
    queries' weight times the keys' spread is largest (the queries' own principal directions
    alone ignore where keys differ; on the default model they lose the pass key of
    ``benchmarks/infinigen.py``'s follow-up question, these keep it).
    """
    e, v = torch.linalg.eigh(cq)
    s = v @ torch.diag_embed(e.clamp(min=0).sqrt()) @ v.transpose(1, 2)
    _, u = torch.linalg.eigh(s @ ck @ s)  # ascending eigenvalues
    p, _ = torch.linalg.qr(s @ u.flip(-1)[..., :r])
    return p.contiguous()


def _fingerprint(model: Any, r: int, tokens: int) -> str:
    cfg = model.config.to_json_string(use_diff=False) if hasattr(model.config, "to_json_string") else repr(model.config)
    h = hashlib.sha256(cfg.encode())
    h.update(f"qk/{r}/{tokens}/{_CALIBRATION_SEED}/{adapter.geometry(model).dtype}".encode())
    for _, p in list(model.named_parameters())[:: max(1, len(list(model.parameters())) // 8)]:
        h.update(p.detach().flatten()[:4096].float().cpu().numpy().tobytes())
    return h.hexdigest()[:24]
