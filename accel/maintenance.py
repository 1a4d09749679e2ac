"""What happens to a row's cache while it decodes: eviction (a selector's ``decode_budget``)
and quantization (a :class:`~accel.strategy.KVQuantizer` such as GEAR), each at logical
lengths that the committed sequence alone decides.

Exactness. Greedy speculative decoding is exact against plain greedy decoding *on the same
cache*. A cache that changes during decoding is the same cache for both only if it changes
at the same tokens, so a row's cache changes only when its logical length reaches its
:meth:`Upkeep.next_event` (a point computed from entry counts, which depend on the committed
tokens only, never on how many tokens a step accepted), and :meth:`Upkeep.draft_room`
keeps a step from verifying tokens past that point: the tokens after it are computed on the
changed cache, in drafted and in plain decoding alike. Drafts shrink only in the steps that
end right before an event.

What that rests on: the verify pass computing a token's entries as a plain step does. With
bit-identical verification (low precision with ordered attention, :mod:`accel.kernels.invariance`)
both kinds of change are exact. In float32 a verify pass and a plain step agree to a few
ulps: an eviction's top-k is a discrete choice like the greedy argmax (which the float32
claim already rests on, tested, not probed), but quantization rounds thousands of entries per
group and a code lying within a few ulps of a rounding boundary goes either way, so rows with
a quantizer report ``exact_verify=False`` there (drafted and plain output agreed in every
test; the caches differ by such flipped codes).

Eviction. Once a row holds ``budget + slack`` entries per KV head (in its fullest layer,
averaged over the heads for per-head layouts), every full-attention layer is evicted back to
``budget`` (:meth:`~accel.strategy.PromptCompressor.evict`); sliding-window layers are left
alone (their window bounds them). Selectors that score with queries get the queries of the
row's latest ``decode_window()`` tokens: the prompt's last ones from the prefill, then those
of decoded tokens, captured (:func:`accel.adapter.capture_step_queries`) only in the steps
that reach into the window before the next eviction, so other steps pay nothing for it.

Quantization. After the prefill every full group of G entries a row keeps is quantized, then
each group of generated entries as soon as it fills; the newest entries (fewer than G) stay
in full precision. The cache stores the groups packed (:meth:`~accel.cache.SharedCache.pack`:
what the quantizer's ``encode`` makes of them, in place of the entries) and attention reads
them decoded, so the row's kept bytes are the size of the tensors its cache holds.
Sliding-window layers stay in full precision (their oldest entries are trimmed). With
eviction too, an eviction decodes the row's groups, keeps the chosen entries in full
precision, and their full groups are quantized again right after (from the decoded values:
the second rounding is part of the eviction, at the same lengths in drafted and plain
decoding).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .cache import SharedCache
from .strategy import KVQuantizer, PromptCompressor

__all__ = ["Upkeep", "start", "prompt_queries"]


@dataclass(eq=False)
class Upkeep:
    """One row's eviction and quantization state (it lives with the request, as a Row's)."""

    layers: list[int]  # full-attention layers: the ones evicted and quantized
    compressor: PromptCompressor | None = None  # evicts during decoding (its decode_limit() is set)
    quantizer: KVQuantizer | None = None
    budget: int | None = 0  # None: evicted every ``slack`` tokens (the selector's policies decide what stays)
    slack: int = 0
    window: int = 0  # latest queries eviction scores with
    # per layer [H_q, window, D]: slot p % window holds the query of the token at position p
    queries: dict[int, torch.Tensor] = field(default_factory=dict)
    slots: list[int] = field(default_factory=list)  # position held by each slot, -1: none
    evict_at: int | None = None  # logical length at which the row is evicted next
    # per layer [H_kv, K]: the sequence position of each entry the row held at logical length
    # ``since`` (its last eviction, or the prefill); entries after them are since, since + 1, ...
    positions: dict[int, torch.Tensor] = field(default_factory=dict)
    since: int = 0
    quantize_at: int | None = None  # logical length at which a group fills next
    evictions: int = 0  # times the row was evicted (all layers at once)

    @property
    def next_event(self) -> int | None:
        """The logical length at which this row's cache changes next (None: never)."""
        points = [p for p in (self.evict_at, self.quantize_at) if p is not None]
        return min(points) if points else None

    def draft_room(self, length: int, budget: int) -> int:
        """Draft nodes a row of logical length ``length`` may verify this step, at most
        ``budget``: none past the next event (a step feeds positions length .. length + d)."""
        event = self.next_event
        return budget if event is None else max(0, min(budget, event - 1 - length))

    def wants_queries(self, length: int, budget: int) -> bool:
        """Whether a step at ``length`` verifying up to ``budget`` drafts commits tokens whose
        queries the next eviction scores with (the latest ``window`` before it)."""
        return bool(self.window) and self.evict_at is not None and length + budget >= self.evict_at - self.window

    def record(self, captured: dict[int, torch.Tensor], b: int, path: list[int], length: int) -> None:
        """Keep the queries of the tokens row ``b`` committed this step: ``path`` (tree node
        indices, root first) at positions ``length``, ``length + 1``, ...; ``captured`` the
        step's queries per layer [B, H_q, T, D]."""
        if not self.window or not captured:
            return
        start = max(0, len(path) - self.window)  # a longer path overwrites its own first slots
        positions = list(range(length + start, length + len(path)))
        slots = [p % self.window for p in positions]
        for layer in self.layers:
            ring = self.queries[layer]
            nodes = torch.tensor(path[start:], dtype=torch.long, device=ring.device)
            ring[:, torch.tensor(slots, device=ring.device)] = captured[layer][b, :, nodes].to(ring.dtype)
        for p, s in zip(positions, slots):
            self.slots[s] = p

    def latest_queries(self, layer: int, length: int) -> torch.Tensor | None:
        """[1, H_q, m, D] the queries of positions length - m .. length - 1, oldest first (m
        up to ``window``: the longest run the ring holds), or None."""
        m = 0
        while m < self.window and self.slots[(length - 1 - m) % self.window] == length - 1 - m:
            m += 1
        if not m:
            return None
        order = torch.tensor([p % self.window for p in range(length - m, length)], device=self.queries[layer].device)
        return self.queries[layer][:, order].unsqueeze(0)

    def run(self, cache: SharedCache, row: int, tokens: torch.Tensor) -> None:
        """Evict and quantize row ``row`` of ``cache`` as its logical length calls for, then
        set the next event points. tokens: LongTensor [>= length] the row's sequence."""
        length = cache.logical_lengths[row]
        if self.compressor is not None and self.layers and self._due(cache, row, length):
            self._evict(cache, row, length, tokens)
        if self.quantizer is not None:
            self._quantize(cache, row)
        self._schedule(cache, row, length)

    def _schedule(self, cache: SharedCache, row: int, length: int) -> None:
        if not self.layers:
            self.evict_at = self.quantize_at = None
            return
        if self.compressor is not None and self.budget is not None:
            self.evict_at = length + max(1, self.budget + self.slack - self._held(cache, row))
        if self.quantizer is not None:
            group = self.quantizer.group_size()
            loose = max(cache.row_lengths(layer)[row] - cache.packed_columns(layer, row) for layer in self.layers)
            self.quantize_at = length + max(1, group - loose)

    def _due(self, cache: SharedCache, row: int, length: int) -> bool:
        if self.budget is None:
            return length >= self.evict_at
        return self._held(cache, row) >= self.budget + self.slack

    def entry_positions(self, cache: SharedCache, layer: int, row: int) -> torch.Tensor:
        """[H_kv, n] the sequence position of each of the row's entries in one layer."""
        held = self.positions[layer]
        length = cache.logical_lengths[row]
        new = torch.arange(self.since, length, device=held.device).expand(held.shape[0], length - self.since)
        out = torch.cat([held, new], dim=1)
        if out.shape[1] != cache.row_lengths(layer)[row]:
            raise RuntimeError(f"layer {layer} holds {cache.row_lengths(layer)[row]} entries of row {row}, "
                               f"its positions say {out.shape[1]}")
        return out

    def _held(self, cache: SharedCache, row: int) -> int:
        """Entries per KV head of the row's fullest layer."""
        return max(cache.entries_per_head(layer, row) for layer in self.layers)

    def _evict(self, cache: SharedCache, row: int, length: int, tokens: torch.Tensor) -> None:
        for layer in self.layers:
            valid = cache.entry_valid(layer, row)
            queries = self.latest_queries(layer, length) if self.window else None
            positions = self.entry_positions(cache, layer, row)
            sel = self.compressor.evict(layer, queries, cache.keys(layer, row), cache.values(layer, row),
                                        None if valid is None else valid.unsqueeze(0), positions.unsqueeze(0),
                                        tokens[:length])
            if sel is None:
                self.positions[layer] = positions
                continue
            self.positions[layer] = positions.gather(1, sel.indices[0])
            cache.evict_row(layer, row, sel.indices, sel.valid)
        self.since = length
        if self.budget is None:
            self.evict_at = length + self.slack
        self.evictions += 1

    def _quantize(self, cache: SharedCache, row: int) -> None:
        group = self.quantizer.group_size()
        for layer in self.layers:
            q, n = cache.packed_columns(layer, row), cache.row_lengths(layer)[row]
            groups = (n - q) // group
            if groups > 0:
                cache.pack(layer, row, groups, self.quantizer)


