"""One step of the decode loop, as small functions over the shared cache: :func:`prefill` a
batch of prompts (compressing as it goes), :func:`verify` every row's draft tree in one
forward, :func:`accept` a row's path, :func:`commit` it. :mod:`accel.engine` runs them for a
batch of requests; :mod:`accel.kernels.invariance` runs them to probe this machine's kernels.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Callable, Generator, Iterator, Protocol, Sequence

import torch

from . import adapter
from .acceptance import Acceptance, greedy_path, sample_accept
from .cache import SharedCache
from .kernels.compiled import step_of
from .calibration.cost_model import round_up
from .strategy import PromptCompressor, Strategy
from .tree import DraftTree

__all__ = ["Warp", "PrefillReuse", "KeptPrefill", "reusing_prefills", "prefill", "prefill_steps", "prefill_rest", "prefill_rest_steps", "exhaust", "forward_tokens",
           "verify", "verify_logits", "accept", "commit", "RowLookahead", "chain_anchors", "lookahead_columns"]

#: A prefill run forward by forward: yields between forwards, returns the hidden states [B, H].
PrefillSteps = Generator[None, None, torch.Tensor]


def exhaust(steps: PrefillSteps) -> torch.Tensor:
    """Run a :data:`PrefillSteps` generator to its end; returns what it returns."""
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return stop.value

class RankedPrefill(Protocol):
    """Processes a prefill runs over (:class:`accel.runahead.PrefillRanks`)."""

    def prefill(self, cache: SharedCache, rows: Sequence[torch.Tensor], window: int,
                queries: dict[int, torch.Tensor]) -> torch.Tensor:
        """Fill the empty ``cache`` with ``rows``' prompts (uncompressed), ``queries`` with each
        layer's last ``window`` prompt queries [B, H_q, window, D]; returns [B, H]."""
        ...


#: A sampling transform of float32 logits [N, V] (temperature, top-k, top-p); None is greedy.
Warp = Callable[[torch.Tensor], torch.Tensor]


def prefill(model, cache: SharedCache, prompts: torch.Tensor | Sequence[torch.Tensor],
            compressors: PromptCompressor | None | Sequence[PromptCompressor | None] = None,
            queries: dict[int, torch.Tensor] | None = None,
            kept: dict[tuple[int, int], torch.Tensor] | None = None, chunk: int | None = None,
            ranks: RankedPrefill | None = None) -> torch.Tensor:
    """:func:`prefill_steps` run to its end (see there)."""
    return exhaust(prefill_steps(model, cache, prompts, compressors, queries, kept, chunk, ranks))


