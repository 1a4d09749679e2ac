"""The shared, possibly compressed, key-value cache that the verifier and every drafter read.

One :class:`SharedCache` holds every row of a batch. Per layer it stores keys and values
``[B, H_kv, capacity, D]``; row ``b`` of layer ``l`` keeps its committed entries at columns
``0 .. lengths[l][b] - 1``, so each row has its own number of kept entries per layer (after
prompt compression, after ragged acceptance). The cache tracks each row's *logical* length
(tokens seen) apart from its *physical* lengths (entries kept): position ids of new tokens
come from the logical length, so RoPE of kept entries is never recomputed.

A step of the batch works like this:

1. :meth:`prepare_step` is given the step's new tokens (positions ``[B, T]`` and the tree
   part of the mask ``[B, 1, T, T]``) and builds each layer's additive attention mask
   ``[B, 1 or H_q, T, P + T]``: a row sees its own committed entries, never another row's
   padding, a dropped entry or (on sliding-window layers) an entry outside its window;
2. during the forward each layer appends the T new entries of every row at one common
   column ``P`` (the layer's longest row), see :meth:`_store`;
3. :meth:`commit` moves each row's accepted entries right behind its committed ones,
   drops the rest and advances the logical lengths.

Prompt compression runs inside the prefill: :meth:`begin_prefill` installs a per-row
selection that each layer applies as it stores its prompt keys, so the full prompt KV of
all layers never coexists. Layers with a sliding window keep only the entries their window
can still see (they are never compressed: their memory is bounded by the window already).

Quantized groups (a :class:`~accel.strategy.KVQuantizer` such as GEAR, :meth:`pack`): a
layer may hold each row's oldest entries as packed groups (what the quantizer's ``encode``
made of them) and only the rest as entries. Such a layer's entry buffer holds row ``b``'s
columns from ``shift_b`` (its packed columns) on, and attention reads a materialized copy:
before the layer attends, the packed groups of every row are decoded into one scratch
buffer that all layers share, followed by each row's entries (:meth:`_materialize`), so
only one layer's worth of full-precision entries exists at a time.

Rows join with :meth:`extend` (the rows of another cache, e.g. freshly prefilled requests)
and leave with :meth:`remove` (the last row moves into the freed slot: one row copied per
departure, nothing on the steps in between). :meth:`cut` takes rows back to earlier
lengths (a draft model's cache, after the verifier rejected some of its drafts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import torch

from .adapter import TransformersCache
from .kernels.ordered import Layout

if TYPE_CHECKING:
    from .strategy import KVQuantizer

__all__ = ["SharedCache", "RowSelector"]

# Entries appended beyond the current need when a buffer grows, so a decode step rarely copies.
_GROW = 256

# (layer_idx, row, keys [1, H_kv, n, D], values) -> (indices [1, H_kv, K], valid [1, H_kv, K] | None) | None
RowSelector = Callable[[int, int, torch.Tensor, torch.Tensor], "tuple[torch.Tensor, torch.Tensor | None] | None"]


class _Packed:
    """One layer's quantized groups: every part the quantizer's ``encode`` makes, stored
    ``[Bcap, H_kv, gcap, ...]`` (row, KV head, group), and how many groups each row holds."""

    def __init__(self, codec: "KVQuantizer", rows: int):
        self.codec = codec
        self.group = codec.group_size()
        self.parts: dict[str, torch.Tensor] = {}
        self.groups: list[int] = [0] * rows

    def columns(self, row: int) -> int:
        """Entries of ``row`` held as groups (its oldest ones)."""
        return self.groups[row] * self.group

    def _reserve(self, rows: int, groups: int, like: dict[str, torch.Tensor]) -> None:
        """Room for ``rows`` x ``groups``; ``like``: parts [H_kv, m, ...] of the shapes to hold."""
        first = next(iter(self.parts.values()), None)
        if first is not None and first.shape[0] >= rows and first.shape[2] >= groups:
            return
        old_rows, old_groups = (first.shape[0], first.shape[2]) if first is not None else (0, 0)
        new_rows = max(rows, old_rows)
        # the first groups exactly (a prefill's); later growth with an eighth to spare
        new_groups = (groups if not old_groups else max(groups + groups // 8, old_groups)) if groups > old_groups \
            else old_groups
        for name, t in like.items():
            grown = t.new_zeros((new_rows, t.shape[0], new_groups, *t.shape[2:]))
            old = self.parts.get(name)
            if old is not None:
                grown[:old_rows, :, :old_groups] = old
            self.parts[name] = grown

    def append(self, row: int, parts: dict[str, torch.Tensor]) -> None:
        """Add m groups ``parts`` (each [H_kv, m, ...]) behind row ``row``'s."""
        m = next(iter(parts.values())).shape[1]
        g = self.groups[row]
        self._reserve(len(self.groups), g + m, parts)
        for name, t in parts.items():
            self.parts[name][row, :, g : g + m] = t
        self.groups[row] = g + m

    def add_rows(self, other: "_Packed | None", count: int) -> None:
        """Append ``count`` rows: the first rows of ``other``, or rows without groups."""
        start = len(self.groups)
        self.groups += other.groups[:count] if other is not None else [0] * count
        if other is None or not other.parts:
            if self.parts:
                self._reserve(len(self.groups), 0, {n: t[0] for n, t in self.parts.items()})
            return
        self._reserve(len(self.groups), max(self.groups), {n: t[0] for n, t in other.parts.items()})
        for name, t in other.parts.items():
            g = min(t.shape[2], self.parts[name].shape[2])
            self.parts[name][start : start + count, :, :g] = t[:count, :, :g]

    def move(self, dst: int, src: int) -> None:
        """Row ``src``'s groups become row ``dst``'s."""
        for t in self.parts.values():
            t[dst, :, : self.groups[src]] = t[src, :, : self.groups[src]]
        self.groups[dst] = self.groups[src]

    def decode(self, rows: slice, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write rows ``rows``'s groups (up to the most any of them holds) into the first
        columns of ``keys``, ``values`` [len(rows), H_kv, >= columns, D]."""
        g = max(self.groups[rows], default=0)
        if not g:
            return
        width = g * self.group
        parts = {name: t[rows, :, :g] for name, t in self.parts.items()}
        self.codec.decode(parts, keys[:, :, :width].unflatten(2, (g, self.group)),
                          values[:, :, :width].unflatten(2, (g, self.group)), self.groups[rows])

    def nbytes(self, row: int | None = None) -> int:
        """Bytes of the parts holding one row's groups (all rows' with None)."""
        rows = range(len(self.groups)) if row is None else [row]
        return sum(t[r, :, : self.groups[r]].numel() * t.element_size() for t in self.parts.values() for r in rows)


@dataclass
class _Prefill:
    lengths: list[int]  # prompt tokens per row (rows are right-padded to max)
    select: RowSelector | None


class SharedCache(TransformersCache):
    """A batched transformers ``Cache`` with per-row logical and physical lengths.

    Args:
        num_layers: decoder layers of the model.
        windows: per layer, the sliding-window size of that layer's attention (a query at
            position p sees keys at positions > p - window), or None for full attention;
            ``None`` means no layer has a window.
    """

    def __init__(self, num_layers: int, windows: Sequence[int | None] | None = None):
        super().__init__(num_layers)
        self.num_layers = num_layers
        self.windows: list[int | None] = list(windows) if windows is not None else [None] * num_layers
        # attention sees each layer's entries padded (masked) to a multiple of this many columns:
        # CPU attention kernels sum the last, partial block of keys in another order than full
        # ones, so a row's result would depend on how many entries other tokens added
        # (accel.kernels.invariance sets it for low-precision batches; 1: exactly the entries)
        self.kv_align = 1
        # attention of accel's forwards over this cache is accel.kernels.ordered's (each query from its
        # own keys in logical order: bit-identical in a tree and in a plain step); set for
        # low-precision batches by accel.kernels.invariance
        self.ordered = False
        self._tree: torch.Tensor | None = None  # [B, T, T] of the step being verified (ordered only)
        self._layouts: dict[tuple, Layout] = {}  # this forward's, by (lengths, pending)
        if len(self.windows) != num_layers:
            raise ValueError(f"windows has {len(self.windows)} entries for {num_layers} layers")
        self._k: list[torch.Tensor | None] = [None] * num_layers  # [Bcap, H_kv, cap, D]
        self._v: list[torch.Tensor | None] = [None] * num_layers
        self._len: list[list[int]] = [[] for _ in range(num_layers)]  # committed entries per layer, per row
        self._base = [0] * num_layers  # column where this step's appended entries start
        self._pending = [0] * num_layers  # entries appended per row since the last commit
        # [Bcap, H_kv, W] validity of the first W entries of a layer whose heads keep different
        # counts (per-head budgets); None when every committed entry is valid.
        self._valid: list[torch.Tensor | None] = [None] * num_layers
        # [Bcap, cap] logical position of every entry, on sliding-window layers only.
        self._pos: list[torch.Tensor | None] = [None] * num_layers
        # per layer: its rows' quantized groups (pack()); the entry buffer then holds row b's
        # columns from its packed columns on
        self._packed: list[_Packed | None] = [None] * num_layers
        self._scratch: tuple[torch.Tensor, torch.Tensor] | None = None  # what packed layers attend to
        self.grow_columns = _GROW  # columns added when a layer's entry buffer grows (a subclass may set more)
        self._grow = [_GROW] * num_layers  # per layer (a layer of quantized groups grows by a group)
        self.logical_lengths: list[int] = []
        self._prefill: _Prefill | None = None
        self._masks: list[torch.Tensor | None] = [None] * num_layers
        self._step_positions: torch.Tensor | None = None  # [B, T] of the step being verified
        # Rows to allocate room for when the batch grows (a service sets its max batch).
        self.row_capacity = 0
        # Entries beyond each sliding window kept when trimming, so that :meth:`cut` may take
        # back up to this many tokens (a draft model's cache, rolled back after each verify).
        self.keep_behind = 0
        self.mask_hook = False  # set while the adapter's per-layer mask hook serves this cache

    # ------------------------------------------------------------------ lengths and bytes

    @property
    def batch_size(self) -> int:
        return len(self.logical_lengths)

    @property
    def logical_length(self) -> int:
        """The logical length of a single-row cache (tokens seen)."""
        if self.batch_size != 1:
            raise ValueError(f"logical_length is per row on a batch of {self.batch_size}; use logical_lengths")
        return self.logical_lengths[0]

    def physical_length(self, layer_idx: int = 0) -> int:
        """Columns in use in one layer: the longest row's committed entries plus this step's."""
        rows = self._len[layer_idx]
        return (max(rows) if rows else 0) + self._pending[layer_idx]

    @property
    def pending_entries(self) -> int:
        """Entries each row appended since the last commit (the same in every layer)."""
        return self._pending[0]

    def row_lengths(self, layer_idx: int = 0) -> list[int]:
        """Committed entries of each row in one layer."""
        return list(self._len[layer_idx])

    def committed_length(self, layer_idx: int = 0) -> int:
        """Longest row's committed entries in one layer (uncommitted appends not counted)."""
        rows = self._len[layer_idx]
        return max(rows) if rows else 0

    @property
    def ragged(self) -> bool:
        """True when layers need masks of their own (rows of different lengths, per-head
        padding, sliding windows): the model's single mask does not serve every layer."""
        return any(v is not None for v in self._valid) or any(w is not None for w in self.windows) or any(
            self._len[layer] != self._len[0] for layer in range(1, self.num_layers)
        )

    def kept_bytes(self, row: int | None = None) -> int:
        """Bytes of the tensors holding the committed entries over all layers (of one row,
        or all): full-precision entries at their size, quantized groups at the size of the
        parts stored for them (measured from those tensors, not from a formula)."""
        total = 0
        for layer, (k, rows) in enumerate(zip(self._k, self._len)):
            if k is None:
                continue
            shifts = self._shifts(layer)
            picked = range(len(rows)) if row is None else [row]
            n = sum(rows[r] - shifts[r] for r in picked)
            total += 2 * n * k.shape[1] * k.shape[3] * k.element_size()
            if self._packed[layer] is not None:
                total += self._packed[layer].nbytes(row)
        return total

    def storage_bytes(self) -> int:
        """Bytes of every tensor the cache holds (the sum of their storages: spare capacity,
        masks' validity, positions and the packed layers' scratch buffer included)."""
        tensors = [*self._k, *self._v, *self._valid, *self._pos, *(self._scratch or ())]
        tensors += [t for p in self._packed if p is not None for t in p.parts.values()]
        seen: dict[int, int] = {}
        for t in tensors:
            if t is not None:
                storage = t.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
        return sum(seen.values())

    @property
    def packed(self) -> bool:
        """Whether some layer holds quantized groups (:meth:`pack`)."""
        return any(self._holds_groups(layer) for layer in range(self.num_layers))

    def packed_columns(self, layer_idx: int, row: int) -> int:
        """Row ``row``'s oldest entries of one layer held as quantized groups (0: none)."""
        p = self._packed[layer_idx]
        return p.columns(row) if p is not None else 0

    def _holds_groups(self, layer: int) -> bool:
        p = self._packed[layer]
        return p is not None and any(p.groups)

    def _shifts(self, layer: int) -> list[int]:
        """Per row, the column where the layer's entry buffer starts (its packed columns)."""
        p = self._packed[layer]
        return [p.columns(r) for r in range(len(self._len[layer]))] if p is not None else [0] * len(self._len[layer])

    def _low(self, layer: int) -> int:
        """The fewest packed columns of any row (0 on a layer without groups: no list built)."""
        return min(self._shifts(layer), default=0) if self._packed[layer] is not None else 0

    def _dense_used(self, layer: int) -> int:
        """Columns of the layer's entry buffer in use (the longest row's, this step's included)."""
        return self.physical_length(layer) - self._low(layer)

    def keys(self, layer_idx: int, row: int = 0) -> torch.Tensor:
        """Committed keys of one row and layer, [1, H_kv, n, D]: a view, or a new tensor
        (the groups decoded) where the layer holds some of the row's entries packed."""
        return self._entries(layer_idx, row)[0]

    def values(self, layer_idx: int, row: int = 0) -> torch.Tensor:
        """Committed values of one row and layer, [1, H_kv, n, D] (as :meth:`keys`)."""
        return self._entries(layer_idx, row)[1]

    def _entries(self, layer: int, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        n, q = self._len[layer][row], self.packed_columns(layer, row)
        k, v = self._k[layer], self._v[layer]
        if not q:
            return k[row : row + 1, :, :n], v[row : row + 1, :, :n]
        keys = k.new_empty((1, k.shape[1], n, k.shape[3]))
        values = v.new_empty(keys.shape)
        self._packed[layer].decode(slice(row, row + 1), keys, values)
        keys[:, :, q:] = k[row : row + 1, :, : n - q]
        values[:, :, q:] = v[row : row + 1, :, : n - q]
        return keys, values

    def entry_valid(self, layer_idx: int, row: int = 0) -> torch.Tensor | None:
        """[H_kv, n] validity of one row's committed entries, None when all are valid."""
        valid = self._valid[layer_idx]
        if valid is None:
            return None
        n = self._len[layer_idx][row]
        out = torch.ones(valid.shape[1], n, dtype=torch.bool, device=valid.device)
        w = min(n, valid.shape[2])
        out[:, :w] = valid[row, :, :w]
        return out

    # ------------------------------------------------------------------ storage

    def _reserve(self, layer: int, rows: int, cols: int, like: torch.Tensor, exact: bool = False) -> None:
        """Make layer storage hold at least ``rows`` x ``cols`` entries (columns of the entry
        buffer: past each row's packed ones), keeping its content; ``exact``: no spare columns."""
        k = self._k[layer]
        if not exact and k is not None and k.shape[0] >= rows and k.shape[2] >= cols:
            return
        h, d = like.shape[1], like.shape[3]
        old_rows = k.shape[0] if k is not None else 0
        old_cols = k.shape[2] if k is not None else 0
        new_rows = max(rows, old_rows, min(self.row_capacity, 2 * old_rows) if rows > old_rows else 0)
        new_cols = max(old_cols, cols + self._grow[layer]) if (k is None or cols > old_cols) else old_cols
        if exact:
            new_cols = cols
        # zeros, not empty: masked-out columns still meet V in the attention matmul (0 * NaN = NaN)
        nk, nv = self._buffers((new_rows, h, new_cols, d), like)
        live = min(len(self._len[layer]), old_rows)
        used = min(self._dense_used(layer), old_cols, new_cols)
        if k is not None and live and used:
            nk[:live, :, :used] = k[:live, :, :used]
            nv[:live, :, :used] = self._v[layer][:live, :, :used]
        self._k[layer], self._v[layer] = nk, nv
        pos = self._pos[layer]
        if self.windows[layer] is not None:
            npos = torch.full((new_rows, new_cols), -1, dtype=torch.long, device=like.device)
            if pos is not None and live and used:
                npos[:live, :used] = pos[:live, :used]
            self._pos[layer] = npos
        valid = self._valid[layer]
        if valid is not None and valid.shape[0] < new_rows:
            nvalid = torch.ones((new_rows, *valid.shape[1:]), dtype=torch.bool, device=valid.device)
            nvalid[: valid.shape[0]] = valid
            self._valid[layer] = nvalid

    def _buffers(self, shape: tuple[int, int, int, int], like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """New zeroed key and value buffers of ``shape`` [Bcap, H_kv, cap, D], of ``like``'s
        dtype and device (a subclass keeps them elsewhere: :class:`accel.tier.TieredCache`)."""
        return like.new_zeros(shape), like.new_zeros(shape)

    def _span(self, columns: int) -> int:
        """Columns attention sees for ``columns`` stored entries: rounded up to ``kv_align``
        (the columns past the entries are masked)."""
        return -(-columns // self.kv_align) * self.kv_align

    def _store(self, layer_idx: int, keys: torch.Tensor, values: torch.Tensor):
        """Called by attention layer ``layer_idx`` with new entries [B, H_kv, T, D]; returns
        what that layer attends to."""
        if self._prefill is not None and not self._len[layer_idx]:
            self._store_prompt(layer_idx, keys, values)
            return keys, values  # the prompt attends to the whole prompt
        bsz, t = keys.shape[0], keys.shape[2]
        base, span = self.claim(layer_idx, bsz, t, keys)
        k, v = self._k[layer_idx], self._v[layer_idx]
        if not self._holds_groups(layer_idx):
            k[:bsz, :, base : base + t] = keys
            v[:bsz, :, base : base + t] = values
            return k[:bsz, :, :span], v[:bsz, :, :span]
        shifts = self._shifts(layer_idx)
        if len(set(shifts)) == 1:
            s = shifts[0]
            k[:bsz, :, base - s : base - s + t] = keys
            v[:bsz, :, base - s : base - s + t] = values
        else:
            for b, s in enumerate(shifts):
                k[b, :, base - s : base - s + t] = keys[b]
                v[b, :, base - s : base - s + t] = values[b]
        return self._materialize(layer_idx, bsz, span)

    def _materialize(self, layer: int, bsz: int, span: int) -> tuple[torch.Tensor, torch.Tensor]:
        """What a layer holding packed groups attends to: [B, H_kv, span, D] keys and values
        in the scratch buffer every such layer shares (valid until the next layer's call):
        each row's groups decoded, then its entries (this step's included)."""
        k, v = self._k[layer], self._v[layer]
        sk = self._scratch[0] if self._scratch is not None else None
        if sk is None or sk.shape[0] < bsz or sk.shape[2] < span or sk.shape[1:4:2] != k.shape[1:4:2] \
                or sk.dtype != k.dtype:
            cols = span + self._grow[layer]
            self._scratch = (k.new_zeros((bsz, k.shape[1], cols, k.shape[3])),
                             k.new_zeros((bsz, k.shape[1], cols, k.shape[3])))
        sk, sv = self._scratch
        self._packed[layer].decode(slice(0, bsz), sk[:bsz], sv[:bsz])
        used = self.physical_length(layer)
        shifts = self._shifts(layer)
        if len(set(shifts)) == 1:
            s = shifts[0]
            sk[:bsz, :, s:used] = k[:bsz, :, : used - s]
            sv[:bsz, :, s:used] = v[:bsz, :, : used - s]
        else:
            for b, s in enumerate(shifts):
                sk[b, :, s:used] = k[b, :, : used - s]
                sv[b, :, s:used] = v[b, :, : used - s]
        return sk[:bsz, :, :span], sv[:bsz, :, :span]

    def claim(self, layer_idx: int, bsz: int, t: int, like: torch.Tensor) -> tuple[int, int]:
        """Make room for T new entries per row in one layer and book them as this step's
        (uncommitted): returns (base, span), the column where they go and the columns
        attention sees. The caller writes keys and values [B, H_kv, T, D] at ``base`` into
        :meth:`storage` (``like``: a tensor of their shape, dtype and device)."""
        if not self.batch_size and self._prefill is None:  # a bare forward on an empty cache: B empty rows
            self.logical_lengths = [0] * bsz
            self._len = [[0] * bsz for _ in range(self.num_layers)]
        if bsz != self.batch_size:
            raise ValueError(f"the forward has {bsz} rows but the cache holds {self.batch_size}")
        base = self.physical_length(layer_idx)
        span = self._span(base + t)
        self._reserve(layer_idx, bsz, span - self._low(layer_idx), like)
        if self._pos[layer_idx] is not None and self._step_positions is not None:
            self._pos[layer_idx][:bsz, base : base + t] = self._step_positions
        if not self._pending[layer_idx]:
            self._base[layer_idx] = base
        self._pending[layer_idx] += t
        return base, span

    def storage(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's whole key and value buffers, [Bcap, H_kv, capacity, D] each (not for
        a layer holding packed groups: its entries are not all in them)."""
        if self._holds_groups(layer_idx):
            raise RuntimeError(f"storage() of layer {layer_idx}, which holds quantized groups")
        return self._k[layer_idx], self._v[layer_idx]

    # ------------------------------------------------------------------ prefill

    def begin_prefill(self, lengths: Sequence[int], select: RowSelector | None = None) -> None:
        """Prepare an empty cache for a prefill of ``len(lengths)`` right-padded prompts.

        select: called per layer and row with that row's prompt entries
            ``[1, H_kv, n, D]``; returns (indices [1, H_kv, K] ascending, valid [1, H_kv, K] or
            None) to keep, or None to keep all. Sliding-window layers are not offered to it.
        """
        if self.batch_size:
            raise RuntimeError("begin_prefill() on a cache that already holds rows; prefill a new cache and extend()")
        self._prefill = _Prefill(list(lengths), select)
        self.logical_lengths = [0] * len(lengths)
        self._len = [[] for _ in range(self.num_layers)]

    def end_prefill(self) -> None:
        """Finish the prefill: every row's logical length is its prompt length."""
        if self._prefill is None:
            raise RuntimeError("end_prefill() without begin_prefill()")
        self.logical_lengths = list(self._prefill.lengths)
        self._prefill = None

    def reserve(self, columns: int) -> None:
        """Make every stored full-attention layer hold ``columns`` entries per row without
        growing again (a chunked prefill reserves its prompt after the first chunk, so later
        chunks append without copying what came before)."""
        for layer in range(self.num_layers):
            if self._k[layer] is not None and self.windows[layer] is None:
                self._reserve(layer, self.batch_size, columns - self._low(layer), self._k[layer])

    def compress_prompt(self, select: RowSelector) -> None:
        """Compress rows that hold their whole prompts, uncompressed and committed (a chunked
        prefill), exactly as :meth:`begin_prefill`'s ``select`` would have during a one-forward
        prefill: per full-attention layer, each row's n prompt entries ``[1, H_kv, n, D]`` are
        offered to ``select`` and only what it keeps is stored (in storage of the kept size;
        the uncompressed layer is freed before the next one is compressed)."""
        if any(self._pending) or self._prefill is not None or self.packed:
            raise RuntimeError("compress_prompt() with uncommitted entries, quantized groups or inside a prefill")
        lengths = list(self.logical_lengths)
        self._prefill = _Prefill(lengths, select)
        try:
            for layer in range(self.num_layers):
                if self.windows[layer] is not None or self._k[layer] is None:
                    continue
                if self._len[layer] != lengths or self._valid[layer] is not None:
                    raise RuntimeError(f"compress_prompt(): layer {layer} does not hold its rows' whole prompts")
                keys = self._k[layer][: len(lengths), :, : max(lengths)]
                values = self._v[layer][: len(lengths), :, : max(lengths)]
                self._k[layer] = self._v[layer] = None
                self._store_prompt(layer, keys, values)
                del keys, values
        finally:
            self._prefill = None

    def load_prefixes(self, prefixes: Sequence[tuple[Sequence[torch.Tensor], Sequence[torch.Tensor], int] | None]
                      ) -> None:
        """Start an empty cache with one row per item: ``(keys, values, n)`` gives the row the
        first n entries of per-layer keys and values ``[H_kv, >= n, D]`` (a prompt prefix
        computed before) and logical length n; None gives an empty row. The rest of each
        prompt then runs as a forward on top (:func:`accel.steps.prefill_rest`). Full
        attention only: a sliding-window layer keeps only its window of a prompt."""
        if self.batch_size or self._prefill is not None:
            raise RuntimeError("load_prefixes() on a cache that already holds rows")
        if any(w is not None for w in self.windows):
            raise ValueError("load_prefixes() on a cache with sliding windows")
        lengths = [p[2] if p is not None else 0 for p in prefixes]
        for item in prefixes:
            if item is not None and (len(item[0]) != self.num_layers or len(item[1]) != self.num_layers):
                raise ValueError(f"a prefix has {len(item[0])} layers of keys, the cache {self.num_layers}")
        like = next((p for p in prefixes if p is not None and p[2]), None)
        for layer in range(self.num_layers):
            if like is not None:
                self._reserve(layer, len(prefixes), max(lengths), like[0][layer].unsqueeze(0))
                for row, item in enumerate(prefixes):
                    if item is not None and item[2]:
                        keys, values, n = item
                        self._k[layer][row, :, :n] = keys[layer][:, :n]
                        self._v[layer][row, :, :n] = values[layer][:, :n]
            self._len[layer] = list(lengths)
        self.logical_lengths = list(lengths)

    def load_prompts(self, other: "SharedCache", select: RowSelector | None = None,
                     rows: Sequence[int] | None = None) -> None:
        """Start this empty cache with the rows of ``other``, which holds their whole prompts,
        uncompressed and committed, on full-attention layers only (an uncompressed prefill):
        each layer's rows are offered to ``select`` as :meth:`begin_prefill`'s would be, and
        what it keeps (all, without one) is copied here. ``rows``: row b here is ``other``'s
        row ``rows[b]`` (repeats allowed; default: every row in order). ``other`` is left as
        it is."""
        if self.batch_size or self._prefill is not None:
            raise RuntimeError("load_prompts() on a cache that already holds rows")
        held = list(other.logical_lengths)
        source = list(range(len(held))) if rows is None else [int(r) for r in rows]
        if any(not 0 <= r < len(held) for r in source):
            raise ValueError(f"load_prompts(): rows {source} of a cache of {len(held)} rows")
        lengths = [held[r] for r in source]
        if not lengths or any(other._pending) or other.packed or other._prefill is not None:
            raise RuntimeError("load_prompts() from a cache without rows, with uncommitted entries or quantized groups")
        if any(w is not None for w in self.windows) or any(w is not None for w in other.windows):
            raise ValueError("load_prompts() on a cache with sliding windows")
        if other.num_layers != self.num_layers:
            raise ValueError(f"load_prompts(): the other cache has {other.num_layers} layers, this one {self.num_layers}")
        self._prefill = _Prefill(lengths, select)
        self.logical_lengths = [0] * len(lengths)
        try:
            for layer in range(self.num_layers):
                if other._len[layer] != held or other._valid[layer] is not None or other._k[layer] is None:
                    raise RuntimeError(f"load_prompts(): layer {layer} of the other cache does not hold its rows' "
                                       "whole prompts")
                n = max(held)
                self._store_prompt(layer, other._k[layer][: len(held), :, :n], other._v[layer][: len(held), :, :n],
                                   source)
        except BaseException:
            n = self.num_layers  # nothing half-loaded stays
            self._k, self._v, self._valid = [None] * n, [None] * n, [None] * n
            self._len = [[] for _ in range(n)]
            self.logical_lengths = []
            raise
        finally:
            self._prefill = None
        self.logical_lengths = lengths

    def _store_prompt(self, layer: int, keys: torch.Tensor, values: torch.Tensor,
                      source: Sequence[int] | None = None) -> None:
        """Store one layer's prompt entries (``keys``/``values`` [B', H_kv, n, D]; row b's are
        row ``source[b]`` of them, default b), each row offered to the prefill's selector."""
        prefill = self._prefill
        window = self.windows[layer]
        kept: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]] = []
        for row, n in enumerate(prefill.lengths):
            src = row if source is None else source[row]
            k, v = keys[src : src + 1, :, :n], values[src : src + 1, :, :n]
            positions = None
            if window is not None:
                start = max(0, n - window)
                k, v = k[:, :, start:], v[:, :, start:]
                positions = torch.arange(start, n, device=keys.device)
                kept.append((k, v, None, positions))
                continue
            sel = prefill.select(layer, row, k, v) if prefill.select is not None else None
            valid = None
            if sel is not None:
                indices, valid = sel
                k, v = _gather(k, v, indices)
                if valid is not None and bool(valid.all()):
                    valid = None
            kept.append((k, v, valid, positions))
        bsz = len(kept)
        counts = [k.shape[2] for k, *_ in kept]
        self._reserve(layer, bsz, max(counts), keys)
        width = max((valid.shape[2] for _, _, valid, _ in kept if valid is not None), default=0)
        if width:
            self._valid[layer] = torch.ones((self._k[layer].shape[0], keys.shape[1], width), dtype=torch.bool,
                                            device=keys.device)
        for row, (k, v, valid, positions) in enumerate(kept):
            n = k.shape[2]
            self._k[layer][row, :, :n] = k[0]
            self._v[layer][row, :, :n] = v[0]
            if valid is not None:
                self._valid[layer][row, :, : valid.shape[2]] = valid[0]
            if positions is not None:
                self._pos[layer][row, :n] = positions
        self._len[layer] = counts

    # ------------------------------------------------------------------ masks

    def prepare_step(self, positions: torch.Tensor, tree_mask: torch.Tensor | None, dtype: torch.dtype,
                     groups: int) -> torch.Tensor | None:
        """Build every layer's attention mask for one forward of T new tokens per row.

        positions: LongTensor [B, T], each new token's logical position.
        tree_mask: BoolTensor [B, T, T], True where new token i may see new token j (its
            ancestors and itself), or None for T == 1.
        groups: query heads per KV head (per-head masks are given per query head).
        Entries appended by earlier forwards since the last commit (a draft model feeding a
        chain token by token) are seen by every new token.
        Returns the mask to hand the model ([B, 1, T, P + T] additive, of ``dtype``), or
        None when a plain causal mask over the cache is right (one token per row, every row
        of every layer the same length, nothing padded). Layers whose mask differs get
        theirs through :meth:`layer_mask` (the adapter's per-layer hook asks for it).
        """
        bsz, t = positions.shape
        self._step_positions = positions
        if t == 1 and self.kv_align == 1 and not self.ordered and not self.ragged and len(set(self._len[0])) <= 1 and not any(self._pending):
            self._masks = [None] * self.num_layers
            return None
        device = positions.device
        low = torch.finfo(dtype).min
        if tree_mask is None:
            tree_mask = torch.ones((bsz, 1, 1), dtype=torch.bool, device=device)
        self._tree = tree_mask if self.ordered else None
        self._layouts = {}
        memo: dict[tuple, torch.Tensor] = {}
        masks: list[torch.Tensor | None] = []
        for layer in range(self.num_layers):
            lengths = self._len[layer]
            pending = self._pending[layer]
            past = (max(lengths) if lengths else 0) + pending
            window = self.windows[layer]
            valid = self._valid[layer]
            key = (tuple(lengths), pending, window, id(valid) if valid is not None else None)
            mask = memo.get(key)
            if mask is None:
                cols = torch.arange(past, device=device)
                seen = cols.unsqueeze(0) < torch.tensor(lengths, device=device).unsqueeze(1)  # [B, P]
                if pending:  # entries of earlier forwards since the last commit: a chain the new tokens extend
                    seen |= cols.unsqueeze(0) >= self._base[layer]
                seen = seen[:, None, None, :]  # [B, 1, 1, P]
                if valid is not None:
                    w = min(past, valid.shape[2])
                    head_ok = torch.ones((bsz, valid.shape[1], past), dtype=torch.bool, device=device)
                    head_ok[:, :, :w] = valid[:bsz, :, :w]
                    seen = seen & head_ok.repeat_interleave(groups, dim=1).unsqueeze(2)  # [B, H_q, 1, P]
                new = tree_mask.unsqueeze(1)  # [B, 1, T, T]
                if window is not None:
                    kept_pos = self._pos[layer][:bsz, :past]  # [B, P]
                    near = positions.unsqueeze(-1) - kept_pos.unsqueeze(1) < window  # [B, T, P]
                    seen = seen & near.unsqueeze(1)
                    gap = positions.unsqueeze(-1) - positions.unsqueeze(1) < window  # [B, T, T]
                    new = new & gap.unsqueeze(1)
                heads = seen.shape[1]
                seen = seen.expand(bsz, heads, t, past)
                parts = [seen, new.expand(bsz, heads, t, t)]
                extra = self._span(past + t) - (past + t)
                if extra:  # the columns :meth:`_store` shows past the end to keep lengths aligned
                    parts.append(torch.zeros((bsz, heads, t, extra), dtype=torch.bool, device=device))
                allowed = torch.cat(parts, dim=-1)
                mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, low)
                memo[key] = mask
            masks.append(mask)
        self._masks = masks
        return masks[0]

    def layout(self, layer_idx: int) -> Layout:
        """Where layer ``layer_idx``'s keys sit during the forward :meth:`prepare_step` set up
        (ordered attention reads it, after the layer stored its new entries)."""
        if self._tree is None:
            raise RuntimeError("layout() outside an ordered forward (prepare_step on a cache with ordered=True)")
        lengths = tuple(self._len[layer_idx])
        pending = self._pending[layer_idx] - self._tree.shape[-1]
        layout = self._layouts.get((lengths, pending))
        if layout is None:  # one per distinct layout in a forward: layers share what it derives
            layout = self._layouts[(lengths, pending)] = Layout(lengths, pending, self._tree)
        return layout

    def layer_mask(self, layer_idx: int) -> torch.Tensor | None:
        """The mask :meth:`prepare_step` built for one layer (None: the model's own)."""
        return self._masks[layer_idx]

    @property
    def uniform_masks(self) -> bool:
        """Whether every layer uses the same mask this step (no per-layer hook needed)."""
        first = self._masks[0]
        return all(m is first for m in self._masks)

    # ------------------------------------------------------------------ commit

    def commit(self, keep: Sequence[Sequence[int] | None] | Sequence[int] | torch.Tensor | None = None,
               advance: int | Sequence[int] | None = None) -> None:
        """Keep, per row, the appended entries at offsets ``keep[b]`` (relative to the first
        entry appended since the last commit, ascending), drop the other appended entries,
        and advance each row's logical length by ``advance`` (default: the number kept).

        On a single-row cache ``keep`` may be one list of offsets. ``keep=None`` (or a row's
        None) keeps every appended entry.
        """
        bsz = self.batch_size
        rows = _per_row(keep, bsz)
        if advance is None:
            if any(r is None for r in rows):
                raise ValueError("commit(keep=None) needs advance=")
            steps = [len(r) for r in rows]
        else:
            steps = [int(advance)] * bsz if isinstance(advance, int) else [int(a) for a in advance]
        memo: dict[tuple, tuple | None] = {}  # index tensors, shared by layers of equal lengths
        for layer in range(self.num_layers):
            t = self._pending[layer]
            if not t:
                continue
            base = self._base[layer]
            offsets = [list(range(t)) if r is None else list(r) for r in rows]
            self._move(layer, base, offsets, memo)
            self._pending[layer] = 0
        self._step_positions = None
        self._masks = [None] * self.num_layers
        self.logical_lengths = [n + s for n, s in zip(self.logical_lengths, steps)]
        self._trim_windows()

    def _move(self, layer: int, base: int, offsets: list[list[int]], memo: dict[tuple, tuple | None]) -> None:
        """Move row b's appended entries ``base + offsets[b]`` to just behind its committed ones."""
        lengths = self._len[layer]
        shifts = self._shifts(layer)  # row b's column c sits at c - shifts[b] in the buffer
        key = (base, tuple(lengths), tuple(shifts))
        if key not in memo:
            width = max((len(o) for o in offsets), default=0)
            memo[key] = None
            if width and any(n != base or o != list(range(len(o))) for n, o in zip(lengths, offsets)):
                device = self._k[layer].device
                src = torch.tensor([[base - s + x for x in _pad_to(o, width)] for o, s in zip(offsets, shifts)],
                                   dtype=torch.long, device=device)  # [B, A]
                dst = torch.tensor([[n - s + i for i in range(width)] for n, s in zip(lengths, shifts)],
                                   dtype=torch.long, device=device)
                memo[key] = (torch.arange(len(lengths), device=device).unsqueeze(1), src, dst)
        moves = memo[key]
        if moves is not None:
            rows, src, dst = moves
            k, v, pos = self._k[layer], self._v[layer], self._pos[layer]
            k[rows, :, dst] = k[rows, :, src]
            v[rows, :, dst] = v[rows, :, src]
            if pos is not None:
                pos[rows, dst] = pos[rows, src]
        self._len[layer] = [n + len(o) for n, o in zip(lengths, offsets)]

    def rollback(self) -> None:
        """Drop every entry appended since the last commit."""
        self.commit(keep=[[] for _ in range(self.batch_size)], advance=0)

    def cut(self, lengths: Sequence[int]) -> None:
        """Take rows back to ``lengths[b]`` tokens (their logical lengths), dropping each row's
        newest committed entries: one per token in every layer.

        Only entries committed after the prefill, one per token, may be cut (the caller keeps
        each length at or above the row's prompt length, whose entries may be compressed); on
        sliding-window layers at most :attr:`keep_behind` tokens (older entries may have been
        trimmed). Raises ValueError for a length above the row's, a cut past ``keep_behind``
        where layers have windows, or one that would cut into entries a layer does not hold.
        """
        if any(self._pending):
            raise RuntimeError("cut() with uncommitted entries; commit() first")
        lengths = [int(n) for n in lengths]
        if len(lengths) != self.batch_size:
            raise ValueError(f"cut() got {len(lengths)} lengths for {self.batch_size} rows")
        drops = [n - m for n, m in zip(self.logical_lengths, lengths)]
        if any(d < 0 for d in drops):
            raise ValueError(f"cut() lengths {lengths} exceed the rows' lengths {self.logical_lengths}")
        if not any(drops):
            return
        if any(w is not None for w in self.windows) and max(drops) > self.keep_behind:
            raise ValueError(f"cut() of {max(drops)} tokens on a cache with sliding windows that keeps "
                             f"{self.keep_behind} behind them (keep_behind)")
        for layer in range(self.num_layers):
            if any(d > n for d, n in zip(drops, self._len[layer])):
                raise ValueError(f"cut() would drop more entries than layer {layer} keeps")
            if any(n - d < s for d, n, s in zip(drops, self._len[layer], self._shifts(layer))):
                raise ValueError(f"cut() would drop entries layer {layer} holds as quantized groups")
        for layer in range(self.num_layers):
            self._len[layer] = [n - d for n, d in zip(self._len[layer], drops)]
        self.logical_lengths = lengths

    def _trim_windows(self) -> None:
        """Drop, on sliding-window layers, the entries no future query can see (amortised:
        once a row holds more than its window plus the growth slack)."""
        for layer, window in enumerate(self.windows):
            if window is None or not self._len[layer] or max(self._len[layer]) <= window + _GROW:
                continue
            pos = self._pos[layer]
            keep = []
            for row, (n, logical) in enumerate(zip(self._len[layer], self.logical_lengths)):
                row_pos = pos[row, :n]
                keep.append(torch.nonzero(row_pos >= logical - window - self.keep_behind).flatten().tolist())
            self._compact(layer, keep)

    def _compact(self, layer: int, keep: list[list[int]]) -> None:
        """Keep, per row, only the committed entries at ``keep[b]`` (ascending)."""
        width = max((len(o) for o in keep), default=0)
        k, v, pos = self._k[layer], self._v[layer], self._pos[layer]
        device = k.device
        src = torch.tensor([_pad_to(o, width) for o in keep], dtype=torch.long, device=device)
        dst = torch.arange(width, device=device).expand(len(keep), width)
        rows = torch.arange(len(keep), device=device).unsqueeze(1)
        k[rows, :, dst] = k[rows, :, src]
        v[rows, :, dst] = v[rows, :, src]
        if pos is not None:
            pos[rows, dst] = pos[rows, src]
        self._len[layer] = [len(o) for o in keep]

    # ------------------------------------------------------------------ rows

    def select(self, layer_idx: int, indices: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """Keep only ``indices`` [B, H_kv, K] (positions into each row's committed entries,
        ascending per head) of one layer; ``valid`` [B, H_kv, K] marks padding (heads keeping
        fewer than K entries), masked out of attention."""
        if self._pending[layer_idx]:
            raise RuntimeError("select() on a layer with uncommitted entries; commit() first")
        if self._holds_groups(layer_idx):
            raise RuntimeError(f"select() on layer {layer_idx}, which holds quantized groups")
        bsz = self.batch_size
        k, v = _gather(self._k[layer_idx][:bsz], self._v[layer_idx][:bsz], indices)
        self._k[layer_idx], self._v[layer_idx] = None, None
        width = indices.shape[2]
        self._reserve(layer_idx, bsz, width, k)
        self._k[layer_idx][:bsz, :, :width] = k
        self._v[layer_idx][:bsz, :, :width] = v
        self._len[layer_idx] = [width] * bsz
        self._valid[layer_idx] = None if valid is None or bool(valid.all()) else valid.bool().clone()

    def evict_row(self, layer_idx: int, row: int, indices: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """Keep only ``indices`` [1, H_kv, K] (positions into row ``row``'s committed entries
        of one layer, ascending per head) of that row; ``valid`` [1, H_kv, K] marks padding
        (heads keeping fewer than K entries), masked out of attention. Other rows are left
        as they are (eviction during decoding, :mod:`accel.maintenance`)."""
        if self._pending[layer_idx]:
            raise RuntimeError("evict_row() on a layer with uncommitted entries; commit() first")
        if self.windows[layer_idx] is not None:
            raise ValueError(f"evict_row() on sliding-window layer {layer_idx}: its window bounds it already")
        keys, values = _gather(self.keys(layer_idx, row), self.values(layer_idx, row), indices)
        width = indices.shape[2]
        packed = self._packed[layer_idx]
        if packed is not None and packed.groups[row]:  # the kept entries return to full precision
            self._reserve(layer_idx, self._k[layer_idx].shape[0], width, keys)
            packed.groups[row] = 0
        self._k[layer_idx][row, :, :width] = keys[0]
        self._v[layer_idx][row, :, :width] = values[0]
        self._len[layer_idx][row] = width
        kept = self._valid[layer_idx]
        if valid is not None and not bool(valid.all()):
            if kept is None or kept.shape[2] < width:
                grown = torch.ones((self._k[layer_idx].shape[0], indices.shape[1], width), dtype=torch.bool,
                                   device=indices.device)
                if kept is not None:
                    grown[: kept.shape[0], :, : kept.shape[2]] = kept
                self._valid[layer_idx] = kept = grown
            kept[row] = True  # columns past a row's entries stay valid: new entries land there
            kept[row, :, :width] = valid[0]
        elif kept is not None:
            kept[row] = True
            if bool(kept.all()):
                self._valid[layer_idx] = None

    def pack(self, layer_idx: int, row: int, groups: int, codec: "KVQuantizer") -> None:
        """Quantize row ``row``'s oldest ``groups`` x G entries of one layer that are not yet
        packed: what ``codec.encode`` makes of them replaces them (the entries after them
        move to the front of the row's buffer; the buffer shrinks once no row needs it)."""
        if self._pending[layer_idx]:
            raise RuntimeError("pack() on a layer with uncommitted entries; commit() first")
        if self.windows[layer_idx] is not None:
            raise ValueError(f"pack() on sliding-window layer {layer_idx}: its window bounds it already")
        p = self._packed[layer_idx]
        if p is None:
            p = self._packed[layer_idx] = _Packed(codec, self.batch_size)
        elif p.codec != codec:
            raise ValueError(f"layer {layer_idx} holds groups of {p.codec.name}, not of {codec.name}")
        g = p.group
        shift, n = p.columns(row), self._len[layer_idx][row]
        m = groups * g
        if groups <= 0 or shift + m > n:
            raise ValueError(f"pack() of {groups} groups of {g} after the row's {shift} packed entries, "
                             f"of {n} it holds")
        k, v = self._k[layer_idx], self._v[layer_idx]
        h, d = k.shape[1], k.shape[3]
        p.append(row, codec.encode(k[row, :, :m].reshape(h, groups, g, d), v[row, :, :m].reshape(h, groups, g, d)))
        tail = n - shift - m
        if tail:
            k[row, :, :tail] = k[row, :, m : m + tail].clone()
            v[row, :, :tail] = v[row, :, m : m + tail].clone()
        self._grow[layer_idx] = g
        need = self._dense_used(layer_idx)
        if k.shape[2] > need + 2 * g:  # give the packed entries' memory back
            self._reserve(layer_idx, k.shape[0], need + g, k, exact=True)

    def entries_per_head(self, layer_idx: int, row: int) -> int:
        """Valid committed entries of one row and layer per KV head, averaged over the heads
        (rounded up): the count a decode budget holds (heads of a per-head layout differ)."""
        n = self._len[layer_idx][row]
        valid = self._valid[layer_idx]
        if valid is None or not n:
            return n
        w = min(n, valid.shape[2])
        heads = valid.shape[1]
        total = int(valid[row, :, :w].sum()) + heads * (n - w)
        return -(-total // heads)

    def extend(self, other: "SharedCache") -> None:
        """Append the rows of ``other`` (a cache of the same model, nothing uncommitted)."""
        if other.num_layers != self.num_layers or other.windows != self.windows:
            raise ValueError("extend() needs a cache of the same model (layers and windows)")
        if any(self._pending) or any(other._pending):
            raise RuntimeError("extend() with uncommitted entries; commit() first")
        start, add = self.batch_size, other.batch_size
        for layer in range(self.num_layers):
            ok = other._k[layer]
            if ok is None:
                continue
            n = other._dense_used(layer)
            self._reserve(layer, start + add, max(self._dense_used(layer) if self._k[layer] is not None else 0, n), ok)
            self._k[layer][start : start + add, :, :n] = ok[:add, :, :n]
            self._v[layer][start : start + add, :, :n] = other._v[layer][:add, :, :n]
            if other._packed[layer] is not None or self._packed[layer] is not None:
                if self._packed[layer] is None:
                    self._packed[layer] = _Packed(other._packed[layer].codec, start)
                self._packed[layer].add_rows(other._packed[layer], add)
                self._grow[layer] = self._packed[layer].group
            if self._pos[layer] is not None:
                self._pos[layer][start : start + add, :n] = other._pos[layer][:add, :n]
            ov, sv = other._valid[layer], self._valid[layer]
            if ov is not None or sv is not None:
                width = max(ov.shape[2] if ov is not None else 0, sv.shape[2] if sv is not None else 0)
                merged = torch.ones((self._k[layer].shape[0], ok.shape[1], width), dtype=torch.bool, device=ok.device)
                if sv is not None:
                    merged[:start, :, : sv.shape[2]] = sv[:start]
                if ov is not None:
                    merged[start : start + add, :, : ov.shape[2]] = ov[:add]
                self._valid[layer] = merged
            self._len[layer] = self._len[layer] + other._len[layer]
            self._extended(layer, other)
        self.logical_lengths = self.logical_lengths + other.logical_lengths

    def _extended(self, layer: int, other: "SharedCache") -> None:
        """Called by :meth:`extend` once a layer's rows of ``other`` are in (a subclass gives
        back what the copy touched: :class:`accel.tier.TieredCache`)."""

    def remove(self, row: int) -> None:
        """Remove one row; the last row moves into its slot (so row indices above change:
        the caller mirrors the move)."""
        if any(self._pending):
            raise RuntimeError("remove() with uncommitted entries; commit() first")
        last = self.batch_size - 1
        for layer in range(self.num_layers):
            if self._k[layer] is None:
                continue
            packed = self._packed[layer]
            if row != last:
                n = self._len[layer][last] - self.packed_columns(layer, last)
                self._k[layer][row, :, :n] = self._k[layer][last, :, :n]
                self._v[layer][row, :, :n] = self._v[layer][last, :, :n]
                if packed is not None:
                    packed.move(row, last)
                n = self._len[layer][last]
                if self._pos[layer] is not None:
                    self._pos[layer][row, :n] = self._pos[layer][last, :n]
                if self._valid[layer] is not None:
                    self._valid[layer][row] = self._valid[layer][last]
                self._len[layer][row] = n
            self._len[layer].pop()
            if packed is not None:
                packed.groups.pop()
            if self._valid[layer] is not None:
                self._valid[layer][last] = True
                if not self._len[layer]:
                    self._valid[layer] = None
        self.logical_lengths[row] = self.logical_lengths[last]
        self.logical_lengths.pop()
        if not self.batch_size:  # free the storage of an empty batch
            self._k = [None] * self.num_layers
            self._v = [None] * self.num_layers
            self._pos = [None] * self.num_layers
            self._len = [[] for _ in range(self.num_layers)]
            self._packed = [None] * self.num_layers
            self._scratch = None
            self._grow = [self.grow_columns] * self.num_layers


def _gather(keys: torch.Tensor, values: torch.Tensor, indices: torch.Tensor):
    idx = indices.unsqueeze(-1).expand(-1, -1, -1, keys.shape[-1])
    return keys.gather(2, idx), values.gather(2, idx)


def _pad_to(offsets: list[int], width: int) -> list[int]:
    """``offsets`` padded to ``width`` by repeating its last element (or 0)."""
    fill = offsets[-1] if offsets else 0
    return list(offsets) + [fill] * (width - len(offsets))


def _per_row(keep, bsz: int) -> list[list[int] | None]:
    if keep is None:
        return [None] * bsz
    if isinstance(keep, torch.Tensor):
        keep = keep.tolist()
    keep = list(keep)
    if bsz == 1 and (not keep or not isinstance(keep[0], (list, tuple)) and keep[0] is not None):
        return [[int(x) for x in keep]]
    if len(keep) != bsz:
        raise ValueError(f"commit() got offsets for {len(keep)} rows, the cache holds {bsz}")
    return [None if r is None else [int(x) for x in r] for r in keep]
