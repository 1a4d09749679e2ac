"""The ``pass`` drafter: PaSS (Monea et al. 2023), drafts from learned look-ahead embeddings.

L learned input vectors (default 4) ride along in every verify pass the engine runs anyway,
after an anchor node of the draft tree (:class:`accel.strategy.Lookahead`). Look-ahead
position i sits i + 1 places past its anchor and sees the anchor's context and the
look-ahead positions before it, so its output predicts the token i + 2 places past the anchor:
when the step's accepted path ends at that anchor, the L outputs predict the L tokens after
the step's bonus token. Those are the next step's drafts, at the cost of L extra positions in
a forward, with no draft forward of its own.

The engine anchors copies on the root and down the tree's main chain (``anchors``), so that a
step whose drafts are all rejected, or only the first accepted, still leaves drafts for the
next. Each step grows a tree best first from the L distributions: depth d's candidates are the
``top_k`` tokens of position d, a node's score the product of its path's probabilities. All
drafts are point masses, so greedy output is exactly the target's and sampling stays
lossless, whatever the embeddings say. Under SnapKV the look-ahead positions read the
compressed cache like any draft.

Only the L vectors are trained (``accel train-pass``, :mod:`speculative.lookahead.train`); the
ones for the default model ship in the package (``embeddings="default"``).
"""

from __future__ import annotations

import heapq
import json
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
from pydantic import Field, field_validator

from accel.files import atomic_path
from accel.strategy import DraftContext, DraftProposal, Drafter, Lookahead, register

__all__ = ["PaSS", "PassEmbeddings", "DEFAULT_PASS_DIR", "load_pass", "save_pass", "model_probe"]

#: The embeddings trained for the default model (SmolLM2-135M-Instruct), shipped in the package.
DEFAULT_PASS_DIR = Path(__file__).resolve().parent.parent / "heads" / "pass"
_FILE = "pass_embeddings.safetensors"
_FORMAT = "accel-pass-1"
_TRAIN_HINT = "train them with `accel train-pass --model MODEL --out DIR` and pass embeddings=DIR"

_LOADED: dict[tuple[Any, ...], "PassEmbeddings"] = {}
_LOCK = threading.Lock()


@dataclass(frozen=True, eq=False)
class PassEmbeddings:
    """Trained look-ahead embeddings and what they were trained for.

    vectors: FloatTensor [L, H]; vocab_size, hidden_size: the model's; probe: FloatTensor
    [4, 8], a corner of that model's input embeddings (tells a model of the same shape apart);
    info: metadata (base model, training facts); source: the file read.
    """

    vectors: torch.Tensor
    vocab_size: int
    hidden_size: int
    probe: torch.Tensor
    info: dict[str, Any] = field(default_factory=dict)
    source: str = ""

    @property
    def positions(self) -> int:
        return int(self.vectors.shape[0])


def model_probe(model: Any) -> torch.Tensor:
    """A corner [4, 8] of ``model``'s input embeddings, float32 on the CPU."""
    return model.get_input_embeddings().weight[:4, :8].detach().float().cpu()


def save_pass(folder: str | os.PathLike, vectors: torch.Tensor, model: Any, info: dict[str, Any] | None = None,
              dtype: torch.dtype = torch.float32) -> Path:
    """Write ``vectors`` [L, H] trained for ``model`` to ``folder/pass_embeddings.safetensors``
    (atomically). Returns the file."""
    from safetensors.torch import save_file

    cfg = model.config.get_text_config(decoder=True)
    meta = {"format": _FORMAT, "vocab_size": str(cfg.vocab_size), "hidden_size": str(cfg.hidden_size),
            "info": json.dumps(info or {}, sort_keys=True)}
    path = Path(folder) / _FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        save_file({"vectors": vectors.detach().to(dtype).cpu().contiguous(), "probe": model_probe(model).contiguous()},
                  str(tmp), metadata=meta)
    return path


def _resolve(embeddings: str | os.PathLike) -> Path:
    folder = DEFAULT_PASS_DIR if os.fspath(embeddings) == "default" else Path(embeddings).expanduser()
    path = folder / _FILE if folder.is_dir() or not folder.suffix else folder
    if not path.is_file():
        where = "the default model's (shipped)" if os.fspath(embeddings) == "default" else f"'{embeddings}'"
        raise FileNotFoundError(f"no PaSS embeddings in {where}: {path} is missing; {_TRAIN_HINT}")
    return path


def load_pass(embeddings: str | os.PathLike = "default") -> PassEmbeddings:
    """The embeddings in a folder (or file) written by :func:`save_pass`, or ``"default"``;
    read once per process (again when the file changes). ValueError for a file that is not
    one; FileNotFoundError (naming the training command) when there is none."""
    from safetensors import safe_open

    path = _resolve(embeddings).resolve()
    key = (str(path), path.stat().st_mtime_ns)
    with _LOCK:
        hit = _LOADED.get(key)
        if hit is not None:
            return hit
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                if meta.get("format") != _FORMAT:
                    raise ValueError(f"{path} is not a PaSS embeddings file (format {meta.get('format')!r})")
                vectors, probe = f.get_tensor("vectors").float(), f.get_tensor("probe").float()
            hit = PassEmbeddings(vectors, int(meta["vocab_size"]), int(meta["hidden_size"]), probe,
                                 json.loads(meta.get("info", "{}")), str(path))
        except ValueError:
            raise
        except Exception as err:  # noqa: BLE001 - a torn or foreign file
            raise ValueError(f"cannot read PaSS embeddings from {path}: {err}") from err
        if vectors.dim() != 2 or vectors.shape[1] != hit.hidden_size or vectors.shape[0] < 1:
            raise ValueError(f"{path}: vectors of shape {tuple(vectors.shape)} for hidden size {hit.hidden_size}")
        for k in [k for k in _LOADED if k[0] == key[0]]:
            del _LOADED[k]
        _LOADED[key] = hit
        return hit


