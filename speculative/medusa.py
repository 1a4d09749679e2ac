"""Medusa draft heads (Cai et al. 2024): K small heads on the model's last hidden state.

Head k (1-based) reads the final normed hidden state ``h_t`` at the last verified position
and predicts the token k steps after the one the model's own head predicts there: the root
(pending token) comes from ``lm_head(h_t)``, so head 1 drafts the token after the root, head
2 the one after that, and so on. Each head is ``num_layers`` residual blocks
``x + SiLU(W x + b)`` followed by the model's own ``lm_head`` (default: nothing to store but
the blocks, a few MB) or by an output layer of its own (the official Medusa format).

The hidden state comes from the very forward pass that verified the previous tree (the
engine hands it over as ``DraftContext.hidden``), so the heads need no cache of their own:
the verifier and the drafts share the one, possibly SnapKV-compressed, cache.

Heads come in two kinds. **Independent** heads (the paper's) see only ``h_t``: head 2 must
guess the token two steps ahead without knowing which token head 1 proposed below it, so
it averages over continuations. **Sequential** heads (``sequential=True``, the Hydra
variant of Ankner et al. 2024, "Hydra: Sequentially-Dependent Draft Heads for Medusa
Decoding") also read the input embeddings of the tokens on the path they extend: head k's
first block is ``x + SiLU(W [h_t; e(root); e(d_1); ...; e(d_{k-1})] + b)``. A tree is then
drafted level by level, each node from its own path, still without any cache: the path is
at most K tokens. ``accel train-heads`` trains sequential heads unless ``--independent``.

The tree a step verifies is, by default, **dynamic** (``tree="dynamic"``, as in EAGLE-2, Li
et al. 2024): each step, the heads' probabilities of whole paths rank the candidates and the
``max_nodes`` most probable are verified, so the tree runs deep where the heads are sure and
wide where they are not. ``tree="auto"`` is the paper's static tree, grown once from the
heads' measured per-rank accuracies; named and explicit trees are static too.

Trained heads may carry a vocabulary subset (the tokens of their training data): the heads
then score only those rows of the output layer, which makes drafting and training several
times cheaper on a CPU; other tokens are never drafted (the verifier still emits them).

Files:

- our format: ``medusa_heads.safetensors`` + ``medusa_config.json`` (num_heads, num_layers,
  hidden_size, vocab_size, own_lm_head, base_model, measured per-head top-1..top-10
  accuracies, training info), written by :meth:`MedusaHeads.save_pretrained` and by
  ``accel train-heads``. ``"default"`` names the heads shipped for the default model.
- the official Medusa format: ``config.json`` with ``medusa_num_heads`` and
  ``medusa_num_layers`` plus ``medusa_lm_head.pt`` (or ``.safetensors``), a state dict with,
  per head k, ``k.{l}.linear.weight/bias`` for each residual block l and ``k.{L}.weight``
  (the head's own vocabulary projection, no bias). :meth:`MedusaHeads.from_official` reads
  it directly, pickles only through ``torch.load(weights_only=True)``. The ``medusa-llm``
  package (0.1) does import with transformers 5.24, but its only loader,
  ``MedusaModel.from_pretrained``, rebuilds the base model and tokenizer from the hub by
  name (a download) and unpickles without ``weights_only``, so it cannot attach heads to a
  model we already hold; the format is a plain state dict, read here as it is.
"""

from __future__ import annotations

import json
import os
import threading
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import Field, field_serializer, field_validator
from torch import nn

from accel.cpu import PackedLinear
from accel.strategy import DraftContext, DraftProposal, Drafter, register

from .medusa_trees import (
    TREES,
    Path as TreePath,
    TreeArrays,
    TreeLevel,
    build_tree,
    check_paths,
    rank_accuracies,
    tree_arrays,
    tree_levels,
    truncate_paths,
)

__all__ = [
    "Medusa",
    "MedusaHeads",
    "PackedHeads",
    "PackedPathHeads",
    "DEFAULT_HEADS_DIR",
    "DEFAULT_MAX_NODES",
    "WEIGHTS_NAME",
    "CONFIG_NAME",
    "resolve_heads_dir",
    "load_heads",
]

WEIGHTS_NAME = "medusa_heads.safetensors"
CONFIG_NAME = "medusa_config.json"
OFFICIAL_CONFIG = "config.json"
OFFICIAL_WEIGHTS = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")
FORMAT = "accel-medusa"
FORMAT_VERSION = 1

#: The heads trained for the default model (SmolLM2-135M-Instruct), shipped in the package.
DEFAULT_HEADS_DIR = Path(__file__).resolve().parent / "heads" / "default"

#: Draft nodes per verify step unless configured (the engine's own budget caps it too). On the
#: 2-core CPU with prepacked weights (``accel.prepack``), at chat lengths a verify pass of 0, 7
#: and 15 drafts took 41.1, 44.8 and 51.9 ms (``python benchmarks/verify_cost.py --contexts 200
#: --sizes 0 7 15``): each draft past the seventh costs ~0.9 ms, so such a node must be
#: accepted ~3-4% of the time to pay for itself. Chosen on the development
#: prompts (``python benchmarks/medusa_check.py sweep --configs dynamic:8 dynamic:10
#: dynamic:12``): 2.06 / 2.10 / 2.13 tokens per step at 1.67x / 1.60x / 1.51x plain decoding;
#: 10 keeps a margin in tokens per step at about the speed of 8. On the benchmark's 40
#: held-out chat prompts (``python benchmarks/medusa_check.py chat``): 2.09 tokens per step, 1.71x.
DEFAULT_MAX_NODES = 10


# --------------------------------------------------------------------------- the heads


