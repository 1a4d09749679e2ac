"""The decode loop for many requests at once: each request's :class:`Row` and :class:`Stats`,
the :class:`Batch` that steps them together, and how much drafting pays (:func:`draft_budgets`,
from each row's running acceptance and drafting cost, checked by :func:`draft_guard`).
Drafting itself (every row's drafters proposing, their trees merged) is :mod:`accel.drafting`;
the step (prefill, verify, accept, commit) is :mod:`accel.steps`; a request's strategies by
capability are its :class:`~accel.strategy.Plan`.

Every live row of a batch is verified in ONE forward pass per step (BASS, Qi et al. 2024).
Each row feeds its *root* (the pending token: sampled last step, its KV not yet computed)
plus its own draft tree; the trees are padded to the step's largest, with per-row position
ids and one mask over stored plus new entries. Acceptance and commit are per row, so rows
accept different numbers of tokens (ragged acceptance) and each row's output is what it
would be alone. Plain decoding is the same loop with root-only trees.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch

from . import adapter, maintenance
from .calibration import calibrate
from .kernels import invariance
from .logprobs import TokenLogprob, token_logprobs
from .acceptance import Acceptance
from .cache import SharedCache
from .drafting import draft_rows, drafter_feedback, start_rows
from .serving.prefix import PrefixStore, common_prefix, shared_prefix
from .calibration.cost_model import CostTable, DraftCost, DraftGuard, acceptance_gains, allocate_drafts, sharing_pays
from .runahead import PrefillRanks
from .steps import (PrefillSteps, Warp, accept, chain_anchors, commit, exhaust, lookahead_columns, prefill_rest_steps,
                    prefill_steps, verify_logits)
from .strategy import DraftContext, Drafter, KVTier, Lookahead, Plan, plan_strategies
from .tier import TieredCache
from .tree import DraftTree

# Plan and plan_strategies live in accel.strategy; importable from here too.
__all__ = ["Stats", "Plan", "Row", "Batch", "plan_strategies", "decode", "draft_budgets", "draft_guard",
           "planning_rate", "batch_steps", "run_batch", "AcceptanceMemory", "remembered_acceptance"]

# No fixed draft limit by default: the measured cost table sizes each step's drafts.
DEFAULT_MAX_DRAFT: int | None = None


#: The most draft nodes one row verifies per step when the caller sets no limit; the cost
#: table decides how many of them are worth it.
MAX_DRAFT_PER_ROW = 16


def draft_budgets(table: CostTable, cache_len: int, rows: Sequence["Row"], max_per_row: int,
                  min_nodes: int = 1, extra: Sequence[int] | None = None) -> list[int]:
    """Draft nodes each row may verify this step, from the measured cost of a padded verify
    pass (``table``, see :func:`accel.calibration.cost_model.allocate_drafts`) and each row's running
    acceptance rate and drafting time: as the batch grows, a deeper tree costs every row,
    so drafting shrinks, down to none when plain batched decoding is faster.

    A row starts slowly: its first drafting step verifies at most one draft, then 2, 4, 8, ...
    (``2 ** drafting steps so far``), so the acceptance and drafting time it measures cheaply
    decide before a deep tree is paid for (a drafter that proposes garbage costs the batch
    little). Its acceptance is planned optimistically at first (:func:`planning_rate`), so a
    row tries drafting even where a two-token pass costs much more than a one-token one.
    ``extra``: per row, the look-ahead positions its tree carries whenever it drafts."""
    gains = [acceptance_gains(planning_rate(r), min(max_per_row, 2 ** min(r.drafted_steps, 30)))
             if r.plan.drafters else [] for r in rows]
    # the static table (calibration off) is a shape in units of one step, not milliseconds
    fits = [r.draft_cost.fit() for r in rows] if table.measured else None
    return allocate_drafts(table, cache_len, gains, max_per_row, min_nodes=min_nodes,
                           drafter_ms=[f for f, _ in fits] if fits else None,
                           drafter_ms_per_token=[t for _, t in fits] if fits else None,
                           extra_nodes=list(extra) if extra is not None else None)


#: Pseudo-hits of optimism in a row's planned acceptance before its drafts are measured
#: (:func:`planning_rate`), fading as 1 / (1 + drafting steps).
EXPLORE_HITS = 6.0


def planning_rate(row: "Row") -> float:
    """The acceptance rate :func:`draft_budgets` plans ``row``'s drafts with: its running
    estimate (``hits / (hits + misses)``, prior 1/2) plus ``EXPLORE_HITS / (1 + drafting
    steps)`` pseudo-hits, 0.875 for a new row, fading to the measured rate as drafts are
    verified.

    Optimism in the face of uncertainty: with the prior alone, a machine whose one-token
    pass is much cheaper than a two-token one (measured on an AMD EPYC Zen 3: 70 ms against
    122 ms, a split kernel for one row) never lets a row verify its first draft, so it never
    learns that prompt lookup on a document is accepted 5 tokens a step. With the bonus a
    garbage drafter costs a few short probes (a 1-, 2-, then 4-draft step on that machine)
    before its measured misses stop it, and the :class:`~accel.calibration.cost_model.DraftGuard`
    checks what drafting delivers either way."""
    bonus = EXPLORE_HITS / (1 + row.drafted_steps + row.prior_steps)
    return (row.hits + bonus) / (row.hits + row.misses + bonus)


#: At most this many drafting steps of earlier requests count as a new row's evidence
#: (:func:`remembered_acceptance`): they fade its exploration bonus as its own steps would.
PRIOR_STEPS = 16


@dataclass
class AcceptanceMemory:
    """What the rows of one drafter set on one model at one batch size accepted, over the
    requests of this process: ``rate`` a running mean of retired rows' acceptance estimates (weight
    ``1 - decay`` on the newest), ``steps`` their drafting steps (capped at
    :data:`PRIOR_STEPS`)."""

    rate: float
    steps: int
    decay: float = 0.7

    def add(self, rate: float, steps: int) -> None:
        self.rate = self.decay * self.rate + (1 - self.decay) * rate
        self.steps = min(self.steps + steps, PRIOR_STEPS)


_MEMORIES: "weakref.WeakKeyDictionary[Any, dict[tuple, AcceptanceMemory]]" = weakref.WeakKeyDictionary()


def _memory_key(row: "Row") -> tuple | None:
    specs = tuple(sorted(row.plan.drafter_specs))
    return (row.memory_bucket, specs) if specs and row.memory_bucket > 1 else None


def remembered_acceptance(model, row: "Row") -> AcceptanceMemory | None:
    """The :class:`AcceptanceMemory` of ``row``'s drafter set on ``model`` at its batch size
    (``row.memory_bucket``: rounded up to a power of two, as the draft guard's), or None before
    any such row has drafted and retired. Batch sizes learn apart: a batch's costs keep its
    trees small, and the acceptance a row measures depends on its trees. A row alone keeps the
    optimistic prior (None here): its probes cost one row little (a two-token pass 1.04x a
    one-token one on the AMX Xeon in bf16), and they pay on the prompts where a drafter does
    well (Medusa + prompt lookup on one row, started from remembered acceptance, ran 2-4%
    slower than from the prior in three of four alternating rounds on the AMX Xeon at e7fc0b0:
    ``python benchmarks/acceptance_memory.py --strategy medusa:heads=default --strategy prompt_lookup``)."""
    key = _memory_key(row)
    return _MEMORIES.get(model, {}).get(key) if key else None


def start_from_memory(model, row: "Row") -> None:
    """Start ``row``'s acceptance estimate from what earlier requests with its drafters
    accepted on ``model``: ``hits / misses`` at the remembered rate (the weight of the
    default prior, 2), and their drafting steps as ``prior_steps``, so its exploration bonus
    (:func:`planning_rate`) is already faded. A drafter that proved useless on this model
    then costs a batch no probing steps in each new request (a batch verify pass of 8 rows x
    2 tokens measured 1.29x one of 8 x 1 on a 2-core Intel Xeon with AMX, bf16, so a row must
    expect 29% of its first draft accepted); one whose acceptance differs by request (prompt
    lookup on a document, then on chat) still learns it from its own steps. The engine applies
    it, as it runs the draft guard, only where calibration is on (measured costs); with
    ``ACCEL_CALIBRATION=off`` every request starts from the same prior, so runs repeat."""
    memory = remembered_acceptance(model, row)
    if memory is not None:
        row.hits, row.misses = 2 * memory.rate, 2 * (1 - memory.rate)
        row.prior_steps = memory.steps


def remember(model, row: "Row") -> None:
    """Fold a retiring row's acceptance estimate into its drafter set's memory on ``model``
    (rows that drafted at least twice: one step says little)."""
    key = _memory_key(row)
    if key is None or row.drafted_steps < 2:
        return
    memories = _MEMORIES.setdefault(model, {})
    if key in memories:
        memories[key].add(row.acceptance_rate, row.drafted_steps)
    else:
        memories[key] = AcceptanceMemory(row.acceptance_rate, min(row.drafted_steps, PRIOR_STEPS))


# The guards of each model's batches, by (batch size rounded up to a power of two, drafter
# settings): what drafting delivered is remembered across calls and requests of the process.
_GUARDS: "weakref.WeakKeyDictionary[Any, dict[tuple, DraftGuard]]" = weakref.WeakKeyDictionary()


def draft_guard(model, rows: Sequence["Row"]) -> DraftGuard:
    """The :class:`~accel.calibration.cost_model.DraftGuard` for a batch of ``rows`` on ``model``: one per
    batch size (rounded up to a power of two: 1, 2, 4, 8, ...) and set of drafters (their
    settings: two draft models, or one with another draft length, learn apart), kept for the
    model's life, so a batch size where drafting did not pay starts the next call muted
    instead of paying for the lesson again."""
    bucket = 1 << max(len(rows) - 1, 0).bit_length()
    specs = tuple(sorted({spec for r in rows for spec in r.plan.drafter_specs}))
    return _GUARDS.setdefault(model, {}).setdefault((bucket, specs), DraftGuard())


@dataclass
class Stats:
    """Measurements of one request, or (summed) of a whole generate call.

    The seconds of a batched call are wall-clock times of the call: ``prefill_s`` the
    prefills, ``decode_s`` the verify steps; per-row stats carry ``first_token_s`` (submit to
    first token) and ``latency_s`` (submit to last token) as well.
    """

    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # prompt tokens whose entries came from an earlier prompt (accel.serving.prefix)
    new_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    verify_steps: int = 0
    drafted_tokens: int = 0  # draft nodes sent to the verifier
    accepted_tokens: int = 0  # draft tokens accepted (bonus tokens excluded)
    decode_tokens: int = 0  # tokens emitted by the verify steps (after the prefill's first one)
    kv_bytes_full: int = 0  # what an uncompressed cache would hold for the same tokens
    kv_bytes_kept: int = 0  # bytes of the cache's tensors holding this row's entries (packed groups at their size)
    # bytes of every tensor of the batch's cache when the row finished (spare room and scratch
    # included; shared by the batch's rows, so not summed over them)
    kv_bytes_stored: int = 0
    first_token_s: float = 0.0
    latency_s: float = 0.0
    accepted_per_step: list[int] = field(default_factory=list)  # accepted drafts, per step
    # False in low precision (accel.kernels.invariance): greedy drafting is padded to agree with plain
    # decoding, but not claimed exact
    exact_verify: bool = True
    # a tiered cache's (accel.tier), the batch's when the row finished (not summed over rows): bytes
    # its planned steps fetched, what reading every entry instead would have been, and what it
    # held in memory outside the slow tier
    kv_bytes_fetched: int = 0
    kv_bytes_fetch_full: int = 0
    kv_bytes_resident: int = 0

    @property
    def mean_accepted(self) -> float:
        """Tokens emitted per verify step, bonus token included (1.0 for plain decoding)."""
        return (self.accepted_tokens + self.verify_steps) / self.verify_steps if self.verify_steps else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s else 0.0

    @property
    def kv_compression(self) -> float:
        return self.kv_bytes_full / self.kv_bytes_kept if self.kv_bytes_kept else 1.0

    _SUMMED = ("prompt_tokens", "cached_prompt_tokens", "new_tokens", "prefill_s", "decode_s", "verify_steps", "drafted_tokens",
               "accepted_tokens", "decode_tokens", "kv_bytes_full", "kv_bytes_kept")

    def merge(self, other: "Stats", seconds: bool = True) -> None:
        """Add ``other``'s counts (and, with ``seconds``, its prefill / decode seconds) to these."""
        for name in self._SUMMED:
            if seconds or not name.endswith("_s"):
                setattr(self, name, getattr(self, name) + getattr(other, name))
        self.accepted_per_step.extend(other.accepted_per_step)
        self.exact_verify = self.exact_verify and other.exact_verify

    def as_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k != "accepted_per_step"}
        d.update(mean_accepted=self.mean_accepted, decode_tokens_per_s=self.decode_tokens_per_s)
        return d

    def summary(self) -> str:
        return (
            f"prompt {self.prompt_tokens} tok | new {self.new_tokens} tok | prefill {self.prefill_s:.2f}s | "
            f"decode {self.decode_s:.2f}s ({self.decode_tokens_per_s:.1f} tok/s) | steps {self.verify_steps} | "
            f"accepted/step {self.mean_accepted:.2f} | KV {self.kv_bytes_kept / 2**20:.1f}/"
            f"{self.kv_bytes_full / 2**20:.1f} MiB" + ("" if self.exact_verify else " | approximate verify")
        )


