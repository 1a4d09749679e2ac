"""Speculative decoding building blocks: draft trees, their masks, and acceptance rules.

Importing the package registers the ``typical`` acceptance rule and the drafters
(``prompt_lookup``, ``medusa``).
"""

from .tree import DraftTree, MergedProposal, merge_proposals, tree_attention_bias, tree_position_ids
from .acceptance import Acceptance, TypicalAcceptance, greedy_accept, sample_accept
from .prompt_lookup import PromptLookup
from .medusa import Medusa, MedusaHeads
from .medusa_trees import TREES, build_tree

__all__ = [
    "DraftTree",
    "MergedProposal",
    "merge_proposals",
    "tree_attention_bias",
    "tree_position_ids",
    "Acceptance",
    "greedy_accept",
    "sample_accept",
    "TypicalAcceptance",
    "PromptLookup",
    "Medusa",
    "MedusaHeads",
    "TREES",
    "build_tree",
]