def prefill_steps(model, cache: SharedCache, prompts: torch.Tensor | Sequence[torch.Tensor],
                  compressors: PromptCompressor | None | Sequence[PromptCompressor | None] = None,
                  queries: dict[int, torch.Tensor] | None = None,
                  kept: dict[tuple[int, int], torch.Tensor] | None = None, chunk: int | None = None,
                  ranks: RankedPrefill | None = None, reuse: bool = False) -> PrefillSteps:
    """Run B prompts through the model, filling (and compressing) an empty cache.

    prompts: LongTensor [1, n] / [n], or a list of B LongTensors [n_b] (right-padded
        internally; padding is never stored and never scored).
    compressors: one compressor for every row, or one (or None) per row.
    queries: a dict that receives, per layer, the trailing prompt queries the compressors
        scored with, [B, H_q, w, D] (row b's last prompt query at index w - 1; w the largest
        observation window), for eviction during decoding to start from.
    kept: a dict that receives, per (row, layer) a compressor selected in, the prompt
        positions kept per KV head [H_kv, K] (padding repeats a head's last).
    chunk: None (or the longest prompt or more): one forward, each layer compressed as it
        stores its prompt. Otherwise the prompts run ``chunk`` tokens at a time, each chunk
        on top of the entries of the chunks before it (activations follow the chunk, not the
        prompt), stored whole; each row's observation-window queries are taken from the
        chunks they fall in, and once the last chunk is in, every layer is offered to its
        compressor with those queries and the whole prompt's keys: the same scores, the same
        selection, the same cache as one forward (within float tolerance).
    ranks: run each row's prompt over these processes instead (KV-Runahead,
        :mod:`accel.runahead`: chunk r on rank r, on top of the entries rank r - 1 hands on
        layer by layer, the last chunk here); compressors then select as after a chunked
        prefill, on the whole prompt's entries. ``chunk`` does not apply.
    reuse: inside :func:`reusing_prefills`, start from the kept uncompressed prefill of the
        same prompts (or make and keep one), each row's compressor then selecting from it as
        after a chunked prefill (see :class:`PrefillReuse`); outside it, no effect.
    A generator: it yields after each chunk but the last (so that a caller may run other
    forwards in between, :class:`accel.serving.Engine`), and returns the final hidden state at
    each row's last prompt position, [B, H] (:func:`prefill` runs it through).
    """
    rows = _prompt_rows(prompts)
    if isinstance(compressors, PromptCompressor) or compressors is None:
        compressors = [compressors] * len(rows)
    lengths = [int(r.numel()) for r in rows]
    windows = [c.observation_window(length) if c is not None else 0 for c, length in zip(compressors, lengths)]
    window = max(windows)
    queries = {} if queries is None else queries

    def select(layer: int, row: int, keys: torch.Tensor, values: torch.Tensor):
        compressor = compressors[row]
        if compressor is None:
            return None
        w = windows[row]
        q = queries[layer][row : row + 1, :, window - w :] if w else None
        sel = compressor.select(layer, q, keys, values, rows[row][: keys.shape[2]].unsqueeze(0))
        if sel is None:
            return None
        if kept is not None:
            kept[(row, layer)] = sel.indices[0]
        return sel.indices, sel.valid

    compress = select if any(c is not None for c in compressors) else None
    memo = _REUSE.get() if reuse and ranks is None else None
    if memo is not None and memo.applies(model, cache, window):
        found = memo.find(model, rows, chunk)
        if found is None:
            found = (yield from memo.make(model, rows, chunk)), None
        return found[0].start(cache, compress, window, queries, found[1])
    if ranks is not None:
        hidden = ranks.prefill(cache, rows, window, queries)
        if compress is not None:
            cache.compress_prompt(compress)
        return hidden
    return (yield from _prefill_whole(model, cache, rows, chunk, window, queries, compress))


def _prefill_whole(model, cache: SharedCache, rows: list[torch.Tensor], chunk: int | None, window: int,
                   queries: dict[int, torch.Tensor], select=None) -> PrefillSteps:
    """Fill the empty ``cache`` with ``rows``' prompts (in ``chunk``-token forwards, then every
    layer offered to ``select``; or one forward, each layer offered as it stores), ``queries``
    with each layer's last ``window`` prompt queries [B, H_q, window, D]; returns the hidden
    states at each row's last prompt position [B, H]. ``select``: a
    :meth:`SharedCache.begin_prefill` selector, None keeps every entry."""
    lengths = [int(r.numel()) for r in rows]
    n, device = max(lengths), rows[0].device
    if chunk is not None and chunk < n:
        hidden = yield from _prefill_chunks(model, cache, rows, chunk, window, queries)
        if select is not None:
            cache.compress_prompt(select)
        return hidden
    ids = torch.zeros((len(rows), n), dtype=torch.long, device=device)
    for b, r in enumerate(rows):
        ids[b, : r.numel()] = r
    positions = torch.arange(n, device=device).unsqueeze(0).expand(len(rows), n)
    mask = ends = None
    if min(lengths) != n:
        mask = (torch.arange(n, device=device).unsqueeze(0) < torch.tensor(lengths, device=device).unsqueeze(1)).long()
        ends = torch.tensor(lengths, device=device)
    cache.begin_prefill(lengths, select)
    with adapter.capture_window_queries(model, cache, window, queries, ends):
        hidden = adapter.backbone_forward(model, ids, positions, cache, mask)
    cache.end_prefill()
    return hidden[torch.arange(len(rows), device=device), torch.tensor(lengths, device=device) - 1]


