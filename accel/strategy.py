"""Strategy protocols, capability flags and the registry from config names to classes.

A strategy is a small, frozen pydantic model: configuration only, validated at construction,
so the same object is built from Python (``SnapKV(budget=512)``), from a YAML mapping
(``{"name": "snapkv", "budget": 512}``) or from a CLI spec (``"snapkv:budget=512"``).
Per-request state never lives on the strategy: a drafter returns a fresh state object from
:meth:`Drafter.start` and the engine keeps it with the request, so one strategy object can
serve many concurrent requests.

The decode loop never uses ``isinstance`` on strategies; it reads capability flags:

- ``compresses_prompt``: the strategy selects which prompt KV entries each layer keeps
  (:class:`PromptCompressor`).
- ``drafts``: the strategy proposes draft trees for verification (:class:`Drafter`).
- ``needs_hidden``: the drafter wants the verifier's last hidden state (Medusa heads).
- :meth:`Drafter.feature_layers`: the target layers whose hidden states the drafter reads at
  every verified position (EAGLE), handed over as ``DraftContext.features``.
- :meth:`Drafter.lookahead`: input vectors the drafter appends to its row's verify pass,
  whose outputs become its next drafts (PaSS), as a :class:`Lookahead`.
- ``accepts``: the strategy replaces the acceptance rule (:class:`AcceptanceRule`).
- ``quantizes_kv``: the strategy quantizes the entries a row keeps (:class:`KVQuantizer`).
- ``tiers_kv``: the strategy keeps every entry in a slower tier and has each decode step's
  attention read only the entries it predicts that step needs (:class:`KVTier`, InfiniGen).

A request's strategies, sorted by capability, are its :class:`Plan` (:func:`plan_strategies`).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

import torch
from pydantic import BaseModel, ConfigDict, ValidationError

__all__ = [
    "Strategy",
    "PromptCompressor",
    "Selection",
    "Drafter",
    "DraftContext",
    "FINAL_HIDDEN",
    "DraftProposal",
    "Lookahead",
    "AcceptanceRule",
    "KVQuantizer",
    "KVTier",
    "REGISTRY",
    "register",
    "build_strategy",
    "build_strategies",
    "StrategyError",
    "Plan",
    "plan_strategies",
]


class StrategyError(ValueError):
    """A strategy name or field is wrong. The message names the offending field."""


class Strategy(BaseModel):
    """Base class of every strategy: frozen configuration plus capability flags."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: ClassVar[str] = ""
    compresses_prompt: ClassVar[bool] = False
    drafts: ClassVar[bool] = False
    needs_hidden: ClassVar[bool] = False
    accepts: ClassVar[bool] = False
    quantizes_kv: ClassVar[bool] = False
    tiers_kv: ClassVar[bool] = False

    def spec(self) -> dict[str, Any]:
        """The mapping this strategy is rebuilt from: ``build_strategy(s.spec()) == s``."""
        return {"name": self.name, **self.model_dump()}


# --------------------------------------------------------------------------- compression


@dataclass
class Selection:
    """Which prompt entries one layer keeps, per KV head.

    indices: LongTensor [B, H_kv, K], positions into the layer's prompt keys, ascending
        along the last dim.
    valid: BoolTensor [B, H_kv, K] or None. When heads keep different counts (adaptive
        budgets), rows are padded to K and ``valid`` marks the real entries.
    """

    indices: torch.Tensor
    valid: torch.Tensor | None = None


