"""Batch-invariant verification for low precision: each row's arithmetic independent of how
many tokens are verified with it, so greedy drafting equals plain decoding in bfloat16.

A verify pass scores a row's draft tree in one forward; plain decoding scores one token per
forward. Both compute the same function, but CPU kernels choose their blocking, and so their
order of summation, by the shapes they get. In float32 the difference is a few ulps and never
flipped a greedy token in our tests; in bfloat16 it is ~1e-2 in the logits, enough to flip
greedy tokens. Two measures, in low precision:

- **Attention** is :mod:`accel.kernels.ordered`'s wherever :func:`ordered` holds (the model's
  attention is sdpa or flash-attention without soft-capping or sinks, and this machine's
  float32 products pass :func:`accel.kernels.ordered.probe`; MKL's default AVX2 path on an AMD EPYC
  Zen 3 does not, and passes with ``MKL_CBWR=AVX2`` set before the process starts, at no
  measured cost to its float32 linears): each query's attention is computed
  from its own keys in logical order, so a node's key sitting after its siblings' in a tree,
  not next to its ancestors' as in a plain step, changes nothing. Otherwise attention is sdpa
  with each layer's cache columns padded (masked) to a multiple of :data:`KV_ALIGN`, which
  makes the last partial block of keys the same for every row but cannot fix where a node's
  key sits (on an Intel Xeon, Ice Lake, a Medusa tree differed on 1 of 40 prompts that way;
  on the Xeon of family 6 model 207 the probe failed at every row count).
- **Linear layers**: a verify pass pads every row's tree to a multiple of ``r`` query tokens
  (padding sees only itself and is dropped at commit), and the output layer gets a multiple
  of ``r`` rows (``steps.verify(..., min_nodes=r)``). Measured: on the Ice Lake Xeon a
  bfloat16 ``F.linear`` gave one result per row for 1, for 2-3 and for 4 or more rows; on the
  model 207 Xeon a ``down_proj`` of one row differed from the same row among two or more.

The thresholds are the kernels' and differ between CPUs and builds, so ``r`` is measured, not
fixed: :func:`verify_rows` probes the candidates once per model, dtype and thread count in a
process (:func:`probe`: plain steps against chains inside trees of 6 to 32 nodes, with and
without siblings between the chain's nodes, and next to other rows; about forty short
forwards per candidate, a few seconds for the default model in bfloat16). Float32 runs
unpadded on sdpa (``r = 1``, what ``model.generate`` computes, so plain accel still equals it
token for token).

A model with int8 / int4 weights (:mod:`accel.kernels.lowbit`) computes in bfloat16 and is
probed like any bfloat16 one, on its own kernels: its quantized linear layers are what decides
``r`` (a probe is remembered per model and quantization, so a model quantized in place is
probed again), and exact there means equal to plain decoding of the quantized model.

Low precision is claimed exact (:func:`is_exact`, ``exact_verify`` in generate's stats) with
ordered attention, a passing probe and full attention in every layer; otherwise it is
labelled *approximate* (one warning per model). What the claim rests on beyond construction:
the linear layers giving a row the same numbers at every multiple of ``r`` rows a step uses
(the probe tries trees up to 32 nodes next to other rows, not every count). Agreement with
plain bf16 decoding is measured by ``python benchmarks/bf16_exactness.py`` (figures in
docs/BENCHMARKS.md: 40/40 prompts with prompt lookup and with Medusa).
"""

from __future__ import annotations

import threading
import warnings
import weakref
from typing import Sequence

import torch

from .. import adapter
from ..cache import SharedCache
from .compiled import step_of
from .lowbit import quantization_of
from ..strategy import DraftProposal
from ..tree import DraftTree

__all__ = ["CANDIDATES", "KV_ALIGN", "probe", "verify_rows", "kv_align", "is_exact"]

#: Row counts tried, smallest first.
CANDIDATES = (1, 2, 4, 8, 16)

_PROMPTS = (57, 17, 90)  # probe prompt lengths, rows of different lengths; row 0's steps cross 64 columns
_STEPS = 6  # plain steps compared with one chain
_EXTRA = (0, 3, 11, 26)  # garbage nodes hung below the chain: trees of 6, 9, 17 and 32 nodes

#: Columns the attention of a low-precision batch sees, padded to a multiple of (see
#: ``SharedCache.kv_align``).
KV_ALIGN = 64