class ResBlock(nn.Module):
    """``x + SiLU(W x + b)``; W and b start at zero, so a fresh block is the identity."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)
        self.dropout = 0.0  # on the block's input to W, in training mode only (a regulariser)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inner = F.dropout(x, self.dropout, training=True) if self.training and self.dropout else x
        return x + F.silu(self.linear(inner))


class PathBlock(nn.Module):
    """The first block of a sequential (Hydra-style) head that extends paths of n tokens:
    ``x + SiLU(W [x; e_1; ...; e_n] + b)``, with e_i the input embeddings of the tokens on
    the path (the root first). W [H, (n + 1) H] and b start at zero."""

    def __init__(self, hidden_size: int, path_len: int):
        super().__init__()
        self.linear = nn.Linear((path_len + 1) * hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)
        self.dropout = 0.0

    def forward(self, x: torch.Tensor, path_emb: torch.Tensor) -> torch.Tensor:
        """x: [..., H]; path_emb: [..., n, H]. Returns [..., H]."""
        inner = torch.cat([x, path_emb.flatten(-2)], dim=-1)
        if self.training and self.dropout:
            inner = F.dropout(inner, self.dropout, training=True)
        return x + F.silu(self.linear(inner))


class MedusaHead(nn.Module):
    """One head: residual blocks (the first a :class:`PathBlock` when the head reads a path
    of ``path_len`` tokens), then (optionally) its own vocabulary projection."""

    def __init__(self, hidden_size: int, vocab_size: int, num_layers: int, own_lm_head: bool, path_len: int = 0):
        super().__init__()
        first = [PathBlock(hidden_size, path_len)] if path_len else []
        self.blocks = nn.ModuleList(first + [ResBlock(hidden_size) for _ in range(num_layers - len(first))])
        self.path_len = path_len
        self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False) if own_lm_head else None

    def hidden(self, x: torch.Tensor, path_emb: torch.Tensor | None = None) -> torch.Tensor:
        for i, block in enumerate(self.blocks):
            x = block(x, path_emb) if i == 0 and self.path_len else block(x)
        return x


class MedusaHeads(nn.Module):
    """K Medusa heads for a model with hidden size H and vocabulary V.

    Independent heads (the paper's) see only the hidden state. Sequential heads
    (``sequential=True``, the Hydra variant of Ankner et al. 2024) also read the input
    embeddings of the tokens on the path they extend: head k sees the root and the drafts of
    heads 1..k-1 above it, so a tree is drafted level by level, each node from its own path.
    That lets head k's guess follow what the earlier heads guessed instead of averaging over
    every possible continuation, the main weakness of independent heads.

    A fresh set (zero-initialised blocks, own output layers copied from the base model with
    :meth:`init_lm_heads`) predicts, at every head, what the base model predicts for the next
    token, the paper's starting point for training.

    vocab_subset: LongTensor [V'] or None, sorted token ids the heads draft from (training
        fills it with the tokens of its data); None: the whole vocabulary. Restricting the
        vocabulary projection to these rows makes training and drafting several times
        cheaper on a CPU; tokens outside it are never drafted.
    info: free-form facts saved in the config: ``base_model``, ``topk_accuracy`` ([K][10]
        cumulative top-1..top-10 accuracies on held-out data, used by the tree builder),
        ``training`` (data, steps, time).
    """

    def __init__(
        self,
        num_heads: int,
        hidden_size: int,
        vocab_size: int,
        num_layers: int = 1,
        own_lm_head: bool = False,
        info: dict[str, Any] | None = None,
        vocab_subset: torch.Tensor | None = None,
        sequential: bool = False,
    ):
        super().__init__()
        if num_heads < 1 or num_layers < (1 if sequential else 0) or hidden_size < 1 or vocab_size < 1:
            raise ValueError(
                f"MedusaHeads needs num_heads >= 1, num_layers >= {1 if sequential else 0}"
                f"{' (sequential heads read the path in their first block)' if sequential else ''}, positive sizes; "
                f"got num_heads={num_heads}, num_layers={num_layers}, hidden_size={hidden_size}, vocab_size={vocab_size}"
            )
        self.sequential = bool(sequential)
        self.num_heads = num_heads
        self.num_layers = num_layers
        self.hidden_size = hidden_size
        self.vocab_size = vocab_size
        self.own_lm_head = own_lm_head
        self.info: dict[str, Any] = dict(info or {})
        self.heads = nn.ModuleList(
            MedusaHead(hidden_size, vocab_size, num_layers, own_lm_head, path_len=k + 1 if sequential else 0)
            for k in range(num_heads)
        )
        self.vocab_subset: torch.Tensor | None
        self.register_buffer("vocab_subset", None)
        if vocab_subset is not None:
            self.set_vocab_subset(vocab_subset)

    def set_vocab_subset(self, tokens: torch.Tensor | None) -> None:
        """Draft only from ``tokens`` (any order, duplicates dropped), or from all with None."""
        if tokens is None:
            self.vocab_subset = None
            return
        tokens = torch.unique(torch.as_tensor(tokens, dtype=torch.long).reshape(-1))
        if tokens.numel() == 0 or int(tokens[0]) < 0 or int(tokens[-1]) >= self.vocab_size:
            raise ValueError(f"vocab_subset must hold token ids in 0..{self.vocab_size - 1}")
        self.vocab_subset = tokens

    # ------------------------------------------------------------------ compute

    def hidden(self, h: torch.Tensor, path_emb: torch.Tensor | None = None) -> torch.Tensor:
        """Per-head hidden states before the vocabulary projection: [..., H] -> [..., K, H].

        path_emb: [..., K, H], sequential heads only (required there): the input embeddings
            of the root and of the K - 1 tokens after it; head k reads the first k.
        """
        if not self.sequential:
            return torch.stack([head.hidden(h) for head in self.heads], dim=-2)
        if path_emb is None or path_emb.shape[-2] < self.num_heads:
            raise ValueError(f"sequential heads need path_emb [..., {self.num_heads}, H], the embeddings of the paths they extend")
        return torch.stack([head.hidden(h, path_emb[..., : k + 1, :]) for k, head in enumerate(self.heads)], dim=-2)

    def forward(self, h: torch.Tensor, lm_head: nn.Module | None = None, path_emb: torch.Tensor | None = None) -> torch.Tensor:
        """Head logits [..., K, V] from hidden states [..., H] (-inf outside ``vocab_subset``).

        lm_head: the base model's output layer (``model.get_output_embeddings()``); required
        unless the heads have their own. path_emb: as in :meth:`hidden`.
        """
        x = self.hidden(h, path_emb)
        if self.own_lm_head:
            logits = torch.stack([head.lm_head(x[..., k, :]) for k, head in enumerate(self.heads)], dim=-2)
        elif lm_head is None:
            raise ValueError("these Medusa heads use the base model's lm_head: pass lm_head=model.get_output_embeddings()")
        else:
            logits = lm_head(x)
        if self.vocab_subset is not None:
            keep = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
            keep[self.vocab_subset.to(logits.device)] = True
            logits = logits.masked_fill(~keep, float("-inf"))
        return logits

    def set_dropout(self, p: float) -> None:
        """Dropout on every block's input to its linear layer while training."""
        for head in self.heads:
            for block in head.blocks:
                block.dropout = float(p)

    def init_lm_heads(self, weight: torch.Tensor) -> None:
        """Copy the base model's output weight [V, H] into every head's own output layer."""
        if not self.own_lm_head:
            raise ValueError("these heads share the base model's lm_head; there is nothing to initialise")
        with torch.no_grad():
            for head in self.heads:
                head.lm_head.weight.copy_(weight)

    def config(self) -> dict[str, Any]:
        """The JSON config saved beside the weights."""
        return {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "num_heads": self.num_heads,
            "num_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "own_lm_head": self.own_lm_head,
            "sequential": self.sequential,
            "vocab_subset_size": int(self.vocab_subset.numel()) if self.vocab_subset is not None else None,
            **self.info,
        }

    @property
    def topk_accuracy(self) -> list[list[float]] | None:
        """[K][topk] cumulative accuracies measured on held-out data, if known."""
        acc = self.info.get("topk_accuracy")
        return [list(map(float, row)) for row in acc] if acc else None

    def pack(self, dtype: torch.dtype | None = None, device: torch.device | str | None = None,
             head_dtype: torch.dtype | None = None) -> "PackedHeads | PackedPathHeads":
        """The weights stacked for fast drafting (see :class:`PackedHeads` and
        :class:`PackedPathHeads`)."""
        dtype = dtype or torch.float32
        L, K, H = self.num_layers, self.num_heads, self.hidden_size
        with torch.no_grad():
            subset = self.vocab_subset.to(device) if self.vocab_subset is not None else None
            out = None
            if self.own_lm_head:
                out = torch.stack([h.lm_head.weight if subset is None else h.lm_head.weight[self.vocab_subset] for h in self.heads])
                out = out.to(device=device, dtype=head_dtype or dtype).contiguous()
            if self.sequential:
                def packed(linear: nn.Linear, to: torch.dtype) -> PackedLinear:
                    return PackedLinear.from_weight(linear.weight.to(device=device, dtype=to).contiguous(),
                                                    linear.bias.to(device=device, dtype=to).contiguous())

                return PackedPathHeads(
                    tuple(tuple(packed(b.linear, dtype) for b in h.blocks) for h in self.heads),
                    tuple(PackedLinear.from_weight(o) for o in out) if out is not None else None,
                    subset,
                )
            if L:
                weight = torch.stack([torch.stack([h.blocks[l].linear.weight for h in self.heads]) for l in range(L)])
                bias = torch.stack([torch.stack([h.blocks[l].linear.bias for h in self.heads]) for l in range(L)])
            else:
                weight, bias = torch.empty(0, K, H, H), torch.empty(0, K, H)
            return PackedHeads(weight.to(device=device, dtype=dtype).contiguous(), bias.to(device=device, dtype=dtype).contiguous(),
                               out, subset)

    # ------------------------------------------------------------------ files

    def save_pretrained(self, folder: str | os.PathLike, dtype: torch.dtype | None = None) -> Path:
        """Write ``medusa_heads.safetensors`` (in ``dtype``, default as held) and
        ``medusa_config.json`` into ``folder``. Returns the folder."""
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        state = {k: (v.to(dtype) if dtype is not None and v.is_floating_point() else v).detach().cpu().contiguous()
                 for k, v in self.state_dict().items()}
        tmp = folder / f".{WEIGHTS_NAME}.tmp-{os.getpid()}"
        save_file(state, str(tmp), metadata={"format": FORMAT})
        os.chmod(tmp, 0o644)
        os.replace(tmp, folder / WEIGHTS_NAME)
        cfg = self.config()
        tmp = folder / f".{CONFIG_NAME}.tmp-{os.getpid()}"
        tmp.write_text(json.dumps(cfg, indent=2) + "\n")
        os.replace(tmp, folder / CONFIG_NAME)
        return folder

    @classmethod
    def from_pretrained(cls, folder: str | os.PathLike) -> "MedusaHeads":
        """Load heads from ``folder`` (our format or the official Medusa format), or the
        heads shipped for the default model with ``"default"``. Weights come back float32.

        Raises FileNotFoundError for a missing folder and ValueError, naming the file and
        the problem, for a malformed config or weights file.
        """
        path = resolve_heads_dir(folder)
        if (path / CONFIG_NAME).is_file():
            return cls._from_ours(path)
        if (path / OFFICIAL_CONFIG).is_file() and any((path / n).is_file() for n in OFFICIAL_WEIGHTS):
            return cls.from_official(path)
        raise ValueError(
            f"'{path}' holds no Medusa heads: expected {CONFIG_NAME} + {WEIGHTS_NAME} (accel's format) or "
            f"{OFFICIAL_CONFIG} + {OFFICIAL_WEIGHTS[1]} (the official Medusa format)"
        )

    @classmethod
    def _from_ours(cls, folder: Path) -> "MedusaHeads":
        cfg_file = folder / CONFIG_NAME
        cfg = _read_json(cfg_file)
        ints = {}
        for key in ("num_heads", "num_layers", "hidden_size", "vocab_size"):
            value = cfg.get(key)
            if not isinstance(value, int) or isinstance(value, bool) or value < (0 if key == "num_layers" else 1):
                raise ValueError(f"{cfg_file}: '{key}' must be a {'non-negative' if key == 'num_layers' else 'positive'} integer, got {value!r}")
            ints[key] = value
        own = cfg.get("own_lm_head", False)
        if not isinstance(own, bool):
            raise ValueError(f"{cfg_file}: 'own_lm_head' must be true or false, got {own!r}")
        sequential = cfg.get("sequential", False)
        if not isinstance(sequential, bool):
            raise ValueError(f"{cfg_file}: 'sequential' must be true or false, got {sequential!r}")
        if sequential and ints["num_layers"] < 1:
            raise ValueError(f"{cfg_file}: sequential heads need 'num_layers' >= 1, got {ints['num_layers']}")
        acc = cfg.get("topk_accuracy")
        if acc is not None and not (
            isinstance(acc, list) and len(acc) == ints["num_heads"]
            and all(isinstance(r, list) and all(isinstance(x, (int, float)) for x in r) for r in acc)
        ):
            raise ValueError(f"{cfg_file}: 'topk_accuracy' must be a list of {ints['num_heads']} lists of numbers")
        subset_size = cfg.get("vocab_subset_size")
        if subset_size is not None and (not isinstance(subset_size, int) or isinstance(subset_size, bool)
                                        or not 0 < subset_size <= ints["vocab_size"]):
            raise ValueError(f"{cfg_file}: 'vocab_subset_size' must be null or an integer in 1..vocab_size, got {subset_size!r}")
        info = {k: v for k, v in cfg.items()
                if k not in {"format", "format_version", "own_lm_head", "sequential", "vocab_subset_size", *ints}}
        heads = cls(own_lm_head=own, info=info, sequential=sequential, **ints)
        if subset_size:
            heads.vocab_subset = torch.zeros(subset_size, dtype=torch.long)  # shape placeholder, loaded below
        weights_file = folder / WEIGHTS_NAME
        state = _read_safetensors(weights_file)
        _load_state(heads, state, weights_file)
        return heads

    @classmethod
    def from_official(cls, folder: str | os.PathLike) -> "MedusaHeads":
        """Load heads saved in the official Medusa format (see the module docstring) as
        heads with their own output layers. Weights come back float32."""
        folder = Path(folder)
        cfg_file = folder / OFFICIAL_CONFIG
        cfg = _read_json(cfg_file)
        num_heads, num_layers = cfg.get("medusa_num_heads"), cfg.get("medusa_num_layers")
        for key, value in (("medusa_num_heads", num_heads), ("medusa_num_layers", num_layers)):
            if not isinstance(value, int) or isinstance(value, bool) or value < (1 if key == "medusa_num_heads" else 0):
                raise ValueError(f"{cfg_file}: '{key}' must be a {'positive' if key == 'medusa_num_heads' else 'non-negative'} integer, got {value!r}")
        weights_file = next((folder / n for n in OFFICIAL_WEIGHTS if (folder / n).is_file()), None)
        if weights_file is None:
            raise FileNotFoundError(f"'{folder}' has {OFFICIAL_CONFIG} but no {' or '.join(OFFICIAL_WEIGHTS)}")
        if weights_file.suffix == ".pt":
            try:
                raw = torch.load(weights_file, map_location="cpu", weights_only=True)
            except Exception as err:  # pickle errors come in many types
                raise ValueError(
                    f"{weights_file}: not a plain state dict that torch.load(weights_only=True) can read "
                    f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})"
                ) from None
        else:
            raw = _read_safetensors(weights_file)
        if not isinstance(raw, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in raw.items()):
            raise ValueError(f"{weights_file}: expected a state dict (names -> tensors), got {type(raw).__name__}")
        prefix = "medusa_head."
        if raw and all(k.startswith(prefix) for k in raw):
            raw = {k[len(prefix):]: v for k, v in raw.items()}
        final = f"0.{num_layers}.weight"
        if final not in raw or raw[final].dim() != 2:
            raise ValueError(
                f"{weights_file}: missing '{final}' (head 0's vocabulary projection after {num_layers} residual "
                f"block(s), per {cfg_file.name}'s medusa_num_layers={num_layers})"
            )
        vocab_size, hidden_size = raw[final].shape
        state = {}
        for k in range(num_heads):
            for l in range(num_layers):
                for part in ("weight", "bias"):
                    state[f"heads.{k}.blocks.{l}.linear.{part}"] = _take(raw, f"{k}.{l}.linear.{part}", weights_file)
            state[f"heads.{k}.lm_head.weight"] = _take(raw, f"{k}.{num_layers}.weight", weights_file)
        if raw:
            extra = sorted(raw)
            raise ValueError(
                f"{weights_file}: {len(extra)} unexpected tensors (e.g. '{extra[0]}'); does {cfg_file.name} "
                f"(medusa_num_heads={num_heads}, medusa_num_layers={num_layers}) describe this file?"
            )
        info = {"base_model": cfg.get("base_model_name_or_path"), "source": f"official Medusa format ({weights_file.name})"}
        heads = cls(num_heads, hidden_size, vocab_size, num_layers, own_lm_head=True, info=info)
        _load_state(heads, state, weights_file)
        return heads


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"'{path}' does not exist") from None
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise ValueError(f"{path}: not a readable JSON file ({err})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    if not path.is_file():
        raise FileNotFoundError(f"'{path}' does not exist")
    try:
        return load_file(str(path))
    except Exception as err:  # SafetensorError, OSError, ...
        raise ValueError(f"{path}: not a readable safetensors file ({err})") from None


def _take(raw: dict[str, torch.Tensor], key: str, where: Path) -> torch.Tensor:
    if key not in raw:
        raise ValueError(f"{where}: missing tensor '{key}'")
    return raw.pop(key)


def _describe(heads: MedusaHeads) -> str:
    return (f"config: {heads.num_heads} {'sequential' if heads.sequential else 'independent'} heads x "
            f"{heads.num_layers} layers, own_lm_head={heads.own_lm_head}")


def _load_state(heads: MedusaHeads, state: dict[str, torch.Tensor], where: Path) -> None:
    """Check names and shapes against ``heads`` and load (as float32); ValueError otherwise."""
    expected = heads.state_dict()
    missing = [k for k in expected if k not in state]
    if missing:
        raise ValueError(f"{where}: missing tensor '{missing[0]}'" + (f" and {len(missing) - 1} more" if len(missing) > 1 else "")
                         + f" ({_describe(heads)})")
    extra = [k for k in state if k not in expected]
    if extra:
        raise ValueError(f"{where}: unexpected tensor '{extra[0]}'" + (f" and {len(extra) - 1} more" if len(extra) > 1 else "")
                         + f" ({_describe(heads)})")
    for k, v in expected.items():
        if tuple(state[k].shape) != tuple(v.shape):
            raise ValueError(f"{where}: tensor '{k}' has shape {tuple(state[k].shape)}, expected {tuple(v.shape)} "
                             f"(hidden_size={heads.hidden_size}, vocab_size={heads.vocab_size}, {_describe(heads)})")
        if state[k].is_floating_point() != v.is_floating_point():
            raise ValueError(f"{where}: tensor '{k}' has dtype {state[k].dtype}, expected {'a floating point' if v.is_floating_point() else 'an integer'} type")
    subset = state.pop("vocab_subset", None)
    heads.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    if subset is not None:
        subset = subset.long()
        if subset.numel() and (int(subset.min()) < 0 or int(subset.max()) >= heads.vocab_size
                               or not bool((subset[1:] > subset[:-1]).all())):
            raise ValueError(f"{where}: 'vocab_subset' must hold sorted, distinct token ids in 0..{heads.vocab_size - 1}")
        heads.vocab_subset = subset


def resolve_heads_dir(heads: str | os.PathLike) -> Path:
    """The folder named by ``heads``: ``"default"`` is the shipped heads, else a path."""
    if os.fspath(heads) == "default":
        if not (DEFAULT_HEADS_DIR / CONFIG_NAME).is_file():
            raise FileNotFoundError(
                f"no Medusa heads are shipped in '{DEFAULT_HEADS_DIR}'; train some with "
                f"`accel train-heads --model default --out DIR` and pass heads=DIR"
            )
        return DEFAULT_HEADS_DIR
    path = Path(heads).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(f"Medusa heads folder '{path}' does not exist")
    return path.resolve()


# --------------------------------------------------------------------------- fast inference


@dataclass(frozen=True)
class PackedHeads:
    """Head weights stacked for one hidden vector at a time (the decode loop's case).

    weight: [L, K, H, H] residual-block weights, layer-major; bias: [L, K, H].
    lm_heads: [K, V', H] own output layers (in the head dtype), or None to use the model's.
    subset: LongTensor [V'] token id of each output row, or None (rows are token ids).
    """

    weight: torch.Tensor
    bias: torch.Tensor
    lm_heads: torch.Tensor | None
    subset: torch.Tensor | None = None

    def hidden(self, h: torch.Tensor, num_heads: int) -> torch.Tensor:
        """[H] -> [K, H]: every head's residual blocks on the same hidden state."""
        x = h.to(self.weight.dtype).unsqueeze(0).expand(num_heads, -1)
        for layer in range(self.weight.shape[0]):
            y = torch.bmm(self.weight[layer], x.unsqueeze(-1)).squeeze(-1) + self.bias[layer]
            x = x + F.silu(y)
        return x

    @property
    def device(self) -> torch.device:
        return self.weight.device

    def top_tokens(self, h: torch.Tensor, k: int, num_heads: int, lm: PackedLinear | None,
                   log_probs: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Each head's ``k`` most likely tokens, [K, k] (rank 0 first), for hidden state [H];
        with ``log_probs`` also their log-probabilities under the head, [K, k] float32.

        lm: the model's output layer restricted to ``subset`` (all rows without one), in the
        head dtype; unused when the heads have their own (``lm_heads``).
        """
        x = self.hidden(h, num_heads)
        if self.lm_heads is not None:
            logits = torch.bmm(self.lm_heads, x.to(self.lm_heads.dtype).unsqueeze(-1)).squeeze(-1)
        else:
            logits = lm(x.to(lm.weight.dtype))
        return _top(logits, k, self.subset, log_probs)


@dataclass(frozen=True)
class PackedPathHeads:
    """Sequential heads' weights, for drafting a tree one level at a time; every matrix a
    :class:`~accel.cpu.PackedLinear` (oneDNN-packed on CPUs, so a few rows cost little).

    blocks: per head, its L residual blocks' linear layers, the first the path block of head
        k (0-based) with weight [H, (k + 2) H], the others [H, H]; lm_heads: per head its own
        output layer [V', H] (in the head dtype), or None to use the model's; subset as in
        :class:`PackedHeads`.
    """

    blocks: tuple[tuple[PackedLinear, ...], ...]
    lm_heads: tuple[PackedLinear, ...] | None
    subset: torch.Tensor | None = None

    @property
    def device(self) -> torch.device:
        return self.blocks[0][0].weight.device

    def top_tokens(self, head: int, h: torch.Tensor, path_emb: torch.Tensor, k: int, lm: PackedLinear | None,
                   log_probs: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Head ``head``'s ``k`` most likely tokens after each of P paths, [P, k] (rank 0 first);
        with ``log_probs`` also their log-probabilities, [P, k] float32.

        h: [H] the verifier's hidden state; path_emb: [P, head + 1, H] the input embeddings of
        each path's tokens, the root first. lm as in :meth:`PackedHeads.top_tokens`.
        """
        first, *rest = self.blocks[head]
        dtype = first.weight.dtype
        rows = path_emb.shape[0]
        x = h.to(dtype).reshape(1, -1).expand(rows, -1)
        inner = torch.cat([x, path_emb.to(dtype).reshape(rows, -1)], dim=-1)
        x = x + F.silu(first(inner))
        for block in rest:
            x = x + F.silu(block(x))
        out = self.lm_heads[head] if self.lm_heads is not None else lm
        return _top(out(x.to(out.weight.dtype)), k, self.subset, log_probs)


def _top(logits: torch.Tensor, k: int, subset: torch.Tensor | None,
         log_probs: bool) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` best rows of ``logits`` [..., V'] as token ids (through ``subset``), rank 0
    first; with ``log_probs`` also their log-softmax values (float32)."""
    values, idx = torch.topk(logits, k, dim=-1, sorted=True)
    tokens = subset[idx] if subset is not None else idx
    if not log_probs:
        return tokens
    return tokens, values.float() - torch.logsumexp(logits.float(), dim=-1, keepdim=True)


@dataclass(frozen=True)
class _Loaded:
    packed: PackedHeads | PackedPathHeads
    sequential: bool
    num_heads: int
    hidden_size: int
    vocab_size: int
    own_lm_head: bool
    topk_accuracy: list[list[float]] | None
    source: Path


# Loaded heads by (resolved folder, weights mtime, dtype, device, head dtype): strategies
# hold configuration only, so the weights live here and every request shares them.
_HEADS_CACHE: dict[tuple[Any, ...], _Loaded] = {}
# The model's output layer converted to the head dtype and packed, by id(weight), with a
# weak reference and the tensor's version counter to notice a replaced or modified weight.
_LM_CACHE: dict[tuple[Any, ...], tuple[weakref.ref, int, PackedLinear]] = {}
_LOCK = threading.Lock()


def load_heads(heads: str | os.PathLike, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
               head_dtype: torch.dtype | None = None) -> _Loaded:
    """Heads from ``heads`` (a folder or ``"default"``), packed in ``dtype`` on ``device``
    (own output layers in ``head_dtype``), cached for the life of the process."""
    path = resolve_heads_dir(heads)
    stamp = max((p.stat().st_mtime_ns for p in path.iterdir() if p.is_file()), default=0)
    device = torch.device(device)
    key = (str(path), stamp, dtype, str(device), head_dtype)
    with _LOCK:
        hit = _HEADS_CACHE.get(key)
        if hit is None:
            module = MedusaHeads.from_pretrained(path)
            hit = _Loaded(
                packed=module.pack(dtype, device, head_dtype),
                sequential=module.sequential,
                num_heads=module.num_heads,
                hidden_size=module.hidden_size,
                vocab_size=module.vocab_size,
                own_lm_head=module.own_lm_head,
                topk_accuracy=module.topk_accuracy,
                source=path,
            )
            _HEADS_CACHE[key] = hit
    return hit


def _lm_layer(out: nn.Module, dtype: torch.dtype, rows: torch.Tensor | None = None) -> PackedLinear:
    """The model's output layer ``out`` (weight [V, H], optional bias; only ``rows`` if
    given) in ``dtype``, as a :class:`~accel.cpu.PackedLinear`: ``out`` itself when it
    already is one over all rows in that dtype, else a packed copy cached for the weight's
    life. ``rows`` must be a long-lived tensor (the cached heads' subset)."""
    weight, bias = out.weight, getattr(out, "bias", None)
    if rows is None and weight.dtype == dtype and isinstance(out, PackedLinear):
        return out
    key = (id(weight), dtype, id(rows) if rows is not None else None)
    with _LOCK:
        hit = _LM_CACHE.get(key)
        if hit is not None and hit[0]() is weight and hit[1] == weight._version:
            return hit[2]
        w = weight.detach()
        w = (w[rows] if rows is not None else w).to(dtype).contiguous()
        b = None if bias is None else (bias.detach()[rows] if rows is not None else bias.detach()).to(dtype).contiguous()
        for k in [k for k, v in _LM_CACHE.items() if v[0]() is None]:
            del _LM_CACHE[k]
        layer = PackedLinear.from_weight(w, b)
        _LM_CACHE[key] = (weakref.ref(weight), weight._version, layer)
        return layer


def _bf16_fast_on_cpu() -> bool:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # pragma: no cover - older / unusual builds
        return False


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# --------------------------------------------------------------------------- the drafter


@dataclass
class _State:
    loaded: _Loaded
    lm: PackedLinear | None  # the model's output layer (subset rows) in the head dtype
    paths: tuple[TreePath, ...]
    embed: torch.Tensor | None = None  # [V, H] the model's input embeddings (sequential heads)
    arrays: dict[int, TreeArrays] = field(default_factory=dict)  # by node count
    topk: dict[int, int] = field(default_factory=dict)  # node count -> top tokens needed per head
    levels: dict[int, tuple[TreeLevel, ...]] = field(default_factory=dict)  # by node count (sequential heads)

    def tree(self, n: int) -> tuple[TreeArrays, int]:
        arrays = self.arrays.get(n)
        if arrays is None:
            paths = self.paths[:n]
            arrays = self.arrays[n] = tree_arrays(paths, device=self.loaded.packed.device)
            self.topk[n] = max(p[-1] for p in paths) + 1
            if self.loaded.sequential:
                self.levels[n] = tree_levels(paths, device=self.loaded.packed.device)
        return arrays, self.topk[n]


@register
class Medusa(Drafter):
    """Medusa heads draft a tree of the heads' top tokens from the verifier's hidden state.

    Lossless like every drafter here: the verifier decides, so greedy output is unchanged
    and sampling stays exact (the drafts are deterministic top-k tokens).

    ``Medusa()`` uses the heads shipped for the default model; ``Medusa(heads=DIR)`` heads
    trained with ``accel train-heads`` or saved in the official Medusa format.
    """

    name: ClassVar[str] = "medusa"
    needs_hidden: ClassVar[bool] = True

    heads: str = Field("default", description="folder of trained heads (ours or the official format), or 'default'")
    tree: str | tuple[tuple[int, ...], ...] = Field(
        "dynamic",
        description="'auto' (built for max_nodes from the heads' measured accuracies), 'dynamic' (built anew "
        f"each step from the heads' probabilities), a named tree ({', '.join(TREES)}), or explicit index paths "
        "like [[0], [1], [0, 0]]",
    )
    max_nodes: int = Field(DEFAULT_MAX_NODES, ge=1, le=1024, description="draft nodes per verify step at most")
    head_dtype: Literal["auto", "model", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="dtype of the heads' vocabulary projection: 'auto' = bfloat16 on CPUs with fast bf16 "
        "matmuls when the model is float32 (drafts only, the verifier is unaffected), else the model's",
    )

    @field_validator("tree", mode="before")
    @classmethod
    def _check_tree(cls, value: Any) -> Any:
        if isinstance(value, str):
            if value not in ("auto", "dynamic") and value not in TREES:
                raise ValueError(f"unknown tree {value!r}; use 'auto', 'dynamic', one of {sorted(TREES)} or a list of index paths")
            return value
        if isinstance(value, (list, tuple)):
            if not value:
                raise ValueError("an explicit tree needs at least one path")
            if not all(isinstance(p, (list, tuple)) and all(isinstance(i, int) and not isinstance(i, bool) for i in p) for p in value):
                raise ValueError("an explicit tree is a list of index paths, each a list of non-negative ints")
            return check_paths(value, what="tree")
        raise ValueError(f"tree must be 'auto', 'dynamic', a tree name or a list of index paths, got {type(value).__name__}")

    @field_serializer("tree")
    def _dump_tree(self, value: Any) -> Any:
        return value if isinstance(value, str) else [list(p) for p in value]  # plain lists for YAML / JSON

    @classmethod
    def from_pretrained(cls, heads: str | os.PathLike = "default", **fields: Any) -> "Medusa":
        """A Medusa drafter over the heads in ``heads`` (loaded now, so a bad file fails here)."""
        path = "default" if os.fspath(heads) == "default" else str(resolve_heads_dir(heads))
        load_heads(path)
        return cls(heads=path, **fields)

    # ------------------------------------------------------------------ per request

    def paths_for(self, loaded: _Loaded) -> tuple[TreePath, ...]:
        """The tree's index paths for these heads, at most ``max_nodes`` of them (none for the
        dynamic tree, which has no fixed shape)."""
        depth = loaded.num_heads
        if self.tree == "dynamic":
            return ()
        if self.tree == "auto":
            if loaded.topk_accuracy:
                return build_tree(rank_accuracies(loaded.topk_accuracy), self.max_nodes)
            return truncate_paths(TREES["mc_sim_7b_63"], self.max_nodes, depth)
        if isinstance(self.tree, str):
            return truncate_paths(TREES[self.tree], self.max_nodes, depth)
        deepest = max(len(p) for p in self.tree)
        if deepest > depth:
            raise ValueError(f"medusa.tree has paths {deepest} deep but the heads in '{loaded.source}' are {depth}")
        return truncate_paths(self.tree, self.max_nodes)

    def check(self, model: Any) -> None:
        """Raise a ValueError unless these heads can draft for ``model``: the heads folder
        loads, and its hidden size, vocabulary, input embeddings (sequential heads) and the
        tree's depth fit the model. Loads the heads (cached), so a bad folder fails before
        the prefill; a missing folder or file is a ValueError here too."""
        try:
            self._fit(model)
        except FileNotFoundError as err:
            raise ValueError(f"medusa.heads: {err}") from err

    def start(self, model: Any, prompt: torch.Tensor) -> _State:
        loaded, head_dtype, embed, paths = self._fit(model)
        out = model.get_output_embeddings()
        lm = None if loaded.own_lm_head else _lm_layer(out, head_dtype, loaded.packed.subset)
        return _State(loaded, lm, paths, embed)

    def _fit(self, model: Any) -> tuple[_Loaded, torch.dtype, torch.Tensor | None, tuple[TreePath, ...]]:
        """The checks of :meth:`check`; returns (heads, head dtype, input embeddings [V, H]
        for sequential heads or None, tree paths)."""
        out = model.get_output_embeddings()
        param = next(model.parameters())
        model_dtype, device = param.dtype, param.device
        if self.head_dtype == "auto":
            fast = device.type == "cpu" and model_dtype == torch.float32 and _bf16_fast_on_cpu()
            head_dtype = torch.bfloat16 if fast else model_dtype
        else:
            head_dtype = model_dtype if self.head_dtype == "model" else _DTYPES[self.head_dtype]
        loaded = load_heads(self.heads, model_dtype, device, head_dtype)
        hidden = model.config.get_text_config(decoder=True).hidden_size
        if loaded.hidden_size != hidden:
            raise ValueError(
                f"the Medusa heads in '{loaded.source}' have hidden size {loaded.hidden_size}, but the model "
                f"({type(model).__name__}) has hidden size {hidden}: they were trained for another model"
            )
        weight = getattr(out, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            raise ValueError(f"{type(model).__name__} has no output layer weight; Medusa heads need one")
        vocab = int(weight.shape[0])
        if loaded.vocab_size != vocab:
            raise ValueError(
                f"the Medusa heads in '{loaded.source}' predict {loaded.vocab_size} tokens, but the model's "
                f"vocabulary has {vocab}: they were trained for another model"
            )
        embed = None
        if loaded.sequential:
            embed = getattr(model.get_input_embeddings(), "weight", None)
            if not isinstance(embed, torch.Tensor) or tuple(embed.shape) != (vocab, hidden):
                raise ValueError(f"the sequential Medusa heads in '{loaded.source}' read the model's input embeddings, "
                                 f"but {type(model).__name__} has no [{vocab}, {hidden}] embedding weight")
        return loaded, head_dtype, embed, self.paths_for(loaded)

    def propose(self, state: _State, ctx: DraftContext) -> DraftProposal | None:
        if ctx.hidden is None:
            raise ValueError("Medusa needs the verifier's hidden state (DraftContext.hidden); the engine did not pass it")
        if self.tree == "dynamic":
            n = min(self.max_nodes, ctx.max_tokens)
            return _dynamic_tree(state, ctx, n) if n > 0 else None
        n = min(len(state.paths), ctx.max_tokens)
        if n <= 0:
            return None
        arrays, k = state.tree(n)
        loaded = state.loaded
        h = ctx.hidden.reshape(-1)
        if not loaded.sequential:
            top = loaded.packed.top_tokens(h, k, loaded.num_heads, state.lm)
            return DraftProposal(tokens=arrays.tokens(top), parents=arrays.parents)
        # level by level: each node's head reads the tokens on the path above it
        tokens = torch.empty(n + 1, dtype=torch.long, device=h.device)
        tokens[0] = ctx.tokens[-1]  # the pending root
        for level in state.levels[n]:
            path_emb = state.embed[tokens[level.ancestry]]  # [P, depth, H]
            top = loaded.packed.top_tokens(level.head, h, path_emb, level.topk, state.lm)
            tokens[level.nodes] = top[level.row, level.rank]
        return DraftProposal(tokens=tokens[1:], parents=arrays.parents)


#: The dynamic tree (``Medusa(tree="dynamic")``) expands, at each depth, the DYNAMIC_BEAM most
#: probable nodes of the depth above, DYNAMIC_WIDTH children each (capped by the node budget).
DYNAMIC_WIDTH = 8
DYNAMIC_BEAM = 6


def _dynamic_tree(state: _State, ctx: DraftContext, n: int) -> DraftProposal:
    """A draft tree of ``n`` nodes chosen anew for this step, as EAGLE-2 does (Li et al.
    2024, "EAGLE-2: Faster Inference of Language Models with Dynamic Draft Trees").

    A node's value is the heads' probability of its whole path (the product of each head's
    probability of its token, given the path above it for sequential heads): an estimate of
    the chance that the verifier accepts the node. Depth by depth, the most valuable nodes
    are expanded, then the ``n`` most valuable nodes of all that were scored are verified.
    Where the heads are sure the tree runs deep, where they are not it spreads wide; a
    static tree spends the same shape on both. A value never grows down a path, so every
    chosen node's parent is chosen too (ties keep the shallower node first).
    """
    loaded, packed = state.loaded, state.loaded.packed
    h = ctx.hidden.reshape(-1)
    device = h.device
    width, beam = min(n, DYNAMIC_WIDTH), min(n, DYNAMIC_BEAM)
    if not loaded.sequential:  # independent heads: one distribution per head, whatever the path
        head_tok, head_lp = packed.top_tokens(h, width, loaded.num_heads, state.lm, log_probs=True)
    paths = ctx.tokens[-1:].reshape(1, 1).to(device)  # [P, depth + 1] the paths expanded next, root first
    values = torch.zeros(1, device=device)  # [P] their log values
    ids = torch.zeros(1, dtype=torch.long, device=device)  # [P] their node ids (the root is 0)
    tokens, logv, parents = [], [], []
    count = 1
    for head in range(loaded.num_heads):
        if loaded.sequential:
            tok, lp = packed.top_tokens(head, h, state.embed[paths], width, state.lm, log_probs=True)  # [P, w]
        else:
            tok, lp = head_tok[head].expand(paths.shape[0], -1), head_lp[head].expand(paths.shape[0], -1)
        v = (values.unsqueeze(1) + lp).reshape(-1)
        t = tok.reshape(-1)
        tokens.append(t)
        logv.append(v)
        parents.append(ids.repeat_interleave(width))
        new_ids = torch.arange(count, count + v.numel(), device=device)
        count += v.numel()
        if head + 1 < loaded.num_heads:
            keep = torch.topk(v, min(beam, v.numel())).indices
            paths = torch.cat([paths[keep // width], t[keep].unsqueeze(1)], dim=1)
            values, ids = v[keep], new_ids[keep]
    chosen = torch.sort(torch.cat(logv), descending=True, stable=True).indices[:n]  # candidate i is node id i + 1
    position = torch.zeros(count, dtype=torch.long, device=device)
    position[chosen + 1] = torch.arange(1, chosen.numel() + 1, device=device)
    return DraftProposal(tokens=torch.cat(tokens)[chosen], parents=position[torch.cat(parents)[chosen]])
