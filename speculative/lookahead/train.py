"""``accel train-pass``: PaSS look-ahead embeddings trained by self-distillation.

The target answers the shipped training prompts greedily (cached under ``OUT/data``, shared
code with ``accel train-eagle``); only the L look-ahead vectors [L, H] are trained, the model
is frozen. One training forward per sequence carries the whole sequence and, after each of K
anchor positions t of its answer, one copy of the L vectors at positions t + 1 .. t + L
(a 4-D mask lets copy k see the sequence up to t and its own earlier vectors, as the verify
pass does). Vector i's output is trained to predict the token at t + 2 + i, the target's own
greedy token there (cross-entropy). Gradients flow only through the look-ahead positions: the sequence's own
activations do not depend on the vectors.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from accel import adapter

from .drafter import save_pass

__all__ = ["PassTrainConfig", "lookahead_batch", "lookahead_loss", "train_pass", "run_cli"]


@dataclass
class PassTrainConfig:
    """Everything that defines a training run (checked in :meth:`check`)."""

    out: str
    model: str = "default"
    prompts: str | None = None  # a text file, one prompt a line; None: the shipped prompts
    max_prompts: int | None = 640
    max_new_tokens: int = 192
    gen_batch_size: int = 32
    positions: int = 4  # L, look-ahead vectors
    anchors: int = 48  # anchor positions per sequence and forward
    max_len: int = 384  # tokens per sequence at most (its end is cut)
    batch_size: int = 4  # sequences per optimizer step
    epochs: float = 1.0
    lr: float = 1e-2
    warmup_steps: int = 10
    seed: int = 0
    threads: int | None = None

    def check(self) -> None:
        bad = [name for name, ok in (("max_new_tokens", self.max_new_tokens >= 2), ("gen_batch_size", self.gen_batch_size >= 1),
                                     ("positions", 1 <= self.positions <= 32), ("anchors", self.anchors >= 1),
                                     ("max_len", self.max_len >= 4), ("batch_size", self.batch_size >= 1),
                                     ("epochs", self.epochs > 0), ("lr", self.lr > 0),
                                     ("max_prompts", self.max_prompts is None or self.max_prompts >= 1)) if not ok]
        if bad:
            raise ValueError(f"train-pass: invalid {', '.join(bad)}")


def lookahead_batch(length: int, anchors: list[int], size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions [n + K*L] and the boolean attention mask [n + K*L, n + K*L] (True: may see)
    of one training forward: the n sequence tokens causal, then per anchor t (in order) L
    look-ahead slots at positions t + 1 .. t + L that see tokens 0..t and their own earlier
    slots."""
    k = len(anchors)
    total = length + k * size
    positions = torch.empty(total, dtype=torch.long)
    positions[:length] = torch.arange(length)
    mask = torch.zeros((total, total), dtype=torch.bool)
    mask[:length, :length] = torch.ones((length, length), dtype=torch.bool).tril()
    causal = torch.ones((size, size), dtype=torch.bool).tril()
    for j, t in enumerate(anchors):
        lo = length + j * size
        positions[lo : lo + size] = t + 1 + torch.arange(size)
        mask[lo : lo + size, : t + 1] = True
        mask[lo : lo + size, lo : lo + size] = causal
    return positions, mask