class KeptPrefill:
    """One uncompressed prefill of some prompts, kept to start later prefills of the same
    prompts from (see :class:`PrefillReuse`).

    Attributes: ``rows`` (the prompts, LongTensors [n_b]), ``chunk`` (the prefill's chunk,
    None: one forward), ``cache`` (a :class:`SharedCache` holding every row's whole prompt),
    ``queries`` (per layer the last ``window`` prompt queries [B, H_q, window, D]),
    ``hidden`` (the hidden states at each row's last prompt position [B, H]), ``seconds``
    (how long the prefill took), ``model`` (the model it ran on).
    """

    def __init__(self, model, rows: list[torch.Tensor], chunk: int | None, window: int, cache: SharedCache,
                 queries: dict[int, torch.Tensor], hidden: torch.Tensor, seconds: float):
        self.model, self.rows, self.chunk, self.window = model, rows, chunk, window
        self.cache, self.queries, self.hidden, self.seconds = cache, queries, hidden, seconds

    def matches(self, model, rows: list[torch.Tensor], chunk: int | None) -> list[int] | None:
        """Where ``rows`` on ``model`` in ``chunk``-token forwards are in this prefill: per row
        the index of the kept row with the same prompt (a prompt may repeat: a batch of one
        document), or None if one is not here."""
        if model is not self.model or chunk != self.chunk:
            return None
        where = []
        for r in rows:
            i = next((i for i, k in enumerate(self.rows) if k.shape == r.shape and torch.equal(k, r)), None)
            if i is None:
                return None
            where.append(i)
        return where

    def start(self, cache: SharedCache, compress, window: int, queries: dict[int, torch.Tensor],
              rows: list[int] | None = None) -> torch.Tensor:
        """Fill the empty ``cache`` from this prefill (row b from kept row ``rows[b]``, default
        b), each full-attention layer's rows offered to ``compress`` (a
        :meth:`SharedCache.begin_prefill` selector, or None to keep all), which reads
        ``queries``: here given each layer's last ``window`` prompt queries. Returns the last
        prompt positions' hidden states [B, H] (a copy); this prefill is left as it was."""
        index = torch.tensor(list(range(len(self.rows))) if rows is None else rows, device=self.hidden.device)
        for layer, q in self.queries.items():
            if window:
                queries[layer] = q[index, :, self.window - window :]
        cache.load_prompts(self.cache, compress, rows)
        return self.hidden[index]