# --------------------------------------------------------------------------- rows and batches


@dataclass(eq=False)
class Row:
    """One request's decoding state while it sits in a batch.

    prompt: LongTensor [n]; tokens: LongTensor [n + generated] (prompt, emitted tokens; the
    last one is the pending root); states: one per drafter of ``plan``; hidden: [H] the
    verifier's hidden state at the root's parent (for drafters that need it); features: per
    layer the drafters read (:meth:`~accel.strategy.Drafter.feature_layers`), the verifier's
    hidden states [m, H] at the positions not yet handed to them (``DraftContext.features``).
    """

    prompt: torch.Tensor
    plan: Plan
    max_new_tokens: int
    eos: frozenset[int]
    warp: Warp | None = None
    generator: torch.Generator | None = None
    tokens: torch.Tensor | None = None
    generated: list[int] = field(default_factory=list)
    states: list[Any] = field(default_factory=list)
    hidden: torch.Tensor | None = None
    features: dict[int, torch.Tensor] | None = None
    feature_layers: tuple[int, ...] = ()  # the layers of ``features`` (set when admitted)
    stats: Stats = field(default_factory=Stats)
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" | "error"
    error: BaseException | None = None  # why the request failed (finish_reason "error")
    started: float = field(default_factory=time.perf_counter)
    tag: Any = None  # the caller's handle for this row
    # Running estimate of the chance that a draft token is accepted given its parent was (a
    # geometric fit to recent accepted depths, hits / (hits + misses)), and of the drafters'
    # milliseconds per step (a line in the tokens drafted); they size the row's drafts
    # (Batch.budgets).
    hits: float = 1.0
    misses: float = 1.0
    draft_cost: DraftCost = field(default_factory=DraftCost)
    drafted_steps: int = 0  # steps in which this row verified drafts (the slow start of draft_budgets)
    prior_steps: int = 0  # drafting steps of earlier requests its estimate starts from (start_from_memory)
    memory_bucket: int = 1  # the batch size it was admitted into, rounded up to a power of two (remembered_acceptance)
    upkeep: maintenance.Upkeep | None = None  # eviction / quantization during decoding (accel.maintenance)
    # Log-probabilities (accel.logprobs): None off, else the alternatives reported per token.
    logprobs: int | None = None  # of the generated tokens, one per token of ``generated`` in generated_logprobs
    prompt_logprobs: int | None = None  # of the prompt's tokens, in prompt_logprob_list after the prefill
    generated_logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprob_list: list[TokenLogprob | None] | None = None  # None at position 0 (nothing precedes it)

    @property
    def acceptance_rate(self) -> float:
        return self.hits / (self.hits + self.misses)

    def observe(self, tree: DraftTree, acc: Acceptance, draft_s: float) -> None:
        """Update the acceptance and drafting-time estimates after one step.

        Recent steps weigh most (decay 0.9). A step without drafts pulls the estimate back
        towards the prior 1/2, so a row whose drafts stopped paying tries again later.
        """
        if not tree.num_drafts:
            self.hits = 0.97 * self.hits + 0.03
            self.misses = 0.97 * self.misses + 0.03
            return
        deepest = max(len(p) for p in tree.paths) - 1
        self.drafted_steps += 1
        self.hits = 0.9 * self.hits + acc.accepted
        self.misses = 0.9 * self.misses + (1.0 if acc.accepted < deepest else 0.0)
        self.draft_cost.observe(tree.num_drafts, draft_s * 1e3)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def emit(self, new: list[int]) -> list[int]:
        """Append ``new`` tokens (cut at EOS and at max_new_tokens); returns what was kept."""
        room = self.max_new_tokens - len(self.generated)
        kept = []
        for tok in new[:room]:
            kept.append(tok)
            if tok in self.eos:
                break
        self.generated.extend(kept)
        now = time.perf_counter()
        if kept and len(self.generated) == len(kept):
            self.stats.first_token_s = now - self.started
        if kept and kept[-1] in self.eos:
            self.finish_reason = "stop"
        elif len(self.generated) >= self.max_new_tokens:
            self.finish_reason = "length"
        if self.done:
            self.stats.latency_s = now - self.started
            self.stats.new_tokens = len(self.generated)
        return kept


