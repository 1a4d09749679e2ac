"""Ordered attention: each query's attention computed from its own keys in their logical
order and from nothing else, so that a token verified inside a draft tree, or next to other
rows, gets bit for bit what a plain decoding step at its position gets.

Why: CPU attention kernels (sdpa's flash kernel, a float32 GEMM) choose blocking and
summation order by the shapes they are given. In float32 that moves results by an ulp; in
bfloat16 it flips greedy tokens, and padding the shapes (the older :mod:`accel.kernels.invariance`
scheme) cannot fix where a node's key sits: in a tree it sits after its siblings', in a plain
step next to its ancestors'.

How: a query's keys are laid out on *virtual columns*, where they will sit once the tree is
committed: the row's committed entries at their own columns ``0 .. n - 1`` (dropped or
out-of-window entries keep their place, masked), then entries of earlier forwards since the
last commit, then the query's ancestors and itself in depth order. The virtual columns are
cut into blocks of :data:`BLOCK`. Per block and query: scores ``K_blk @ q`` (a float32
matrix product whose shape is fixed by the block and the head size: 64 keys x D), the
block's max, ``exp(s - max)``, and ``[V_blk^T; 1] @ e`` (values and the sum of weights, a
product of fixed shape D + 1 x 64). Blocks are then merged with a common max and a
sequential sum (``cumsum``: one accumulator, block order). Blocks below the row's last full
block of committed entries are read in place (one product for all queries of the row);
the rest, the *tail* (under 64 committed entries, the earlier entries, the query's
ancestors), is gathered per query. A block gives the same numbers on either path where
this machine's kernels allow it, which :func:`probe` and :func:`probe_widths` check once per
head size and process:

- the tail's products have a fixed shape (64 keys x D by the G query heads of one KV head);
  only the number of matrices in the batch varies. :func:`probe` checks that a matrix's
  result does not depend on it: ordered attention is used only where it passes;
- the direct path's products take all G * T queries of a row at once, so their width varies
  with T. :func:`probe_widths` checks that a query's column does not depend on the width
  (true of the Intel Xeons' MKL; not of MKL's AVX2 path on an AMD EPYC Zen 3, where widths
  of 5 and more sum in another order). Where it fails every query's keys are gathered: the
  same numbers, at the cost of a float32 copy per query at long context.

A single matrix-vector product is the exception on MKL, so a lone column is doubled.

Everything is float32 from bf16/fp16 inputs (products of two bf16 numbers are exact in
float32); the output is cast back. It agrees with sdpa to float32 rounding (tested), and
costs a float32 copy of the keys and values a layer reads (see docs/BENCHMARKS.md).

Where a C++ compiler is at hand, :func:`accel.kernels.native.ordered_attend` does all of it in
one pass instead: per query, its virtual columns (:func:`virtual_columns`, once per forward)
read straight from the cache's buffers, the same blocks of 64, each sum in an order the
kernel's own loops fix. It needs no probe (no library kernel chooses an order), copies
nothing, and replaces some forty tensor operations a layer with one call. Its numbers are
not the torch operations' bit for bit (other summation orders), so one process uses one of
the two for every forward (the choice depends only on dtype, head size and the kernel being
built); a compiled step calls it as the operator ``accel::ordered_attend``.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field

import torch

from . import native

__all__ = ["BLOCK", "Layout", "attend", "attend_gathered", "choose_limit", "gather_limit", "gather_timings",
           "gathered_inputs", "probe", "probe_widths", "virtual_columns"]

#: Keys per block of virtual columns.
BLOCK = 64
#: Up to this many (query, committed entry) pairs a forward gathers every query's keys
#: instead of reading full blocks in place (the blocks' numbers are the same either way); None:
#: :func:`gather_limit` measures where the two paths cross on this machine.
GATHER: int | None = None


@dataclass(frozen=True, eq=False)
class Layout:
    """Where one layer's keys sit for a forward of T new tokens per row.

    lengths: committed entries per row (columns ``0 .. n_b - 1``).
    pending: entries earlier forwards appended since the last commit, at columns
        ``max(lengths) ..``, seen by every new token.
    tree: BoolTensor [B, T, T], True where new token i sees new token j (its ancestors and
        itself; ancestors come before their descendants).
    """

    lengths: tuple[int, ...]
    pending: int
    tree: torch.Tensor
    # what every layer of the forward with this layout derives alike (tail columns, masks)
    memo: dict = field(default_factory=dict, repr=False)

    @property
    def start(self) -> int:
        """Column of this forward's first new entry."""
        return max(self.lengths) + self.pending


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` with ``b``'s last dimension at least 2 (a lone column would be a
    matrix-vector product, which sums in another order)."""
    if b.shape[-1] == 1:
        return torch.matmul(a, torch.cat([b, b], dim=-1))[..., :1]
    return torch.matmul(a, b)


def _weights(scores: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block and query: (the max of its scores over the block's keys, at ``dim``, kept;
    exp(scores - max)). A max is exact in any order; exp is elementwise."""
    top = scores.amax(dim=dim, keepdim=True)
    return top, torch.exp(scores - top)


def _augmented(values: torch.Tensor) -> torch.Tensor:
    """values [..., BLOCK, D] -> [..., D + 1, BLOCK] float32: the values transposed, and a
    row of ones (its product with the weights is their sum)."""
    *lead, n, d = values.shape
    out = torch.empty((*lead, d + 1, n), dtype=torch.float32, device=values.device)
    out[..., :d, :] = values.transpose(-1, -2)
    out[..., d, :] = 1.0
    return out


def direct_blocks(layout: Layout, widths: bool = True, geometry: tuple[int, int, int] = (64, 1, 1),
                  gather: int | None = None) -> int:
    """Blocks of committed entries read in place (the same for every row; a row's blocks past
    its own full ones are masked there and gathered in its tail): 0 where gathering every
    query's keys is faster (up to ``gather``, else :data:`GATHER`, else :func:`gather_limit`
    (query, entry) pairs for heads of ``geometry`` = (head dim, query heads per KV head, KV
    heads)), which saves the second path, and where the kernels' columns depend on the
    product's width (``widths`` False: :func:`probe_widths`)."""
    if not widths:
        return 0
    limit = gather if gather is not None else GATHER if GATHER is not None else \
        gather_limit(*geometry, torch.get_num_threads())
    return 0 if max(layout.lengths) * layout.tree.shape[-1] <= limit else max(layout.lengths) // BLOCK


#: The (committed entries, query tokens) of one row that :func:`gather_timings` times.
_LIMIT_POINTS = tuple((n, t) for n in (128, 256, 512, 1024) for t in (1, 2, 4, 8))


@functools.cache
def gather_limit(head_dim: int, groups: int, kv_heads: int, threads: int | None = None) -> int:
    """Up to how many (query, committed entry) pairs gathering every query's keys is faster
    than reading full blocks in place: :func:`choose_limit` of :func:`gather_timings`,
    measured once per process for a head geometry and thread count (``threads`` only keys
    the cache: callers pass torch's current count). About 0.1 s on 2 cores."""
    return choose_limit(gather_timings(head_dim, groups, kv_heads))


def gather_timings(head_dim: int, groups: int, kv_heads: int) -> dict[tuple[int, int], tuple[float, float]]:
    """Seconds of one :func:`attend` call per (committed entries, query tokens) point of
    :data:`_LIMIT_POINTS` (one row, a chain of T queries, random bf16 data), (gathered, read in
    place), each the faster of 2 calls after a warm-up. On a 2-core AMX Xeon with the default
    model's heads (64, 3, 3) the paths crossed between 512 and 1024 pairs::

        python -c "from accel.kernels.ordered import gather_timings as g; print(g(64, 3, 3))"
    """
    timings = {}
    gen = torch.Generator().manual_seed(0)
    for n, t in _LIMIT_POINTS:
        k = torch.randn(1, kv_heads, n + t, head_dim, generator=gen).bfloat16()
        v = torch.randn(1, kv_heads, n + t, head_dim, generator=gen).bfloat16()
        q = torch.randn(1, kv_heads * groups, t, head_dim, generator=gen).bfloat16()
        tree = torch.ones(1, t, t, dtype=torch.bool).tril()
        mask = torch.zeros(1, 1, t, n + t, dtype=torch.bfloat16)
        mask[0, 0, :, n:].masked_fill_(~tree[0], torch.finfo(torch.bfloat16).min)
        best = []
        for limit in (n * t, n * t - 1):  # gathered, then read in place
            seconds = []
            for _ in range(3):
                layout = Layout((n,), 0, tree)
                start = time.perf_counter()
                attend(q, k, v, mask, layout, head_dim ** -0.5, gather=limit)
                seconds.append(time.perf_counter() - start)
            best.append(min(seconds[1:]))
        timings[(n, t)] = (best[0], best[1])
    return timings


def choose_limit(timings: dict[tuple[int, int], tuple[float, float]]) -> int:
    """The gather limit (in pairs) that minimises the total time of the timed points, given
    per (committed entries, query tokens) point its (gathered, read in place) times: each
    point runs gathered where its pairs are at most the limit. Ties go to the smaller limit."""
    pairs = sorted({n * t for n, t in timings})
    best, best_total = 0, float("inf")
    for limit in [0] + pairs:
        total = sum(g if n * t <= limit else d for (n, t), (g, d) in timings.items())
        if total < best_total:
            best, best_total = limit, total
    return best


def _tail_columns(layout: Layout, nd: int, device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Storage columns of every query's tail past ``nd`` direct blocks, in virtual order:
    (columns [B, T, W], valid [B, T, W], W) with W a multiple of BLOCK; invalid slots point
    at column 0."""
    n = torch.tensor(layout.lengths, device=device)
    first = (n // BLOCK).clamp(max=nd) * BLOCK  # [B] virtual column where the tail starts
    left = (n - first)[:, None, None]  # committed entries in the tail
    tree = layout.tree
    t = tree.shape[-1]
    seen = tree.sum(-1)  # [B, T] ancestors and itself
    width = int((left[..., 0] + layout.pending + seen).max())
    w = -(-width // BLOCK) * BLOCK
    i = torch.arange(w, device=device)  # [W]
    order = torch.argsort((~tree).to(torch.int8), dim=-1, stable=True)  # visible new tokens first, in order
    rank = (i - left - layout.pending).clamp(0, t - 1).expand(tree.shape[0], t, w)
    cols = torch.where(
        i < left,
        first[:, None, None] + i,
        torch.where(i < left + layout.pending, max(layout.lengths) + i - left,
                    layout.start + order.gather(-1, rank)),
    )
    valid = i < (left + layout.pending + seen[..., None])
    return torch.where(valid, cols, 0), valid, w


def _memo(layout: Layout, key, make):
    found = layout.memo.get(key)
    if found is None:
        found = layout.memo[key] = make()
    return found


def _masks(mask: torch.Tensor, layout: Layout, nd: int, hkv: int, g: int, cols: torch.Tensor, valid: torch.Tensor
           ) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The mask, float32, laid out as the direct scores [B, H_kv or 1, nd, BLOCK, G or 1, T]
    (blocks past a row's own full ones masked: they are in its tail) and as the tail scores
    [B, H_kv or 1, T, nt, BLOCK, G or 1]."""
    b, heads, t, _ = mask.shape
    low = torch.finfo(mask.dtype).min
    mg = (hkv, g) if heads == hkv * g else (1, 1)
    direct = [min(n // BLOCK, nd) for n in layout.lengths]
    m_direct = None
    if nd:
        m_direct = mask[:, :, :, : nd * BLOCK].float().reshape(b, *mg, t, nd, BLOCK).permute(0, 1, 4, 5, 2, 3)
        if min(direct) < nd:
            beyond = torch.arange(nd, device=mask.device)[None, :] >= torch.tensor(direct, device=mask.device)[:, None]
            m_direct = m_direct.masked_fill(beyond[:, None, :, None, None, None], low)
        m_direct = m_direct.contiguous()
    w = cols.shape[-1]
    m_tail = mask.gather(-1, cols[:, None].expand(b, heads, t, w)).float().masked_fill(~valid[:, None], low)
    m_tail = m_tail.reshape(b, *mg, t, w // BLOCK, BLOCK).permute(0, 1, 3, 4, 5, 2).contiguous()
    return m_direct, m_tail


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, layout: Layout,
           scale: float, gather: int | None = None) -> torch.Tensor:
    """Attention of T new tokens per row, each query from its own keys in virtual order.

    query [B, H_q, T, D]; key, value [B, H_kv, S, D] (the layer's stored entries, this
    forward's included); mask [B, 1 or H_q, T, S] additive (what a query may see: dropped
    entries, windows, other rows' padding masked). Returns [B, T, H_q, D] in query's dtype.
    ``gather``: the gather limit to use (default: :func:`direct_blocks`'s).
    """
    b, hq, t, d = query.shape
    hkv = key.shape[1]
    g = hq // hkv
    if native.ordered_serves(query.dtype, d, g, query.device):  # one pass in C++: the same order, no copies
        cols, counts = _memo(layout, "virtual", lambda: virtual_columns(layout, query.device))
        out = native.ordered_attend(query, key, value, mask, cols, counts, scale)
        if out is not None:
            return out
    q = query.float()
    tops, sums = [], []
    nd = direct_blocks(layout, probe_widths(d, g), (d, g, hkv), gather)
    cols, valid, w = _memo(layout, ("tail", nd), lambda: _tail_columns(layout, nd, query.device))
    m_direct, m_tail = _memo(layout, ("mask", id(mask), nd, hkv, g),
                             lambda: _masks(mask, layout, nd, hkv, g, cols, valid))

    if nd:  # every row's full blocks of committed entries, read in place
        width = nd * BLOCK
        keys = key[:, :, :width].float().reshape(b, hkv, nd, BLOCK, d)
        scores = _mm(keys, q.reshape(b, hkv, 1, g * t, d).transpose(-1, -2))  # [B, H_kv, nd, BLOCK, G*T]
        scores = scores.reshape(b, hkv, nd, BLOCK, g, t) * scale + m_direct
        top, weights = _weights(scores, dim=3)
        out = _mm(_augmented(value[:, :, :width].reshape(b, hkv, nd, BLOCK, d)),
                  weights.reshape(b, hkv, nd, BLOCK, g * t))  # [B, H_kv, nd, D + 1, G*T]
        tops.append(top.reshape(b, hkv, nd, g, t).permute(0, 1, 3, 4, 2))
        sums.append(out.reshape(b, hkv, nd, d + 1, g, t).permute(0, 1, 4, 5, 2, 3))

    # what every layer of the forward shares: the gather's row indices, the values' buffer
    index = None  # values laid out as the keys (the cache's buffers): one index for both
    if value.shape == key.shape and value.stride() == key.stride():
        index = _memo(layout, ("index", nd, tuple(key.shape), key.stride()), lambda: _gather_index(key, cols))
    nt = w // BLOCK
    vals = _memo(layout, ("vals", nd, hkv, d), lambda: _values_buffer((b, hkv, t, nt, d + 1, BLOCK), q.device))
    top, acc = _tail(q, key, value, cols, m_tail, scale, g, index, vals)
    tops.append(top)
    sums.append(acc)
    return _merge(tops, sums, query.dtype)


def _values_buffer(shape: tuple[int, ...], device) -> torch.Tensor:
    """The tail's augmented values [..., D + 1, BLOCK] float32, its last row of ones set (the
    rest is written by each layer)."""
    vals = torch.empty(shape, dtype=torch.float32, device=device)
    vals[..., -1, :] = 1.0
    return vals


def _tail(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cols: torch.Tensor, m_tail: torch.Tensor,
          scale: float, g: int, index: torch.Tensor | None = None, vals: torch.Tensor | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """The gathered blocks of every query: q [B, H_q, T, D] float32, cols [B, T, W] (storage
    columns in virtual order), m_tail the mask as :func:`_masks` lays it out; ``index``
    (:func:`_gather_index` of ``key``, valid for ``value`` too) and ``vals``
    (:func:`_values_buffer`), shared by a forward's layers, or None to make them here. Returns
    per block its max [B, H_kv, G, T, nt] and weighted sums [B, H_kv, G, T, nt, D + 1]."""
    b, hq, t, d = q.shape
    hkv = hq // g
    nt = cols.shape[-1] // BLOCK
    keys = _gather(key, cols, index).view(b, hkv, t, nt, BLOCK, d).float()
    if vals is None:
        vals = _values_buffer((b, hkv, t, nt, d + 1, BLOCK), q.device)
    # [V_blk^T; 1]: the product's last row sums the weights
    vals[..., :d, :] = _gather(value, cols, index).view(b, hkv, t, nt, BLOCK, d).transpose(-1, -2)
    qt = q.reshape(b, hkv, g, t, d).permute(0, 1, 3, 4, 2).unsqueeze(3)  # [B, H_kv, T, 1, D, G]
    scores = _mm(keys, qt) * scale + m_tail  # [B, H_kv, T, nt, BLOCK, G]
    top, weights = _weights(scores, dim=4)
    out = _mm(vals, weights)  # [B, H_kv, T, nt, D + 1, G]
    return top.squeeze(4).permute(0, 1, 4, 2, 3), out.permute(0, 1, 5, 2, 3, 4)


def _gather_index(x: torch.Tensor, cols: torch.Tensor) -> torch.Tensor | None:
    """The rows of ``x`` [B, H, S, D] seen as a [B * H * capacity, D] matrix that
    :func:`_gather` reads for storage columns cols [B, T, W], flat [B * H * T * W], or None
    where ``x`` is not a slice of such a buffer.

    A cache layer's keys are a slice of its buffer [B_cap, H, capacity, D], so every (row,
    head, column) is one contiguous D-vector of that matrix, and one ``index_select`` of its
    rows gathers them all, already in the output's order (3-4x faster on a 2-core Xeon than
    indexing x by two tensors and permuting; the values are the same either way)."""
    b, h, _, d = x.shape
    t, w = cols.shape[1:]
    per_head = x.stride(1)
    if not (x.stride(3) == 1 and x.stride(2) == d and per_head % d == 0 and x.stride(0) == h * per_head):
        return None
    starts = torch.arange(b * h, device=x.device).view(b, h, 1) * (per_head // d)
    return (starts + cols.view(b, 1, t * w)).view(-1)


def _gather(x: torch.Tensor, cols: torch.Tensor, index: torch.Tensor | None = None) -> torch.Tensor:
    """x [B, H, S, D] at storage columns cols [B, T, W] -> [B, H, T, W, D] (contiguous);
    ``index``: :func:`_gather_index` of ``x`` and ``cols`` if known."""
    b, h, _, d = x.shape
    t, w = cols.shape[1:]
    if index is None:
        index = _gather_index(x, cols)
    if index is not None:
        flat = x.as_strided((x.stride(0) * b // d, d), (d, 1))
        return flat.index_select(0, index).view(b, h, t, w, d)
    rows = torch.arange(b, device=x.device)[:, None, None]
    return x.transpose(1, 2)[rows, cols].permute(0, 3, 1, 2, 4).contiguous()


def _merge(tops: list[torch.Tensor], sums: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """Blocks merged with a common max and a sequential sum -> [B, T, H_q, D] of ``dtype``."""
    top = torch.cat(tops, dim=-1) if len(tops) > 1 else tops[0]  # [B, H_kv, G, T, blocks]
    acc = torch.cat(sums, dim=-2) if len(sums) > 1 else sums[0]  # [B, H_kv, G, T, blocks, D + 1]
    b, hkv, g, t, _, d1 = acc.shape
    scale_b = torch.exp(top - top.amax(dim=-1, keepdim=True))
    total = (acc * scale_b.unsqueeze(-1)).cumsum(dim=-2)[..., -1, :]  # block order, one accumulator
    out = total[..., : d1 - 1] / total[..., d1 - 1 :]
    return out.permute(0, 3, 1, 2, 4).reshape(b, t, hkv * g, d1 - 1).to(dtype)


def virtual_columns(layout: Layout, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Every query's keys in virtual order, as :func:`accel.kernels.native.ordered_attend`
    reads them: (storage columns [B, T, W] int64, how many of each query's are valid [B, T])."""
    cols, valid, _ = _tail_columns(layout, 0, device)
    return cols, valid.sum(-1)


def gathered_inputs(layout: Layout, mask: torch.Tensor, kv_heads: int, groups: int,
                    head_dim: int | None = None) -> tuple[torch.Tensor, ...]:
    """What :func:`attend_gathered` needs of a forward's layout and mask [B, 1, T, S]
    (computed once per forward, every layer alike): where the native kernel serves queries of
    ``head_dim`` and the mask's dtype, (cols [B, T, W], counts [B, T], mask); else (cols, m_tail)."""
    if head_dim is not None and native.ordered_serves(mask.dtype, head_dim, groups, mask.device):
        return (*virtual_columns(layout, mask.device), mask)
    cols, valid, _ = _tail_columns(layout, 0, mask.device)
    _, m_tail = _masks(mask, layout, 0, kv_heads, groups, cols, valid)
    return cols, m_tail


@torch.library.custom_op("accel::ordered_attend", mutates_args=())
def _ordered_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                cols: torch.Tensor, counts: torch.Tensor, scale: float) -> torch.Tensor:
    """:func:`accel.kernels.native.ordered_attend` as an operator a compiled graph keeps."""
    out = native.ordered_attend(query, key, value, mask, cols, counts, scale)
    if out is None:
        raise RuntimeError("accel::ordered_attend: the native kernel does not serve these inputs")
    return out


@_ordered_op.register_fake
def _ordered_op_fake(query, key, value, mask, cols, counts, scale):
    b, hq, t, d = query.shape
    return query.new_empty((b, t, hq, d))


def attend_gathered(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, inputs: tuple[torch.Tensor, ...],
                    scale: float) -> torch.Tensor:
    """:func:`attend` with every query's keys gathered (no blocks read in place), from the
    tensors :func:`gathered_inputs` derived: the native kernel as one operator, or plain
    tensor operations, for a compiled graph. query [B, H_q, T, D]; key, value [B, H_kv, S, D].
    Returns [B, T, H_q, D]."""
    if len(inputs) == 3:
        cols, counts, mask = inputs
        return torch.ops.accel.ordered_attend(query, key, value, mask, cols, counts, scale)
    cols, m_tail = inputs
    g = query.shape[1] // key.shape[1]
    top, acc = _tail(query.float(), key, value, cols, m_tail, scale, g)
    return _merge([top], [acc], query.dtype)


def _data(head_dim: int, count: int):
    """Random bf16-valued operands of both products: keys [count, BLOCK, D], augmented values
    [count, D + 1, BLOCK], query columns [count, D, 40] and weights [count, BLOCK, 40]."""
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(count, BLOCK, head_dim, generator=gen).bfloat16().float()
    vals = _augmented(torch.randn(count, BLOCK, head_dim, generator=gen).bfloat16().float())
    cols = torch.randn(count, head_dim, 40, generator=gen).bfloat16().float()
    weights = torch.rand(count, BLOCK, 40, generator=gen)
    return keys, vals, cols, weights


@functools.cache
def probe(head_dim: int, groups: int) -> bool:
    """Whether this machine's float32 products of the tail's shape (keys of ``head_dim`` by
    the ``groups`` query heads of one KV head) give a matrix the same numbers whatever the
    number of other matrices in the batch (the property :func:`attend` needs of its
    kernels): checked once per process on random bf16-valued data."""
    g = min(groups, 40)
    keys, vals, cols, weights = _data(head_dim, 40)
    ref_s = _mm(keys[:1], cols[:1, :, :g])[0]
    ref_o = _mm(vals[:1], weights[:1, :, :g])[0]
    for batch in (2, 3, 9, 40):
        k, v, c, wt = keys[:batch].clone(), vals[:batch].clone(), cols[:batch, :, :g].clone(), weights[:batch, :, :g].clone()
        k[-1], v[-1], c[-1], wt[-1] = keys[0], vals[0], cols[0, :, :g], weights[0, :, :g]
        if not (torch.equal(_mm(k, c)[-1], ref_s) and torch.equal(_mm(v, wt)[-1], ref_o)):
            return False
    return True


@functools.cache
def probe_widths(head_dim: int, groups: int) -> bool:
    """Whether, beyond :func:`probe`, a query's column of those products is the same whatever
    the number of other columns (the direct path's products are G * T queries wide):
    checked once per process on random bf16-valued data."""
    if not probe(head_dim, groups):
        return False
    keys, vals, cols, weights = _data(head_dim, 9)
    ref_s = _mm(keys[:1], cols[:1, :, :1])[0, :, 0]
    ref_o = _mm(vals[:1], weights[:1, :, :1])[0, :, 0]
    for n in sorted({1, 2, groups, 3 * groups, 8 * groups, 40}):
        n = min(n, 40)
        for batch in (1, 2, 9):
            c = cols[:batch, :, :n].clone()
            c[-1, :, -1] = cols[0, :, 0]
            k = keys[:batch].clone()
            k[-1] = keys[0]
            wt = weights[:batch, :, :n].clone()
            wt[-1, :, -1] = weights[0, :, 0]
            v = vals[:batch].clone()
            v[-1] = vals[0]
            if not (torch.equal(_mm(k, c)[-1, :, -1], ref_s) and torch.equal(_mm(v, wt)[-1, :, -1], ref_o)):
                return False
    return True