class PrefillReuse:
    """The uncompressed prefill of the latest prompts, kept so that later calls on the same
    prompts (other compressors, drafters or settings over one long document) start from it
    instead of running the model over the prompt again.

    Active inside :func:`reusing_prefills`, for the prompt prefills of
    :class:`accel.engine.Batch` (``accel.generate``, ``accel.stream``): a prefill whose
    model and ``prefill_chunk`` are the kept one's and whose every prompt is among the kept
    prompts (in any order, repeats allowed: a batch of rows over one document) loads their
    entries (each row's
    compressor selecting from them as after a chunked prefill: the same scores within float
    tolerance, see :func:`prefill_steps`), takes its observation-window queries from the
    kept ones, and its last hidden states. One that does not runs uncompressed, capturing
    ``window`` queries per layer, and becomes the kept one (the previous one is dropped). Not
    used (the prefill runs as without it) for models with sliding-window layers, tiered
    caches (InfiniGen), compressors observing more than ``window`` queries, and rows whose
    drafters read prompt hidden states or that ask for prompt log-probabilities (their
    prefill is not kept whole).

    The kept prefill holds every prompt entry (the full cache) until it is replaced or the
    :func:`reusing_prefills` block ends; a call starting from it reports the seconds of its
    own copy and selection as ``prefill_s``, not those of the kept prefill (``kept.seconds``).

    Args:
        window: observation-window queries kept per layer (the largest compressor window
            that may start from the kept prefill).
        match_chunk: a prefill matches the kept one only with the same ``prefill_chunk``
            (False: whatever its chunk; a chunked prefill's cache is one forward's within
            float tolerance, so a benchmark may compare chunk settings on one prefill).
    """

    def __init__(self, window: int = 64, match_chunk: bool = True):
        if isinstance(window, bool) or not isinstance(window, int) or window < 0:
            raise ValueError(f"window must be an integer >= 0 (observation-window queries kept), got {window!r}")
        self.window = window
        self.match_chunk = match_chunk
        self.kept: KeptPrefill | None = None
        self.hits = 0
        self.misses = 0

    def applies(self, model, cache: SharedCache, window: int) -> bool:
        """Whether a prefill of ``model`` into ``cache`` needing ``window`` queries may use this."""
        if type(cache) is not SharedCache or window > self.window:
            return False
        if any(w is not None for w in adapter.layer_windows(model)):
            return False
        try:
            adapter.check_window_queries(model)
        except ValueError:
            return False
        return True

    def find(self, model, rows: list[torch.Tensor], chunk: int | None) -> tuple[KeptPrefill, list[int]] | None:
        """(The kept prefill, where each of ``rows`` is in it) if it holds every one of
        ``rows`` on ``model`` with ``chunk`` (a hit), else None."""
        if self.kept is None:
            return None
        where = self.kept.matches(model, rows, chunk if self.match_chunk else self.kept.chunk)
        if where is None:
            return None
        self.hits += 1
        return self.kept, where

    def make(self, model, rows: list[torch.Tensor], chunk: int | None) -> PrefillSteps:
        """Run and keep the uncompressed prefill of ``rows`` (a generator: yields between
        chunks, returns the :class:`KeptPrefill`)."""
        import time

        self.misses += 1
        self.kept = None  # the previous one's memory goes before the new prefill's
        cache = SharedCache(adapter.geometry(model).num_layers, adapter.layer_windows(model))
        queries: dict[int, torch.Tensor] = {}
        t0 = time.perf_counter()
        hidden = yield from _prefill_whole(model, cache, rows, chunk, self.window, queries)
        self.kept = KeptPrefill(model, [r.clone() for r in rows], chunk, self.window, cache, queries, hidden,
                                time.perf_counter() - t0)
        return self.kept

    def prefill(self, model, prompts: torch.Tensor | Sequence[torch.Tensor], chunk: int | None = None) -> KeptPrefill:
        """Run and keep the uncompressed prefill of ``prompts`` now (LongTensor [1, n] / [n]
        or a list of B LongTensors [n_b]), so that the next calls on them start from it."""
        with torch.inference_mode():
            return exhaust(self.make(model, _prompt_rows(prompts), chunk))

    def clear(self) -> None:
        """Drop the kept prefill."""
        self.kept = None


_REUSE: contextvars.ContextVar[PrefillReuse | None] = contextvars.ContextVar("accel_prefill_reuse", default=None)


@contextlib.contextmanager
def reusing_prefills(reuse: PrefillReuse | None = None) -> Iterator[PrefillReuse]:
    """While active (in this thread or task), prompt prefills start from the kept uncompressed
    prefill of the same prompts, or keep theirs (see :class:`PrefillReuse`); yields the
    :class:`PrefillReuse` (``reuse``, or a new one keeping 64 queries per layer)::

        with reusing_prefills() as reuse:
            full = accel.generate(model, ids, max_new_tokens=32)  # prefills and keeps it
            snap = accel.generate(model, ids, strategies=[SnapKV(budget=1024)], max_new_tokens=32)
        assert reuse.hits == 1
    """
    reuse = PrefillReuse() if reuse is None else reuse
    token = _REUSE.set(reuse)
    try:
        yield reuse
    finally:
        _REUSE.reset(token)


