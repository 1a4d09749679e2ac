"""The ``eagle`` drafter: one draft layer over the target's own features drafts a dynamic tree.

Each step the engine hands over the target's hidden states at the positions verified since
the last step (``DraftContext.features``, collected by the prefill and verify forwards the
engine runs anyway, over a compressed target cache too). The drafter first *reads* them: one
forward of the draft layer appends their entries to its own per-row cache (position p holds
the target's features at p and the embedding of token p + 1). Its output at the last of them
(whose next token is the pending root) predicts the first draft depth; then it drafts
autoregressively, feeding back its own outputs as features:

- greedy rows grow a tree the EAGLE-2 way (Li et al. 2024): at each depth the ``top_k`` most
  valuable nodes (a node's value: the draft's probability of its whole path) are expanded
  into their ``top_k`` best children, and the ``max_nodes`` most valuable nodes of all are
  verified;
- sampling rows draft a chain, each token drawn from q = softmax(warp(draft logits)) over the
  target vocabulary (zero outside the draft vocabulary) and q recorded, so the engine's
  rejection sampling keeps the output distributed as the target's.

All rows of a batch draft together: one draft forward per depth for every row. Tree entries
are temporary; only the target's features enter a row's cache. Greedy output is the target's
greedy output whatever the draft says; the draft only decides how many tokens a step keeps.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from pydantic import Field, field_validator

from accel.acceptance import draw_from
from accel.strategy import DraftContext, DraftProposal, Drafter, register

from .formats import read_eagle, resolve_draft_dir
from .layer import EagleLayer, default_layer_ids

__all__ = ["Eagle", "load_eagle"]

_LOADED: dict[tuple[Any, ...], EagleLayer] = {}
_LOCK = threading.Lock()


def load_eagle(path: str | os.PathLike, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu") -> EagleLayer:
    """The draft in ``path`` (``"default"``: ``speculative/heads/eagle``, none shipped yet) in
    ``dtype`` on ``device``, read once per process (again when its files change)."""
    folder = resolve_draft_dir(path).resolve()
    stamp = tuple((f.name, f.stat().st_mtime_ns) for f in sorted(folder.glob("*")) if f.is_file()) \
        if folder.is_dir() else ()
    key = (str(folder), stamp, dtype, str(torch.device(device)))
    with _LOCK:
        hit = _LOADED.get(key)
        if hit is None:
            hit = read_eagle(folder).to(device=device, dtype=dtype)
            hit.requires_grad_(False)
            for k in [k for k in _LOADED if k[0] == key[0]]:
                del _LOADED[k]
            _LOADED[key] = hit
        return hit


class _Cache:
    """One row's draft-layer entries: keys / values [H_kv, n, D] of the positions read."""

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.n = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [H_kv, t, D]."""
        t = k.shape[1]
        if self.keys is None or self.n + t > self.keys.shape[1]:
            cap = max(64, 2 * (self.n + t))
            keys = k.new_empty((k.shape[0], cap, k.shape[2]))
            values = v.new_empty((v.shape[0], cap, v.shape[2]))
            if self.keys is not None:
                keys[:, : self.n] = self.keys[:, : self.n]
                values[:, : self.n] = self.values[:, : self.n]
            self.keys, self.values = keys, values
        self.keys[:, self.n : self.n + t] = k
        self.values[:, self.n : self.n + t] = v
        self.n += t


@dataclass(eq=False)
class _State:
    layer: EagleLayer
    embed: torch.Tensor  # [V, H] token embeddings the layer reads (its own or the target's)
    head: Any  # the target's output layer (EAGLE-1), else None
    layer_ids: tuple[int, ...]  # target layers, concatenated in this order
    cache: _Cache
    seen: int = 0  # positions read so far (the next one the features must start at)


@register
class Eagle(Drafter):
    """An EAGLE draft layer drafts a dynamic tree from the target's own hidden states.

    ``draft`` is a folder in the EAGLE-3 format (``accel train-eagle`` writes one; vLLM's and
    SGLang's EAGLE-3 checkpoints load as they are) or an EAGLE-1 checkpoint; ``"default"``
    (``Eagle()``) reads ``speculative/heads/eagle``, where a draft for the default model goes (none
    ships yet: docs/EAGLE.md). Lossless: the verifier decides.
    """

    name: ClassVar[str] = "eagle"

    draft: str = Field("default", description="folder of the EAGLE draft (EAGLE-3 format, or an EAGLE-1 checkpoint), "
                                              "or 'default': speculative/heads/eagle (none shipped yet)")
    max_nodes: int = Field(16, ge=1, le=1024, description="draft nodes per verify step at most (the engine's budget may cut it)")
    depth: int = Field(6, ge=1, le=64, description="draft depth at most (tree levels; a sampled chain's length)")
    top_k: int = Field(8, ge=1, le=64, description="nodes expanded per depth and children per expanded node")

    @field_validator("draft", mode="before")
    @classmethod
    def _path(cls, value: Any) -> Any:
        if isinstance(value, os.PathLike):
            value = os.fspath(value)
        if isinstance(value, str) and not value:
            raise ValueError("needs the folder of an EAGLE draft")
        return value

    # ------------------------------------------------------------------ per request

    def _layer(self, model: Any) -> EagleLayer:
        param = next(model.parameters())
        try:
            return load_eagle(self.draft, param.dtype, param.device)
        except FileNotFoundError as err:
            raise ValueError(f"eagle.draft: {err}") from err

    def feature_layers(self, model: Any) -> tuple[int, ...]:
        layer = self._layer(model)
        return layer.spec.layer_ids or default_layer_ids(model.config.get_text_config(decoder=True).num_hidden_layers)

    def check(self, model: Any) -> None:
        """Raise a ValueError naming what differs unless the draft fits ``model``: its
        vocabulary, the hidden size of the features it reads, its feature layers, and the
        embeddings it reads."""
        self._fit(model)

    def _fit(self, model: Any) -> _State:
        layer = self._layer(model)
        spec, src = layer.spec, getattr(layer, "source", self.draft)
        cfg = model.config.get_text_config(decoder=True)
        name = type(model).__name__
        vocab = int(getattr(model.get_output_embeddings(), "weight", torch.empty(cfg.vocab_size, 0)).shape[0])
        if spec.vocab_size != vocab:
            raise ValueError(f"the EAGLE draft in '{src}' has a vocabulary of {spec.vocab_size} tokens, but the model "
                             f"({name}) has {vocab}: it was trained for another model")
        if spec.target_hidden_size != cfg.hidden_size:
            raise ValueError(f"the EAGLE draft in '{src}' reads hidden states of size {spec.target_hidden_size}, but the "
                             f"model ({name}) has hidden size {cfg.hidden_size}: it was trained for another model")
        ids = self.feature_layers(model)
        bad = [k for k in ids if not -1 <= k < cfg.num_hidden_layers]
        if bad:
            raise ValueError(f"the EAGLE draft in '{src}' reads layers {list(ids)}, but the model ({name}) has "
                             f"{cfg.num_hidden_layers} layers (no layer {bad[0]}): it was trained for another model")
        embed = layer.embed_tokens.weight if layer.embed_tokens is not None else model.get_input_embeddings().weight
        if tuple(embed.shape) != (spec.vocab_size, spec.hidden_size):
            raise ValueError(f"the EAGLE draft in '{src}' has hidden size {spec.hidden_size} and no embeddings of its "
                             f"own, but the model's ({name}) are {tuple(embed.shape)}")
        head = None if spec.kind == "eagle3" else model.get_output_embeddings()
        return _State(layer, embed.detach(), head, ids, _Cache())

    def start(self, model: Any, prompt: torch.Tensor) -> _State:
        return self._fit(model)

    # ------------------------------------------------------------------ drafting

    @torch.inference_mode()
    def propose(self, state: _State, ctx: DraftContext) -> DraftProposal | None:
        return self.propose_batch([state], [ctx])[0]

    @torch.inference_mode()
    def propose_batch(self, states: list[_State], ctxs: list[DraftContext]) -> list[DraftProposal | None]:
        """Every row's draft at once: one draft forward reads every row's new features, then
        one per depth drafts for every row. States change only once every row has drafted."""
        out: list[DraftProposal | None] = [None] * len(states)
        live = [i for i, c in enumerate(ctxs) if min(c.max_tokens, self.max_nodes) > 0]
        if not live:
            return out
        layer = states[live[0]].layer
        if any(states[i].layer is not layer for i in live):  # drafts of another dtype or folder: one by one
            for i in live:
                out[i] = self.propose_batch([states[i]], [ctxs[i]])[0]
            return out
        st, cx = [states[i] for i in live], [ctxs[i] for i in live]
        read = _read(layer, st, cx)
        for i, prop in zip(live, self._draft(layer, st, cx, read)):
            out[i] = prop
        for s, (k, v, seen) in zip(st, read.commit):  # success: keep what was read
            if seen < s.seen:
                s.cache = _Cache()
            s.cache.append(k, v)
            s.seen = seen + k.shape[1]
        return out

    def _draft(self, layer: EagleLayer, states: list[_State], ctxs: list[DraftContext], read: "_Read") -> list[DraftProposal]:
        R = len(states)
        device = read.h.device
        sizes = [min(c.max_tokens, self.max_nodes) for c in ctxs]
        sampled = [c.warp is not None for c in ctxs]
        depth = min(self.depth, max(sizes))
        width = min(self.top_k, max(sizes))
        V = layer.spec.vocab_size
        # candidate nodes per row: target token, log value, parent node id (0: root); node ids from 1
        tokens: list[list[torch.Tensor]] = [[] for _ in range(R)]
        values: list[list[torch.Tensor]] = [[] for _ in range(R)]
        parents: list[list[torch.Tensor]] = [[] for _ in range(R)]
        qs: list[list[torch.Tensor]] = [[] for _ in range(R)]
        count = [1] * R
        h = read.h.unsqueeze(1)  # [R, 1, H] the outputs whose children come next
        node_ids = torch.zeros(R, 1, dtype=torch.long, device=device)
        node_vals = torch.zeros(R, 1, device=device)
        anc = torch.zeros(R, 1, 0, dtype=torch.bool, device=device)  # [R, P, E] tree entries each sees
        tree_k = tree_v = None
        for d in range(depth):
            logits = layer.logits(h, states[0].head).float()  # [R, P, V_d]
            lp = torch.log_softmax(logits, dim=-1)
            top_lp, top_ids = torch.topk(lp, min(width, lp.shape[-1]), dim=-1)  # [R, P, w]
            child_tok = layer.draft_to_target(top_ids)
            child_val = node_vals.unsqueeze(-1) + top_lp
            for r in range(R):
                if sampled[r]:  # one draw from q over the target vocabulary
                    full = logits.new_full((V,), float("-inf"))
                    full[layer.draft_to_target(torch.arange(logits.shape[-1], device=device))] = logits[r, 0]
                    q = torch.softmax(ctxs[r].warp(full.unsqueeze(0)), dim=-1)[0]
                    x = draw_from(None, q, ctxs[r].generator, count[r])
                    tokens[r].append(torch.tensor([x], device=device))
                    values[r].append(torch.tensor([0.0], device=device))
                    parents[r].append(node_ids[r, :1])
                    qs[r].append(q.unsqueeze(0))
                    count[r] += 1
                else:
                    tokens[r].append(child_tok[r].reshape(-1))
                    values[r].append(child_val[r].reshape(-1))
                    parents[r].append(node_ids[r].repeat_interleave(child_tok.shape[-1]))
                    count[r] += child_tok[r].numel()
            if d + 1 >= depth:
                break
            # expand: each row's best `width` children (sampled rows: their one draw)
            w = child_tok.shape[-1]
            flat_val = child_val.reshape(R, -1)
            keep = torch.topk(flat_val, min(width, flat_val.shape[1]), dim=1).indices  # [R, B]
            B = keep.shape[1]
            new_tok = torch.gather(child_tok.reshape(R, -1), 1, keep)
            new_val = torch.gather(flat_val, 1, keep)
            base = torch.tensor([c - v.numel() for c, v in zip(count, [t[-1] for t in tokens])], device=device)
            new_ids = base.unsqueeze(1) + keep
            from_parent = keep // w  # [R, B] which expanded node each comes from
            for r in range(R):
                if sampled[r]:
                    new_tok[r] = tokens[r][-1][0]
                    new_val[r] = 0.0
                    new_ids[r] = count[r] - 1
                    from_parent[r] = 0
            h_in = torch.gather(h, 1, from_parent.unsqueeze(-1).expand(-1, -1, h.shape[-1]))
            anc = torch.gather(anc, 1, from_parent.unsqueeze(-1).expand(-1, -1, anc.shape[-1]))
            positions = read.last_pos.unsqueeze(1) + d + 1
            q, k, v, res = layer.project(h_in, states[0].embed[new_tok].to(h.dtype), positions.expand(-1, B))
            tree_k = k if tree_k is None else torch.cat([tree_k, k], dim=2)
            tree_v = v if tree_v is None else torch.cat([tree_v, v], dim=2)
            anc = torch.cat([anc, torch.eye(B, dtype=torch.bool, device=device).expand(R, -1, -1)], dim=2)
            visible = torch.cat([read.visible[:, -1:].expand(-1, B, -1), anc], dim=2)
            h = layer.finish(q, torch.cat([read.keys, tree_k], dim=2), torch.cat([read.values, tree_v], dim=2),
                             visible, res)
            node_ids, node_vals = new_ids, new_val
        return [self._proposal(tokens[r], values[r], parents[r], qs[r], sizes[r], device) for r in range(R)]

    @staticmethod
    def _proposal(tokens: list[torch.Tensor], values: list[torch.Tensor], parents: list[torch.Tensor],
                  qs: list[torch.Tensor], n: int, device: torch.device) -> DraftProposal:
        tok, val, par = torch.cat(tokens), torch.cat(values), torch.cat(parents)
        if qs:  # a sampled chain, in order
            n = min(n, tok.numel())
            return DraftProposal(tokens=tok[:n], parents=par[:n], probs=torch.cat(qs)[:n])
        # the n most valuable nodes; a value never grows down a path and a parent precedes its
        # children in node order, so a stable sort keeps every chosen node's parent before it
        chosen = torch.sort(val, descending=True, stable=True).indices[:n]
        position = torch.zeros(tok.numel() + 1, dtype=torch.long, device=device)
        position[chosen + 1] = torch.arange(1, chosen.numel() + 1, device=device)
        return DraftProposal(tokens=tok[chosen], parents=position[par[chosen]])


@dataclass
class _Read:
    """The draft layer's pass over every row's new features.

    h: [R, H] its output at each row's last new position (the root's parent); keys / values:
    [R, H_kv, S, D] each row's entries (old ones, then new), padded; visible: [R, M, S] what
    each new position sees (row r's last new one at index m_r - 1 is copied to ``[:, -1]``);
    last_pos: [R] the position of each row's last new entry; commit: per row the new entries
    (keys, values [H_kv, m, D]) and the position they start at.
    """

    h: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    visible: torch.Tensor
    last_pos: torch.Tensor
    commit: list[tuple[torch.Tensor, torch.Tensor, int]]


def _read(layer: EagleLayer, states: list[_State], ctxs: list[DraftContext]) -> _Read:
    """One forward of the draft layer over every row's new features (see :class:`_Read`)."""
    R = len(states)
    spec = layer.spec
    dtype = layer.fc.weight.dtype
    device = layer.fc.weight.device
    feats, starts = [], []
    for s, c in zip(states, ctxs):
        if c.features is None or any(k not in c.features for k in s.layer_ids):
            raise ValueError("Eagle needs the target's hidden states (DraftContext.features); the engine did not pass them")
        f = torch.cat([c.features[k] for k in s.layer_ids], dim=-1)
        if f.shape[0] == 0:
            raise ValueError("Eagle got no new features for a row: every draft step follows a verified position")
        feats.append(f.to(device, dtype))
        starts.append(int(c.tokens.numel()) - 1 - f.shape[0])
    ms = [f.shape[0] for f in feats]
    M = max(ms)
    old = [s.cache.n if st >= s.seen else 0 for s, st in zip(states, starts)]  # a rewound row starts afresh
    N = max(old)
    H = spec.hidden_size
    h = torch.zeros(R, M, H, dtype=dtype, device=device)
    emb = torch.zeros(R, M, H, dtype=dtype, device=device)
    positions = torch.zeros(R, M, dtype=torch.long, device=device)
    for r, (s, c, f, st, m) in enumerate(zip(states, ctxs, feats, starts, ms)):
        h[r, :m] = layer.fuse(f)
        nxt = c.tokens[st + 1 : st + 1 + m].to(device)
        emb[r, :m] = s.embed[nxt].to(dtype)
        positions[r, :m] = torch.arange(st, st + m, device=device)
        positions[r, m:] = st + m - 1
    q, k, v, res = layer.project(h, emb, positions)
    keys = k.new_zeros((R, spec.num_kv_heads, N + M, spec.head_dim))
    values = torch.zeros_like(keys)
    visible = torch.zeros(R, M, N + M, dtype=torch.bool, device=device)
    causal = torch.ones(M, M, dtype=torch.bool, device=device).tril()
    for r, (s, n, m) in enumerate(zip(states, old, ms)):
        if n:
            keys[r, :, :n] = s.cache.keys[:, :n]
            values[r, :, :n] = s.cache.values[:, :n]
            visible[r, :, :n] = True
        visible[r, :, N : N + M] = causal
        visible[r, :, N + m :] = False
        visible[r, m:, :] = False
        visible[r, torch.arange(m, M), N + torch.arange(m, M)] = True  # padding sees itself
    keys[:, :, N:] = k
    values[:, :, N:] = v
    out = layer.finish(q, keys, values, visible, res)
    idx = torch.tensor([m - 1 for m in ms], device=device)
    rows = torch.arange(R, device=device)
    last_vis = visible[rows, idx].unsqueeze(1)  # [R, 1, S]
    return _Read(h=out[rows, idx], keys=keys, values=values, visible=last_vis,
                 last_pos=positions[rows, idx],
                 commit=[(k[r, :, : ms[r]].clone(), v[r, :, : ms[r]].clone(), starts[r]) for r in range(R)])
