"""The Medusa drafter: heads on the verifier's hidden state draft a tree each step.

The hidden state comes from the very forward pass that verified the previous tree (the
engine hands it over as ``DraftContext.hidden``), so the heads need no cache of their own:
the verifier and the drafts share the one, possibly SnapKV-compressed, cache.

The tree a step verifies is, by default, **dynamic** (``tree="dynamic"``, see
:mod:`.dynamic_tree`): the heads' probabilities of whole paths rank the candidates and the
``max_nodes`` most probable are verified. ``tree="auto"`` is the paper's static tree, grown
once from the heads' measured per-rank accuracies; named and explicit trees are static too
(:mod:`.trees`). Sequential heads draft a static tree level by level, each node from its
own path.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch
from pydantic import Field, field_serializer, field_validator

from accel.dtypes import as_dtype, dtype_name
from accel.kernels.cpu import PackedLinear
from accel.strategy import DraftContext, DraftProposal, Drafter, register

from .dynamic_tree import dynamic_tree, dynamic_trees
from .formats import resolve_heads_dir
from .packed import LoadedHeads, bf16_fast_on_cpu, lm_layer, load_heads
from .trees import (
    TREES,
    TreeArrays,
    TreeLevel,
    TreePath,
    build_tree,
    check_paths,
    rank_accuracies,
    tree_arrays,
    tree_levels,
    truncate_paths,
)

__all__ = ["Medusa", "DEFAULT_MAX_NODES"]

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



@dataclass
class _State:
    loaded: LoadedHeads
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

    The heads' blocks run in the model's dtype (bfloat16 for a bfloat16 model, whatever
    dtype the heads were saved in), the vocabulary projection in ``head_dtype``.
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

    @field_validator("head_dtype", mode="before")
    @classmethod
    def _head_dtype_name(cls, v):
        return v if v in ("auto", "model") or not isinstance(v, (str, torch.dtype)) else dtype_name(v)

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

    def paths_for(self, loaded: LoadedHeads) -> tuple[TreePath, ...]:
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
        lm = None if loaded.own_lm_head else lm_layer(out, head_dtype, loaded.packed.subset)
        return _State(loaded, lm, paths, embed)

    def _fit(self, model: Any) -> tuple[LoadedHeads, torch.dtype, torch.Tensor | None, tuple[TreePath, ...]]:
        """The checks of :meth:`check`; returns (heads, head dtype, input embeddings [V, H]
        for sequential heads or None, tree paths)."""
        out = model.get_output_embeddings()
        param = next(model.parameters())
        model_dtype, device = param.dtype, param.device
        if self.head_dtype == "auto":
            fast = device.type == "cpu" and model_dtype == torch.float32 and bf16_fast_on_cpu()
            head_dtype = torch.bfloat16 if fast else model_dtype
        else:
            head_dtype = model_dtype if self.head_dtype == "model" else as_dtype(self.head_dtype)
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

    def propose_batch(self, states: list[_State], ctxs: list[DraftContext]) -> list[DraftProposal | None]:
        """The dynamic trees of every row at once (:func:`.dynamic_tree.dynamic_trees`): each
        head runs one vocabulary projection over all rows' paths. Rows whose heads differ
        (another folder or dtype) and static trees go row by row."""
        loaded = states[0].loaded if states else None
        if (self.tree != "dynamic" or len(states) < 2 or any(c.hidden is None for c in ctxs)
                or any(s.loaded is not loaded or s.lm is not states[0].lm for s in states)):
            return super().propose_batch(states, ctxs)
        sizes = [min(self.max_nodes, c.max_tokens) for c in ctxs]
        live = [i for i, n in enumerate(sizes) if n > 0]
        out: list[DraftProposal | None] = [None] * len(states)
        if not live:
            return out
        h = torch.stack([ctxs[i].hidden.reshape(-1) for i in live])
        roots = torch.stack([ctxs[i].tokens[-1] for i in live])
        trees = dynamic_trees(loaded, h, roots, [sizes[i] for i in live], states[0].lm, states[0].embed)
        for i, tree in zip(live, trees):
            out[i] = tree
        return out

    def propose(self, state: _State, ctx: DraftContext) -> DraftProposal | None:
        if ctx.hidden is None:
            raise ValueError("Medusa needs the verifier's hidden state (DraftContext.hidden); the engine did not pass it")
        if self.tree == "dynamic":
            n = min(self.max_nodes, ctx.max_tokens)
            if n <= 0:
                return None
            return dynamic_tree(state.loaded, ctx.hidden.reshape(-1), ctx.tokens[-1:], n, state.lm, state.embed)
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