def _prefill_chunks(model, cache: SharedCache, rows: list[torch.Tensor], chunk: int, window: int,
                    queries: dict[int, torch.Tensor]) -> PrefillSteps:
    """:func:`prefill` of ``rows`` ``chunk`` tokens at a time, uncompressed. The first chunk is
    a prefill of every row's first ``chunk`` tokens; each later one a forward of every row's
    next tokens on top of the cache (right-padded; a row already done feeds one padding
    token; padding sees only itself and is dropped), committed. ``queries`` receives, per
    layer, what one forward's capture would hold: [B, H_q, window, D], row b's slot j the
    query at position ``max(n_b - window + j, 0)``, taken in the chunk holding it.
    Yields after each chunk but the last; returns the final hidden state at each row's last
    prompt position, [B, H]."""
    lengths = [int(r.numel()) for r in rows]
    bsz, n, device = len(rows), max(lengths), rows[0].device
    dtype, groups = adapter.geometry(model).dtype, adapter.query_groups(model)
    ends = torch.tensor(lengths, device=device)
    slots = (ends.unsqueeze(1) - window + torch.arange(window, device=device)).clamp(min=0)  # [B, w] positions
    last = [None] * bsz
    for start in range(0, n, chunk):
        counts = [max(0, min(chunk, m - start)) for m in lengths]  # each row's tokens in this chunk
        t = max(counts)
        ids = torch.zeros((bsz, t), dtype=torch.long, device=device)
        for b, (r, m) in enumerate(zip(rows, counts)):
            ids[b, :m] = r[start : start + m]
        taken = (slots >= start) & (slots < start + torch.tensor(counts, device=device).unsqueeze(1))  # [B, w]
        span = taken.any(dim=0).nonzero().flatten().tolist()
        sink: dict[int, torch.Tensor] = {}
        tap = contextlib.nullcontext()
        if span:
            lo, hi = span[0], span[-1] + 1
            index = (slots[:, lo:hi] - start).clamp(0, t - 1)  # [B, hi - lo] positions within the chunk
            tap = adapter.capture_queries_at(model, cache, index, sink)
        with tap:
            if not start:
                cache.begin_prefill(counts)
                mask = None
                if min(counts) != t:
                    mask = (torch.arange(t, device=device).unsqueeze(0) < torch.tensor(counts, device=device)
                            .unsqueeze(1)).long()
                positions = torch.arange(t, device=device).unsqueeze(0).expand(bsz, t)
                hidden = adapter.backbone_forward(model, ids, positions, cache, mask)
                cache.end_prefill()
                cache.reserve(n)
            else:
                steps = torch.arange(t, device=device)
                positions = torch.empty((bsz, t), dtype=torch.long, device=device)
                visible = torch.eye(t, dtype=torch.bool, device=device).repeat(bsz, 1, 1)  # padding sees itself
                causal = torch.ones((t, t), dtype=torch.bool, device=device).tril()
                for b, m in enumerate(counts):
                    positions[b] = min(start, lengths[b]) + steps.clamp(max=max(m - 1, 0))
                    visible[b, :m, :m] = causal[:m, :m]
                hidden = forward_tokens(model, cache, ids, positions, visible if t > 1 else None, dtype, groups)
                cache.commit([list(range(m)) for m in counts])
        for layer, q in sink.items():  # [B, H_q, hi - lo, D]: keep each row's slots that fell in this chunk
            held = queries.setdefault(layer, q.new_zeros((bsz, q.shape[1], window, q.shape[3])))
            inside = taken[:, lo:hi][:, None, :, None]
            held[:, :, lo:hi] = torch.where(inside, q, held[:, :, lo:hi])
        for b, m in enumerate(counts):
            if m and start + m == lengths[b]:
                last[b] = hidden[b, m - 1].clone()
        if start + chunk < n:
            yield
    return torch.stack(last)