class PromptCompressor(Strategy):
    """Chooses, layer by layer during the prefill, which prompt KV entries to keep.

    The engine calls :meth:`observation_window` once per request, captures that many
    trailing prompt queries of every layer (post-RoPE, ``[B, H_q, w, D]``), and calls
    :meth:`select` right after the layer's attention inputs are known, so each layer is
    compressed before the next one runs.
    """

    compresses_prompt: ClassVar[bool] = True

    def observation_window(self, prompt_len: int) -> int:
        """How many trailing prompt queries :meth:`select` needs (0: none)."""
        raise NotImplementedError

    def select(
        self, layer_idx: int, queries: torch.Tensor | None, keys: torch.Tensor, values: torch.Tensor,
        tokens: torch.Tensor | None = None,
    ) -> Selection | None:
        """Entries to keep for one layer, or None to keep all.

        queries: [B, H_q, w, D] trailing prompt queries (post-RoPE), or None if w == 0.
        keys, values: [B, H_kv, L, D] the layer's full prompt KV (post-RoPE keys).
        tokens: LongTensor [B, L] the prompt's token ids (for policies by token kind), or
            None where the caller has none.
        """
        raise NotImplementedError

    # Eviction during decoding (see :mod:`accel.maintenance`): a selector that keeps the
    # cache bounded as generation goes on overrides these three.

    def decode_limit(self) -> tuple[int | None, int] | None:
        """(budget, slack) of eviction during decoding: once a row holds ``budget + slack``
        entries per KV head, :meth:`evict` brings it back to ``budget``; a budget of None
        calls :meth:`evict` every ``slack`` tokens instead (a selector whose policies decide
        what stays). None (the default): only the prompt is compressed, the cache grows with
        the generation."""
        return None

    def decode_window(self) -> int:
        """How many of a row's latest tokens' queries :meth:`evict` scores with (0: none)."""
        return 0

    def evict(self, layer_idx: int, queries: torch.Tensor | None, keys: torch.Tensor, values: torch.Tensor,
              valid: torch.Tensor | None, positions: torch.Tensor | None = None,
              tokens: torch.Tensor | None = None) -> Selection | None:
        """Entries one row keeps of one layer during decoding, or None to keep all.

        keys, values: [1, H_kv, n, D] the row's committed entries, oldest first.
        valid: [1, H_kv, n] False where an entry is padding of a per-head layout (heads that
            keep different counts), or None when every entry is real.
        queries: [1, H_q, w, D] the queries of the row's latest w tokens (post-RoPE, oldest
            first, w <= :meth:`decode_window`), or None when the window is 0. The entries of
            those tokens are the last w valid entries of every head.
        positions: LongTensor [1, H_kv, n] each entry's position in the sequence (padding:
            its head's last real one); tokens: LongTensor [N] the row's sequence, so
            ``tokens[positions]`` are the entries' token ids.
        Returns a :class:`Selection` over the n entries (indices ascending per head).
        """
        raise NotImplementedError


# --------------------------------------------------------------------------- drafting


#: The layer id of :meth:`Drafter.feature_layers` that names the final normed hidden state
#: (the output head's input), not a decoder layer's input.
FINAL_HIDDEN = -1


