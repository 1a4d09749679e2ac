"""A cache whose entries live in a slow tier, each step's attention reading only what it needs
(InfiniGen, Lee et al. 2024; the strategy is a :class:`~accel.strategy.KVTier`).

:class:`TieredCache` is a :class:`~accel.cache.SharedCache` that keeps every entry (nothing
is dropped, so a later question may still read any part of the prompt) in buffers of the
slow tier: memory-mapped files whose pages the process gives back layer by layer (so its
resident memory holds what a layer reads, not the cache), or ordinary tensors. Beside them it
keeps, in memory, the *partial keys* of every entry: each key projected onto ``r`` directions
of its KV head (``k @ P``, ``P`` [D, r] from :meth:`~accel.strategy.KVTier.projections`),
``r / D`` of the keys' bytes.

A decode step (or the verify pass of a draft tree, up to ``step_tokens()`` new tokens per
row) goes like this, for each layer l:

1. before layer l - 1 attends, :func:`accel.adapter.predict_queries` hands :meth:`plan` the
   queries layer l would compute from layer l - 1's attention input (layer 0: its own);
2. :meth:`plan` scores every committed entry of the layer with ``(q @ P) . (k @ P)``, the
   query heads of a KV head combined (:meth:`~accel.strategy.KVTier.head_pooling`), and picks for each row, KV head and new token the
   top ``selected`` entries before the token's window and every committed entry in its
   window (its last ``window`` positions); the union over the step's tokens is what the
   layer will read, and its mask lets each token see exactly its own choice, plus its
   ancestors in the step (the draft tree);
3. when layer l stores its new entries, they go to the slow tier (and their partial keys to
   memory), and the union and the new entries are *fetched*: copied out of the slow tier into
   the buffer attention reads (one ``index_select``; on a CPU there is no transfer for an
   earlier fetch to overlap), after which the layer's pages of a file tier are given back.

A token's choice depends only on its own predicted query and the entries committed before
its window, which are the same whether it is verified in a tree or decoded alone: greedy
drafting on a tiered cache emits what plain decoding on one does (float32; tested).
Forwards of more tokens (prompt chunks), steps with uncommitted entries, and rows that hold
no more than ``selected + window`` entries attend to every entry, as a
:class:`~accel.cache.SharedCache` does.

``fetched_bytes`` / ``full_bytes`` count, over the planned steps, the bytes fetched and the
bytes a full read of the same entries would have been (keys and values, every layer).
"""

from __future__ import annotations

import mmap
import math
import tempfile
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import torch

from . import adapter
from .cache import SharedCache
from .files import cache_dir

if TYPE_CHECKING:
    from .strategy import KVTier

__all__ = ["TieredCache"]

# Columns a slow-tier file grows by: its unwritten pages cost neither memory nor disk, so
# growing seldom saves the copies a growth makes.
_FILE_GROW = 4096


class _PartialKeys(SharedCache):
    """The partial keys of a :class:`TieredCache`, as a cache of their own whose rows, lengths
    and commits mirror it: keys ``[Bcap, H_kv, cap, r]``, values of width 0."""

    def _buffers(self, shape, like):
        return like.new_zeros(shape), like.new_zeros((*shape[:3], 0))


@dataclass
class _Plan:
    """One layer's fetch for the step: the slow-tier columns ``[B, H_kv, U + T]`` attention
    reads (U chosen committed entries, ascending, then the step's T new ones), U, and the
    layer's mask [B, H_q or 1, T, U + T]."""

    columns: torch.Tensor
    width: int
    mask: torch.Tensor


