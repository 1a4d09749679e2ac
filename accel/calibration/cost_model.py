"""What a verify step costs and how many draft tokens each row should verify: pure functions.

A :class:`CostTable` holds the time of one verify forward pass (decoder stack plus output
head) measured on this machine at a small grid of query tokens x cache lengths, with four
linear kernels: plain (row-major weights, as transformers stores them), transposed
(column-major weights, :func:`accel.kernels.cpu.transpose_weights`), oneDNN-packed, and split (one
``bmm`` over each weight's two halves, :func:`accel.kernels.cpu.split_linear`).
:mod:`accel.calibration.calibrate` measures and caches it; nothing here times anything, so tests drive the
choices with hand-made tables.

- :attr:`CostTable.transposed` says whether to store the weights column-major (it costs no
  memory; :func:`weight_layout` decides from the geometric mean over the grid, each layout
  with packed kernels where they beat it).
- :attr:`CostTable.packed_rows` is the window of query tokens per pass (rows of every linear
  layer) where packed kernels beat that layout on this machine, or None; ``accel.load_model``
  packs the model to run packed inside it (:func:`accel.kernels.cpu.prepack`), unpacked outside.
- :attr:`CostTable.split_rows` is how many of the fewest query tokens per pass run split
  kernels, ahead of the packed window (0: none).
- :meth:`CostTable.step_ms` interpolates the grid of the kernels so chosen piecewise-linearly
  (and extrapolates linearly beyond it).
- :func:`allocate_drafts` splits a step's draft tokens over the rows of a batch so that the
  expected tokens per millisecond are highest.
- :func:`acceptance_gains` is the expected gain of each draft token of a chain.
- :class:`DraftGuard` watches what drafting steps really deliver against plain steps of the
  same batch and stops drafting for a while when it does not pay: the allocation is a
  prediction, the guard checks it.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import math
from dataclasses import dataclass, field, replace
from typing import Any

__all__ = ["CostTable", "DraftCost", "DraftGuard", "acceptance_gains", "allocate_drafts", "chosen_kernels", "in_window",
           "packed_rows", "split_rows", "static_table", "weight_layout"]

KERNELS = ("plain", "transposed", "packed", "split")
#: Column-major weights are chosen only when their passes are this much faster on the
#: geometric mean of the grid: a layout is one choice for every pass, and a tie is noise.
LAYOUT_MARGIN = 0.03


@dataclass(frozen=True)
class CostTable:
    """Measured costs of verify passes on one (model, device, dtype, threads, machine).

    tokens: query tokens of one pass, ascending (e.g. 1, 2, 4, ..., 64).
    cache_lens: cached entries each query attends over, ascending (e.g. 256, 2048).
    ms: [len(cache_lens)][len(tokens)] milliseconds of one pass, each run with the
        kernels :attr:`transposed` and :attr:`packed_rows` choose for its token count (made
        non-decreasing).
    kernel_tokens: query tokens of the kernel comparison passes (the measurement uses
        ``tokens``).
    kernel_ms: kernel name (``"plain"``, ``"transposed"``, ``"packed"``) ->
        [len(cache_lens)][len(kernel_tokens)] ms (each point's fastest pass, see
        :func:`accel.calibration.timing.measure`); only kernels this model can run
        appear (nothing but ``"plain"`` off a float32 CPU model).
    measured: False for :func:`static_table` (nominal units, shape only, not milliseconds).
    key: what the table was measured for (model identity, device, dtype, threads, machine).
    batch_rows, batch_tokens, batch_ms, batch_cache: passes of several rows, each with its own
        ``batch_cache`` cached entries and ``batch_tokens`` query tokens:
        ``batch_ms[len(batch_rows)][len(batch_tokens)]`` ms, with the kernels ``ms`` chose.
        A batch's verify pass costs more than one row's pass of as many tokens (every row
        attends over a cache of its own, and ordered attention gathers each row's keys), so
        :meth:`pass_ms` scales the grid by what these passes measured (empty: no scaling).
    """

    tokens: tuple[int, ...]
    cache_lens: tuple[int, ...]
    ms: tuple[tuple[float, ...], ...]
    kernel_tokens: tuple[int, ...] = ()
    kernel_ms: dict[str, tuple[tuple[float, ...], ...]] = field(default_factory=dict)
    measured: bool = True
    key: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0  # time the measurement took
    load: float | None = None  # 1-minute load average when measured; above the core count, timings were disturbed
    batch_rows: tuple[int, ...] = ()
    batch_tokens: tuple[int, ...] = ()
    batch_ms: tuple[tuple[float, ...], ...] = ()
    batch_cache: int = 0

    def __post_init__(self) -> None:
        _check_axis("tokens", self.tokens)
        _check_axis("cache_lens", self.cache_lens)
        _check_grid("ms", self.ms, len(self.cache_lens), len(self.tokens))
        if self.kernel_ms:
            _check_axis("kernel_tokens", self.kernel_tokens)
        for name, grid in self.kernel_ms.items():
            if name not in KERNELS:
                raise ValueError(f"kernel_ms: unknown kernels {name!r}")
            _check_grid(f"kernel_ms[{name}]", grid, len(self.cache_lens), len(self.kernel_tokens))
        if self.batch_rows or self.batch_ms:
            _check_axis("batch_rows", self.batch_rows)
            _check_axis("batch_tokens", self.batch_tokens)
            _check_grid("batch_ms", self.batch_ms, len(self.batch_rows), len(self.batch_tokens))
            if self.batch_rows[0] < 2 or self.batch_tokens[0] < 1 or self.batch_cache < 1:
                raise ValueError(f"batch passes need rows >= 2, tokens >= 1 and a cache length >= 1, got rows "
                                 f"{self.batch_rows}, tokens {self.batch_tokens}, cache {self.batch_cache}")

    # ------------------------------------------------------------------ the model

    def step_ms(self, total_tokens: int, cache_len: int) -> float:
        """Milliseconds of one verify pass of ``total_tokens`` query tokens over ``cache_len``
        cached entries: piecewise-linear in both, extrapolated linearly past the grid."""
        return _positive(_interp(self.tokens, self._at_cache(cache_len), total_tokens))

    def curve(self, cache_len: int, max_tokens: int) -> list[float]:
        """``[step_ms(n, cache_len) for n in range(max_tokens + 1)]``, computed at once."""
        row = self._at_cache(cache_len)
        return [_positive(_interp(self.tokens, row, n)) for n in range(max_tokens + 1)]

    def pass_ms(self, rows: int, tokens_per_row: int, cache_len: int) -> float:
        """Milliseconds of one verify pass of ``rows`` rows of ``tokens_per_row`` query tokens
        each, every row over ``cache_len`` cached entries of its own: :meth:`step_ms` of all
        the tokens, times :meth:`batch_factor`."""
        return self.step_ms(rows * tokens_per_row, cache_len) * self.batch_factor(rows, tokens_per_row)

    def batch_curve(self, cache_len: int, rows: int, max_width: int) -> list[float]:
        """``[pass_ms(rows, w, cache_len) for w in range(max_width + 1)]``, computed at once
        (index 0 holds a pass of no tokens, extrapolated; callers start at 1)."""
        row = self._at_cache(cache_len)
        return [_positive(_interp(self.tokens, row, rows * w)) * self.batch_factor(rows, w) for w in range(max_width + 1)]

    def batch_factor(self, rows: int, tokens_per_row: int) -> float:
        """What a pass of ``rows`` rows x ``tokens_per_row`` tokens measured against the grid's
        one-row pass of as many tokens (:attr:`batch_ms`, at :attr:`batch_cache` entries):
        interpolated over the measured tokens per row (held constant past them) and over rows
        from 1.0 at one row (held constant past the most rows measured); 1.0 without batch
        measurements."""
        if rows <= 1 or not self.batch_rows or tokens_per_row < 1:
            return 1.0
        at_rows = [_interp_held(self.batch_tokens, factors, tokens_per_row) for factors in self._batch_factors]
        return _interp_held((1, *self.batch_rows), [1.0, *at_rows], rows)

    @functools.cached_property
    def _batch_factors(self) -> list[list[float]]:
        """[len(batch_rows)][len(batch_tokens)]: each batch pass over the grid's one-row pass of
        as many tokens (computed once: allocation reads it every drafting step)."""
        return [[ms / _positive(self.step_ms(r * t, self.batch_cache)) for t, ms in zip(self.batch_tokens, grid)]
                for r, grid in zip(self.batch_rows, self.batch_ms)]

    def _at_cache(self, cache_len: int) -> list[float]:
        """The grid's column for each token count, interpolated to ``cache_len``: [len(tokens)]."""
        return [_interp(self.cache_lens, [r[t] for r in self.ms], cache_len) for t in range(len(self.tokens))]

    @property
    def transposed(self) -> bool:
        """Whether to store the linear weights column-major (:func:`accel.kernels.cpu.transpose_weights`):
        see :func:`weight_layout`."""
        return weight_layout(self.kernel_ms) == "transposed"

    @property
    def packed_rows(self) -> tuple[int, int | None] | None:
        """The query tokens per pass, ``(fewest, most)`` (most None: no limit), for which
        packed linear kernels beat the chosen weight layout here (see :func:`packed_rows`), or
        None where they never do."""
        return packed_rows(self.kernel_tokens, self.kernel_ms)

    @property
    def split_rows(self) -> int:
        """Up to how many query tokens per pass the split kernel (:func:`accel.kernels.cpu.split_linear`)
        beats every other choice here (see :func:`split_rows`); 0: never."""
        return split_rows(self.kernel_tokens, self.kernel_ms)

    @property
    def prefer_prepack(self) -> bool:
        """Whether to pack the model's linear layers (:func:`accel.kernels.cpu.prepack`) at all: packed
        kernels won for the passes of :attr:`packed_rows`."""
        return self.packed_rows is not None

    @property
    def kernels(self) -> str:
        """Which kernels the grid's passes ran with: ``"plain"``, ``"transposed"``,
        ``"packed"``, or e.g. ``"packed for 4-32 tokens, plain otherwise"`` or ``"split for 1
        token, packed otherwise"``."""
        base = weight_layout(self.kernel_ms)
        window, split = self.packed_rows, self.split_rows
        parts = [f"split for {'1 token' if split == 1 else f'1-{split} tokens'}"] if split else []
        if window is not None:
            lo, hi = max(window[0], split + 1), window[1]
            if hi is None and lo <= max(split + 1, self.tokens[0]):  # packed for every other pass
                return ", ".join(parts + ["packed otherwise"]) if parts else "packed"
            if hi is None or hi >= lo:
                parts.append(f"packed for {lo}-{hi if hi is not None else 'any'} tokens")
        return ", ".join(parts + [f"{base} otherwise"]) if parts else base

    def run_with(self, transposed: bool, window: tuple[int, int | None] | None, split: int = 0) -> "CostTable":
        """This table for a model whose linear weights are column-major (``transposed``) or
        not, packed for the passes of ``window`` (None: never) and split for passes of at most
        ``split`` tokens: ``ms`` rebuilt from :attr:`kernel_ms` with the kernels that model
        runs. A model loaded by plain transformers rather than :func:`accel.load_model` runs
        plain kernels whatever this machine measured fastest, and its drafts must be sized by
        what its passes cost. The table itself where it already describes those kernels, or
        lacks the measurements."""
        layout = "transposed" if transposed else "plain"
        if (layout, window, split) == (weight_layout(self.kernel_ms), self.packed_rows, self.split_rows):
            return self
        chosen = chosen_kernels(self.tokens, layout, window, split)
        if self.kernel_tokens != self.tokens or not set(chosen) <= set(self.kernel_ms):
            return self
        ms = [[self.kernel_ms[chosen[t]][c][t] for t in range(len(self.tokens))] for c in range(len(self.cache_lens))]
        return replace(self, ms=monotone(ms))

    # ------------------------------------------------------------------ JSON

    def to_dict(self) -> dict[str, Any]:
        return {
            "tokens": list(self.tokens),
            "cache_lens": list(self.cache_lens),
            "ms": [list(r) for r in self.ms],
            "kernel_tokens": list(self.kernel_tokens),
            "kernel_ms": {k: [list(r) for r in g] for k, g in self.kernel_ms.items()},
            "measured": self.measured,
            "key": self.key,
            "seconds": self.seconds,
            "load": self.load,
            "batch_rows": list(self.batch_rows),
            "batch_tokens": list(self.batch_tokens),
            "batch_ms": [list(r) for r in self.batch_ms],
            "batch_cache": self.batch_cache,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "CostTable":
        """Inverse of :meth:`to_dict`; raises ValueError (or KeyError / TypeError) on a
        malformed mapping."""
        return cls(
            tokens=tuple(int(x) for x in d["tokens"]),
            cache_lens=tuple(int(x) for x in d["cache_lens"]),
            ms=tuple(tuple(float(x) for x in r) for r in d["ms"]),
            kernel_tokens=tuple(int(x) for x in d.get("kernel_tokens", ())),
            kernel_ms={str(k): tuple(tuple(float(x) for x in r) for r in g) for k, g in d.get("kernel_ms", {}).items()},
            measured=bool(d["measured"]),
            key=dict(d.get("key", {})),
            seconds=float(d.get("seconds", 0.0)),
            load=None if d.get("load") is None else float(d["load"]),
            batch_rows=tuple(int(x) for x in d.get("batch_rows", ())),
            batch_tokens=tuple(int(x) for x in d.get("batch_tokens", ())),
            batch_ms=tuple(tuple(float(x) for x in r) for r in d.get("batch_ms", ())),
            batch_cache=int(d.get("batch_cache", 0)),
        )


def weight_layout(kernel_ms: dict[str, tuple[tuple[float, ...], ...]]) -> str:
    """``"transposed"`` (store the linear weights column-major) when the passes a model so
    loaded runs are at least :data:`LAYOUT_MARGIN` faster than with row-major weights on the
    geometric mean of every measured point, else ``"plain"`` (also when either is missing).
    Each layout is judged with the packed kernels where they beat it (:func:`packed_rows`'s
    window for that layout), and row-major weights also with the split kernel for the fewest
    tokens where it beats those (:func:`split_rows`): the layout and the windows are one choice.

    The geometric mean weighs a pass of one token as much as one of 64: a layout is chosen
    once for every pass, and which passes a model will run (one row decoding, batches,
    drafts) is not known when it is loaded. On the Intel Xeon without AMX the transposed
    passes were 23-46% faster for 4-32 tokens, 5% slower for one and 20% slower for two
    (``accel calibrate``, 256 cached entries). On an AMD EPYC (Zen 3) packed kernels won for
    2-64 tokens against either layout, and for one token transposed weights beat both
    (49 ms against 59 packed and 59 plain at 256 cached entries): judged alone, transposed
    weights lost there (slower for 4-64 tokens), but beside the packed window they win."""
    plain, transposed = kernel_ms.get("plain"), kernel_ms.get("transposed")
    if not plain or not transposed:
        return "plain"
    cost = {"plain": _with_split(_with_packed(plain, kernel_ms.get("packed")), kernel_ms.get("split")),
            "transposed": _with_packed(transposed, kernel_ms.get("packed"))}
    logs = [math.log(t / p) for prow, trow in zip(cost["plain"], cost["transposed"]) for p, t in zip(prow, trow)]
    return "transposed" if logs and sum(logs) / len(logs) < math.log(1.0 - LAYOUT_MARGIN) else "plain"


def _window(packed: tuple[tuple[float, ...], ...] | None, base: tuple[tuple[float, ...], ...]
            ) -> tuple[int, int] | None:
    """Indices (first, last) of the longest run of consecutive token counts where ``packed``
    is below ``base`` at every cache length (the larger counts on a tie), or None."""
    if not packed:
        return None
    wins = [all(prow[t] < qrow[t] for prow, qrow in zip(packed, base)) for t in range(len(base[0]))]
    runs = []  # (first, last) index of each run of consecutive wins
    for won, group in itertools.groupby(range(len(wins)), key=wins.__getitem__):
        if won:
            idx = list(group)
            runs.append((idx[0], idx[-1]))
    return max(runs, key=lambda r: (r[1] - r[0], r[0])) if runs else None  # the longest; on a tie the larger counts


def _with_packed(base: tuple[tuple[float, ...], ...], packed: tuple[tuple[float, ...], ...] | None
                 ) -> tuple[tuple[float, ...], ...]:
    """``base``'s passes with packed ones inside its window (:func:`_window`)."""
    window = _window(packed, base)
    if window is None:
        return base
    return tuple(tuple(p if window[0] <= t <= window[1] else q for t, (p, q) in enumerate(zip(prow, qrow)))
                 for prow, qrow in zip(packed, base))


def _split_prefix(split: tuple[tuple[float, ...], ...] | None, base: tuple[tuple[float, ...], ...]) -> int:
    """How many of the first token counts ``split`` is below ``base`` at, every cache length
    each (counting stops at the first where it is not)."""
    if not split:
        return 0
    n = 0
    while n < len(base[0]) and all(srow[n] < brow[n] for srow, brow in zip(split, base)):
        n += 1
    return n


def _with_split(base: tuple[tuple[float, ...], ...], split: tuple[tuple[float, ...], ...] | None
                ) -> tuple[tuple[float, ...], ...]:
    """``base``'s passes with split ones for the token counts of :func:`_split_prefix`."""
    n = _split_prefix(split, base)
    if not n:
        return base
    return tuple(tuple(s if t < n else b for t, (s, b) in enumerate(zip(srow, brow))) for srow, brow in zip(split, base))


def split_rows(kernel_tokens: tuple[int, ...], kernel_ms: dict[str, tuple[tuple[float, ...], ...]]) -> int:
    """The most query tokens per pass up to which ``kernel_ms["split"]`` (one ``bmm`` over
    the two halves of each weight, :func:`accel.kernels.cpu.split_linear`) is below row-major weights
    with packed kernels in their window (:func:`packed_rows`) at every cache length, counted
    from the fewest tokens and stopping at the first count where it is not; 0 where it loses
    at the fewest, is missing, or the weights are stored column-major (:func:`weight_layout`;
    the split kernel was measured on row-major ones).

    A prefix, not a window: splitting pays where one product of few rows leaves a core idle
    (on an AMD EPYC Zen 3, ``F.linear`` of one row), and stops paying once the rows fill both."""
    split, plain = kernel_ms.get("split"), kernel_ms.get("plain")
    if not split or not plain or weight_layout(kernel_ms) != "plain":
        return 0
    n = _split_prefix(split, _with_packed(plain, kernel_ms.get("packed")))
    return kernel_tokens[n - 1] if n else 0


def chosen_kernels(tokens: tuple[int, ...], layout: str, window: tuple[int, int | None] | None, split: int
                   ) -> list[str]:
    """The kernel a pass of each of ``tokens`` query tokens runs with: ``"split"`` up to
    ``split`` tokens, else ``"packed"`` inside ``window`` (:func:`in_window`), else ``layout``
    (what :class:`accel.kernels.cpu.PackedLinear` does, row by row)."""
    return ["split" if n <= split else "packed" if in_window(n, window) else layout for n in tokens]


def packed_rows(kernel_tokens: tuple[int, ...], kernel_ms: dict[str, tuple[tuple[float, ...], ...]]
                ) -> tuple[int, int | None] | None:
    """The window of ``kernel_tokens`` where ``kernel_ms["packed"]`` is below the chosen
    layout's (:func:`weight_layout`: ``kernel_ms["plain"]`` or ``["transposed"]``) at every
    cache length: ``(fewest, most)``, ``most`` None when the window reaches the largest
    measured count (it then goes on past the grid). The longest run of consecutive winning
    counts (the larger one on a tie); None when packed never wins or a kernel is missing.

    One window, not a pattern: oneDNN's packed layout pays once a call multiplies enough
    rows to amortise it, until the plain GEMM's own blocking takes over for many rows; a
    lone count where packed wins amid ones where it loses is noise."""
    base = kernel_ms.get(weight_layout(kernel_ms))
    best = _window(kernel_ms.get("packed"), base) if base else None
    if best is None:
        return None
    last = None if best[1] == len(kernel_tokens) - 1 else kernel_tokens[best[1]]
    return kernel_tokens[best[0]], last


def monotone(ms: list[list[float]]) -> tuple[tuple[float, ...], ...]:
    """Each point at least the one before it in tokens and in cache length: a pass with more
    query tokens or more cached entries does a superset of the work, so a dip is noise (and
    would read as a reason to draft more)."""
    out = [list(row) for row in ms]
    for c, row in enumerate(out):
        for t in range(len(row)):
            row[t] = max([row[t]] + ([row[t - 1]] if t else []) + ([out[c - 1][t]] if c else []))
    return tuple(tuple(row) for row in out)


def in_window(n: int, window: tuple[int, int | None] | None) -> bool:
    """Whether a pass of ``n`` query tokens runs packed kernels under ``window``
    (:func:`packed_rows`)."""
    return window is not None and n >= window[0] and (window[1] is None or n <= window[1])


def static_table() -> CostTable:
    """The table used when calibration is off (``ACCEL_CALIBRATION=off``): ``measured=False``,
    plain kernels (no prepacking), and a nominal cost curve in units of one decode step --
    nearly flat for a few query tokens, then linear, steeper over a longer cache. It is a
    shape, not a measurement of any machine: it keeps drafts moderate."""
    return CostTable(
        tokens=(1, 2, 4, 8, 16, 32, 64),
        cache_lens=(256, 2048),
        ms=((1.0, 1.05, 1.1, 1.25, 1.5, 2.0, 3.0),
            (1.0, 1.1, 1.2, 1.45, 1.9, 2.8, 4.6)),
        measured=False,
    )


# ---------------------------------------------------------------------------- allocation


def acceptance_gains(rate: float, n: int) -> list[float]:
    """Expected extra accepted tokens from each of the ``n`` draft tokens of a chain whose
    tokens are each accepted with probability ``rate`` (given their parent was):
    ``[rate, rate**2, ..., rate**n]``."""
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"rate must be in [0, 1], got {rate}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    return [rate ** (i + 1) for i in range(n)]


def allocate_drafts(
    table: CostTable,
    cache_len: int,
    gains: list[list[float]],
    max_per_row: int,
    drafter_ms: list[float] | None = None,
    min_nodes: int = 1,
    drafter_ms_per_token: list[float] | None = None,
    extra_nodes: list[int] | None = None,
) -> list[int]:
    """How many draft tokens each row of a batch should verify in this step.

    gains[b][i]: expected extra accepted tokens row b gets from its (i+1)-th draft token
        (non-increasing in i, e.g. :func:`acceptance_gains`); a row offers at most
        ``len(gains[b])`` tokens and gets at most ``max_per_row``.
    drafter_ms[b] (optional): milliseconds row b's drafter costs in a step where it drafts
        at all (k_b > 0); rows that get no drafts do not pay it.
    drafter_ms_per_token[b] (optional): what each of row b's k_b draft tokens adds to that
        (a draft model runs one forward per token; see :class:`DraftCost`).
    extra_nodes[b] (optional): query positions row b's tree carries on top of its k_b drafts
    whenever it drafts at all (a look-ahead drafter's positions, PaSS): they widen the padded
    pass like drafts do, and bring no accepted token of this step.

    The batched verify pass pads every row's tree to the step's largest, so a step that
    lets some row verify m drafts costs ``pass_ms(B, m + 1, cache_len)`` whatever the
    others verify: below the deepest row, draft tokens are free. The rule therefore picks
    one depth m (0 .. the largest cap) and gives every row ``min(m, its cap)`` drafts,
    except rows whose expected gain does not pay for their drafter's own cost (and, where
    some rows carry look-ahead positions, it also tries each depth without them); it returns
    the allocation with the most expected tokens per millisecond,
    ``(B + sum of the chosen gains) / (step_ms(B * (m + 1)) + drafter ms of drafting rows)``.
    Rows may get 0, and m = 0 (plain decoding) wins whenever drafting does not pay.
    ``min_nodes``: every row's tree is padded to a multiple of this many query tokens anyway
    (the padding of :mod:`accel.kernels.invariance`), so drafts that fill the padding cost nothing. The
    costs come from ``table``, measured on this machine by :mod:`accel.calibration.calibrate`, not
    from constants.
    """
    rows = len(gains)
    if max_per_row < 0:
        raise ValueError(f"max_per_row must be >= 0, got {max_per_row}")
    if drafter_ms is not None and len(drafter_ms) != rows:
        raise ValueError(f"drafter_ms has {len(drafter_ms)} entries for {rows} rows")
    if drafter_ms_per_token is not None and len(drafter_ms_per_token) != rows:
        raise ValueError(f"drafter_ms_per_token has {len(drafter_ms_per_token)} entries for {rows} rows")
    if rows == 0:
        return []
    if extra_nodes is not None and (len(extra_nodes) != rows or min(extra_nodes, default=0) < 0):
        raise ValueError(f"extra_nodes must hold {rows} counts >= 0, got {extra_nodes}")
    caps = [min(max_per_row, len(g)) for g in gains]
    extra = [int(x) for x in extra_nodes] if extra_nodes is not None else [0] * rows
    fixed = [float(x) for x in drafter_ms] if drafter_ms is not None else [0.0] * rows
    per_token = [float(x) for x in drafter_ms_per_token] if drafter_ms_per_token is not None else [0.0] * rows

    def own_ms(b: int, k: int) -> float:  # row b's drafter, drafting k tokens
        return fixed[b] + per_token[b] * k

    prefix = [[0.0] for _ in range(rows)]  # prefix[b][j]: sum of row b's first j gains
    for b in range(rows):
        for i in range(caps[b]):
            prefix[b].append(prefix[b][-1] + float(gains[b][i]))
    deepest = max(caps)
    if min_nodes < 1:
        raise ValueError(f"min_nodes must be >= 1, got {min_nodes}")
    cost = table.batch_curve(cache_len, rows, round_up(deepest + 1 + max(extra), min_nodes))  # by tokens per row
    best_ratio, best = rows / cost[min_nodes], [0] * rows
    def settle(m: int, take: list[int]) -> tuple[float, list[int]]:
        """Drop the rows whose gain does not pay for their own drafter, until none is left to drop."""
        ratio = 0.0
        while take:
            width = round_up(max(min(m, caps[b]) + extra[b] for b in take) + 1, min_nodes)
            value = rows + sum(prefix[b][min(m, caps[b])] for b in take)
            ratio = value / (cost[width] + sum(own_ms(b, min(m, caps[b])) for b in take))
            keep = [b for b in take if prefix[b][min(m, caps[b])] >= ratio * own_ms(b, min(m, caps[b]))]
            if len(keep) == len(take):
                break
            take = keep
        return ratio, take

    for m in range(1, deepest + 1):
        take = [b for b in range(rows) if caps[b] > 0 and prefix[b][min(m, caps[b])] > 0]
        tries = [take]
        if any(extra[b] for b in take):  # look-ahead positions widen every row's pass: try without them too
            tries.append([b for b in take if not extra[b]])
        for ratio, chosen in (settle(m, t) for t in tries):
            if chosen and ratio > best_ratio * (1 + 1e-12):
                best_ratio = ratio
                best = [min(m, caps[b]) if b in chosen else 0 for b in range(rows)]
    return best


@dataclass
class DraftCost:
    """A running fit of what a row's drafters cost per step, as a line in the tokens drafted:
    ``ms(k) = fixed + per_token * k``.

    Prompt lookup and Medusa cost about the same whatever they propose; a draft model runs
    one forward of its own per draft token, so its cost grows with k and the allocation must
    know it. Each step reports ``(k, ms)``; the fit is least squares on exponentially
    decaying weights (``decay`` on the past). With one k seen so far the cost is all
    ``fixed``; neither part is ever negative.
    """

    decay: float = 0.8
    _w: float = 0.0  # decayed sums of 1, k, ms, k*k, k*ms
    _k: float = 0.0
    _m: float = 0.0
    _kk: float = 0.0
    _km: float = 0.0

    def observe(self, k: int, ms: float) -> None:
        d = self.decay
        self._w = d * self._w + 1.0
        self._k = d * self._k + k
        self._m = d * self._m + ms
        self._kk = d * self._kk + k * k
        self._km = d * self._km + k * ms

    def fit(self) -> tuple[float, float]:
        """``(fixed, per_token)`` milliseconds; (0, 0) before any observation."""
        if not self._w:
            return 0.0, 0.0
        k, m = self._k / self._w, self._m / self._w
        var = self._kk / self._w - k * k
        if var <= 1e-6 * (1.0 + k * k):
            return max(m, 0.0), 0.0
        slope = max((self._km / self._w - k * m) / var, 0.0)
        fixed = m - slope * k
        if fixed < 0:  # the line through the origin and the mean
            return 0.0, (m / k if k > 0 else 0.0)
        return fixed, slope


# ---------------------------------------------------------------------------- the guard


@dataclass
class DraftGuard:
    """Stops a batch from drafting while drafting measurably does not pay, and tries again later.

    :func:`allocate_drafts` predicts from the cost table and each row's running acceptance;
    what a step really costs also depends on what the table cannot see (the drafters' own
    time in this batch, kernels switching past the table's grid, a machine busy with
    something else). The guard compares what steps deliver. Each step reports its
    ``speed``: tokens emitted per row, times the table's time of a plain step of this batch
    over the step's measured time -- so a plain step that takes what the table predicts
    scores 1.0 and a drafting step that emits 1.5 tokens per row at 1.2x the time scores 1.25.

    After ``patience`` drafting steps it judges: if their running speed (decaying mean,
    weight ``decay`` on the past) is below that of the batch's plain steps, drafting stops for
    ``cooldown`` steps, doubling after each failed try up to ``max_cooldown``; a try that pays
    resets the cool-down. Without a plain step seen yet it first runs ``probe`` plain steps
    to measure one. Pure logic: the engine feeds it measured times, tests feed it numbers.
    """

    patience: int = 8
    cooldown: int = 16
    max_cooldown: int = 256
    probe: int = 2
    decay: float = 0.85
    plain: float | None = None  # running speed of plain steps
    draft: float | None = None  # running speed of the drafting steps of the current try
    tried: int = 0  # drafting steps in the current try
    failures: int = 0  # failed tries in a row
    muted: int = 0  # steps left without drafting

    def allow(self) -> bool:
        """Whether this step may draft (call once per step, before drafting)."""
        if self.muted > 0:
            self.muted -= 1
            return False
        return True

    def observe(self, drafted: bool, speed: float) -> None:
        """One step's outcome: whether any row verified drafts, and its ``speed`` (see above)."""
        if not math.isfinite(speed) or speed <= 0:
            return
        if not drafted:
            self.plain = speed if self.plain is None else self.decay * self.plain + (1 - self.decay) * speed
            return
        self.draft = speed if self.draft is None else self.decay * self.draft + (1 - self.decay) * speed
        self.tried += 1
        if self.tried < self.patience:
            return
        if self.plain is None:
            self.muted = self.probe  # measure plain steps of this batch, then judge
            return
        if self.draft < self.plain:
            self.failures += 1
            self.muted = min(self.cooldown * 2 ** (self.failures - 1), self.max_cooldown)
            self.draft, self.tried = None, 0
        else:
            self.failures = 0


# ---------------------------------------------------------------------------- helpers


def sharing_pays(table: CostTable, rows: int, shared: int, longest: int) -> bool:
    """Whether ``rows`` prompts of at most ``longest`` tokens, whose first ``shared`` tokens are
    the same, prefill faster with those tokens run once in a forward of their own (then every
    row's rest on top) than whole in one forward: the extra pass pays its own weight reads,
    the shared tokens are computed once instead of ``rows`` times. From the table's measured
    pass times (one row's tokens count as tokens of a pass)."""
    if rows < 2 or not 0 < shared < longest:
        return False
    whole = table.step_ms(rows * longest, longest)
    split = table.step_ms(shared, shared) + table.step_ms(rows * (longest - shared), longest)
    return split < whole


def round_up(n: int, multiple: int) -> int:
    """``n`` rounded up to a multiple of ``multiple`` (the query tokens of a padded row)."""
    return -(-n // multiple) * multiple


def _check_axis(name: str, axis: tuple[int, ...]) -> None:
    if not axis or any(b <= a for a, b in zip(axis, axis[1:])) or axis[0] < 0:
        raise ValueError(f"{name} must be non-empty, non-negative and strictly ascending, got {axis}")


def _check_grid(name: str, grid, n_rows: int, n_cols: int) -> None:
    if len(grid) != n_rows or any(len(r) != n_cols for r in grid):
        raise ValueError(f"{name} must be {n_rows} x {n_cols}")
    if not all(math.isfinite(x) and x > 0 for r in grid for x in r):
        raise ValueError(f"{name} must hold positive finite times")


def _interp(xs: tuple[int, ...], ys: list[float], x: float) -> float:
    """Piecewise-linear through (xs, ys), linear past both ends; constant for one point.

    Past the right end the slope is at least the chord's from the first to the last point:
    a measured top segment that came out flat (noise, made non-decreasing) must not make
    every larger pass look free."""
    if len(xs) == 1:
        return ys[0]
    if x > xs[-1]:
        chord = (ys[-1] - ys[0]) / (xs[-1] - xs[0])
        last = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
        return ys[-1] + max(chord, last) * (x - xs[-1])
    i = min(max(bisect.bisect_right(xs, x) - 1, 0), len(xs) - 2)
    x0, x1 = xs[i], xs[i + 1]
    return ys[i] + (ys[i + 1] - ys[i]) * (x - x0) / (x1 - x0)


def _interp_held(xs: tuple[int, ...], ys: list[float], x: float) -> float:
    """Piecewise-linear through (xs, ys), held at the end values past both ends."""
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    return _interp(xs, ys, x)


def _positive(ms: float) -> float:
    """Extrapolating down can cross zero; a step never costs nothing."""
    return max(ms, 1e-6)
