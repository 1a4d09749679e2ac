"""Draft trees: the tokens one verify pass checks, and their masks and positions.

A tree has N+1 nodes. Node 0 is the ROOT, the pending token (the last sampled token, not yet
in the KV cache); nodes 1..N are draft tokens. Nodes are topologically ordered: every node's
parent has a smaller index. The verifier runs all N+1 nodes in one forward pass over the
cache; node i may attend to the whole cache and to its own ancestors (and itself) only, and
sits at position ``logical_len + depth[i]``. Row j of the verifier's output is its next-token
distribution after the root..j path.

    root (0)             tokens   [r, a, b, c]
     ├── a (1)           parents  [-1, 0, 0, 1]
     │   └── c (3)       depth    [0, 1, 1, 2]
     └── b (2)           retrieve_indices [[0, 1, 3], [0, 2, -1]]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from .strategy import DraftProposal

__all__ = [
    "DraftTree",
    "MergedProposal",
    "merge_proposals",
    "tree_attention_bias",
    "tree_position_ids",
]


def _check_parents(parents: list[int], offset: int, what: str) -> None:
    """Raise ValueError unless parents[i] (of node i + offset) is in 0 .. i + offset - 1."""
    for i, p in enumerate(parents):
        node = i + offset
        if not 0 <= p < node:
            raise ValueError(
                f"{what}: node {node} has parent {p}; a parent must be an earlier node "
                f"(0 <= parent < {node}) so the tree is topologically ordered"
            )


@dataclass(frozen=True, eq=False)
class DraftTree:
    """The root plus draft nodes of one verify step, with its derived structure.

    tokens: LongTensor [N+1], node 0 is the root (pending) token, nodes 1..N draft tokens.
    parents: LongTensor [N+1], parents[0] == -1, 0 <= parents[i] < i for i >= 1.
    probs: FloatTensor [N+1, V] or None, the draft distribution q each node's token was drawn
        from (row 0 unused). None: every draft token is deterministic (q a point mass).

    Derived once at construction (on ``tokens.device``):
    depth: LongTensor [N+1], root 0.
    ancestor_mask: BoolTensor [N+1, N+1], row i True at i's ancestors and at i itself.
    children: list[list[int]], children of each node in node order.
    paths: list[list[int]], root-to-leaf node indices, depth-first with children in node
        order (the path through an earlier sibling comes first).
    retrieve_indices: LongTensor [num_leaves, max_depth + 1], ``paths`` padded with -1.
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    probs: torch.Tensor | None = None

    depth: torch.Tensor = field(init=False, repr=False)
    ancestor_mask: torch.Tensor = field(init=False, repr=False)
    children: list[list[int]] = field(init=False, repr=False)
    paths: list[list[int]] = field(init=False, repr=False)
    retrieve_indices: torch.Tensor = field(init=False, repr=False)
    token_list: list[int] = field(init=False, repr=False)  # tokens as Python ints
    parent_list: list[int] = field(init=False, repr=False)  # parents as Python ints

    def __post_init__(self) -> None:
        tokens, parents = self.tokens, self.parents
        if tokens.dim() != 1 or tokens.numel() == 0:
            raise ValueError(f"DraftTree.tokens must be a non-empty 1-D tensor, got shape {tuple(tokens.shape)}")
        if parents.shape != tokens.shape:
            raise ValueError(f"DraftTree.parents has shape {tuple(parents.shape)}, tokens {tuple(tokens.shape)}")
        n1 = tokens.numel()
        if self.probs is not None and (self.probs.dim() != 2 or self.probs.shape[0] != n1):
            raise ValueError(f"DraftTree.probs must have shape [{n1}, V], got {tuple(self.probs.shape)}")
        par = [int(p) for p in parents.tolist()]
        if par[0] != -1:
            raise ValueError(f"DraftTree.parents[0] must be -1 (the root has no parent), got {par[0]}")
        _check_parents(par[1:], 1, "DraftTree")

        depth = [0] * n1
        children: list[list[int]] = [[] for _ in range(n1)]
        anc = torch.zeros(n1, n1, dtype=torch.bool)
        anc[0, 0] = True
        for i in range(1, n1):
            p = par[i]
            depth[i] = depth[p] + 1
            children[p].append(i)
            anc[i] = anc[p]
            anc[i, i] = True
        paths: list[list[int]] = []  # depth-first, children in node order
        stack = [[0]]
        while stack:
            path = stack.pop()
            kids = children[path[-1]]
            if not kids:
                paths.append(path)
            stack.extend(path + [c] for c in reversed(kids))
        width = max(depth) + 1
        retrieve = torch.tensor([p + [-1] * (width - len(p)) for p in paths], dtype=torch.long)

        device = tokens.device
        set_ = object.__setattr__
        set_(self, "depth", torch.tensor(depth, dtype=torch.long, device=device))
        set_(self, "ancestor_mask", anc.to(device))
        set_(self, "children", children)
        set_(self, "paths", paths)
        set_(self, "retrieve_indices", retrieve.to(device))
        set_(self, "token_list", [int(t) for t in tokens.tolist()])
        set_(self, "parent_list", par)

    # ------------------------------------------------------------------ constructors

    @classmethod
    def from_proposal(cls, root_token: int, proposal: DraftProposal | None) -> DraftTree:
        """The tree of ``root_token`` with ``proposal``'s nodes below it (None/empty: root only).

        proposal.tokens [N], proposal.parents [N] (node i+1's parent, in 0..i),
        proposal.probs [N, V] or None; a zero row 0 is prepended to probs.
        """
        if proposal is None or proposal.tokens.numel() == 0:
            device = proposal.tokens.device if proposal is not None else None
            return cls.root_only(root_token, device=device)
        toks, pars = proposal.tokens.reshape(-1), proposal.parents.reshape(-1)
        if pars.numel() != toks.numel():
            raise ValueError(f"DraftProposal has {toks.numel()} tokens but {pars.numel()} parents")
        device = toks.device
        tokens = torch.cat([torch.tensor([root_token], dtype=torch.long, device=device), toks.long()])
        parents = torch.cat([torch.tensor([-1], dtype=torch.long, device=device), pars.to(device, torch.long)])
        probs = proposal.probs
        if probs is not None:
            if probs.dim() != 2 or probs.shape[0] != toks.numel():
                raise ValueError(f"DraftProposal.probs must have shape [{toks.numel()}, V], got {tuple(probs.shape)}")
            probs = torch.cat([probs.new_zeros(1, probs.shape[1]), probs])
        return cls(tokens, parents, probs)

    @classmethod
    def chain(
        cls, root_token: int, tokens: Sequence[int] | torch.Tensor, device: torch.device | str | None = None
    ) -> DraftTree:
        """A single path: root -> tokens[0] -> tokens[1] -> ...

        device: where the tree's tensors live (pass the model's); default the device of
        ``tokens`` when it is a tensor, else the CPU.
        """
        if isinstance(tokens, torch.Tensor):
            device = device if device is not None else tokens.device
            tokens = tokens.reshape(-1).tolist()
        toks = [int(root_token), *map(int, tokens)]
        parents = list(range(-1, len(toks) - 1))
        return cls(
            torch.tensor(toks, dtype=torch.long, device=device),
            torch.tensor(parents, dtype=torch.long, device=device),
        )

    @classmethod
    def root_only(cls, root_token: int, device: torch.device | str | None = None) -> DraftTree:
        """The tree with no drafts: plain decoding of one token, its tensors on ``device``
        (pass the model's; default the CPU)."""
        return cls.chain(root_token, [], device=device)

    # ------------------------------------------------------------------ helpers

    @property
    def num_nodes(self) -> int:
        """N + 1 (root included)."""
        return len(self.token_list)

    @property
    def num_drafts(self) -> int:
        """N, the draft nodes (root excluded)."""
        return len(self.token_list) - 1

    def __len__(self) -> int:
        return len(self.token_list)

    def path_tokens(self, path: Sequence[int]) -> list[int]:
        """Tokens of the nodes in ``path``."""
        return [self.token_list[j] for j in path]


