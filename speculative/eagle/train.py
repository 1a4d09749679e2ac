"""``accel train-eagle``: an EAGLE-3 draft trained on the target's own answers, with
training-time test.

1. **Data.** The shipped training prompts (``speculative/data/train_prompts.txt``, the Medusa
   heads' set, or ``--prompts``) through the chat template, answered greedily by the target
   itself (``accel.generate``, plain decoding); chunks cached in ``DIR/data/``. The draft
   vocabulary is the ``draft_vocab`` most frequent tokens of the answers (EOS always in).
2. **Training.** The target stays frozen; each step runs it over a batch of whole sequences
   (prompt + answer) and reads its hidden states at the draft's three layers, exactly as
   drafting reads them (:func:`accel.adapter.capture_layer_states`): the features are never
   stored. Training-time test (EAGLE-3): step 0 reads the target's features at every
   position; step j > 0 reads the layer's own outputs of step j - 1 (what drafting feeds back),
   each query seeing the target's entries up to its root and its own chain of draft entries.
   Step j at position p learns the target's greedy token p + 2 + j (cross-entropy over the
   draft vocabulary, answer positions only, weight ``decay ** j``). AdamW, linear warm-up then
   cosine decay. A checkpoint (draft, optimizer, step, RNG) goes to ``DIR/checkpoint/`` every
   ``checkpoint_every`` steps; a rerun resumes there, batch for batch.
3. The draft is saved in ``DIR`` in the EAGLE-3 format (:func:`.formats.save_eagle`); use it
   with ``Eagle(draft=DIR)``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from accel import adapter
from accel.dtypes import as_dtype

from .formats import read_eagle, save_eagle
from .layer import EagleLayer, new_layer, warm_start

__all__ = ["EagleTrainConfig", "answer_prompts", "draft_vocabulary", "target_features", "ttt_unroll", "ttt_loss",
           "ttt_hits", "train_eagle", "run_cli"]


@dataclass
class EagleTrainConfig:
    """Everything that defines a training run (checked in :meth:`check`, saved with checkpoints)."""

    out: str
    model: str = "default"
    prompts: str | None = None  # a text file, one prompt a line; None: the shipped prompts
    max_prompts: int | None = None
    max_new_tokens: int = 192
    gen_batch_size: int = 32
    draft_vocab: int = 8192  # most frequent answer tokens the draft predicts
    ttt_steps: int = 3  # unrolled steps of training-time test (1: the target's features only)
    decay: float = 0.8  # loss weight of unrolled step j is decay ** j
    max_len: int = 384  # tokens per sequence at most (its end is cut)
    batch_size: int = 4  # sequences per step
    epochs: float = 2.0
    lr: float = 3e-4
    warmup_steps: int = 20
    checkpoint_every: int = 50
    seed: int = 0
    threads: int | None = None
    save_dtype: str = "bfloat16"
    # "target": start where the target ends (layer.warm_start); "frozen": so, and keep the head
    # and final norm the target's (only fc and the decoder layer learn); "random"
    init: str = "target"

    def check(self) -> None:
        bad = [name for name, ok in (("max_new_tokens", self.max_new_tokens >= 2), ("gen_batch_size", self.gen_batch_size >= 1),
                                     ("draft_vocab", self.draft_vocab >= 2), ("ttt_steps", self.ttt_steps >= 1),
                                     ("max_len", self.max_len >= 4), ("batch_size", self.batch_size >= 1),
                                     ("epochs", self.epochs > 0), ("lr", self.lr > 0), ("decay", 0 < self.decay <= 1),
                                     ("checkpoint_every", self.checkpoint_every >= 0),
                                     ("init", self.init in ("target", "frozen", "random"))) if not ok]
        if bad:
            raise ValueError(f"train-eagle: invalid {', '.join(bad)}")


_RUN_KEYS = ("model", "max_new_tokens", "draft_vocab", "ttt_steps", "decay", "max_len", "batch_size", "epochs", "lr",
             "warmup_steps", "seed", "init")


# --------------------------------------------------------------------------- data


def answer_prompts(model: Any, tokenizer: Any, prompts: list[str], cfg: EagleTrainConfig, cache: Path | None,
                   log: Any = None) -> list[tuple[torch.Tensor, int]]:
    """Every prompt through the chat template and answered greedily by ``model``: per prompt
    (sequence [n + m] token ids, prompt length n), in chunks of ``cfg.gen_batch_size`` cached
    under ``cache`` (a rerun loads finished chunks)."""
    import accel
    from accel.models import chat_ids

    out: list[tuple[torch.Tensor, int]] = []
    for lo in range(0, len(prompts), cfg.gen_batch_size):
        chunk = prompts[lo : lo + cfg.gen_batch_size]
        key = hashlib.sha256(json.dumps([chunk, cfg.model, cfg.max_new_tokens]).encode()).hexdigest()[:16]
        file = cache / f"answers_{key}.pt" if cache is not None else None
        if file is not None and file.is_file():
            try:
                out += [(s, int(n)) for s, n in torch.load(file, weights_only=True)]
                continue
            except Exception:  # noqa: BLE001 - a torn file from an interrupted run: answer again
                pass
        ids = [chat_ids(tokenizer, p)[0] for p in chunk]
        result = accel.generate(model, ids, strategies=[], max_new_tokens=cfg.max_new_tokens, tokenizer=tokenizer)
        rows = [(torch.cat([i, result.sequences[b, i.numel() : i.numel() + s.new_tokens].cpu()]), int(i.numel()))
                for b, (i, s) in enumerate(zip(ids, result.row_stats))]
        if file is not None:
            file.parent.mkdir(parents=True, exist_ok=True)
            tmp = file.with_name(file.name + ".tmp")
            torch.save([(s, n) for s, n in rows], tmp)
            os.replace(tmp, file)
        out += rows
        if log is not None:
            log(f"answered {min(lo + cfg.gen_batch_size, len(prompts))}/{len(prompts)} prompts")
    return out


def draft_vocabulary(seqs: list[tuple[torch.Tensor, int]], size: int, vocab: int, eos: list[int]) -> torch.Tensor:
    """The ``size`` most frequent answer tokens (EOS included), ascending target ids."""
    counts = torch.zeros(vocab, dtype=torch.long)
    for s, n in seqs:
        counts += torch.bincount(s[n:].clamp(max=vocab - 1), minlength=vocab)
    for e in eos:
        if e < vocab:
            counts[e] = counts.max() + 1
    keep = torch.topk(counts, min(size, vocab)).indices
    return keep.sort().values


# --------------------------------------------------------------------------- the loss


def target_features(model: Any, ids: torch.Tensor, lengths: list[int], layer_ids: tuple[int, ...]) -> torch.Tensor:
    """The target's hidden states at ``layer_ids`` for right-padded sequences ids [B, T]
    (true lengths ``lengths``), concatenated: [B, T, len(layer_ids) * H]; one frozen forward,
    read as drafting reads them."""
    from accel.cache import SharedCache
    from accel.steps import prefill

    geo = adapter.geometry(model)
    cache = SharedCache(geo.num_layers, adapter.layer_windows(model))
    sink: dict[int, torch.Tensor] = {}
    with torch.no_grad(), adapter.capture_layer_states(model, cache, tuple(sorted(set(layer_ids))), sink):
        prefill(model, cache, [ids[b, :n] for b, n in enumerate(lengths)])
    return torch.cat([sink[k] for k in layer_ids], dim=-1).float()


def ttt_unroll(layer: EagleLayer, embed: torch.Tensor, features: torch.Tensor, ids: torch.Tensor, steps: int):
    """The unrolled steps of training-time test over one batch, as drafting runs them.

    features: [B, T, 3 H_t] the target's; ids: [B, T] the sequences. Step 0 reads the target's
    features at every position; step j > 0 reads the layer's own outputs of step j - 1, each
    query seeing the target's entries up to its root and its own chain of draft entries.
    Yields (j, logits [B, m - 1, V_d], target positions [m - 1]): step j's logits at position p
    predict token p + 2 + j.
    """
    B, T, _ = features.shape
    n = T - 1  # entries: position p reads features p and token p + 1
    positions = torch.arange(n, device=ids.device).unsqueeze(0).expand(B, n)
    h = layer.fuse(features[:, :n])
    keys = values = None
    causal = torch.ones(n, n, dtype=torch.bool, device=ids.device).tril()
    eye = torch.eye(n, dtype=torch.bool, device=ids.device)
    for j in range(steps):
        m = n - j  # queries whose input token p + 1 + j exists
        if m < 2:
            break
        q, k, v, res = layer.project(h[:, :m], embed[ids[:, 1 + j : 1 + j + m]], positions[:, :m] + j)
        keys = [k] if keys is None else [kk[:, :, :m] for kk in keys] + [k]
        values = [v] if values is None else [vv[:, :, :m] for vv in values] + [v]
        visible = torch.cat([causal[:m, :m]] + [eye[:m, :m]] * j, dim=1).unsqueeze(0).expand(B, -1, -1)
        out = layer.finish(q, torch.cat(keys, dim=2), torch.cat(values, dim=2), visible, res)
        yield j, layer.logits(out[:, : m - 1]), 2 + j + torch.arange(m - 1, device=ids.device)
        h = out


def ttt_loss(layer: EagleLayer, embed: torch.Tensor, features: torch.Tensor, ids: torch.Tensor, learn: torch.Tensor,
             t2d: torch.Tensor, steps: int, decay: float) -> tuple[torch.Tensor, list[float]]:
    """The training-time-test loss of one batch (:func:`ttt_unroll`).

    features: [B, T, 3 H_t] the target's; ids: [B, T] the sequences; learn: BoolTensor [B, T],
    True where token t is one the target chose (answer tokens); t2d: [V] each target id's
    draft index (-1: outside the draft vocabulary). Step j at position p learns token
    p + 2 + j with weight ``decay ** j``. Returns (loss, per-step mean CE).
    """
    total, per_step = features.new_zeros(()), []
    for j, logits, tgt_pos in ttt_unroll(layer, embed, features, ids, steps):
        target = t2d[ids[:, tgt_pos]]
        ok = learn[:, tgt_pos] & (target >= 0)
        if bool(ok.any()):
            ce = F.cross_entropy(logits[ok].float(), target[ok])
            total = total + decay ** j * ce
            per_step.append(float(ce.detach()))
    return total, per_step


@torch.no_grad()
def ttt_hits(layer: EagleLayer, embed: torch.Tensor, features: torch.Tensor, ids: torch.Tensor, learn: torch.Tensor,
             steps: int, top_k: int = 1) -> list[tuple[int, int]]:
    """Per unrolled step j: (hits, positions) over the ``learn`` positions, where a hit is token
    p + 2 + j among the draft's ``top_k`` best target ids (tokens outside the draft vocabulary
    count as misses). With ``top_k=1``, step 0's rate is the first-draft acceptance of a chain on
    that text and step j's depth j + 1's given a right path above it; a larger ``top_k`` bounds
    what a tree with that many children per node can accept."""
    out = []
    for _, logits, tgt_pos in ttt_unroll(layer, embed, features, ids, steps):
        guess = layer.draft_to_target(logits.topk(min(top_k, logits.shape[-1]), dim=-1).indices)
        hit = (guess == ids[:, tgt_pos].unsqueeze(-1)).any(-1)
        ok = learn[:, tgt_pos]
        out.append((int(hit[ok].sum()), int(ok.sum())))
    return out


# --------------------------------------------------------------------------- the run


def _lr_at(step: int, total: int, cfg: EagleTrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps)
    return cfg.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def _save_checkpoint(folder: Path, layer: EagleLayer, opt: torch.optim.Optimizer, step: int, cfg: EagleTrainConfig,
                     data_key: str, losses: list[float]) -> None:
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_eagle(layer, tmp)
    torch.save({"optimizer": opt.state_dict(), "step": step, "rng": torch.get_rng_state(), "losses": losses,
                "run": {k: getattr(cfg, k) for k in _RUN_KEYS}, "data_key": data_key}, tmp / "trainer_state.pt")
    old = folder.with_name(folder.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if folder.exists():
        os.replace(folder, old)
    os.replace(tmp, folder)
    shutil.rmtree(old, ignore_errors=True)


def _load_checkpoint(folder: Path, layer: EagleLayer, opt: torch.optim.Optimizer, cfg: EagleTrainConfig,
                     data_key: str) -> tuple[int, list[float]]:
    """Restore the draft, optimizer and RNG; returns (step, losses), (0, []) without one."""
    file = folder / "trainer_state.pt"
    if not file.is_file():
        return 0, []
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
        saved = read_eagle(folder)
    except Exception as err:  # noqa: BLE001
        raise ValueError(f"{file}: unreadable checkpoint ({err}); delete '{folder}' or pass --restart") from None
    run = {k: getattr(cfg, k) for k in _RUN_KEYS}
    if state.get("run") != run or state.get("data_key") != data_key:
        diff = sorted(k for k in run if (state.get("run") or {}).get(k) != run[k]) or ["training data"]
        raise ValueError(f"the checkpoint in '{folder}' belongs to a different run (differs in: {', '.join(diff)}); "
                         "use another --out, or pass --restart to start over")
    layer.load_state_dict(saved.state_dict())
    opt.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"])
    return int(state["step"]), list(state["losses"])


def train_eagle(cfg: EagleTrainConfig, model: Any = None, tokenizer: Any = None, prompts: list[str] | None = None,
                restart: bool = False, log: Any = None, stop_after: int | None = None) -> EagleLayer | None:
    """Answer the prompts, train, save the draft in ``cfg.out``; returns it (float32), or None
    when ``stop_after`` steps are done first (a checkpoint left to resume from).

    model / tokenizer: an already loaded target (default: ``accel.models.load_model(cfg.model)``).
    log: a function of one line of progress (default: print to stderr; False: silent).
    """
    cfg.check()
    if log is None:
        log = lambda line: print(f"train-eagle: {line}", file=sys.stderr, flush=True)  # noqa: E731
    log = log or (lambda line: None)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    out = Path(cfg.out)
    if restart:
        for sub in ("data", "checkpoint", "checkpoint.tmp", "checkpoint.old"):
            shutil.rmtree(out / sub, ignore_errors=True)
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
    seqs = [(s[: cfg.max_len], n) for s, n in seqs if min(s.numel(), cfg.max_len) > n + 2]
    if not seqs:
        raise ValueError("no training sequences: the model answered nothing (check the prompts and max_new_tokens)")
    data_key = hashlib.sha256(b"".join(s.numpy().tobytes() for s, _ in seqs)).hexdigest()[:16]
    vocab = int(model.config.get_text_config(decoder=True).vocab_size)
    keep = draft_vocabulary(seqs, cfg.draft_vocab, vocab, adapter.default_eos(model, tokenizer))
    t2d = torch.full((vocab,), -1, dtype=torch.long)
    t2d[keep] = torch.arange(keep.numel())
    layer = new_layer(model, vocab_ids=keep, seed=cfg.seed)
    if cfg.init in ("target", "frozen"):
        warm_start(layer, model)
    if cfg.init == "frozen":
        layer.lm_head.requires_grad_(False)
        layer.norm.requires_grad_(False)
    param = next(model.parameters())
    layer.to(param.device)
    layer.train()
    embed = model.get_input_embeddings().weight.detach().float()
    opt = torch.optim.AdamW([p for p in layer.parameters() if p.requires_grad], lr=cfg.lr)
    per_epoch = math.ceil(len(seqs) / cfg.batch_size)
    total = max(1, math.ceil(cfg.epochs * per_epoch))
    ckpt = out / "checkpoint"
    step, losses = _load_checkpoint(ckpt, layer, opt, cfg, data_key)
    if step:
        log(f"resumed at step {step}/{total}")
    t2d = t2d.to(param.device)
    while step < total:
        epoch, i = divmod(step, per_epoch)
        perm = torch.randperm(len(seqs), generator=torch.Generator().manual_seed(cfg.seed * 1000003 + epoch))
        batch = [seqs[int(b)] for b in perm[i * cfg.batch_size : (i + 1) * cfg.batch_size]]
        lengths = [int(s.numel()) for s, _ in batch]
        T = max(lengths)
        ids = torch.zeros(len(batch), T, dtype=torch.long)
        learn = torch.zeros(len(batch), T, dtype=torch.bool)
        for b, (s, n) in enumerate(batch):
            ids[b, : s.numel()] = s
            learn[b, n : s.numel()] = True
        ids, learn = ids.to(param.device), learn.to(param.device)
        feats = target_features(model, ids, lengths, layer.spec.layer_ids)
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, total, cfg)
        loss, per_step = ttt_loss(layer, embed, feats, ids, learn, t2d, cfg.ttt_steps, cfg.decay)
        opt.zero_grad(set_to_none=True)
        if loss.requires_grad:
            loss.backward()
            opt.step()
        losses.append(round(float(loss.detach()), 4))
        step += 1
        log(f"step {step}/{total} loss {losses[-1]:.3f} (per unrolled step: "
            + " ".join(f"{x:.2f}" for x in per_step) + f") {time.perf_counter() - t0:.0f} s")
        if stop_after is not None and step >= stop_after and step < total:
            _save_checkpoint(ckpt, layer, opt, step, cfg, data_key, losses)
            return None
        if cfg.checkpoint_every and step % cfg.checkpoint_every == 0 and step < total:
            _save_checkpoint(ckpt, layer, opt, step, cfg, data_key, losses)
    layer.eval()
    facts = {**{k: v for k, v in asdict(cfg).items() if k not in ("out", "threads")}, "sequences": len(seqs),
             "steps": total, "losses_first_last": [losses[0], losses[-1]] if losses else None,
             "total_s": round(time.perf_counter() - t0, 1)}
    save_eagle(layer, out, dtype=as_dtype(cfg.save_dtype), extra={"accel_training": facts})
    shutil.rmtree(ckpt, ignore_errors=True)
    layer.info = facts
    layer.losses = losses
    return layer


def run_cli(args: argparse.Namespace) -> int:
    """``accel train-eagle``: the flags set onto :class:`EagleTrainConfig` (unset: its defaults)."""
    fields = {k: v for k, v in vars(args).items() if k in EagleTrainConfig.__dataclass_fields__ and v is not None}
    cfg = EagleTrainConfig(**fields)
    layer = train_eagle(cfg, restart=bool(getattr(args, "restart", False)))
    info = layer.info
    print(f"saved an EAGLE-3 draft ({layer.spec.draft_vocab_size} draft tokens, layers {list(layer.spec.layer_ids)}) "
          f"to {cfg.out}; {info['sequences']} sequences, {info['steps']} steps, loss {info['losses_first_last']}, "
          f"{info['total_s']} s")
    print(f"use it: accel generate PROMPT --strategy eagle:draft={cfg.out}")
    return 0