class Batch:
    """Live rows decoded together on one :class:`SharedCache`.

    ``admit`` prefills new rows (one forward for all of them) and joins them to the batch;
    ``step`` runs one verify forward for every live row and returns what each emitted;
    ``retire`` removes finished or cancelled rows. ``accel.generate`` admits every row at
    once and steps until all are done; ``accel.Engine`` admits between steps.

    max_draft: the most draft nodes a row may verify per step (None: up to
    ``MAX_DRAFT_PER_ROW``); within it :func:`draft_budgets` sizes each step's drafts from the
    measured cost table (``costs``; default: :func:`accel.calibration.calibrate.step_costs` of the model,
    the table for the kernels it runs).
    prefixes: where admitted prompts' entries are kept and looked up, so that a prompt that
        starts like an earlier one is prefilled only past the shared part (see
        :mod:`accel.serving.prefix`; the Engine keeps one); None: every prompt is prefilled whole.
    prefill_chunk: prompt tokens per prefill forward (None: one forward per admission), see
        :func:`accel.steps.prefill`.
    prefill_ranks: the processes each whole prompt's prefill runs over (KV-Runahead,
        :class:`accel.runahead.PrefillRanks`); None: this process alone.
    tier: a :class:`~accel.strategy.KVTier` (InfiniGen) every row's cache lives in: the
        batch's cache is then a :class:`~accel.tier.TieredCache`; None: a plain one.
    """

    def __init__(self, model, max_draft: int | None = DEFAULT_MAX_DRAFT, row_capacity: int = 0,
                 costs: CostTable | None = None, prefixes: PrefixStore | None = None,
                 prefill_chunk: int | None = None, prefill_ranks: PrefillRanks | None = None,
                 tier: KVTier | None = None):
        self.model = model
        self.prefill_chunk = prefill_chunk
        self.prefill_ranks = prefill_ranks
        self.prefixes = prefixes
        self.costs = costs
        self.geo = adapter.geometry(model)
        self.groups = self.geo.num_heads // self.geo.num_kv_heads
        self.windows = adapter.layer_windows(model)
        self.max_draft = max_draft
        self.tier = tier
        self._projections = None
        if tier is not None:
            if any(w is not None for w in self.windows):
                raise ValueError(f"{tier.name}: the model has sliding-window layers, which a tiered cache does not hold")
            if prefill_ranks is not None:
                raise ValueError(f"prefill_ranks: the prefill over several ranks fills plain caches, not {tier.name}'s")
            if self.geo.device.type != "cpu":
                raise ValueError(f"{tier.name}: the slow tier of a {self.geo.device.type} model (host memory) is not "
                                 "built yet; tiered caches run CPU models")
            self._projections = tier.projections(model)
        self.cache = self.new_cache()
        self.cache.row_capacity = row_capacity
        self.cache.kv_align = invariance.kv_align(model)
        self.cache.ordered = invariance.ordered(model)
        self.rows: list[Row] = []
        self._min_nodes: int | None = None
        self.exact = invariance.is_exact(model)  # greedy drafting claimed exact (float32; bf16 with ordered attention)
        # prompts may reuse stored prefixes (accel.serving.prefix): a store, float32, full attention
        self._prefix_model = (prefixes is not None and self.geo.dtype == torch.float32
                              and all(w is None for w in self.windows))
        self.guard: DraftGuard | None = None  # this step's (see draft_guard): set when it may draft, measured tables only

    def new_cache(self) -> SharedCache:
        """An empty cache of the batch's kind (tiered where the batch has a tier)."""
        if self.tier is not None:
            return TieredCache(self.geo.num_layers, self.tier, self._projections)
        return SharedCache(self.geo.num_layers, self.windows)

    @property
    def min_nodes(self) -> int:
        """Every row's tree is padded to a multiple of this many query tokens per step, so
        that its arithmetic is the same whatever the trees around it (measured on first use,
        see :mod:`accel.kernels.invariance`; 1 in float32)."""
        if self._min_nodes is None:
            self._min_nodes = invariance.verify_rows(self.model)
        return self._min_nodes

    def __len__(self) -> int:
        return len(self.rows)

    def admit(self, rows: list[Row]) -> None:
        """Prefill ``rows`` together, emit each one's first token and add them to the batch.

        With a prefix store, rows whose prompt starts like a stored one load those entries
        and run only the rest of their prompt; when any row does, every row that may reuse
        prefixes runs that way (one forward), the others (prompt compression) in a plain
        prefill of their own.
        """
        exhaust(self.admitting(rows))

    def admitting(self, rows: list[Row]) -> PrefillSteps:
        """:meth:`admit` as a generator that yields between prefill forwards (with
        ``prefill_chunk``, after every chunk), so that the caller may :meth:`step` the rows
        already in the batch in between: the rows being admitted join only at the end (their
        prefill fills caches of their own). Only one admission may be under way at a time."""
        if not rows:
            return
        t0 = time.perf_counter()
        bucket = 1 << max(len(self.rows) + len(rows) - 1, 0).bit_length()
        remembers = calibrate.calibration_enabled()  # as the draft guard: where steps are sized by measured costs
        for r in rows:
            r.feature_layers, r.features = r.plan.feature_layers(self.model), None
            r.memory_bucket = bucket
            if remembers:
                start_from_memory(self.model, r)
        reusable = [self._reuses(r) for r in rows]
        yield from self._share_within([r for r, ok in zip(rows, reusable) if ok])
        matches = [self.prefixes.match(r.prompt) if ok else None for r, ok in zip(rows, reusable)]
        if not any(matches):
            reusable = [False] * len(rows)
        whole = [r for r, ok in zip(rows, reusable) if not ok]
        rest = [(r, m) for r, ok, m in zip(rows, reusable, matches) if ok]
        parts: list[tuple[list[Row], SharedCache, torch.Tensor]] = []
        latest: dict[int, dict[int, torch.Tensor]] = {}  # id(row) -> its last prompt queries, for eviction
        kept: dict[int, dict[int, torch.Tensor]] = {}  # id(row) -> layer -> prompt positions kept per head
        if whole:
            fresh = self.new_cache()
            captured: dict[int, torch.Tensor] = {}
            selected: dict[tuple[int, int], torch.Tensor] = {}
            states: dict[int, torch.Tensor] = {}
            layers = self._feature_layers(whole)
            if any(r.prompt_logprobs is not None for r in whole) and -1 not in layers:
                layers = (*layers, -1)  # the normed hidden state of every prompt position
            if layers and self.prefill_ranks is not None:
                raise ValueError("prefill_ranks: the prefill over several ranks keeps only the last chunk's hidden "
                                 f"states here; drafters reading prompt features (layers {layers}) and prompt "
                                 "logprobs need a prefill in one process")
            with adapter.capture_layer_states(self.model, fresh, layers, states):
                hidden = yield from prefill_steps(self.model, fresh, [r.prompt for r in whole],
                                                  [r.plan.compressor for r in whole], captured, selected,
                                                  chunk=self.prefill_chunk, ranks=self.prefill_ranks,
                                                  reuse=not layers)
            _hand_features(whole, states, [(b, torch.arange(int(r.prompt.numel()))) for b, r in enumerate(whole)])
            for b, r in enumerate(whole):
                if r.prompt_logprobs is not None:
                    r.prompt_logprob_list = _prompt_logprobs(self.model, states[-1][b, : int(r.prompt.numel())],
                                                             r.prompt, r.prompt_logprobs)
            for b, r in enumerate(whole):
                c = r.plan.compressor
                if c is not None and c.decode_limit() is not None and c.decode_window():
                    latest[id(r)] = maintenance.prompt_queries(captured, b, int(r.prompt.numel()), c.decode_window())
                kept[id(r)] = {layer: idx for (row, layer), idx in selected.items() if row == b}
            del captured, selected
            parts.append((whole, fresh, hidden))
        if rest:
            fresh = self.new_cache()
            fresh.load_prefixes([(m.keys, m.values, m.length) if m is not None else None for _, m in rest])
            if whole:
                yield
            states = {}
            with adapter.capture_layer_states(self.model, fresh, self._feature_layers([r for r, _ in rest]), states):
                hidden = yield from prefill_rest_steps(self.model, fresh, [r.prompt for r, _ in rest], self.geo.dtype,
                                                       self.groups, chunk=self.prefill_chunk)
            _hand_features([r for r, _ in rest], states,  # the features of the prompt past the reused prefix
                           [(b, torch.arange(int(r.prompt.numel()) - (m.length if m is not None else 0)))
                            for b, (r, m) in enumerate(rest)])
            for r, m in rest:
                r.stats.cached_prompt_tokens = m.length if m is not None else 0
            parts.append(([r for r, _ in rest], fresh, hidden))
        rows = [r for part, _, _ in parts for r in part]
        hidden = torch.cat([h for _, _, h in parts]) if len(parts) > 1 else parts[0][2]
        logits = adapter.output_logits(self.model, hidden)  # [B, V]
        top = logits.argmax(dim=-1).tolist()
        root = DraftTree.root_only(-1, device=hidden.device)
        elapsed = time.perf_counter() - t0
        for b, row in enumerate(rows):
            acc = accept(root, logits[b : b + 1], row.warp, row.plan.rule, row.generator, top=[top[b]])
            row.stats.prompt_tokens = int(row.prompt.numel())
            row.stats.prefill_s = elapsed
            # a quantized cache rounds entries: exact only where verify passes compute them bit for bit
            # as plain steps do (ordered attention); float32 agrees to a few ulps (accel.maintenance)
            row.stats.exact_verify = self.exact and (row.plan.quantizer is None or self.cache.ordered)
            row.tokens = torch.cat([row.prompt, row.prompt.new_tensor([acc.next_token])])
            row.hidden = hidden[b] if row.plan.needs_hidden else None
            if row.emit([acc.next_token]) and row.logprobs is not None:
                row.generated_logprobs = token_logprobs(logits[b : b + 1], [acc.next_token], row.logprobs)
        for row, states in zip(rows, start_rows(self.model, [r.plan for r in rows], [r.prompt for r in rows])):
            row.states = states
        for part, fresh, _ in parts:
            if self.prefixes is not None:
                for b, row in enumerate(part):
                    if self._reuses(row):
                        self.prefixes.add(row.prompt, fresh, b)
            self.cache.extend(fresh)
        first = len(self.rows)
        self.rows.extend(rows)
        for i, row in enumerate(rows):
            row.upkeep = maintenance.start(row.plan.compressor, row.plan.quantizer, self.cache, first + i,
                                           row.tokens, latest.get(id(row)), kept.get(id(row)))

    def _feature_layers(self, rows: Sequence[Row]) -> tuple[int, ...]:
        """Every target layer the drafters of ``rows`` read (see :func:`_hand_features`)."""
        return tuple(sorted({k for r in rows for k in r.feature_layers}))

    def _share_within(self, rows: list[Row]) -> PrefillSteps:
        """When admitted prompts share a prefix the store does not hold (a burst of requests
        about one new document) and the cost table says a pass of its own pays
        (:func:`~accel.calibration.cost_model.sharing_pays`), prefill it once, alone, and store it, so that
        each of them then runs only its own rest."""
        if len(rows) < 2:  # rows are those that may reuse prefixes: none without a store
            return
        prompts = [r.prompt for r in rows]
        i, length = shared_prefix(prompts)
        if (length < self.prefixes.min_tokens or self.prefixes.longest(prompts[i][: length + 1]) >= length
                or self.geo.entry_bytes() * length > self.prefixes.max_bytes):
            return
        part = prompts[i][:length]
        sharing = [p for p in prompts if common_prefix(p, part) == length]
        if self.costs is None:
            self.costs = calibrate.step_costs(self.model)
        if not sharing_pays(self.costs, len(sharing), length, max(int(p.numel()) for p in sharing)):
            return
        fresh = SharedCache(self.geo.num_layers, self.windows)
        yield from prefill_steps(self.model, fresh, [part], chunk=self.prefill_chunk)
        self.prefixes.add(part, fresh, 0)
        yield

    def _reuses(self, row: Row) -> bool:
        """Whether ``row``'s prompt may reuse and leave prompt entries (see :mod:`accel.serving.prefix`);
        not a row that reports its prompt's log-probabilities (its whole prompt must run)."""
        return (self._prefix_model and row.plan.compressor is None and row.plan.quantizer is None
                and row.plan.tier is None and row.prompt_logprobs is None)

    def budgets(self, extra: Sequence[int] | None = None) -> tuple[list[int], bool]:
        """(Draft nodes each live row may propose this step (see :func:`draft_budgets`),
        whether the drafting rows carry their look-ahead positions). ``extra``: per row, the
        look-ahead positions its tree carries if it drafts. Where no row may draft with them
        but some may without (prompt lookup beside PaSS, say), the step drafts without them."""
        self.guard = None
        rows = len(self.rows)
        if not any(r.plan.drafters for r in self.rows):
            return [0] * rows, False
        if self.costs is None:
            self.costs = calibrate.step_costs(self.model)
        self.guard = draft_guard(self.model, self.rows) if self.costs.measured else None
        if self.guard is not None and not self.guard.allow():
            return [0] * rows, False
        cap = self.max_draft if self.max_draft is not None else MAX_DRAFT_PER_ROW
        length = self.cache.committed_length(0)
        budgets = draft_budgets(self.costs, length, self.rows, cap, self.min_nodes, extra)
        if extra is None or not any(extra) or any(budgets):
            return budgets, True
        return draft_budgets(self.costs, length, self.rows, cap, self.min_nodes), False

    def step(self) -> list[list[int]]:
        """One verify forward for every live row; returns each row's newly emitted tokens."""
        rows = self.rows
        t0 = time.perf_counter()
        lengths = list(self.cache.logical_lengths)
        asked = [_lookahead(row) if row.error is None else None for row in rows]
        extra = [len(lk[1]) * lk[1].anchors if lk is not None else 0 for lk in asked]
        planned, carry = self.budgets(extra)
        budgets = [row.upkeep.draft_room(n, k) if row.upkeep is not None else k
                   for row, n, k in zip(rows, lengths, planned)]  # no step verifies past a cache change
        looks = [lk if carry and budget >= 1 and row.error is None else None
                 for row, lk, budget in zip(rows, asked, budgets)]
        ctxs = [DraftContext(tokens=row.tokens, hidden=row.hidden, max_tokens=budget, warp=row.warp,
                             generator=row.generator, features=row.features) for row, budget in zip(rows, budgets)]
        for row, budget in zip(rows, budgets):
            if budget > 0 and row.plan.drafters:  # handed over: the next context carries what follows
                row.features = None
        drafted, draft_s, errors = draft_rows([r.plan for r in rows], [r.states for r in rows], ctxs)
        trees, sources = [t for t, _ in drafted], [s for _, s in drafted]
        for row, err in zip(rows, errors):
            if err is not None:  # one request's drafter failed: that request ends, the batch goes on
                row.error = err
        captured: dict[int, torch.Tensor] | None = None  # this step's queries, when an eviction will score with them
        if any(r.upkeep is not None and r.upkeep.wants_queries(n, k) for r, n, k in zip(rows, lengths, budgets)):
            captured = {}
        tap = adapter.capture_step_queries(self.model, self.cache, captured) if captured is not None \
            else contextlib.nullcontext()
        states: dict[int, torch.Tensor] = {}
        fetch = self.cache.planning(self.model) if isinstance(self.cache, TieredCache) else contextlib.nullcontext()
        with fetch, tap, adapter.capture_layer_states(self.model, self.cache, self._feature_layers(rows), states):
            anchors = [chain_anchors(tree, lk[1].anchors) if lk is not None else None for tree, lk in zip(trees, looks)]
            hidden, logits = verify_logits(self.model, self.cache, trees, self.geo.dtype, self.groups,
                                           self.min_nodes, [(a, lk[1].vectors) if lk is not None else None
                                                            for a, lk in zip(anchors, looks)])
        counts = [tree.num_nodes for tree in trees]
        greedy = [row.warp is None for row in rows]
        top = logits.argmax(dim=-1).tolist() if any(greedy) else None
        accs, out, starts, start = [], [], [], 0
        for b, (row, tree) in enumerate(zip(rows, trees)):
            end = start + counts[b]
            acc = accept(tree, logits[start:end], row.warp, row.plan.rule, row.generator,
                         top=top[start:end] if greedy[b] else None)
            accs.append(acc)
            starts.append(start)
            start = end
        commit(self.cache, accs)
        if any(lk is not None for lk in looks):
            self._read_lookahead(rows, trees, looks, anchors, accs, hidden)
        if states:
            _hand_features(rows, states, [(b, torch.tensor(acc.path)) for b, acc in enumerate(accs)])
        elapsed = time.perf_counter() - t0
        self._judge(trees, accs, elapsed)
        for b, (row, tree, acc) in enumerate(zip(rows, trees, accs)):
            if row.error is not None:
                row.finish_reason = "error"
                out.append([])
                continue
            emitted = acc.emitted(tree)
            new = row.emit(emitted)
            out.append(new)
            if row.logprobs is not None and new:  # emitted token j was decided by the logits of path node j
                row.generated_logprobs += token_logprobs(logits[[starts[b] + j for j in acc.path[: len(new)]]], new,
                                                         row.logprobs)
            row.tokens = torch.cat([row.tokens, row.tokens.new_tensor(emitted)])
            s = row.stats
            s.decode_s += elapsed
            s.decode_tokens += len(new)
            s.verify_steps += 1
            s.drafted_tokens += tree.num_drafts
            s.accepted_tokens += acc.accepted
            s.accepted_per_step.append(acc.accepted)
            if row.plan.drafters:
                drafter_feedback(row.plan, row.states, sources[b], acc)
                row.observe(tree, acc, draft_s[b])
            if row.hidden is not None:
                row.hidden = hidden[b, acc.path[-1]]
        t1 = time.perf_counter()
        for b, (row, acc) in enumerate(zip(rows, accs)):  # each row's cache changes where its length calls for
            up = row.upkeep
            if up is None or row.error is not None:
                continue
            if captured:
                up.record(captured, b, acc.path, lengths[b])
            event = up.next_event
            if event is not None and self.cache.logical_lengths[b] >= event:
                up.run(self.cache, b, row.tokens)
        if any(row.upkeep is not None for row in rows):  # the step's time includes its evictions
            upkeep_s = time.perf_counter() - t1
            for row in rows:
                row.stats.decode_s += upkeep_s
        return out

    def _read_lookahead(self, rows: Sequence[Row], trees: list[DraftTree], looks: list, anchors: list,
                        accs: list[Acceptance], hidden: torch.Tensor) -> None:
        """Hand each look-ahead drafter the output logits [L, V] at the copy after the anchor
        its row's accepted path ended at (None where it ended elsewhere), every row's in one
        pass of the output layer."""
        wanted: list[tuple[int, slice]] = []
        for b, (tree, lk, acc) in enumerate(zip(trees, looks, accs)):
            if lk is not None and acc.path[-1] in anchors[b]:
                wanted.append((b, lookahead_columns(tree, anchors[b].index(acc.path[-1]), len(lk[1]))))
        logits = adapter.output_logits(self.model, torch.cat([hidden[b, cols] for b, cols in wanted])) \
            if wanted else None
        got: dict[int, torch.Tensor] = {}
        start = 0
        for b, cols in wanted:
            size = cols.stop - cols.start
            got[b] = logits[start : start + size]
            start += size
        for b, (row, lk) in enumerate(zip(rows, looks)):
            if lk is None:
                continue
            try:
                row.plan.drafters[lk[0]].read_lookahead(row.states[lk[0]], got.get(b))
            except Exception as err:  # noqa: BLE001 - the drafter's failure is its row's
                row.error = row.error or err

    def _judge(self, trees: list[DraftTree], accs: list[Acceptance], elapsed: float) -> None:
        """Report the step to the guard: tokens per row against the table's plain step."""
        if self.guard is None:
            return
        rows = len(self.rows)
        emitted = sum(acc.accepted + 1 for acc in accs)
        plain_ms = self.costs.pass_ms(rows, 1, self.cache.committed_length(0))
        self.guard.observe(any(t.num_drafts for t in trees), emitted / rows * plain_ms / max(elapsed * 1e3, 1e-6))

    def retire(self, row: Row) -> None:
        """Remove one row (finished or cancelled) from the batch and its cache."""
        i = next(i for i, r in enumerate(self.rows) if r is row)
        s = row.stats
        s.new_tokens = len(row.generated)
        s.kv_bytes_kept = self.cache.kept_bytes(i)
        s.kv_bytes_stored = self.cache.storage_bytes()
        s.kv_bytes_full = self.geo.entry_bytes() * self.cache.logical_lengths[i]
        if isinstance(self.cache, TieredCache):
            s.kv_bytes_fetched, s.kv_bytes_fetch_full = self.cache.fetched_bytes, self.cache.full_bytes
            s.kv_bytes_resident = self.cache.resident_bytes()
        remember(self.model, row)
        self.cache.remove(i)
        for drafter, state in zip(row.plan.drafters, row.states):
            drafter.release(state)
        last = self.rows.pop()
        if last is not row:
            self.rows[i] = last

    def retire_done(self) -> list[Row]:
        """Remove and return every finished row."""
        done = [r for r in self.rows if r.done]
        for row in done:
            self.retire(row)
        return done