# --------------------------------------------------------------------------- merging


@dataclass
class MergedProposal:
    """Several drafters' proposals as one tree below the root.

    proposal: the merged DraftProposal (tokens [N], parents [N], probs [N, V] or None).
    source: LongTensor [N], index (into the input list) of the first proposal that proposed
        each node; the engine credits accepted nodes to that drafter.
    proposed_by: BoolTensor [num_proposals, N], True where a proposal proposed the node
        (a deduplicated node is True for every proposal that had it).
    """

    proposal: DraftProposal
    source: torch.Tensor
    proposed_by: torch.Tensor


def merge_proposals(proposals: list[DraftProposal | None], max_nodes: int) -> MergedProposal | None:
    """Union of several drafters' trees below one root, at most ``max_nodes`` draft nodes.

    Deduplication: proposals WITHOUT ``probs`` (deterministic drafters) are merged into one
    trie: a token path that several of them propose becomes one node, so a shared prefix is
    verified once. For point-mass drafts this is exact for speculative sampling too (after a
    point mass on token t is rejected, the residual is 0 at t, so a second sibling with t
    could never be accepted).

    Sampled proposals (``probs`` not None) are never merged: merging two samples of the same
    token would drop one of the independent draws that lossless multi-draft sampling needs.
    Each such proposal is added as-is (its own duplicate siblings kept) as extra subtrees of
    the root. If any proposal carries probs, the merged probs is [N, V] with the sampled
    rows copied and a one-hot row (the point mass) for every deterministic node; all sampled
    proposals must share V (ValueError otherwise).

    Cap: nodes are ranked by (depth, insertion order), insertion order being proposal order
    then node order; the first ``max_nodes`` are kept. Shallow nodes of every drafter thus
    come before deep nodes of the first one, the kept set is closed under parents, and the
    kept children of any node are a prefix of its children. Kept nodes stay in insertion
    order, which is topological (parents before children), so a single proposal within the
    cap and without duplicates comes back unchanged.

    Returns None when no node is left (all proposals None / empty, or ``max_nodes <= 0``).
    """

    # Flat node list in insertion order: (token, parent merged index, depth, source, prob row).
    tok: list[int] = []
    par: list[int] = []
    dep: list[int] = []
    src: list[int] = []
    row: list[tuple[int, int] | None] = []  # (proposal index, node index) of a sampled row
    owners: list[set[int]] = []
    trie: dict[tuple[int, int], int] = {}  # (parent merged index or -1 for root, token) -> index
    device = None
    vocab = None
    prob_dtype = None
    for k, prop in enumerate(proposals):
        if prop is None or prop.tokens.numel() == 0:
            continue
        toks = [int(t) for t in prop.tokens.reshape(-1).tolist()]
        pars = [int(p) for p in prop.parents.reshape(-1).tolist()]
        if len(pars) != len(toks):
            raise ValueError(f"proposal {k}: {len(toks)} tokens but {len(pars)} parents")
        _check_parents(pars, 1, f"proposal {k}")
        device = device if device is not None else prop.tokens.device
        sampled = prop.probs is not None
        if sampled:
            if prop.probs.dim() != 2 or prop.probs.shape[0] != len(toks):
                raise ValueError(f"proposal {k}: probs must have shape [{len(toks)}, V], got {tuple(prop.probs.shape)}")
            if vocab is not None and prop.probs.shape[1] != vocab:
                raise ValueError(f"proposal {k}: probs has V={prop.probs.shape[1]}, an earlier proposal V={vocab}")
            vocab, prob_dtype = prop.probs.shape[1], prob_dtype or prop.probs.dtype
        local = [-1]  # proposal node index -> merged index (node 0 = root = -1 here)
        for i, (t, p) in enumerate(zip(toks, pars)):
            mp = local[p]
            key = (mp, t)
            if not sampled and key in trie:
                m = trie[key]
                owners[m].add(k)
            else:
                m = len(tok)
                tok.append(t)
                par.append(mp)
                dep.append(dep[mp] + 1 if mp >= 0 else 1)
                src.append(k)
                row.append((k, i) if sampled else None)
                owners.append({k})
                if not sampled:
                    trie[key] = m
            local.append(m)

    if not tok or max_nodes <= 0:
        return None
    order = sorted(range(len(tok)), key=lambda m: (dep[m], m))
    keep = sorted(order[:max_nodes])
    new_index = {m: n for n, m in enumerate(keep)}  # merged index -> output node (0-based)

    tokens = torch.tensor([tok[m] for m in keep], dtype=torch.long, device=device)
    parents = torch.tensor([new_index[par[m]] + 1 if par[m] >= 0 else 0 for m in keep], dtype=torch.long, device=device)
    source = torch.tensor([src[m] for m in keep], dtype=torch.long, device=device)
    proposed_by = torch.zeros(len(proposals), len(keep), dtype=torch.bool)
    for n, m in enumerate(keep):
        proposed_by[sorted(owners[m]), n] = True
    probs = None
    if vocab is not None:
        probs = torch.zeros(len(keep), vocab, dtype=prob_dtype, device=device)
        for n, m in enumerate(keep):
            if row[m] is None:
                probs[n, tok[m]] = 1.0
            else:
                k, i = row[m]
                probs[n] = proposals[k].probs[i].to(device, prob_dtype)
    return MergedProposal(DraftProposal(tokens, parents, probs), source, proposed_by.to(device))


# --------------------------------------------------------------------------- masks, positions


def tree_attention_bias(tree: DraftTree, past_len: int, dtype: torch.dtype, device=None) -> torch.Tensor:
    """Additive attention mask for verifying ``tree`` on top of ``past_len`` cached entries.

    Returns FloatTensor [1, 1, N+1, past_len + N+1] of ``dtype`` (on ``device``, default the
    tree's): 0 where a query may attend, ``torch.finfo(dtype).min`` where not. Columns
    0..past_len-1 (the cache) are visible to every node; tree column k is visible to row i
    iff k is an ancestor of i or i itself.
    """
    device = device if device is not None else tree.tokens.device
    n1 = tree.num_nodes
    bias = torch.zeros(1, 1, n1, past_len + n1, dtype=dtype, device=device)
    visible = tree.ancestor_mask.to(device)
    bias[0, 0, :, past_len:].masked_fill_(~visible, torch.finfo(dtype).min)
    return bias


def tree_position_ids(tree: DraftTree, logical_len: int) -> torch.Tensor:
    """Position ids [1, N+1] of the tree's nodes: ``logical_len + depth`` (root at logical_len,
    the number of tokens already in the sequence before the pending root)."""
    return (tree.depth + logical_len).unsqueeze(0)
