"""Log-probabilities of tokens under the model's distribution, for callers that report them
(the OpenAI ``logprobs`` / ``echo`` fields of ``accel serve``, evaluation harnesses).

The distribution is the model's own: ``log_softmax`` of the float32 logits at temperature 1,
before any top-k / top-p warping, as vLLM's default and OpenAI's. They are the logits of
the cache the request used: with a compressed or quantized cache (SnapKV, GEAR) the
generated tokens' log-probabilities are those of that cache, not of the full one. A prompt's
log-probabilities come from its prefill, before any compression.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

__all__ = ["MAX_TOP_LOGPROBS", "TokenLogprob", "check_logprobs", "token_logprobs"]

#: The most alternatives a request may ask for per token (OpenAI's chat cap).
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log-probability and the most likely tokens at its position.

    token: the token id; logprob: its log-probability (natural log); top: the ``k`` most
    likely (token id, log-probability) pairs at that position, most likely first.
    """

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = field(default=())


def check_logprobs(value: object, name: str = "logprobs") -> None:
    """Raise a ValueError naming ``name`` unless ``value`` is None or an integer in 0..20."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TOP_LOGPROBS:
        raise ValueError(f"{name} must be None or an integer in 0..{MAX_TOP_LOGPROBS} (alternatives per token), "
                         f"got {value!r}")


def token_logprobs(logits: torch.Tensor, tokens: Sequence[int] | torch.Tensor, k: int) -> list[TokenLogprob]:
    """The log-probability of ``tokens[i]`` under ``logits[i]`` and the top ``k`` there.

    logits: [N, V] (any float dtype; computed in float32); tokens: N ids; k: alternatives per
    token (0: none). The caller keeps N small (a verify step's path, a chunk of a prompt).
    """
    ids = torch.as_tensor(tokens, dtype=torch.long, device=logits.device).reshape(-1)
    if logits.dim() != 2 or logits.shape[0] != ids.numel():
        raise ValueError(f"logits must be [N={ids.numel()}, V], got {tuple(logits.shape)}")
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(1, ids[:, None])[:, 0].tolist()
    if k > 0:
        values, indices = logp.topk(min(k, logp.shape[-1]), dim=-1)
        tops = [tuple(zip(i, v)) for i, v in zip(indices.tolist(), values.tolist())]
    else:
        tops = [()] * len(chosen)
    return [TokenLogprob(t, lp, top) for t, lp, top in zip(ids.tolist(), chosen, tops)]