class TieredCache(SharedCache):
    """A :class:`~accel.cache.SharedCache` of every entry in a slow tier, decode steps
    attending to the entries :meth:`plan` fetches (see the module docstring).

    Args:
        num_layers: decoder layers of the model (full attention only: no sliding windows).
        tier: the strategy (its :meth:`~accel.strategy.KVTier.fast_entries`,
            :meth:`~accel.strategy.KVTier.slow_tier`, :meth:`~accel.strategy.KVTier.step_tokens`).
        projections: per layer the partial projection [H_kv, D, r].
    """

    def __init__(self, num_layers: int, tier: "KVTier", projections: Sequence[torch.Tensor]):
        super().__init__(num_layers)
        if len(projections) != num_layers:
            raise ValueError(f"{tier.name}: {len(projections)} partial projections for {num_layers} layers")
        self.tier = tier
        self.selected, self.window = tier.fast_entries()
        self.pooling = tier.head_pooling()
        kind, folder = tier.slow_tier()
        self.in_files = kind == "file"
        self.folder = Path(folder) if folder is not None else cache_dir() / "kv-tier"
        if self.in_files:
            self.folder.mkdir(parents=True, exist_ok=True)
            self.grow_columns = _FILE_GROW
            self._grow = [_FILE_GROW] * num_layers
        self.projections = list(projections)
        self.partial = _PartialKeys(num_layers)
        self._maps: dict[int, tuple[weakref.ref, mmap.mmap]] = {}  # id(buffer) -> its mapping, while it lives
        self._plans: list[_Plan | None] = [None] * num_layers
        self._parts: tuple | None = None  # what every layer's plan of this step shares
        self._sparse = False  # this forward attends to what plan() fetches
        self.predicting = False  # set while accel.adapter.predict_queries serves this cache
        self.query_plan = None  # what accel.adapter.flat_forward plans with, meanwhile
        self._visible: torch.Tensor | None = None  # [B, T, T] of the step
        self._dtype = torch.float32
        self.fetched_bytes = 0
        self.full_bytes = 0

    # ------------------------------------------------------------------ the slow tier

    def _buffers(self, shape, like):
        if not self.in_files or like.device.type != "cpu":
            return super()._buffers(shape, like)
        return self._mapped(shape, like.dtype), self._mapped(shape, like.dtype)

    def _mapped(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A zeroed tensor of ``shape`` in a memory-mapped file of its own (unlinked: it goes
        when the tensor does)."""
        count = math.prod(shape)
        nbytes = max(count * torch.empty((), dtype=dtype).element_size(), 1)
        with tempfile.TemporaryFile(dir=self.folder, prefix="accel-kv-") as f:
            f.truncate(nbytes)  # a sparse file: pages cost nothing until written
            mm = mmap.mmap(f.fileno(), nbytes)
        if not count:
            return torch.empty(shape, dtype=dtype)
        t = torch.frombuffer(mm, dtype=dtype, count=count).view(shape)
        self._maps[id(t)] = (weakref.ref(t), mm)
        return t

    def release(self, layer: int | None = None) -> None:
        """Give back the process's pages of the slow tier, of one layer or all (they stay in the
        files): what the process holds resident is then the fast tier, the partial keys and
        the model. Called after each layer's fetch, after a layer stores its prompt and after
        every commit."""
        if not self._maps:
            return
        if layer is not None:
            for t in (self._k[layer], self._v[layer]):
                entry = self._maps.get(id(t)) if t is not None else None
                if entry is not None and entry[0]() is t:
                    entry[1].madvise(mmap.MADV_DONTNEED)
            return
        live = {}
        for key, (ref, mm) in self._maps.items():
            if ref() is not None:
                mm.madvise(mmap.MADV_DONTNEED)
                live[key] = (ref, mm)
        self._maps = live

    # ------------------------------------------------------------------ what a layer attends to

    @contextmanager
    def planning(self, model: Any) -> Iterator[None]:
        """While active, forwards of ``model`` over this cache fetch what each layer attends
        to (:func:`accel.adapter.predict_queries` hands :meth:`plan` the predicted queries);
        outside it every forward reads every entry."""
        self.predicting = True
        try:
            with adapter.predict_queries(model, self, self.plan, lambda: self._sparse, self.tier.predicts_ahead()):
                yield
        finally:
            self.predicting = False
            self._sparse = False

    @property
    def ragged(self) -> bool:  # masks built every step (a step may be planned), never the compiled step's
        return True

    @property
    def uniform_masks(self) -> bool:
        return not self._sparse and super().uniform_masks

    def layer_mask(self, layer_idx: int) -> torch.Tensor | None:
        plan = self._plans[layer_idx]
        return plan.mask if plan is not None else super().layer_mask(layer_idx)

    def prepare_step(self, positions, tree_mask, dtype, groups):
        mask = super().prepare_step(positions, tree_mask, dtype, groups)
        bsz, t = positions.shape
        self._plans = [None] * self.num_layers
        self._parts = None
        self._visible = tree_mask if tree_mask is not None else torch.ones((bsz, 1, 1), dtype=torch.bool,
                                                                           device=positions.device)
        self._dtype = dtype
        self._sparse = (self.predicting and self._prefill is None and not any(self._pending)
                        and t <= self.tier.step_tokens() and self.committed_length(0) > self.selected + self.window)
        return mask

    def plan(self, layer: int, queries: torch.Tensor) -> None:
        """Choose what layer ``layer`` attends to this step and build its mask (see the module
        docstring); the entries are fetched when the layer stores its own (:meth:`_store`).

        queries: [B, H_q, T, D] the step's (predicted) queries of that layer, post-RoPE.
        """
        if not self._sparse or not self._len[layer]:
            return
        proj = self.projections[layer]  # [H, D, r]
        bsz, hq, t, d = queries.shape
        h = proj.shape[0]
        groups = hq // h
        lengths = self._len[layer]
        width = max(lengths)  # the step's new entries go to columns width .. width + T - 1
        part = self.partial.storage(layer)[0][:bsz, :, :width]  # [B, H, W, r]
        q = queries.reshape(bsz, h, groups, t, d).to(proj.dtype) @ proj[None, :, None]  # [B, H, G, T, r]
        device = queries.device
        key = (tuple(lengths), h)
        if self._parts is None or self._parts[0] != key:  # the same for every layer of a step
            cols = torch.arange(width, device=device)
            held = torch.tensor(lengths, device=device)[:, None, None]  # [B, 1, 1]
            start = self._step_positions[:, :, None] - self.window  # [B, T, 1]: where each token's window starts
            outside = ~((cols < start) & (cols < held))[:, None]  # [B, 1, T, W]: not a candidate
            window = ((cols >= start) & (cols < held))[:, None].expand(bsz, h, t, width)
            new = (width + torch.arange(t, device=device)).expand(bsz, h, t)
            self._parts = (key, cols, outside, window, new, {})
        _, cols, outside, window, new, masks = self._parts
        if self.pooling == "sum" or groups == 1:
            scores = q.sum(2) @ part.transpose(-1, -2)  # [B, H, T, W]: the group's logits summed
            scores.masked_fill_(outside, float("-inf"))
        else:  # each query head's softmax over the candidates, the group's largest
            logits = (q.reshape(bsz, h, groups * t, -1) @ part.transpose(-1, -2)).view(bsz, h, groups, t, width)
            logits.masked_fill_(outside[:, :, None], float("-inf"))
            scores = logits.softmax(-1).amax(2).masked_fill_(outside, float("-inf"))
        top = scores.topk(min(self.selected, width), dim=-1, sorted=False)
        chosen = window.clone()  # [B, H, T, W]: the window, then the top candidates
        chosen.scatter_(-1, top.indices, top.values > float("-inf"))
        union = chosen.any(2) if t > 1 else chosen[:, :, 0]  # [B, H, W]
        count = union.sum(-1)  # [B, H]
        u = max(int(count.max()), 1)
        if bool((count == u).all()):  # every head fetches as many: ascending columns, no padding
            index = union.nonzero()[:, -1].view(bsz, h, u)
            real = None
        else:  # column i of a head is its i-th chosen entry; heads with fewer are padded (masked)
            slot = torch.where(union, union.cumsum(-1) - 1, u)
            index = torch.zeros((bsz, h, u + 1), dtype=torch.long, device=device)
            index.scatter_(-1, slot, cols.expand(bsz, h, width))
            index = index[..., :u]
            real = torch.arange(u, device=device) < count[..., None]  # [B, H, U]
        if t == 1 and real is None:  # each token sees every fetched entry and itself
            mask = masks.get(u)
            if mask is None:
                mask = masks[u] = torch.zeros((bsz, 1, 1, u + 1), dtype=self._dtype, device=device)
        else:
            sees = chosen.gather(-1, index[:, :, None, :].expand(bsz, h, t, u))  # [B, H, T, U]
            if real is not None:
                sees &= real[:, :, None, :]
            allowed = torch.cat([sees.repeat_interleave(groups, dim=1),
                                 self._visible[:bsz, None].expand(bsz, hq, t, t)], dim=-1)
            mask = torch.zeros(allowed.shape, dtype=self._dtype, device=device)
            mask.masked_fill_(~allowed, torch.finfo(self._dtype).min)
        self._plans[layer] = _Plan(torch.cat([index, new], dim=-1), u, mask)
        entry = 2 * d * self._k[layer].element_size()
        self.fetched_bytes += int(count.sum()) * entry
        self.full_bytes += sum(lengths) * h * entry

    def _store(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor):
        prompt = self._prefill is not None and not self._len[layer_idx]
        out = super()._store(layer_idx, keys, values)
        part = keys.to(self.projections[layer_idx].dtype) @ self.projections[layer_idx][None]  # [B, H, T, r]
        self.partial._store(layer_idx, part, part[..., :0])
        if prompt:  # the prompt attends to its own keys, not to the slow tier's copy
            self.release(layer_idx)
        plan = self._plans[layer_idx]
        if plan is None:
            return out
        # the fetch: the chosen committed entries and the step's own, one row copy each
        k, v = self._k[layer_idx], self._v[layer_idx]  # [Bcap, H, cap, D], contiguous
        bsz, h, d = keys.shape[0], k.shape[1], k.shape[3]
        heads = torch.arange(bsz * h, device=keys.device).view(bsz, h, 1) * k.shape[2]
        rows = (heads + plan.columns).flatten()
        fk = k.view(-1, d).index_select(0, rows).view(bsz, h, -1, d)
        fv = v.view(-1, d).index_select(0, rows).view(bsz, h, -1, d)
        self.release(layer_idx)
        return fk, fv

    # ------------------------------------------------------------------ mirrored on the partial keys

    def begin_prefill(self, lengths, select=None) -> None:
        if select is not None:
            raise ValueError(f"{self.tier.name} keeps every prompt entry: no prompt compression on a tiered cache")
        super().begin_prefill(lengths)
        self.partial.begin_prefill(lengths)

    def end_prefill(self) -> None:
        super().end_prefill()
        self.partial.end_prefill()
        self.release()

    def reserve(self, columns: int) -> None:
        super().reserve(columns)
        self.partial.reserve(columns)

    def commit(self, keep=None, advance=None) -> None:
        super().commit(keep, advance)
        self.partial.commit(keep, advance)
        self._plans = [None] * self.num_layers
        self._sparse = False
        self.release()

    def cut(self, lengths) -> None:
        super().cut(lengths)
        self.partial.cut(lengths)

    def extend(self, other: SharedCache) -> None:
        if not isinstance(other, TieredCache):
            raise ValueError("extend() of a tiered cache needs the rows of another tiered cache")
        super().extend(other)
        self.partial.extend(other.partial)

    def _extended(self, layer: int, other: SharedCache) -> None:
        self.release(layer)  # the copy touched every page of both: one layer's at a time stays resident
        other.release(layer)

    def remove(self, row: int) -> None:
        super().remove(row)
        self.partial.remove(row)

    def _refuse(self, what: str):
        raise RuntimeError(f"{what} on a tiered cache: {self.tier.name} keeps every entry as it is")

    def compress_prompt(self, select) -> None:
        self._refuse("compress_prompt()")

    def load_prefixes(self, prefixes) -> None:
        self._refuse("load_prefixes()")

    def select(self, layer_idx, indices, valid=None) -> None:
        self._refuse("select()")

    def evict_row(self, layer_idx, row, indices, valid=None) -> None:
        self._refuse("evict_row()")

    def pack(self, layer_idx, row, groups, codec) -> None:
        self._refuse("pack()")

    def resident_bytes(self) -> int:
        """Bytes the cache holds in memory outside the slow tier: the partial keys and the
        fast buffers of the step (the slow tier's own when it is in memory)."""
        total = self.partial.storage_bytes()
        if not self.in_files:
            total += self.storage_bytes()
        return total
