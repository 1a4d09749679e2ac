"""Medusa's typical acceptance (Cai et al. 2024): a LOSSY acceptance rule, opt in by name."""

from __future__ import annotations

from typing import ClassVar

import torch
from pydantic import Field

from accel.acceptance import Acceptance, check_rows, draw_from
from accel.strategy import AcceptanceRule, register
from accel.tree import DraftTree

__all__ = ["TypicalAcceptance"]


@register
class TypicalAcceptance(AcceptanceRule):
    """Medusa's typical acceptance. LOSSY: the output does NOT follow the target distribution.

    A draft token x at child c of node j is accepted when
    ``p[j](x) > min(posterior_threshold, alpha * exp(-entropy(p[j])))``: confident target
    rows demand a likely draft, flat rows accept anything moderately plausible. The longest
    accepted root-to-leaf prefix wins (ties: the first path in ``tree.paths`` order). The
    token after it is SAMPLED from p at the last accepted node (Medusa takes the greedy
    token for the first position; here every emitted non-draft token is a sample of p, so
    with temperature 0 / one-hot p this rule reduces to greedy acceptance).
    """

    name: ClassVar[str] = "typical"
    lossy: ClassVar[bool] = True

    posterior_threshold: float = Field(
        0.09, gt=0, description="hard ceiling of the acceptance threshold on p(draft token)"
    )
    alpha: float = Field(
        0.3, ge=0, description="entropy-adaptive threshold: alpha * exp(-entropy(p)), the lower one applies"
    )

    def accept(self, tree: DraftTree, probs: torch.Tensor, generator: torch.Generator | None = None) -> Acceptance:
        """probs: [N+1, V] target distribution p, row j after node j. Returns the Acceptance."""
        check_rows(tree, probs, "probs")
        if tree.num_drafts == 0:
            return Acceptance(path=[0], next_token=draw_from(None, probs[0], generator, 0))
        p = probs.float()
        entropy = -(p * torch.log(p.clamp_min(torch.finfo(p.dtype).tiny))).sum(-1)  # [N+1], 0 log 0 = 0
        threshold = torch.clamp(self.alpha * torch.exp(-entropy), max=self.posterior_threshold)
        parents = tree.parents[1:]
        p_draft = p[parents, tree.tokens[1:]]  # [N], p of each draft under its parent's row
        ok = [True, *(p_draft > threshold[parents]).tolist()]
        best: list[int] = [0]
        for path in tree.paths:
            n = 1
            while n < len(path) and ok[path[n]]:
                n += 1
            if n > len(best):
                best = path[:n]
        return Acceptance(path=best, next_token=draw_from(None, probs[best[-1]], generator, best[-1]))
