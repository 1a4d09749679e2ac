"""Drafters and lossy acceptance rules for accel's speculative decoding.

Importing the package registers the ``typical`` acceptance rule and the drafters
(``prompt_lookup``, ``medusa``, ``eagle``, ``draft_model``, ``ngrammys``, ``pass``). Draft trees and the exact acceptance rules are core verify
machinery and live in ``accel.tree`` / ``accel.acceptance``.
"""

from .typical import TypicalAcceptance
from .prompt_lookup import PromptLookup
from .medusa import Medusa, MedusaHeads
from .eagle import Eagle
from .draft_model import DraftModel
from .ngrammys import NGrammys
from .lookahead import PaSS
from .medusa.trees import TREES, build_tree

__all__ = [
    "TypicalAcceptance",
    "PromptLookup",
    "Medusa",
    "MedusaHeads",
    "Eagle",
    "DraftModel",
    "NGrammys",
    "PaSS",
    "TREES",
    "build_tree",
]
