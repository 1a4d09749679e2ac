"""Prompt prefix reuse for services: the KV entries of recent prompts, kept so that a later
prompt that starts with the same tokens is prefilled only past them.

Requests to one service share beginnings: every chat prompt of a model starts with its chat
template's system turn (24 of the ~40 tokens of a short SmolLM2 chat prompt), each turn of a
conversation starts with the whole previous turn, and a retried request is the same prompt
again. :class:`PrefixStore` keeps the committed prompt entries of recent requests, least
recently used first out, within a byte budget; :meth:`accel.engine.Batch.admit` loads the
longest stored prefix of each new prompt into its row and runs only the rest of the prompt
(:func:`accel.steps.prefill_rest`), one forward for every admitted row.

What is reused is what the prefill computed for the same tokens at the same positions, so
the row's entries are the entries it would have; the rest of the prompt is computed as a
multi-token verify pass is, in another order than one whole-prompt forward, so it agrees
with a plain prefill as closely as drafting agrees with plain decoding. Hence the engine
reuses prefixes in float32 only (in lower precision the rest of a prompt would not agree with
a whole-prompt forward to the last bit, and ordered attention is sized for draft trees, not prompts),
for rows without prompt compression (SnapKV scores need the whole prompt's queries) and on
models without sliding windows (their prompt entries are trimmed to the window).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from ..cache import SharedCache

__all__ = ["PrefixStore", "PrefixMatch", "common_prefix", "shared_prefix"]


def common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many first tokens the 1-D LongTensors ``a`` and ``b`` have in common."""
    m = min(int(a.numel()), int(b.numel()))
    same = a[:m] == b[:m]
    return m if bool(same.all()) else int((~same).nonzero()[0])


def shared_prefix(prompts: list[torch.Tensor]) -> tuple[int, int]:
    """The longest prefix two of ``prompts`` share, short of either one's last token:
    (index of one of the two, its length); (-1, 0) for fewer than two prompts."""
    best = (-1, 0)
    for i in range(len(prompts)):
        for j in range(i + 1, len(prompts)):
            cap = min(int(prompts[i].numel()), int(prompts[j].numel())) - 1
            length = min(cap, common_prefix(prompts[i], prompts[j]))
            if length > best[1]:
                best = (i, length)
    return best


@dataclass(eq=False)
class _Entry:
    tokens: torch.Tensor  # LongTensor [n], the prompt
    keys: list[torch.Tensor]  # per layer [H_kv, n, D]
    values: list[torch.Tensor]
    nbytes: int


@dataclass(frozen=True, eq=False)
class PrefixMatch:
    """The first ``length`` entries of a stored prompt, the same tokens as a new prompt's
    first ``length``: ``keys[layer]`` / ``values[layer]`` are [H_kv, >= length, D]."""

    length: int
    keys: list[torch.Tensor]
    values: list[torch.Tensor]


class PrefixStore:
    """Committed prompt entries of recent requests, by their tokens (least recently used
    out first).

    Args:
        max_bytes: the most bytes of K and V entries kept (a prompt larger than this is not
            kept); 0 keeps nothing.
        min_tokens: the shortest shared prefix worth reusing.

    Not thread-safe: the engine's loop thread owns it.
    """

    def __init__(self, max_bytes: int, min_tokens: int = 8):
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"max_bytes must be an integer >= 0, got {max_bytes!r}")
        if isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or min_tokens < 1:
            raise ValueError(f"min_tokens must be an integer >= 1, got {min_tokens!r}")
        self.max_bytes = max_bytes
        self.min_tokens = min_tokens
        self._entries: "OrderedDict[int, _Entry]" = OrderedDict()  # oldest first
        self._ids = 0
        self.nbytes = 0
        self.hits = 0  # prompts that reused a prefix
        self.reused_tokens = 0  # prompt tokens not prefilled thanks to it

    def __len__(self) -> int:
        return len(self._entries)

    def match(self, prompt: torch.Tensor) -> PrefixMatch | None:
        """The longest stored prefix of ``prompt`` (LongTensor [n]), at most n - 1 tokens (the
        last prompt token is always run: its output gives the first new token), or None when
        none reaches ``min_tokens``. A match counts as a use (most recent)."""
        key, length = self._find(prompt)
        if key is None:
            return None
        self._entries.move_to_end(key)
        entry = self._entries[key]
        self.hits += 1
        self.reused_tokens += length
        return PrefixMatch(length, entry.keys, entry.values)

    def longest(self, prompt: torch.Tensor) -> int:
        """How many tokens :meth:`match` would reuse for ``prompt`` (0: none); not a use."""
        return self._find(prompt)[1]

    def _find(self, prompt: torch.Tensor) -> tuple[int | None, int]:
        n = int(prompt.numel())
        best, best_len = None, 0
        for key, entry in reversed(self._entries.items()):  # the most recent first wins ties
            m = min(n - 1, int(entry.tokens.numel()))
            if m < max(self.min_tokens, best_len + 1):
                continue
            length = common_prefix(entry.tokens[:m], prompt[:m])
            if length > best_len:
                best, best_len = key, length
        return (best, best_len) if best is not None and best_len >= self.min_tokens else (None, 0)

    def add(self, prompt: torch.Tensor, cache: SharedCache, row: int) -> None:
        """Keep (a copy of) row ``row``'s entries of ``prompt`` [n]: the row must hold exactly
        the prompt's n entries in every layer (a full, uncompressed prefill). Stored prompts
        that this one starts with are dropped (it serves every match they would), and nothing
        is added when a stored prompt already starts with this one."""
        n = int(prompt.numel())
        if not self.max_bytes or n < self.min_tokens:
            return
        for layer in range(cache.num_layers):
            if cache.row_lengths(layer)[row] != n:
                raise ValueError(f"row {row} holds {cache.row_lengths(layer)[row]} entries in layer {layer}, "
                                 f"not its prompt's {n}: only full prompt entries can be reused")
        for key, entry in list(self._entries.items()):
            m = int(entry.tokens.numel())
            if m >= n and torch.equal(entry.tokens[:n], prompt):
                self._entries.move_to_end(key)
                return
            if m < n and torch.equal(prompt[:m], entry.tokens):
                self._drop(key)
        keys = [cache.keys(layer, row)[0].clone() for layer in range(cache.num_layers)]
        values = [cache.values(layer, row)[0].clone() for layer in range(cache.num_layers)]
        nbytes = sum(k.numel() * k.element_size() for k in keys) * 2
        if nbytes > self.max_bytes:
            return
        while self._entries and self.nbytes + nbytes > self.max_bytes:
            self._drop(next(iter(self._entries)))
        self._ids += 1
        self._entries[self._ids] = _Entry(prompt.detach().clone(), keys, values, nbytes)
        self.nbytes += nbytes

    def clear(self) -> None:
        self._entries.clear()
        self.nbytes = 0

    def _drop(self, key: int) -> None:
        self.nbytes -= self._entries.pop(key).nbytes