@dataclass
class DraftContext:
    """What a drafter may read when proposing; owned by the engine, read-only for drafters.

    tokens: LongTensor [n] every token of the sequence so far (prompt, generated, and the
        pending root token that the next verify pass feeds), batch row 0.
    hidden: FloatTensor [H] the verifier's final hidden state at the pending root's parent
        (the last verified position), or None unless the drafter ``needs_hidden``.
    max_tokens: int, the draft node budget the engine allows this step.
    warp: the request's logits warper (temperature / top-k / top-p) on logits [N, V], or
        None for greedy decoding; a drafter that samples drafts samples from
        ``softmax(warp(logits))`` and records that distribution as ``DraftProposal.probs``.
    generator: the request's random generator (None when greedy).
    features: per layer of the row's drafters' :meth:`Drafter.feature_layers`, the verifier's
        hidden states [m, H] at the m positions just before the pending root that no earlier
        context of this row carried (positions ``len(tokens) - 1 - m .. len(tokens) - 2``: the
        prompt at the first step, the accepted path root included after a verify), or None
        when no drafter of the row asks for layers.
    """

    tokens: torch.Tensor
    hidden: torch.Tensor | None
    max_tokens: int
    warp: Callable[[torch.Tensor], torch.Tensor] | None = None
    generator: torch.Generator | None = None
    features: dict[int, torch.Tensor] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class DraftProposal:
    """A tree of draft tokens hanging below the root (the pending token).

    tokens: LongTensor [N] draft tokens, nodes 1..N of the tree (node 0 is the root).
    parents: LongTensor [N] parent node of each draft node, in 0..N-1 and smaller than its
        own node index (parents[i] < i + 1), so the tree is topologically ordered.
    probs: FloatTensor [N, V] or None, the draft distribution q each token was sampled from.
        None means the drafter is deterministic (q is a point mass on the token).
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    probs: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.tokens.numel())


@dataclass
class Lookahead:
    """Look-ahead positions a drafter appends to its row's verify pass (PaSS, Monea et al. 2023).

    vectors: FloatTensor [L, H], input embeddings fed in place of token embeddings at L extra
        positions after an anchor node: position i (0-based) sits at the anchor's position
        + 1 + i and sees the anchor, its ancestors, the cache, and vectors 0..i. Nothing else
        sees them and they are dropped at commit, so the verified tokens are unchanged.
    anchors: how many nodes of the tree's main chain (the root, then each node's first child)
        get their own copy of the L positions; the engine may give fewer (its draft budget
        pays for them, L positions per anchor). When the accepted path ends at an anchor,
        the drafter reads that copy's outputs (:meth:`Drafter.read_lookahead`).
    """

    vectors: torch.Tensor
    anchors: int = 1

    def __len__(self) -> int:
        return int(self.vectors.shape[0])


class Drafter(Strategy):
    """Proposes draft trees; learns from how many of its tokens were accepted."""

    drafts: ClassVar[bool] = True

    def check(self, model: Any) -> None:
        """Raise a ValueError with a clear message if this drafter cannot draft for ``model``
        (files for another model, a missing file, a model it cannot read).

        Called once per request before the prefill, so a bad configuration fails before any
        expensive work. The default accepts every model.
        """

    def feature_layers(self, model: Any) -> tuple[int, ...]:
        """Target layers whose hidden states this drafter reads, collected by the forwards the
        engine runs anyway (prefill and verify: no extra pass) and handed over as
        ``DraftContext.features``: layer k is the input of decoder layer k (the residual
        stream after k layers, as vLLM's EAGLE-3 auxiliary layers count them),
        :data:`FINAL_HIDDEN` the final normed hidden state. The default reads none."""
        return ()

    def start(self, model: Any, prompt: torch.Tensor) -> Any:
        """Per-request state, created after the prefill. prompt: LongTensor [n]."""
        return None

    def start_batch(self, model: Any, prompts: list[torch.Tensor]) -> list[Any]:
        """:meth:`start` for several requests admitted together, one state per prompt [n_b].
        The default starts them one by one; a drafter with per-request model work overrides
        it (a draft model prefills every prompt in one forward)."""
        return [self.start(model, p) for p in prompts]

    def propose(self, state: Any, ctx: DraftContext) -> DraftProposal | None:
        """A draft tree of at most ``ctx.max_tokens`` nodes, or None for no draft."""
        raise NotImplementedError

    def propose_batch(self, states: list[Any], ctxs: list[DraftContext]) -> list[DraftProposal | None]:
        """:meth:`propose` for several rows of one batched step at once, one proposal per row:
        the engine hands each drafter the rows it drafts for (rows whose drafter equals this
        one, each with ``ctx.max_tokens >= 1``). The default asks row by row; a drafter whose
        work batches overrides it (Medusa runs its heads over every row's hidden state in one
        matmul), so drafting for B rows need not cost B times drafting for one. An override
        must leave ``states`` unchanged when it raises: the engine then asks row by row, to
        find the row that fails."""
        return [self.propose(s, c) for s, c in zip(states, ctxs)]

    def release(self, state: Any) -> None:
        """The request of ``state`` left its batch (finished, cancelled or failed): free what
        the state shares with other rows (a batched draft cache's row). Called once per
        state; the default does nothing."""

    def feedback(self, state: Any, proposed: int, accepted: int) -> None:
        """After each verify step: how many of this drafter's nodes were proposed, and how
        many of the accepted tokens (bonus excluded) came from them."""

    def lookahead(self, state: Any) -> Lookahead | None:
        """Look-ahead inputs for this row's next verify pass (:class:`Lookahead`), or None
        (the default: the drafter appends nothing). Only a row's first drafter that returns
        one gets its positions."""
        return None

    def read_lookahead(self, state: Any, logits: torch.Tensor | None) -> None:
        """After a verify pass that carried this drafter's :meth:`lookahead`: the output
        logits [L, V] (float32) at the L positions after the anchor the accepted path ended
        at (they continue the text after this step's bonus token), or None when the path
        ended elsewhere (or the row drafted nothing this step)."""


class KVQuantizer(Strategy):
    """Quantizes the entries a row keeps, a group of G tokens at a time (see
    :mod:`accel.maintenance`): after the prefill every full group of the kept prompt entries,
    then each group of generated entries as it fills; the newest entries stay in full
    precision until their group fills.

    The cache stores what :meth:`encode` returns (packed codes, scales, ...) in place of the
    group's full-precision entries, and attention reads the groups back through
    :meth:`decode`, layer by layer, each step (:class:`accel.cache.SharedCache`)."""

    quantizes_kv: ClassVar[bool] = True

    def group_size(self) -> int:
        """Tokens quantized together (G)."""
        raise NotImplementedError

    def check_geometry(self, num_kv_heads: int, head_dim: int) -> None:
        """Raise a ValueError naming the field if the quantizer cannot serve a cache of this
        shape (called before the prefill). The default accepts every shape."""

    def encode(self, keys: torch.Tensor, values: torch.Tensor) -> dict[str, torch.Tensor]:
        """keys, values [H_kv, m, G, D]: m groups of one row -> the tensors that stand for
        them, each ``[H_kv, m, ...]`` (the cache keeps them per row and group)."""
        raise NotImplementedError

    def decode(self, parts: dict[str, torch.Tensor], keys: torch.Tensor, values: torch.Tensor,
               groups: list[int] | None = None) -> None:
        """Write the groups ``parts`` (each ``[B, H_kv, g, ...]``, as :meth:`encode` made
        them) back as entries into ``keys``, ``values`` [B, H_kv, g, G, D] (views of the
        attention buffers, of the cache's dtype). ``groups``: how many row b holds; the
        columns of groups past them may be left as they were (they are overwritten or masked)."""
        raise NotImplementedError

    def quantize(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """keys, values [H_kv, m, G, D] -> what attention reads back for them (same shape
        and dtype): :meth:`decode` of :meth:`encode`."""
        parts = {name: t.unsqueeze(0) for name, t in self.encode(keys, values).items()}
        k, v = torch.empty_like(keys).unsqueeze(0), torch.empty_like(values).unsqueeze(0)
        self.decode(parts, k, v)
        return k[0], v[0]

    def group_bytes(self, num_kv_heads: int, head_dim: int, element_size: int) -> int:
        """Bytes :meth:`encode` makes for one group of one row and layer, keys and values
        together (a formula; the cache reports what its tensors hold, and tests check they
        agree)."""
        raise NotImplementedError


class KVTier(Strategy):
    """Keeps every entry of the cache in a slow tier and, before each layer of a decode step
    attends, fetches only the entries it predicts that layer's queries need into a fast tier
    (:class:`accel.tier.TieredCache`). Nothing is dropped for good: a later step may fetch
    what an earlier one left behind.

    The cache scores every committed entry with partial keys (each key projected onto the
    few directions :meth:`projections` gives, kept in memory) against the step's predicted
    partial queries, and fetches, per row, KV head and query token, the top
    :meth:`fast_entries` ``[0]`` entries plus the ``[1]`` latest (the recent window).
    """

    tiers_kv: ClassVar[bool] = True

    def fast_entries(self) -> tuple[int, int]:
        """(selected, window): entries each query token reads per KV head beside its own
        step's: the top-scored ``selected`` of those before its window, and every committed
        entry of its last ``window`` positions."""
        raise NotImplementedError

    def slow_tier(self) -> tuple[str, str | None]:
        """(kind, folder): ``"file"`` (memory-mapped files in ``folder``, None: the user
        cache folder; the process keeps none of their pages between steps) or ``"memory"``
        (ordinary tensors)."""
        raise NotImplementedError

    def step_tokens(self) -> int:
        """Forwards of more new tokens per row than this (prompt chunks) attend to every
        entry."""
        return 64

    def predicts_ahead(self) -> bool:
        """True: layer l + 1's queries are predicted from layer l's attention input, during
        layer l (InfiniGen's speculation, which lets a fetch overlap layer l's work); False:
        each layer chooses with its own queries, computed before it attends."""
        return True

    def head_pooling(self) -> str:
        """How the query heads sharing a KV head combine their partial scores: ``"sum"``
        of the logits, or ``"max"`` of each head's softmax over the entries."""
        return "max"

    def projections(self, model: Any) -> list[torch.Tensor]:
        """Per decoder layer, the partial projection ``[H_kv, D, r]`` (orthonormal columns)
        that partial keys and queries are made with (``k @ P``, ``q @ P``): computed once per
        model and kept."""
        raise NotImplementedError


class AcceptanceRule(Strategy):
    """Replaces the default acceptance (greedy / lossless speculative sampling)."""

    accepts: ClassVar[bool] = True
    lossy: ClassVar[bool] = False


# --------------------------------------------------------------------------- registry

REGISTRY: dict[str, type[Strategy]] = {}


def register(cls: type[Strategy]) -> type[Strategy]:
    """Class decorator: make ``cls`` buildable by its ``name`` from configs and the CLI."""
    if not cls.name:
        raise TypeError(f"{cls.__name__} needs a class attribute `name` to be registered")
    if REGISTRY.get(cls.name, cls) is not cls:
        raise TypeError(f"strategy name {cls.name!r} is already registered by {REGISTRY[cls.name]}")
    REGISTRY[cls.name] = cls
    return cls


def _load_builtin() -> None:
    # The built-in strategies live in packages that `accel` composes but does not own.
    # Importing them registers their classes; a missing optional package is not an error.
    import importlib

    for module in ("snapkv", "speculative"):
        try:
            importlib.import_module(module)
        except ImportError:  # pragma: no cover - both ship in the same distribution
            pass


def _parse_value(text: str) -> Any:
    import yaml

    return yaml.safe_load(text) if text != "" else ""


def parse_spec(spec: str) -> dict[str, Any]:
    """``"snapkv:budget=512,window=32"`` -> ``{"name": "snapkv", "budget": 512, "window": 32}``."""
    name, _, rest = spec.partition(":")
    out: dict[str, Any] = {"name": name.strip()}
    for item in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq:
            raise StrategyError(f"strategy spec {spec!r}: expected key=value, got {item!r}")
        out[key.strip()] = _parse_value(value.strip())
    return out


def _describe(err: ValidationError, prefix: str) -> str:
    parts = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(value)"
        parts.append(f"{prefix}{loc}: {e['msg']}")
    return "; ".join(parts)


def build_strategy(spec: Strategy | str | dict[str, Any], where: str = "") -> Strategy:
    """Build one strategy from an instance, a ``"name:key=val,..."`` string or a mapping
    with a ``name`` key. Errors name the field: ``StrategyError("snapkv.budget: ...")``."""
    if isinstance(spec, Strategy):
        return spec
    if isinstance(spec, str):
        spec = parse_spec(spec)
    if not isinstance(spec, dict):
        raise StrategyError(f"{where}strategy must be a name, a mapping or a Strategy, got {type(spec).__name__}")
    if not REGISTRY:
        _load_builtin()
    fields = dict(spec)
    name = fields.pop("name", None)
    if not name:
        raise StrategyError(f"{where}strategy mapping needs a 'name' (one of {sorted(REGISTRY)})")
    cls = REGISTRY.get(str(name).lower())
    if cls is None:
        _load_builtin()
        cls = REGISTRY.get(str(name).lower())
    if cls is None:
        raise StrategyError(f"{where}unknown strategy {name!r}; known: {', '.join(sorted(REGISTRY)) or 'none'}")
    try:
        return cls(**fields)
    except ValidationError as err:
        raise StrategyError(_describe(err, f"{where}{name}.")) from None


def build_strategies(specs: Any) -> list[Strategy]:
    """Build a list of strategies (``None`` and ``[]`` are plain decoding)."""
    if specs is None:
        return []
    if isinstance(specs, (Strategy, str, dict)):
        specs = [specs]
    return [build_strategy(s, where=f"strategies[{i}].") for i, s in enumerate(specs)]


# --------------------------------------------------------------------------- a request's plan


@dataclass(frozen=True)
class Plan:
    """The strategies of one request, sorted by capability."""

    compressor: PromptCompressor | None
    drafters: tuple[Drafter, ...]
    rule: Strategy | None  # an AcceptanceRule, or None for greedy / lossless sampling
    quantizer: KVQuantizer | None = None  # quantizes what the row keeps (after the compressor)
    tier: KVTier | None = None  # keeps the whole cache in a slow tier, fetching what each step reads

    @property
    def needs_hidden(self) -> bool:
        return any(d.needs_hidden for d in self.drafters)

    def feature_layers(self, model: Any) -> tuple[int, ...]:
        """Every layer the drafters read (:meth:`Drafter.feature_layers`), sorted."""
        return tuple(sorted({k for d in self.drafters for k in d.feature_layers(model)}))

    @functools.cached_property
    def drafter_specs(self) -> tuple[str, ...]:
        """Each drafter's settings as one string (``name`` + its fields as JSON): what tells
        drafters apart for :func:`accel.engine.draft_guard`. A drafter whose fields have no JSON
        form (a tensor, say) is told apart by identity, as :mod:`accel.drafting` groups them."""
        return tuple(_spec_string(d) for d in self.drafters)

    def check(self, model: Any) -> None:
        """Let every drafter, and the quantizer, refuse the model before any prefill work
        (clear ValueErrors)."""
        if self.quantizer is not None:
            from .adapter import geometry

            geo = geometry(model)
            self.quantizer.check_geometry(geo.num_kv_heads, geo.head_dim)
        for d in self.drafters:
            d.check(model)


def plan_strategies(strategies: list[Strategy]) -> Plan:
    """Sort one request's strategies by capability: at most one prompt compressor, one KV
    quantizer and one acceptance rule, any number of drafters (in the order given)."""
    compressors = [s for s in strategies if s.compresses_prompt]
    rules = [s for s in strategies if s.accepts]
    quantizers = [s for s in strategies if s.quantizes_kv]
    tiers = [s for s in strategies if s.tiers_kv]
    if len(tiers) > 1:
        raise ValueError(f"at most one KV tier per call, got {[s.name for s in tiers]}")
    if tiers and (compressors or quantizers):
        other = (compressors or quantizers)[0].name
        raise ValueError(f"{tiers[0].name} keeps every entry and fetches what each step reads; it does not stack "
                         f"with {other}, which drops or rounds entries")
    if len(quantizers) > 1:
        raise ValueError(f"at most one KV quantizer per call, got {[s.name for s in quantizers]}")
    if len(compressors) > 1:
        raise ValueError(f"at most one prompt compressor per call, got {[s.name for s in compressors]}")
    if len(rules) > 1:
        raise ValueError(f"at most one acceptance rule per call, got {[s.name for s in rules]}")
    drafters = tuple(s for s in strategies if s.drafts)
    return Plan(compressors[0] if compressors else None, drafters, rules[0] if rules else None,
                quantizers[0] if quantizers else None, tiers[0] if tiers else None)


def _spec_string(drafter: Drafter) -> str:
    try:
        return f"{drafter.name}{json.dumps(drafter.model_dump(mode='json'), sort_keys=True)}"
    except (ValueError, TypeError):  # pydantic's serialization error is a ValueError
        return f"{drafter.name}<{type(drafter).__qualname__} at {id(drafter):#x}>"
