"""Medusa draft heads (Cai et al. 2024) as modules: K small heads on the model's last hidden state.

Head k (1-based) reads the final normed hidden state ``h_t`` at the last verified position
and predicts the token k steps after the one the model's own head predicts there. Each head
is ``num_layers`` residual blocks ``x + SiLU(W x + b)`` followed by the model's own
``lm_head`` (default: nothing to store but the blocks) or by an output layer of its own (the
official Medusa format).

**Independent** heads (the paper's) see only ``h_t``. **Sequential** heads
(``sequential=True``, the Hydra variant of Ankner et al. 2024, "Hydra:
Sequentially-Dependent Draft Heads for Medusa Decoding") also read the input embeddings of
the tokens on the path they extend: head k's first block is
``x + SiLU(W [h_t; e(root); e(d_1); ...; e(d_{k-1})] + b)``.

These modules are what training runs; drafting runs the same weights packed
(:mod:`.packed`), files are read and written by :mod:`.formats`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from . import formats

__all__ = ["residual_block", "head_hidden", "ResBlock", "PathBlock", "MedusaHead", "MedusaHeads"]


#: A linear map [..., in] -> [..., out]: an ``nn.Linear``, a :class:`~accel.kernels.cpu.PackedLinear`,
#: or one batched matmul over the stacked layers of several heads.
Linear = Callable[[torch.Tensor], torch.Tensor]


def residual_block(x: torch.Tensor, linear: Linear, path_emb: torch.Tensor | None = None) -> torch.Tensor:
    """One residual block of a Medusa head: ``x + SiLU(linear(x))``, or, with ``path_emb`` (the
    first block of a sequential head), ``x + SiLU(linear([x; e_1; ...; e_n]))`` with e_i the
    input embeddings of the tokens on the path, the root first.

    The one definition of the heads' arithmetic: the modules below (training, the reference
    forward) and the packed heads (drafting) differ only in the ``linear`` they pass.
    x: [..., H]; path_emb: [..., n, H]; linear: [..., H] (or [..., (n + 1) H]) -> [..., H].
    """
    inner = x if path_emb is None else torch.cat([x, path_emb.flatten(-2)], dim=-1)
    return x + F.silu(linear(inner))


def head_hidden(x: torch.Tensor, linears: Sequence[Linear], path_emb: torch.Tensor | None = None,
                dtype: torch.dtype | None = None) -> torch.Tensor:
    """A head's residual blocks in order, [..., H] -> [..., H] (see :func:`residual_block`):
    the first block reads ``path_emb`` [..., n, H] when given, the others ``x`` alone.

    dtype: the dtype of the blocks' weights, which the blocks compute in; ``x`` and
    ``path_emb`` (the model's hidden state and embeddings, bfloat16 for a bfloat16 model)
    are cast to it. None: as given.
    """
    if dtype is not None:
        x = x.to(dtype)
        path_emb = path_emb.to(dtype) if path_emb is not None else None
    for i, linear in enumerate(linears):
        x = residual_block(x, linear, path_emb if i == 0 else None)
    return x


class ResBlock(nn.Module):
    """``x + SiLU(W x + b)`` (:func:`residual_block`); W and b start at zero, so a fresh block
    is the identity."""

    def __init__(self, hidden_size: int, in_features: int | None = None):
        super().__init__()
        self.linear = nn.Linear(in_features or hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)
        self.dropout = 0.0  # on the block's input to W, in training mode only (a regulariser)

    def project(self, inner: torch.Tensor) -> torch.Tensor:
        """``W inner + b``, with dropout on ``inner`` while training."""
        if self.training and self.dropout:
            inner = F.dropout(inner, self.dropout, training=True)
        return self.linear(inner)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return residual_block(x, self.project)


class PathBlock(ResBlock):
    """The first block of a sequential (Hydra-style) head that extends paths of n tokens:
    ``x + SiLU(W [x; e_1; ...; e_n] + b)``, with e_i the input embeddings of the tokens on
    the path (the root first). W [H, (n + 1) H] and b start at zero."""

    def __init__(self, hidden_size: int, path_len: int):
        super().__init__(hidden_size, (path_len + 1) * hidden_size)

    def forward(self, x: torch.Tensor, path_emb: torch.Tensor) -> torch.Tensor:
        """x: [..., H]; path_emb: [..., n, H]. Returns [..., H]."""
        return residual_block(x, self.project, path_emb)


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
        """[..., H] -> [..., H] in the blocks' dtype; path_emb [..., path_len, H] for a head
        that reads a path."""
        dtype = self.blocks[0].linear.weight.dtype if len(self.blocks) else None
        return head_hidden(x, [block.project for block in self.blocks], path_emb if self.path_len else None, dtype)


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
        unless the heads have their own. path_emb: as in :meth:`hidden`. The blocks compute
        in the heads' dtype, each vocabulary projection in its weight's: float32 heads serve
        a bfloat16 model as they are.
        """
        x = self.hidden(h, path_emb)
        if self.own_lm_head:
            logits = torch.stack([_project(head.lm_head, x[..., k, :]) for k, head in enumerate(self.heads)], dim=-2)
        elif lm_head is None:
            raise ValueError("these Medusa heads use the base model's lm_head: pass lm_head=model.get_output_embeddings()")
        else:
            logits = _project(lm_head, x)
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
        """The JSON config saved beside the weights (see :mod:`.formats`)."""
        return formats.heads_config(self)

    @property
    def topk_accuracy(self) -> list[list[float]] | None:
        """[K][topk] cumulative accuracies measured on held-out data, if known."""
        acc = self.info.get("topk_accuracy")
        return [list(map(float, row)) for row in acc] if acc else None

    # ------------------------------------------------------------------ files

    def save_pretrained(self, folder: str | os.PathLike, dtype: torch.dtype | None = None) -> Path:
        """Write ``medusa_heads.safetensors`` (in ``dtype``, default as held) and
        ``medusa_config.json`` into ``folder``. Returns the folder."""
        return formats.save_heads(self, folder, dtype)

    @classmethod
    def from_pretrained(cls, folder: str | os.PathLike) -> "MedusaHeads":
        """Load heads from ``folder`` (our format or the official Medusa format), or the
        heads shipped for the default model with ``"default"``. Weights come back float32.

        Raises FileNotFoundError for a missing folder and ValueError, naming the file and
        the problem, for a malformed config or weights file.
        """
        return formats.read_heads(cls, folder)

    @classmethod
    def from_official(cls, folder: str | os.PathLike) -> "MedusaHeads":
        """Load heads saved in the official Medusa format (see :mod:`.formats`) as heads
        with their own output layers. Weights come back float32."""
        return formats.read_official(cls, folder)


def _project(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``layer(x)`` with ``x`` cast to the dtype of the layer's weight (if it has one)."""
    weight = getattr(layer, "weight", None)
    return layer(x.to(weight.dtype) if isinstance(weight, torch.Tensor) else x)
