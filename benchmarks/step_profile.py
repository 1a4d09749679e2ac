"""Where a batched decode step's time goes, plain and drafting, on this machine.

B chat prompts (benchmarks/serve_load.py's, in the default model's chat template) are
admitted into one :class:`accel.engine.Batch`; then, in alternating rounds, a bare
transformers forward of one token per row over a DynamicCache of the same B prompts, and
``--steps`` steps of the Batch, plain and with ``--strategy`` drafters. Per configuration:
ms per step (fastest round's mean), tokens per row per step, draft nodes per step, and the
milliseconds of each phase of a step (drafting, the verify forward with the output layer,
commit).

    python benchmarks/step_profile.py --batch 8 12 --strategy medusa:heads=default --strategy prompt_lookup
    python benchmarks/step_profile.py --batch 1 8 --dtype bfloat16 --quantize int4
    python benchmarks/step_profile.py --batch 8 --dtype bfloat16 --profile 12

``--profile N`` also runs each configuration's steps once under ``torch.profiler`` and
prints its N operators of most self CPU time per step (what is the model's compute and
what is accel's bookkeeping around it). The native kernels (accel.kernels.native, ordered
attention in bf16) are plain calls, not torch operators: their time is the step's ms less
"(all operators)".
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

import torch
from transformers import DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_load import PROMPTS  # noqa: E402

from accel import adapter, engine  # noqa: E402
from accel.bench.measurement import cpu_model  # noqa: E402
from accel.models import chat_ids, load_model  # noqa: E402
from accel.strategy import build_strategies  # noqa: E402

PHASES = ("draft_rows", "verify_logits", "commit")


class PhaseTimer:
    """Wraps the engine module's step phases so that each call adds to ``seconds[name]``; it
    also counts the draft nodes the verify forwards got (``drafts``)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = collections.defaultdict(float)
        self.drafts = 0
        for name in PHASES:
            setattr(engine, name, self._timed(name, getattr(engine, name)))

    def clear(self) -> None:
        self.seconds.clear()
        self.drafts = 0

    def _timed(self, name, fn):
        def timed(*args, **kwargs):
            if name == "verify_logits":  # (model, cache, trees, ...)
                self.drafts += sum(tree.num_drafts for tree in args[2])
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - start
        return timed


def bare_forward_ms(model, prompts: list[torch.Tensor], steps: int) -> float:
    """Mean ms of a transformers forward of one token per row over the rows' prompts (each cut
    to the shortest, so no padding is needed)."""
    n = min(int(p.numel()) for p in prompts)
    ids = torch.stack([p[:n] for p in prompts])
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        model(ids, past_key_values=cache, use_cache=True)
        nxt = ids[:, -1:]
        model(nxt, past_key_values=cache, use_cache=True)  # warm-up
        start = time.perf_counter()
        for _ in range(steps):
            model(nxt, past_key_values=cache, use_cache=True)
    return (time.perf_counter() - start) * 1e3 / steps


def batch_steps(model, prompts, plan, steps: int, timer: PhaseTimer, profile: int = 0,
                label: str = "") -> dict[str, float]:
    rows = [engine.Row(prompt=p, plan=plan, max_new_tokens=10 * steps + 20, eos=frozenset()) for p in prompts]
    batch = engine.Batch(model)
    with adapter.packed_gqa_attention(model), adapter.per_layer_masks(model, batch.cache), torch.inference_mode():
        batch.admit(rows)
        for _ in range(3):  # warm-up (and the drafters' slow start)
            batch.step()
        if profile:
            from torch.profiler import ProfilerActivity, profile as profiled

            with profiled(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(steps):
                    batch.step()
            print(f"  torch.profiler, {steps} steps ({label}, B={len(prompts)}): self CPU ms per step")
            events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
            total = sum(e.self_cpu_time_total for e in events)
            for e in events[:profile]:
                print(f"    {e.key:<40} {e.self_cpu_time_total / 1e3 / steps:7.2f} ms  "
                      f"{e.count / steps:6.1f} calls  {100 * e.self_cpu_time_total / total:5.1f}%")
            print(f"    {'(all operators)':<40} {total / 1e3 / steps:7.2f} ms")
        timer.clear()
        tokens = 0
        start = time.perf_counter()
        for _ in range(steps):
            tokens += sum(len(new) for new in batch.step())
        wall = time.perf_counter() - start
    out = {"ms": wall * 1e3 / steps, "tokens_per_row": tokens / steps / len(prompts), "drafts": timer.drafts / steps}
    out.update({name: timer.seconds[name] * 1e3 / steps for name in PHASES})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--batch", type=int, nargs="+", default=[8])
    ap.add_argument("--strategy", action="append", default=[], help="NAME:k=v, as for accel generate")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtype", default="float32", help="as for accel.load_model (default: float32)")
    ap.add_argument("--quantize", default=None, choices=["int8", "int4"])
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="print each configuration's N operators of most self CPU time (torch.profiler)")
    args = ap.parse_args()
    model, tok = load_model(args.model, dtype=args.dtype, quantize=args.quantize)
    plans = {"plain": engine.plan_strategies([])}
    if args.strategy:
        plans["+".join(args.strategy)] = engine.plan_strategies(build_strategies(args.strategy))
    for plan in plans.values():
        plan.check(model)
    timer = PhaseTimer()
    print(f"model={args.model} dtype={model.dtype} quantize={args.quantize} cpu={cpu_model()!r} threads={torch.get_num_threads()} steps={args.steps} rounds={args.rounds}")
    for b in args.batch:
        prompts = [chat_ids(tok, PROMPTS[i % len(PROMPTS)])[0] for i in range(b)]
        best: dict[str, dict[str, float]] = {}
        for _ in range(args.rounds):
            bare = bare_forward_ms(model, prompts, args.steps)
            if "bare" not in best or bare < best["bare"]["ms"]:
                best["bare"] = {"ms": bare}
            for name, plan in plans.items():
                got = batch_steps(model, prompts, plan, args.steps, timer, args.profile if name not in best else 0, name)
                if name not in best or got["ms"] < best[name]["ms"]:
                    best[name] = got
        print(f"\nB={b}: bare transformers forward {best['bare']['ms']:.1f} ms")
        plain_tok_s = None
        for name in plans:
            r = best[name]
            tok_s = r["tokens_per_row"] * b / r["ms"] * 1e3
            plain_tok_s = plain_tok_s or tok_s
            phases = ", ".join(f"{p} {r[p]:.1f}" for p in PHASES)
            print(f"  {name}: {r['ms']:.1f} ms/step ({r['ms'] / best['bare']['ms']:.2f}x bare), "
                  f"{r['tokens_per_row']:.2f} tokens/row/step, {r['drafts']:.1f} draft nodes/step, "
                  f"{tok_s:.1f} tok/s ({tok_s / plain_tok_s:.2f}x plain); phases ms: {phases}")


if __name__ == "__main__":
    main()