_memo: "weakref.WeakKeyDictionary[torch.nn.Module, dict[tuple, tuple[int, bool]]]" = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def _fresh(model, geo, prompt: torch.Tensor, align: int) -> tuple[SharedCache, int]:
    from ..steps import prefill

    cache = SharedCache(geo.num_layers, adapter.layer_windows(model))
    cache.kv_align = align
    cache.ordered = ordered(model)
    hidden = prefill(model, cache, prompt.reshape(1, -1))
    return cache, int(adapter.output_logits(model, hidden).argmax(dim=-1)[0])


def _garbage(n: int, vocab: int) -> list[int]:
    return [(7919 * i + 13) % vocab for i in range(n)]


def probe(model, rows: int, align: int = KV_ALIGN, prompts: Sequence[torch.Tensor] | None = None) -> bool:
    """Whether verify passes padded to a multiple of ``rows`` query tokens per row, on a
    cache whose attention columns are aligned to ``align``, are batch-invariant for
    ``model`` on this machine: a row's logits are bit for bit the same whether it is verified
    one token at a time, as a chain inside trees of 6 to 32 nodes (its nodes first, then
    with siblings between them, as in most draft trees), or next to other rows whose trees
    have other sizes; each of ``prompts`` (default: random ones of 57, 17 and 90 tokens) is
    the first row once."""
    geo = adapter.geometry(model)
    vocab = int(model.get_output_embeddings().weight.shape[0])
    if prompts is None:
        gen = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, vocab, (n,), generator=gen).to(geo.device) for n in _PROMPTS]
    prompts = list(prompts)
    with adapter.packed_gqa_attention(model), torch.inference_mode():
        return all(_probe_row(model, geo, vocab, rows, align, prompts[i:] + prompts[:i]) for i in range(len(prompts)))


def _probe_row(model, geo, vocab: int, rows: int, align: int, prompts: list[torch.Tensor]) -> bool:
    from ..steps import verify_logits

    groups = geo.num_heads // geo.num_kv_heads
    p0 = prompts[0]

    def logits_of(trees):  # row 0 and len(trees) - 1 others, prefilled one by one and joined
        cache, _ = _fresh(model, geo, p0, align)
        for p in prompts[1 : len(trees)]:
            cache.extend(_fresh(model, geo, p, align)[0])
        return verify_logits(model, cache, trees, geo.dtype, groups, rows)[1]

    cache, tok = _fresh(model, geo, p0, align)
    toks, plain = [tok], []
    for _ in range(_STEPS):  # row 0 alone, plain steps
        _, logits = verify_logits(model, cache, [DraftTree.root_only(toks[-1], device=geo.device)], geo.dtype,
                                  groups, rows)
        plain.append(logits[0])
        toks.append(int(logits[0].argmax()))
        cache.commit([[0]])
    for extra in _EXTRA:  # the same tokens as one chain, with garbage siblings
        tokens = torch.tensor(toks[1:_STEPS] + _garbage(extra, vocab), device=geo.device)
        parents = torch.tensor(list(range(_STEPS - 1)) + [0] * extra, device=geo.device)
        widest = DraftTree.from_proposal(toks[0], DraftProposal(tokens=tokens, parents=parents))
        logits = logits_of([widest])
        if not all(torch.equal(logits[i], plain[i]) for i in range(_STEPS)):
            return False
    chain = DraftTree.chain(toks[0], toks[1:_STEPS], device=geo.device)
    root = DraftTree.root_only(toks[0], device=geo.device)

    def other(i: int, nodes: int) -> DraftTree:
        return DraftTree.chain(int(prompts[i][-1]), _garbage(nodes - 1, vocab), device=geo.device)

    for trees in ([chain, other(1, 17)], [root, other(1, 11)], [widest, other(1, 5), other(2, 1)]):
        logits = logits_of(trees)  # next to other rows with other trees
        if not all(torch.equal(logits[i], plain[i]) for i in range(min(trees[0].num_nodes, _STEPS))):
            return False
    # a draft tree's usual layout: a sibling sits between each node and its parent, so the
    # node's own key is not next to its ancestors' (plain decoding: always next to them)
    tokens, parents, at = [], [], [0]
    for i in range(1, _STEPS):
        gap = (3, 1, 2, 0, 3)[(i - 1) % 5]
        tokens += _garbage(gap, vocab)
        parents += [at[-1]] * gap
        tokens.append(toks[i])
        parents.append(at[-1])
        at.append(len(tokens))
    tree = DraftTree.from_proposal(toks[0], DraftProposal(tokens=torch.tensor(tokens, device=geo.device),
                                                          parents=torch.tensor(parents, device=geo.device)))
    logits = logits_of([tree])
    return all(torch.equal(logits[at[i]], plain[i]) for i in range(_STEPS))