def prompt_queries(queries: dict[int, torch.Tensor], b: int, prompt_len: int, window: int) -> dict[int, torch.Tensor]:
    """Row ``b``'s last ``min(window, prompt_len, w)`` prompt queries per layer [H_q, m, D],
    oldest first, from a prefill's captured ``queries`` (:func:`accel.steps.prefill`)."""
    out = {}
    for layer, q in queries.items():
        m = min(window, prompt_len, q.shape[2])
        out[layer] = q[b, :, q.shape[2] - m :].clone()
    return out


def start(compressor: PromptCompressor | None, quantizer: KVQuantizer | None, cache: SharedCache, row: int,
          tokens: torch.Tensor, queries: dict[int, torch.Tensor] | None = None,
          kept: dict[int, torch.Tensor] | None = None) -> Upkeep | None:
    """The upkeep of a freshly prefilled row ``row`` of ``cache`` (None when its strategies
    change nothing during decoding); evicts and quantizes it as far as its length calls for.

    tokens: LongTensor [>= prompt length] the row's sequence.
    queries: the row's last prompt queries per layer [H_q, m, D] (:func:`prompt_queries`),
        for a selector that scores eviction with queries.
    kept: per layer the prompt positions the prefill kept per KV head [H_kv, K] (layers
        the compressor left whole are missing).
    """
    limit = compressor.decode_limit() if compressor is not None else None
    if limit is None and quantizer is None:
        return None
    layers = [layer for layer, w in enumerate(cache.windows) if w is None]
    up = Upkeep(layers=layers, quantizer=quantizer)
    if limit is not None:
        up.compressor = compressor
        up.budget, up.slack = limit
        up.window = compressor.decode_window()
        length = cache.logical_lengths[row]
        up.since = length
        if up.budget is None:
            up.evict_at = length + up.slack
        for layer in layers:
            got = (kept or {}).get(layer)
            if got is None:
                n = cache.row_lengths(layer)[row]
                got = torch.arange(n).expand(cache.keys(layer, row).shape[1], n)
            up.positions[layer] = got.to(cache.keys(layer, row).device)
        if up.window:
            up.slots = [-1] * up.window
            length = cache.logical_lengths[row]
            for layer in layers:
                got = (queries or {}).get(layer)
                if got is None:
                    raise ValueError(f"{compressor.name} evicts with queries, but the prefill captured none "
                                     f"for layer {layer}")
                ring = got.new_zeros((got.shape[0], up.window, got.shape[2]))
                m = got.shape[1]
                for i in range(m):
                    ring[:, (length - m + i) % up.window] = got[:, i]
                up.queries[layer] = ring
            m = min(got.shape[1] for got in (queries[layer] for layer in layers)) if layers else 0
            for p in range(length - m, length):
                up.slots[p % up.window] = p
    up.run(cache, row, tokens)
    return up