def _lookahead(row: Row) -> tuple[int, Lookahead] | None:
    """The look-ahead of ``row``'s first drafter that asks for one, as (drafter index,
    :class:`Lookahead`), or None when no drafter asks. The step carries it only where the
    row may draft (a budget of at least one draft). Its positions ride on top of the row's
    draft budget: without them the drafter has nothing to propose, so the slow start of
    :func:`draft_budgets` would never begin; the allocation charges them
    (``allocate_drafts(extra_nodes=)``) and the :class:`~accel.calibration.cost_model.DraftGuard`
    weighs what the steps cost against plain steps. Every asking drafter is asked each step
    (even where its row does not draft), so it knows that what it read last is stale; a
    drafter that fails here fails its row."""
    found = None
    for i, (drafter, state) in enumerate(zip(row.plan.drafters, row.states)):
        if type(drafter).lookahead is Drafter.lookahead:
            continue
        try:
            look = drafter.lookahead(state)
        except Exception as err:  # noqa: BLE001 - the drafter's failure is its row's
            row.error = row.error or err
            return None
        if found is None and look is not None and len(look) > 0 and look.anchors >= 1:
            found = (i, look)
    return found


def _prompt_logprobs(model, hidden: torch.Tensor, prompt: torch.Tensor, k: int) -> list[TokenLogprob | None]:
    """Each prompt token's log-probability given the tokens before it (None for the first).

    hidden: [n, H] the final normed hidden states of the prompt's positions; prompt: [n].
    The output head runs a few hundred positions at a time ([chunk, V], never [n, V]).
    """
    out: list[TokenLogprob | None] = [None]
    n, step = int(prompt.numel()), 256
    for start in range(0, n - 1, step):
        end = min(start + step, n - 1)
        out.extend(token_logprobs(adapter.output_logits(model, hidden[start:end]), prompt[start + 1 : end + 1], k))
    return out