def lookahead_loss(model: Any, vectors: torch.Tensor, seq: torch.Tensor, anchors: list[int]
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-entropy of the look-ahead outputs against the sequence's tokens (the target's own
    greedy answer): slot i of anchor t against the token at t + 2 + i.

    vectors: [L, H] (requires grad); seq: LongTensor [n]; anchors: K positions t with
    t + L + 1 < n. Returns (loss, top-1 agreement per look-ahead position [L]).
    """
    size = vectors.shape[0]
    n = int(seq.numel())
    positions, mask = lookahead_batch(n, anchors, size)
    embed = model.get_input_embeddings()
    with torch.no_grad():
        tokens = embed(seq.unsqueeze(0))[0]  # [n, H]
    inputs = torch.cat([tokens, vectors.to(tokens.dtype).repeat(len(anchors), 1)]).unsqueeze(0)
    out = model.get_decoder()(inputs_embeds=inputs, position_ids=positions.unsqueeze(0),
                              attention_mask=mask[None, None], use_cache=False).last_hidden_state[0]
    look = out[n:]  # [K*L, H]
    # slot i of anchor t predicts the token at t + 2 + i: the target's own greedy token there
    labels = seq[(torch.tensor(anchors, device=seq.device).unsqueeze(1) + 2 + torch.arange(size, device=seq.device)).reshape(-1)]
    logits = adapter.output_logits(model, look)
    loss = torch.nn.functional.cross_entropy(logits, labels)
    agree = (logits.argmax(-1) == labels).float().reshape(len(anchors), size).mean(0)
    return loss, agree.detach()


def _lr_at(step: int, total: int, cfg: PassTrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps)
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def train_pass(cfg: PassTrainConfig, model: Any = None, tokenizer: Any = None, prompts: list[str] | None = None,
               log: Any = None) -> tuple[torch.Tensor, dict[str, Any]]:
    """Answer the prompts, train the L vectors, save them in ``cfg.out``; returns (vectors
    [L, H] float32, training facts: those saved with them, and every step's ``losses``).

    model / tokenizer: an already loaded target (default: ``accel.models.load_model(cfg.model)``).
    log: a function of one line of progress (default: print to stderr; False: silent).
    """
    from speculative.eagle.train import answer_prompts

    cfg.check()
    if log is None:
        log = lambda line: print(f"train-pass: {line}", file=sys.stderr, flush=True)  # noqa: E731
    log = log or (lambda line: None)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    if model is None:
        from accel.models import load_model

        model, tokenizer = load_model(cfg.model)
    if tokenizer is None:
        raise ValueError(f"model {cfg.model!r} has no tokenizer; training needs one for the chat template")
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    if prompts is None:
        from speculative.train import load_prompts

        prompts = load_prompts(cfg.prompts, cfg.max_prompts)
    t0 = time.perf_counter()
    seqs = answer_prompts(model, tokenizer, prompts, cfg, out / "data", log)
    size = cfg.positions
    seqs = [(s[: cfg.max_len], n) for s, n in seqs if min(s.numel(), cfg.max_len) - size - 2 >= n + 1]
    if not seqs:
        raise ValueError("no training sequences: the model's answers are too short (check the prompts and max_new_tokens)")
    log(f"{len(seqs)} sequences answered in {time.perf_counter() - t0:.0f} s")
    param = next(model.parameters())
    weight = model.get_input_embeddings().weight.detach().float()
    gen = torch.Generator().manual_seed(cfg.seed)
    start = weight.mean(0, keepdim=True).repeat(size, 1)
    start += torch.randn(start.shape, generator=gen) * weight.std() * 0.1
    vectors = torch.nn.Parameter(start.to(param.device))
    opt = torch.optim.Adam([vectors], lr=cfg.lr)
    per_epoch = math.ceil(len(seqs) / cfg.batch_size)
    total = max(1, math.ceil(cfg.epochs * per_epoch))
    losses: list[float] = []
    agree_avg: torch.Tensor | None = None  # running mean of the top-1 agreement per position
    t1 = time.perf_counter()
    for step in range(total):
        epoch, i = divmod(step, per_epoch)
        perm = torch.randperm(len(seqs), generator=torch.Generator().manual_seed(cfg.seed * 1000003 + epoch))
        batch = [seqs[int(b)] for b in perm[i * cfg.batch_size : (i + 1) * cfg.batch_size]]
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, total, cfg)
        opt.zero_grad(set_to_none=True)
        step_loss = 0.0
        for s, n in batch:
            last = int(s.numel()) - size - 2  # the last anchor whose L targets all exist
            pool = torch.arange(n, last + 1)  # anchors are answer tokens, as at decoding
            pick = pool[torch.randperm(pool.numel(), generator=gen)[: cfg.anchors]].sort().values.tolist()
            loss, agree = lookahead_loss(model, vectors, s.to(param.device), pick)
            (loss / len(batch)).backward()
            step_loss += float(loss.detach()) / len(batch)
            agree_avg = agree.cpu() if agree_avg is None else 0.95 * agree_avg + 0.05 * agree.cpu()
        opt.step()
        losses.append(round(step_loss, 4))
        log(f"step {step + 1}/{total} loss {step_loss:.3f} top-1 agreement per position "
            + " ".join(f"{a:.2f}" for a in agree_avg.tolist()) + f" {time.perf_counter() - t0:.0f} s")
    facts = {**{k: v for k, v in asdict(cfg).items() if k not in ("out", "threads", "prompts")},
             "sequences": len(seqs), "steps": total, "losses_first_last": [losses[0], losses[-1]],
             "agreement": [round(a, 3) for a in agree_avg.tolist()], "train_s": round(time.perf_counter() - t1, 1),
             "total_s": round(time.perf_counter() - t0, 1)}
    save_pass(out, vectors.detach().float(), model, info=facts)
    return vectors.detach().float().cpu(), {**facts, "losses": losses}


def run_cli(args: argparse.Namespace) -> int:
    """``accel train-pass``: the flags set onto :class:`PassTrainConfig` (unset: its defaults)."""
    fields = {k: v for k, v in vars(args).items() if k in PassTrainConfig.__dataclass_fields__ and v is not None}
    cfg = PassTrainConfig(**fields)
    vectors, facts = train_pass(cfg)
    print(f"saved {vectors.shape[0]} PaSS look-ahead embeddings to {cfg.out}; {facts['sequences']} sequences, "
          f"{facts['steps']} steps, loss {facts['losses_first_last']}, top-1 agreement {facts['agreement']}, "
          f"{facts['total_s']} s")
    print(f"use it: accel generate PROMPT --strategy pass:embeddings={cfg.out}")
    return 0
