"""N-Grammys (Stewart et al. 2024): learning-free drafting from n-grams the model itself implies.

Two sources, no training:

- **Model bigrams.** For every token ``v`` of the vocabulary, the target's own top-k next
  tokens and their probabilities with ``v`` as the only context after the model's BOS token:
  a table ``[V, k]`` computed once per model (one forward per chunk of two-token sequences,
  with a progress bar) and cached in ``$ACCEL_CACHE/ngrammys``. The BOS token is there
  because a token at position 0 is the model's attention sink, not context: alone there,
  the default model's next token after each token of 40 held-out greedy chat answers was the
  table's top-1 1.1% of the time and among its top 4 10.6%; after BOS, 13.0% and 26.0%
  (``python benchmarks/ngrammys_offline.py``'s answers; a model without a BOS token gets
  the one-token table). The target's next token is rarely the table's top-1
  but often among its top-k, so every node of the draft may branch.
- **Context n-grams.** Prompt lookup's matches (:func:`speculative.prompt_lookup.find_continuations`):
  continuations of the text's last n-gram found earlier in the prompt or the answer.

Each step grows one draft tree best first: a node's score is the product, along its path, of
the table probability of each table step and ``context_confidence`` for each step copied
from a context match; the highest-scored candidate joins the tree until it holds the engine's
budget (``ctx.max_tokens``, sized by the cost table). All candidates are point masses, so
verification is exact for greedy decoding and lossless for sampling, whatever the table says.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import math
import sys
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from pydantic import Field

from accel.files import atomic_path, cache_dir
from accel.strategy import DraftContext, DraftProposal, Drafter, register

from .prompt_lookup import find_continuations

__all__ = ["NGrammys", "BigramTable", "model_bigrams", "bigram_table"]

_FORMAT = "accel-ngrammys-bigrams-2"  # 2: each token after the BOS token (1: alone)


@dataclass(frozen=True)
class BigramTable:
    """The model's top-k next tokens after each single token.

    tokens: LongTensor [V, k], row ``v`` the k most likely next tokens with ``v`` alone as
        context, most likely first; probs: FloatTensor [V, k], their probabilities.
    """

    tokens: torch.Tensor
    probs: torch.Tensor

    @property
    def vocab_size(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def top_k(self) -> int:
        return int(self.tokens.shape[1])

    def save(self, path: str | Path, key: dict[str, Any] | None = None) -> Path:
        """Write the table as safetensors (atomically), with ``key`` in its metadata."""
        from safetensors.torch import save_file

        with atomic_path(path) as tmp:
            save_file({"tokens": self.tokens.to(torch.int32).contiguous(), "probs": self.probs.float().contiguous()},
                      str(tmp), metadata={"format": _FORMAT, "key": json.dumps(key or {}, sort_keys=True)})
        return Path(path)

    @classmethod
    def load(cls, path: str | Path) -> tuple["BigramTable", dict[str, Any]]:
        """(table, key) read from ``path``; ValueError if it is not a bigram table file."""
        from safetensors import safe_open

        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"ngrammys: no bigram table at '{path}'")
        try:
            with safe_open(str(path), framework="pt") as fh:
                meta = fh.metadata() or {}
                tokens, probs = fh.get_tensor("tokens").long(), fh.get_tensor("probs").float()
        except Exception as err:  # a torn or foreign file
            raise ValueError(f"ngrammys: '{path}' is not a readable bigram table ({err})") from err
        if meta.get("format") != _FORMAT or tokens.shape != probs.shape or tokens.dim() != 2:
            raise ValueError(f"ngrammys: '{path}' is not a bigram table of format {_FORMAT}")
        return cls(tokens, probs), json.loads(meta.get("key") or "{}")


def _vocab_size(model) -> int:
    return int(model.get_output_embeddings().weight.shape[0])


def sink_token(model) -> int | None:
    """The token the table puts before each token (the config's ``bos_token_id``), or None."""
    bos = getattr(model.config, "bos_token_id", None)
    if isinstance(bos, (list, tuple)):
        bos = bos[0] if bos else None
    return int(bos) if bos is not None and 0 <= int(bos) < _vocab_size(model) else None


def model_key(model, top_k: int) -> dict[str, Any]:
    """What a table is computed from: the model's class, sizes, dtype and a digest of sampled
    weights (two models with one config but other weights get other tables), and ``top_k``."""
    cfg = model.config.get_text_config(decoder=True)
    h = hashlib.sha256()
    for param in (model.get_input_embeddings().weight, model.get_output_embeddings().weight):
        rows = param.detach()[:: max(1, param.shape[0] // 64)].float().cpu()
        h.update(rows.numpy().tobytes())
    for name, param in list(model.named_parameters())[-4:]:
        h.update(name.encode())
        h.update(param.detach().reshape(-1)[:4096].float().cpu().numpy().tobytes())
    return {"format": _FORMAT, "class": type(model).__name__, "vocab": _vocab_size(model),
            "hidden": getattr(cfg, "hidden_size", None), "layers": getattr(cfg, "num_hidden_layers", None),
            "dtype": str(next(model.parameters()).dtype).removeprefix("torch."), "top_k": top_k, "sink": sink_token(model),
            "weights": h.hexdigest()[:24]}


@torch.inference_mode()
def model_bigrams(model, top_k: int, chunk: int = 256, progress: bool = True, after_bos: bool = True) -> BigramTable:
    """Compute the table: every token id after the model's BOS token (:func:`sink_token`; alone
    where it has none) through the model, ``chunk`` sequences per forward; the top ``top_k`` of
    each softmax at the token (``after_bos=False``: every token alone, as format 1 had it, for
    comparison). A progress bar goes to stderr."""
    vocab = _vocab_size(model)
    device = next(model.parameters()).device
    sink = sink_token(model) if after_bos else None
    tokens = torch.empty((vocab, top_k), dtype=torch.long)
    probs = torch.empty((vocab, top_k), dtype=torch.float32)
    bar = None
    if progress:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        bar = Progress(TextColumn("ngrammys: model bigrams (once per model)"), BarColumn(), MofNCompleteColumn(),
                       TimeRemainingColumn(), console=Console(file=sys.stderr), transient=True)
        bar.start()
        task = bar.add_task("bigrams", total=vocab)
    try:
        for lo in range(0, vocab, chunk):
            ids = torch.arange(lo, min(vocab, lo + chunk), device=device).unsqueeze(1)  # [c, 1]
            if sink is not None:
                ids = torch.cat([torch.full_like(ids, sink), ids], dim=1)  # [c, 2]
            logits = model(input_ids=ids, use_cache=False).logits[:, -1].float()
            p, t = torch.softmax(logits, dim=-1).topk(top_k, dim=-1)
            tokens[lo : lo + ids.shape[0]] = t.cpu()
            probs[lo : lo + ids.shape[0]] = p.cpu()
            if bar is not None:
                bar.update(task, completed=lo + ids.shape[0])
    finally:
        if bar is not None:
            bar.stop()
    return BigramTable(tokens, probs)


_MEMO: "weakref.WeakKeyDictionary[Any, dict[int, BigramTable]]" = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def bigram_table(model, top_k: int, progress: bool = True) -> BigramTable:
    """The table of ``model``: held per process, read from ``$ACCEL_CACHE/ngrammys`` or
    computed once (:func:`model_bigrams`) and written there."""
    with _LOCK:
        known = _MEMO.setdefault(model, {})
        if top_k in known:
            return known[top_k]
        key = model_key(model, top_k)
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
        path = cache_dir() / "ngrammys" / f"{digest}.safetensors"
        table = None
        if path.is_file():
            try:
                table, stored = BigramTable.load(path)
                table = table if stored == key else None
            except (OSError, ValueError):
                table = None
        if table is None:
            table = model_bigrams(model, top_k, progress=progress)
            table.save(path, key)
        known[top_k] = table
        return table


@dataclass
class _State:
    table: BigramTable
    tokens: dict[int, list[int]]  # table rows as lists, filled lazily: token -> top-k next tokens
    logp: dict[int, list[float]]  # their log-probabilities


@register
class NGrammys(Drafter):
    """Drafts a tree from the model's own bigram table and from context n-gram matches; no
    training, no extra model. Lossless: drafts are point masses the verifier checks."""

    name: ClassVar[str] = "ngrammys"

    top_k: int = Field(4, ge=1, le=64, description="alternatives per node from the model's bigram table")
    num_tokens: int = Field(15, ge=1, description="most draft nodes per step (the engine's cost-sized budget may be lower)")
    context: bool = Field(True, description="also draft the continuations of context n-gram matches (prompt lookup)")
    max_ngram: int = Field(3, ge=1, description="longest context n-gram matched")
    context_confidence: float = Field(
        0.6, gt=0, le=1, description="score of a token copied from a context match (a table step scores its probability)"
    )
    table: str | None = Field(None, description="a bigram table file (BigramTable.save) instead of the model's own")

    def _table(self, model) -> BigramTable:
        if self.table is None:
            return bigram_table(model, self.top_k)
        table, _ = BigramTable.load(self.table)
        vocab = _vocab_size(model)
        if table.vocab_size != vocab:
            raise ValueError(f"ngrammys: the bigram table '{self.table}' is for a vocabulary of {table.vocab_size} "
                             f"tokens, the model has {vocab}")
        return table

    def check(self, model) -> None:
        if self.table is not None:
            self._table(model)

    def start(self, model, prompt: torch.Tensor) -> _State:
        table = self._table(model)
        return _State(table, {}, {})

    def _row(self, state: _State, token: int) -> tuple[list[int], list[float]]:
        row = state.tokens.get(token)
        if row is None:
            k = min(self.top_k, state.table.top_k)
            row = state.tokens[token] = state.table.tokens[token, :k].tolist()
            state.logp[token] = [math.log(max(p, 1e-30)) for p in state.table.probs[token, :k].tolist()]
        return row, state.logp[token]

    def propose(self, state: _State, ctx: DraftContext) -> DraftProposal | None:
        budget = min(self.num_tokens, ctx.max_tokens)
        if budget <= 0:
            return None
        vocab = state.table.vocab_size
        chains: list[list[int]] = []
        if self.context:
            chains = [c.tolist() for _, c in find_continuations(ctx.tokens, self.max_ngram, 1, budget, 2)]
        ctx_logp = math.log(self.context_confidence)
        tokens: list[int] = []
        parents: list[int] = []
        index: dict[tuple[int, int], int] = {}  # (parent node, token) -> node (the root is node 0)
        heap: list[tuple[float, int, int, int, tuple[int, int] | None]] = []  # (-score, order, parent, token, chain)
        order = 0

        def expand(node: int, token: int, logp: float, chain: tuple[int, int] | None) -> None:
            nonlocal order
            if 0 <= token < vocab:
                for t, lp in zip(*self._row(state, token)):
                    heapq.heappush(heap, (-(logp + lp), order, node, t, None))
                    order += 1
            if chain is not None:
                c, at = chain
                if at < len(chains[c]):
                    heapq.heappush(heap, (-(logp + ctx_logp), order, node, chains[c][at], (c, at + 1)))
                    order += 1

        root = int(ctx.tokens[-1])
        expand(0, root, 0.0, None)
        for c in range(len(chains)):
            expand(0, -1, 0.0, (c, 0))
        while heap and len(tokens) < budget:
            neg, _, parent, token, chain = heapq.heappop(heap)
            node = index.get((parent, token))
            if node is None:
                tokens.append(token)
                parents.append(parent)
                node = index[(parent, token)] = len(tokens)
                expand(node, token, -neg, chain)
            elif chain is not None:  # a context chain through a node already drafted: follow it on
                expand(node, -1, -neg, chain)
        if not tokens:
            return None
        device = ctx.tokens.device
        return DraftProposal(tokens=torch.tensor(tokens, dtype=torch.long, device=device),
                             parents=torch.tensor(parents, dtype=torch.long, device=device))