def _prompt_rows(prompts) -> list[torch.Tensor]:
    if isinstance(prompts, torch.Tensor):
        return [prompts.reshape(-1)] if prompts.dim() == 1 or prompts.shape[0] == 1 else list(prompts)
    return [p.reshape(-1) for p in prompts]


#: Per row, the look-ahead a verify pass appends (see :func:`verify`): the anchor nodes and the
#: input vectors [L, H] each anchor gets a copy of; None for a row without.
RowLookahead = tuple[Sequence[int], torch.Tensor] | None


def chain_anchors(tree: DraftTree, count: int) -> list[int]:
    """The first ``count`` nodes of ``tree``'s main chain: the root, then each node's first
    child (fewer when the chain ends)."""
    out = [0]
    while len(out) < count and tree.children[out[-1]]:
        out.append(tree.children[out[-1]][0])
    return out[:count]


def lookahead_columns(tree: DraftTree, anchor: int, size: int) -> slice:
    """The columns of a verify pass's hidden states holding anchor number ``anchor``'s
    ``size`` look-ahead positions, for a row whose tree is ``tree``."""
    start = tree.num_nodes + anchor * size
    return slice(start, start + size)


def verify(model, cache: SharedCache, trees: DraftTree | Sequence[DraftTree], dtype: torch.dtype,
           groups: int | None = None, min_nodes: int = 1,
           lookahead: Sequence[RowLookahead] | None = None) -> torch.Tensor:
    """One forward pass over every row's [root + draft nodes] on top of the cache.

    trees: one DraftTree per cache row (a single tree for a one-row cache).
    groups: query heads per KV head (default: read from the model).
    min_nodes: pad every row to a multiple of this many query tokens (padding sees only
        itself and is dropped at commit). Low-precision kernels pick their arithmetic by the
        number of rows they get (and a row's by where it falls in their tiles), so
        :mod:`accel.kernels.invariance` measures the multiple that makes a plain step compute each
        row exactly as a tree does.
    lookahead: per row None or (anchors, vectors [L, H]): after the row's N+1 nodes come L
        positions per anchor node a (columns :func:`lookahead_columns`), fed ``vectors``
        instead of token embeddings, at positions depth(a) + 1 .. depth(a) + L past the
        root, each seeing a's ancestors, a, and the earlier positions of its own copy. No
        node sees them and commit drops them (PaSS's look-ahead, :class:`~accel.strategy.Lookahead`).
    Returns final hidden states [B, T, H] (T the largest row, look-ahead included, rounded
    up to ``min_nodes``; a single tree: [N+1, H]); the new entries stay uncommitted.
    """
    single = isinstance(trees, DraftTree)
    trees = [trees] if single else list(trees)
    device = trees[0].tokens.device
    looks = list(lookahead) if lookahead is not None else [None] * len(trees)
    extra = [len(lk[0]) * lk[1].shape[0] if lk is not None else 0 for lk in looks]
    t = round_up(max(tree.num_nodes + e for tree, e in zip(trees, extra)), min_nodes)
    bsz = len(trees)
    # tokens appended since the last commit (a chain fed forward by forward) come first
    logical = [n + cache.pending_entries for n in cache.logical_lengths]
    if t == 1:
        ids = torch.tensor([[tree.token_list[0]] for tree in trees], dtype=torch.long, device=device)
        positions = torch.tensor([[n] for n in logical], dtype=torch.long, device=device)
        visible = None
    else:
        ids = torch.empty((bsz, t), dtype=torch.long, device=device)
        positions = torch.empty((bsz, t), dtype=torch.long, device=device)
        visible = torch.eye(t, dtype=torch.bool, device=device).repeat(bsz, 1, 1)  # padding sees itself
        for b, tree in enumerate(trees):
            m = tree.num_nodes
            ids[b, :m] = tree.tokens
            ids[b, m:] = tree.token_list[0]
            positions[b, :m] = tree.depth + logical[b]
            positions[b, m:] = logical[b]
            visible[b, :m, :m] = tree.ancestor_mask
    where, vectors = None, []
    if any(extra):
        where = torch.zeros((bsz, t), dtype=torch.bool, device=device)
        for b, (tree, look) in enumerate(zip(trees, looks)):
            if look is None:
                continue
            anchors, vec = look
            size = vec.shape[0]
            causal = torch.ones((size, size), dtype=torch.bool, device=device).tril()
            for j, a in enumerate(anchors):
                cols = lookahead_columns(tree, j, size)
                positions[b, cols] = logical[b] + int(tree.depth[a]) + 1 + torch.arange(size, device=device)
                visible[b, cols, : tree.num_nodes] = tree.ancestor_mask[a]
                visible[b, cols, cols] = causal
                where[b, cols] = True
                vectors.append(vec)
    with adapter.replace_embeddings(model, where, torch.cat(vectors) if vectors else None):
        hidden = forward_tokens(model, cache, ids, positions, visible, dtype, groups)
    return hidden[0, : trees[0].num_nodes] if single else hidden


