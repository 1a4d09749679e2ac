"""One step of the decode loop, as small functions over the shared cache: :func:`prefill` a
batch of prompts (compressing as it goes), :func:`verify` every row's draft tree in one
forward, :func:`accept` a row's path, :func:`commit` it. :mod:`accel.engine` runs them for a
batch of requests; :mod:`accel.kernels.invariance` runs them to probe this machine's kernels.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Generator, Protocol, Sequence

import torch

from . import adapter
from .acceptance import Acceptance, greedy_path, sample_accept
from .cache import SharedCache
from .kernels.compiled import step_of
from .calibration.cost_model import round_up
from .strategy import PromptCompressor, Strategy
from .tree import DraftTree

__all__ = ["Warp", "prefill", "prefill_steps", "prefill_rest", "prefill_rest_steps", "exhaust", "forward_tokens",
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
                  ranks: RankedPrefill | None = None) -> PrefillSteps:
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
    A generator: it yields after each chunk but the last (so that a caller may run other
    forwards in between, :class:`accel.serving.Engine`), and returns the final hidden state at
    each row's last prompt position, [B, H] (:func:`prefill` runs it through).
    """
    rows = _prompt_rows(prompts)
    if isinstance(compressors, PromptCompressor) or compressors is None:
        compressors = [compressors] * len(rows)
    lengths = [int(r.numel()) for r in rows]
    device = rows[0].device
    n = max(lengths)
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
    if ranks is not None:
        hidden = ranks.prefill(cache, rows, window, queries)
        if compress is not None:
            cache.compress_prompt(compress)
        return hidden
    if chunk is not None and chunk < n:
        hidden = yield from _prefill_chunks(model, cache, rows, chunk, window, queries)
        if compress is not None:
            cache.compress_prompt(compress)
        return hidden
    ids = torch.zeros((len(rows), n), dtype=torch.long, device=device)
    for b, r in enumerate(rows):
        ids[b, : r.numel()] = r
    positions = torch.arange(n, device=device).unsqueeze(0).expand(len(rows), n)
    mask = None
    if min(lengths) != n:
        mask = (torch.arange(n, device=device).unsqueeze(0) < torch.tensor(lengths, device=device).unsqueeze(1)).long()
    cache.begin_prefill(lengths, compress)
    ends = torch.tensor(lengths, device=device) if mask is not None else None
    with adapter.capture_window_queries(model, cache, window, queries, ends):
        hidden = adapter.backbone_forward(model, ids, positions, cache, mask)
    cache.end_prefill()
    last = torch.tensor(lengths, device=device) - 1
    return hidden[torch.arange(len(rows), device=device), last]


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