def verify_rows(model, candidates: Sequence[int] = CANDIDATES) -> int:
    """The multiple of query tokens per row a verify pass pads to, so that drafts agree with
    plain decoding of ``model``: 1 in float32; otherwise the smallest of ``candidates`` that
    :func:`probe` finds invariant (1 where none is), measured once per model, dtype and
    thread count in a process, with one warning where low-precision verification is
    approximate (:func:`is_exact`)."""
    return _probed(model, tuple(candidates))[0]


def _probed(model, candidates: tuple[int, ...] = CANDIDATES) -> tuple[int, bool]:
    """(rows to pad to, whether some candidate passed the probe), measured once per model,
    dtype, device and thread count; warns once where the result is approximate."""
    geo = adapter.geometry(model)
    if geo.dtype == torch.float32:
        return 1, True
    quant = quantization_of(model)
    # a model quantized in place after a probe runs other kernels: probed again
    # ... and a compiled step (accel.kernels.compiled) runs its own kernels: probed through it
    key = (geo.dtype, geo.device, torch.get_num_threads(), candidates,
           None if quant is None else tuple(sorted(quant.key().items())), step_of(model) is not None)
    with _lock:
        known = _memo.setdefault(model, {})
        if key in known:
            return known[key]
        use_ordered = ordered(model)
        full = next((r for r in candidates if probe(model, r, kv_align(model))), None)
        known[key] = (full or 1, full is not None)
        windows = any(w is not None for w in adapter.layer_windows(model))
        if full is None:
            why = f"none of {list(candidates)} query rows per step gave bit-identical logits on this machine"
        elif not use_ordered:
            why = (f"padded to {full} query rows per step it passed the invariance probe, but without ordered "
                   "attention (see accel.kernels.invariance) draft trees can still differ from plain decoding in the "
                   "last bits")
            if adapter.ordered_capable(model):
                why += ("; this machine's float32 products failed accel.kernels.ordered.probe (with MKL on an AMD CPU, "
                        "setting MKL_CBWR=AVX2 before the process starts makes them pass)")
        elif windows:
            why = ("its sliding-window layers trim entries by what each step accepted, so a token's keys "
                   "do not sit where a plain step's would")
        else:
            return known[key]
        what = str(geo.dtype) if quant is None else f"{quant.name} ({geo.dtype} activations)"
        warnings.warn(
            f"accel: {what} verification of {type(model).__name__} is approximate: {why}"
            "; greedy speculative output may differ from plain decoding",
            RuntimeWarning,
            stacklevel=3,
        )
        return known[key]


def ordered(model) -> bool:
    """Whether accel's verify forwards of ``model`` use :mod:`accel.kernels.ordered` attention: in
    low precision, where the model's attention allows it (:func:`accel.adapter.ordered_capable`)
    and this machine's float32 products pass :func:`accel.kernels.ordered.probe`."""
    geo = adapter.geometry(model)
    return (geo.dtype != torch.float32 and adapter.ordered_capable(model)
            and _ordered_probe(geo.head_dim, geo.num_heads // geo.num_kv_heads))


def _ordered_probe(head_dim: int, groups: int) -> bool:
    """The native kernel sums in an order of its own making (no probe needed); torch's
    operations need this machine's float32 products to pass :func:`accel.kernels.ordered.probe`."""
    from . import native
    from .ordered import probe as ordered_probe

    return native.ordered_serves(torch.bfloat16, head_dim, groups, "cpu") or ordered_probe(head_dim, groups)


def kv_align(model) -> int:
    """Columns a batch's attention sees are padded to a multiple of this: 1 in float32 and
    with ordered attention (which lays keys out itself), :data:`KV_ALIGN` otherwise."""
    return 1 if adapter.geometry(model).dtype == torch.float32 or ordered(model) else KV_ALIGN


def is_exact(model) -> bool:
    """Whether accel claims greedy drafting exact for ``model``: True in float32 (tested,
    not probed). In lower precision only with ordered attention (each query's attention a
    function of its own keys in logical order, by construction), full attention in every
    layer (a sliding window's trimming moves entries by what each step accepted), and a
    passing :func:`probe` (the linear layers give a row the same result at the row counts a
    step pads to); without ordered attention the padding makes drafts agree with plain
    decoding on chains and on what the probe tries, not on every tree layout."""
    geo = adapter.geometry(model)
    if geo.dtype == torch.float32:
        return True
    if not ordered(model) or any(w is not None for w in adapter.layer_windows(model)):
        return False
    return _probed(model)[1]