def forward_tokens(model, cache: SharedCache, ids: torch.Tensor, positions: torch.Tensor,
                   visible: torch.Tensor | None, dtype: torch.dtype, groups: int | None = None) -> torch.Tensor:
    """One forward of T new tokens per row on top of the cache (left uncommitted): the
    compiled step where one serves it, else the flat forward of a Llama-family model
    (:func:`accel.adapter.flat_forward`: transformers' numbers without its module calls),
    else transformers' forward (prefills, hooked models, other architectures).

    ids, positions: LongTensor [B, T]; visible: BoolTensor [B, T, T], True where new token
    i sees new token j (None for T == 1). Returns final hidden states [B, T, H].
    """
    groups = groups if groups is not None else adapter.query_groups(model)
    mask = cache.prepare_step(positions, visible, dtype, groups)
    compiled = step_of(model)
    if compiled is not None and compiled.serves(model, cache):
        return compiled(ids, positions, cache, mask)
    order = adapter.ordered_attention(cache) if cache.ordered else contextlib.nullcontext()
    if cache._prefill is None and not adapter.has_hooks(model):
        layers, _ = adapter.flat_layers(model)
        if layers is not None:
            with order:
                return adapter.flat_forward(model, layers, ids, positions, cache, mask)
    hook = adapter.per_layer_masks(model, cache) if not cache.uniform_masks and not cache.mask_hook else contextlib.nullcontext()
    with hook, order:
        return adapter.backbone_forward(model, ids, positions, cache, mask)


def prefill_rest(model, cache: SharedCache, prompts: Sequence[torch.Tensor], dtype: torch.dtype,
                 groups: int | None = None, chunk: int | None = None) -> torch.Tensor:
    """:func:`prefill_rest_steps` run to its end (see there)."""
    return exhaust(prefill_rest_steps(model, cache, prompts, dtype, groups, chunk))