def _hand_features(rows: Sequence[Row], states: dict[int, torch.Tensor], where: list[tuple[int, torch.Tensor]]) -> None:
    """Append to each row's pending ``features`` the captured hidden states ``states[k]``
    ([B, T, H] of one forward) of the layers its drafters read, at ``where[i] = (b, nodes)``:
    row i's batch row in the forward and its committed nodes (a prompt's positions, an
    accepted path), in order."""
    if not states:
        return
    for row, (b, nodes) in zip(rows, where):
        layers = [k for k in row.feature_layers if k in states]
        if not layers:
            continue
        new = {k: states[k][b, nodes.to(states[k].device)] for k in layers}
        old = row.features
        row.features = new if old is None else {k: torch.cat([old[k], new[k]]) for k in layers}


# --------------------------------------------------------------------------- the loop


def batch_steps(model, rows: list[Row], max_draft: int | None = DEFAULT_MAX_DRAFT,
                prefill_chunk: int | None = None,
                prefill_ranks: PrefillRanks | None = None) -> Iterator[list[tuple[Row, list[int]]]]:
    """Decode ``rows`` together until every one is done, yielding after the prefill and after
    every step the (row, newly emitted tokens) pairs of the rows that took part (the first
    yield has every row: one with ``max_new_tokens=0`` is done there, with no tokens)."""
    tiers = {id(r.plan.tier): r.plan.tier for r in rows}
    if len(tiers) > 1:
        raise ValueError("strategies: the rows of one call share one cache, so one KV tier (or none) for all")
    batch = Batch(model, max_draft=max_draft, prefill_chunk=prefill_chunk, prefill_ranks=prefill_ranks,
                  tier=next(iter(tiers.values()), None))
    live = [r for r in rows if r.max_new_tokens > 0]
    for r in rows:
        if r.max_new_tokens <= 0:
            r.finish_reason = "length"
            r.stats.prompt_tokens = int(r.prompt.numel())
    with adapter.packed_gqa_attention(model), adapter.per_layer_masks(model, batch.cache):
        with torch.inference_mode():
            batch.admit(live)
            pairs = [(r, list(r.generated)) for r in rows]
            batch.retire_done()
        yield pairs
        while batch.rows:
            with torch.inference_mode():
                new = batch.step()
                failed = next((r.error for r in batch.rows if r.error is not None), None)
                if failed is not None:  # one call, one caller: a drafter's error is the call's
                    raise failed
                pairs = list(zip(batch.rows, new))
                batch.retire_done()
            yield pairs


