"""The shared, possibly compressed, key-value cache that the verifier and every drafter read.

One :class:`SharedCache` per request. Per layer it stores keys and values
``[B, H_kv, capacity, D]`` in a growable buffer, of which the first ``physical_length``
entries are live. It tracks the *logical* length (tokens seen) apart from the *physical*
length (entries kept): after prompt compression the two differ, and position ids of new
tokens always come from the logical length, so RoPE of kept entries is never recomputed.

Three operations:

- :meth:`select` replaces one layer's prompt KV by a subset per KV head (prompt
  compression; during the prefill it runs inside the layer, so the full prompt KV of all
  layers never coexists);
- :meth:`_store` (called by the model's attention through the transformers adapter)
  appends T entries, e.g. a draft tree for one verification pass;
- :meth:`commit` keeps only a chosen subset of the entries appended since the last
  commit (the accepted path), drops the rest and advances the logical length.
"""

from __future__ import annotations

from typing import Callable

import torch

from .adapter import TransformersCache

__all__ = ["SharedCache"]

# Entries appended beyond the current need when a buffer grows, so a decode step rarely copies.
_GROW = 256

# (layer_idx, keys, values) -> (indices [B, H_kv, K], valid [B, H_kv, K] | None) or None
PrefillHook = Callable[[int, torch.Tensor, torch.Tensor], "tuple[torch.Tensor, torch.Tensor | None] | None"]