def prefill_rest_steps(model, cache: SharedCache, prompts: Sequence[torch.Tensor], dtype: torch.dtype,
                       groups: int | None = None, chunk: int | None = None) -> PrefillSteps:
    """Prefill each row's prompt past the entries its row already holds (a reused prefix,
    :meth:`SharedCache.load_prefixes`): one forward of every row's remaining tokens
    (right-padded; padding sees only itself and is dropped), committed; with ``chunk``, one
    forward per ``chunk`` of them (a row already done feeds one padding token).

    prompts: per row a LongTensor [n_b], longer than the row's logical length.
    A generator, as :func:`prefill_steps`: yields after each chunk but the last; returns the
    final hidden state at each row's last prompt position, [B, H].
    """
    starts = list(cache.logical_lengths)
    rest = [int(p.numel()) - s for p, s in zip(prompts, starts)]
    if len(prompts) != cache.batch_size or min(rest) < 1:
        raise ValueError(f"prefill_rest() needs one prompt per row, each longer than the row ({starts})")
    device = prompts[0].device
    bsz = len(prompts)
    step = max(rest) if chunk is None else chunk
    last: list[torch.Tensor | None] = [None] * bsz
    for done in range(0, max(rest), step):
        counts = [max(0, min(step, m - done)) for m in rest]
        t = max(counts)
        ids = torch.zeros((bsz, t), dtype=torch.long, device=device)
        positions = torch.empty((bsz, t), dtype=torch.long, device=device)
        steps = torch.arange(t, device=device)
        visible = torch.eye(t, dtype=torch.bool, device=device).repeat(bsz, 1, 1)  # padding sees itself
        causal = torch.ones((t, t), dtype=torch.bool, device=device).tril()
        for b, (prompt, start, m) in enumerate(zip(prompts, starts, counts)):
            at = start + min(done, rest[b])
            ids[b, :m] = prompt[at : at + m]
            positions[b] = at + steps.clamp(max=max(m - 1, 0))
            visible[b, :m, :m] = causal[:m, :m]
        hidden = forward_tokens(model, cache, ids, positions, visible if t > 1 else None, dtype, groups)
        cache.commit([list(range(m)) for m in counts])
        for b, m in enumerate(counts):
            if m and done + m == rest[b]:
                last[b] = hidden[b, m - 1].clone()
        if done + step < max(rest):
            yield
    return torch.stack(last)


def verify_logits(model, cache: SharedCache, trees: Sequence[DraftTree], dtype: torch.dtype,
                  groups: int | None = None, min_nodes: int = 1,
                  lookahead: Sequence[RowLookahead] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`verify` for every row, then the output head over each row's real nodes (not
    its look-ahead positions).

    Returns (hidden [B, T, H], float32 logits [sum_b N_b, V]: row b's nodes in order, rows
    one after another). One call computes every row's logits in one pass of the output layer.
    """
    hidden = verify(model, cache, trees, dtype, groups, min_nodes, lookahead)
    counts = [tree.num_nodes for tree in trees]
    if all(c == hidden.shape[1] for c in counts):
        flat = hidden.reshape(-1, hidden.shape[-1])
    else:
        flat = torch.cat([hidden[b, :c] for b, c in enumerate(counts)])
    pad = round_up(flat.shape[0], min_nodes) - flat.shape[0]  # the output layer is a linear too
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad, flat.shape[1])])
    return hidden, adapter.output_logits(model, flat)[: sum(counts)]


def accept(tree: DraftTree, logits: torch.Tensor, warp: Warp | None, rule: Strategy | None,
           generator: torch.Generator | None, top: list[int] | None = None) -> Acceptance:
    """Choose the accepted path and the bonus token of one row. logits: [N+1, V] float32.

    top: the argmax of every row of ``logits``, when the caller already has it (greedy).
    At temperature 0 every rule is greedy acceptance (typical acceptance included), so the
    output is exactly greedy decoding's.
    """
    if warp is None:
        return greedy_path(tree, top if top is not None else logits.argmax(dim=-1).tolist())
    probs = torch.softmax(warp(logits), dim=-1)
    if rule is not None:
        return rule.accept(tree, probs, generator)
    if tree.num_nodes == 1:
        return Acceptance(path=[0], next_token=int(torch.multinomial(probs[0], 1, generator=generator)), accepted=0)
    return sample_accept(tree, probs, generator)


def commit(cache: SharedCache, accs: Acceptance | Sequence[Acceptance]) -> None:
    """Keep each row's accepted path entries (root included) and advance its logical length."""
    accs = [accs] if isinstance(accs, Acceptance) else accs
    cache.commit([a.path for a in accs])