@dataclass(eq=False)
class _State:
    look: Lookahead
    pending: torch.Tensor | None = None  # logits [L, V] read after the last verify pass
    current: torch.Tensor | None = None  # the ones this step drafts from


@register
class PaSS(Drafter):
    """Drafts from L learned look-ahead embeddings fed in the verify pass (PaSS). Lossless:
    the verifier decides."""

    name: ClassVar[str] = "pass"

    embeddings: str = Field("default", description="folder of trained look-ahead embeddings (accel train-pass), "
                            "or 'default' (shipped for the default model)")
    anchors: int = Field(2, ge=1, le=8, description="tree nodes down the main chain (root first) whose look-ahead "
                         "copies the verify pass carries, L positions each")
    top_k: int = Field(2, ge=1, le=16, description="candidate tokens per depth")
    max_nodes: int = Field(8, ge=1, le=256, description="draft nodes per step at most (the engine's budget may cut it)")

    @field_validator("embeddings", mode="before")
    @classmethod
    def _path(cls, value: Any) -> Any:
        if isinstance(value, os.PathLike):
            value = os.fspath(value)
        if isinstance(value, str) and not value:
            raise ValueError("needs a folder of PaSS embeddings, or 'default'")
        return value

    def _fit(self, model: Any) -> PassEmbeddings:
        try:
            loaded = load_pass(self.embeddings)
        except FileNotFoundError as err:
            raise ValueError(f"pass.embeddings: {err}") from err
        cfg = model.config.get_text_config(decoder=True)
        name = type(model).__name__
        if loaded.hidden_size != cfg.hidden_size or loaded.vocab_size != cfg.vocab_size:
            raise ValueError(f"the PaSS embeddings in '{loaded.source}' are for hidden size {loaded.hidden_size} and "
                             f"{loaded.vocab_size} tokens, but the model ({name}) has {cfg.hidden_size} and "
                             f"{cfg.vocab_size}: they were trained for another model; {_TRAIN_HINT}")
        if not torch.allclose(model_probe(model), loaded.probe, rtol=0.05, atol=0.01):
            raise ValueError(f"the PaSS embeddings in '{loaded.source}' were trained for another model of the same "
                             f"shape (its input embeddings differ from {name}'s); {_TRAIN_HINT}")
        return loaded

    def check(self, model: Any) -> None:
        """ValueError unless the embeddings load and were trained for ``model`` (same vocabulary,
        hidden size and input embeddings); a missing file names the training command."""
        self._fit(model)

    def start(self, model: Any, prompt: torch.Tensor) -> _State:
        loaded = self._fit(model)
        param = next(model.parameters())
        dtype = param.dtype if param.dtype.is_floating_point else torch.float32
        return _State(Lookahead(loaded.vectors.to(device=param.device, dtype=dtype), self.anchors))

    def lookahead(self, state: _State) -> Lookahead:
        # What the last pass read is this step's to draft from; nothing read, nothing drafted.
        state.current, state.pending = state.pending, None
        return state.look

    def read_lookahead(self, state: _State, logits: torch.Tensor | None) -> None:
        state.pending = logits

    def propose(self, state: _State, ctx: DraftContext) -> DraftProposal | None:
        logits, state.current = state.current, None
        budget = min(self.max_nodes, ctx.max_tokens)
        if logits is None or budget < 1:
            return None
        scores = logits if ctx.warp is None else ctx.warp(logits)
        probs, tokens = torch.softmax(scores.float(), dim=-1).topk(min(self.top_k, scores.shape[-1]), dim=-1)
        probs, tokens = probs.tolist(), tokens.tolist()  # [L][k]
        depth_count = len(tokens)
        out_tokens: list[int] = []
        parents: list[int] = []
        heap = [(-p, 0, 0, tok) for p, tok in zip(probs[0], tokens[0])]  # (-score, depth, parent node, token)
        heapq.heapify(heap)
        while heap and len(out_tokens) < budget:
            neg, d, parent, tok = heapq.heappop(heap)
            out_tokens.append(tok)
            parents.append(parent)
            node = len(out_tokens)
            if d + 1 < depth_count:
                for p, t in zip(probs[d + 1], tokens[d + 1]):
                    heapq.heappush(heap, (neg * p, d + 1, node, t))
        device = ctx.tokens.device
        return DraftProposal(torch.tensor(out_tokens, dtype=torch.long, device=device),
                             torch.tensor(parents, dtype=torch.long, device=device))