def run_batch(model, rows: list[Row], max_draft: int | None = DEFAULT_MAX_DRAFT,
              prefill_chunk: int | None = None, prefill_ranks: PrefillRanks | None = None) -> Stats:
    """Decode ``rows`` together until every one is done. Returns the call's aggregate Stats
    (wall-clock prefill and decode seconds, counts summed over rows)."""
    total = Stats()
    t0 = time.perf_counter()
    steps = batch_steps(model, rows, max_draft, prefill_chunk, prefill_ranks)
    next(steps)
    total.prefill_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    for _ in steps:
        pass
    total.decode_s = time.perf_counter() - t1
    for r in rows:
        total.merge(r.stats, seconds=False)  # the call's seconds are wall-clock, not summed
    return total


def decode(model, prompt: torch.Tensor, plan: Plan, *, max_new_tokens: int, eos: list[int], warp: Warp | None,
           generator: torch.Generator | None, max_draft: int | None = DEFAULT_MAX_DRAFT) -> tuple[torch.Tensor, Stats]:
    """Generate up to ``max_new_tokens`` after one ``prompt`` [1, n]. Returns (new tokens [m], stats)."""
    row = Row(prompt=prompt.reshape(-1), plan=plan, max_new_tokens=max_new_tokens, eos=frozenset(eos), warp=warp,
              generator=generator)
    stats = run_batch(model, [row], max_draft=max_draft)
    return prompt.new_tensor(row.generated), stats