class SharedCache(TransformersCache):
    """A transformers ``Cache`` with logical vs physical length and select / append / commit.

    Args:
        num_layers: decoder layers of the model.
    """

    def __init__(self, num_layers: int):
        super().__init__(num_layers)
        self.num_layers = num_layers
        self._k: list[torch.Tensor | None] = [None] * num_layers  # [B, H_kv, cap, D]
        self._v: list[torch.Tensor | None] = [None] * num_layers
        self._len = [0] * num_layers  # physical entries per layer
        self._pending = [0] * num_layers  # entries appended since the last commit
        self._valid: list[torch.Tensor | None] = [None] * num_layers  # [B, H_kv, K] of selected entries
        self.logical_length = 0
        self.prefill_hook: PrefillHook | None = None
        # True once some layer holds padded entries (per-head budgets): attention then needs
        # a per-layer mask, see :meth:`layer_mask`.
        self.ragged = False

    # ------------------------------------------------------------------ lengths and bytes

    def physical_length(self, layer_idx: int = 0) -> int:
        return self._len[layer_idx]

    def committed_length(self, layer_idx: int = 0) -> int:
        """Physical entries not counting uncommitted appends."""
        return self._len[layer_idx] - self._pending[layer_idx]

    def kept_bytes(self) -> int:
        """Bytes of the live K and V entries over all layers."""
        total = 0
        for k, n in zip(self._k, self._len):
            if k is not None:
                total += 2 * n * k.shape[0] * k.shape[1] * k.shape[3] * k.element_size()
        return total

    def keys(self, layer_idx: int) -> torch.Tensor:
        """Live keys of one layer, [B, H_kv, physical_length, D] (a view)."""
        return self._k[layer_idx][:, :, : self._len[layer_idx]]

    def values(self, layer_idx: int) -> torch.Tensor:
        return self._v[layer_idx][:, :, : self._len[layer_idx]]

    # ------------------------------------------------------------------ storage

    def _reserve(self, layer_idx: int, needed: int, like: torch.Tensor) -> None:
        k = self._k[layer_idx]
        if k is not None and k.shape[2] >= needed:
            return
        b, h, _, d = like.shape
        cap = needed + _GROW
        nk = like.new_empty((b, h, cap, d))
        nv = like.new_empty((b, h, cap, d))
        n = self._len[layer_idx]
        if k is not None and n:
            nk[:, :, :n] = k[:, :, :n]
            nv[:, :, :n] = self._v[layer_idx][:, :, :n]
        self._k[layer_idx], self._v[layer_idx] = nk, nv

    def _put(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        n, t = self._len[layer_idx], keys.shape[2]
        self._reserve(layer_idx, n + t, keys)
        self._k[layer_idx][:, :, n : n + t] = keys
        self._v[layer_idx][:, :, n : n + t] = values
        self._len[layer_idx] = n + t

    def _store(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor):
        """Called by attention layer ``layer_idx`` with new entries [B, H_kv, T, D]."""
        if self.prefill_hook is not None and self._len[layer_idx] == 0:
            # Prefill of an empty layer: the layer attends to the full prompt, but only the
            # selected entries are stored, so each layer is compressed before the next runs.
            selection = self.prefill_hook(layer_idx, keys, values)
            if selection is None:
                self._put(layer_idx, keys, values)
            else:
                indices, valid = selection
                self._put(layer_idx, *self._gather(keys, values, indices))
                self._set_valid(layer_idx, valid)
            return keys, values
        self._put(layer_idx, keys, values)
        self._pending[layer_idx] += keys.shape[2]
        return self.keys(layer_idx), self.values(layer_idx)

    @staticmethod
    def _gather(keys: torch.Tensor, values: torch.Tensor, indices: torch.Tensor):
        idx = indices.unsqueeze(-1).expand(-1, -1, -1, keys.shape[-1])
        return keys.gather(2, idx), values.gather(2, idx)

    # ------------------------------------------------------------------ operations

    def _set_valid(self, layer_idx: int, valid: torch.Tensor | None) -> None:
        if valid is not None and not bool(valid.all()):
            self._valid[layer_idx] = valid.bool()
            self.ragged = True
        else:
            self._valid[layer_idx] = None

    def select(self, layer_idx: int, indices: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """Keep only ``indices`` [B, H_kv, K] (positions into the layer's stored entries,
        ascending per head) of one layer.

        Every KV head stores K entries; with ``valid`` [B, H_kv, K] some of them are padding
        (heads keeping fewer than K), masked out of attention by :meth:`layer_mask`.
        """
        if self._pending[layer_idx]:
            raise RuntimeError("select() on a layer with uncommitted entries; commit() first")
        k, v = self._gather(self.keys(layer_idx), self.values(layer_idx), indices)
        self._k[layer_idx], self._v[layer_idx], self._len[layer_idx] = None, None, 0
        self._put(layer_idx, k, v)
        self._set_valid(layer_idx, valid)

    def layer_mask(self, layer_idx: int, mask: torch.Tensor | None, q_len: int, groups: int, dtype: torch.dtype) -> torch.Tensor:
        """The additive attention mask of one layer for ``q_len`` new tokens, when layers
        differ in length or hold padding.

        mask: the forward's shared mask, [1, 1, q_len, P0 + q_len] or None (then the new
            tokens are one, or causal among themselves); only its last q_len columns (the
            new tokens' part) are used.
        groups: query heads per KV head. Returns [B, H_q, q_len, P + q_len], P being this
        layer's committed entries.
        """
        past = self.committed_length(layer_idx)
        like = self._k[layer_idx]
        b, h = like.shape[:2]
        low = torch.finfo(dtype).min
        prefix = torch.zeros((b, h, past), dtype=dtype, device=like.device)
        valid = self._valid[layer_idx]
        if valid is not None:
            prefix[:, :, : valid.shape[2]].masked_fill_(~valid, low)
        prefix = prefix.repeat_interleave(groups, dim=1).unsqueeze(2).expand(-1, -1, q_len, -1)
        if mask is not None:
            new = mask[..., -q_len:].to(dtype)
        else:
            new = torch.zeros((q_len, q_len), dtype=dtype, device=like.device)
            new.masked_fill_(torch.ones_like(new, dtype=torch.bool).triu(1), low)
        new = new.expand(b, h * groups, q_len, q_len)
        return torch.cat([prefix, new], dim=-1)

    def commit(self, keep: torch.Tensor | list[int] | None = None, advance: int | None = None) -> None:
        """Keep the appended entries at offsets ``keep`` (relative to the first entry
        appended since the last commit, ascending), drop the other appended entries, and
        advance the logical length by ``advance`` (default: the number kept).

        ``keep=None`` keeps every appended entry.
        """
        if keep is not None:
            offsets = torch.as_tensor(keep, dtype=torch.long)
            count = int(offsets.numel())
            moved = bool(count) and not torch.equal(offsets, torch.arange(count))
        for layer in range(self.num_layers):
            pending = self._pending[layer]
            if not pending:
                continue
            base = self._len[layer] - pending
            kept = pending if keep is None else count
            if keep is not None and moved:
                src = offsets.to(self._k[layer].device) + base
                k, v = self._k[layer], self._v[layer]
                k[:, :, base : base + kept] = k.index_select(2, src)
                v[:, :, base : base + kept] = v.index_select(2, src)
            self._len[layer] = base + kept
            self._pending[layer] = 0
        if advance is None:
            advance = len(keep) if keep is not None else None
            if advance is None:
                raise ValueError("commit(keep=None) needs advance=")
        self.logical_length += int(advance)

    def rollback(self) -> None:
        """Drop every entry appended since the last commit."""
        self.commit(keep=[], advance=0)
