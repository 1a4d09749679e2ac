"""Any drafter on the held-out chat prompts of the default model: tokens per verify step,
exactness against plain greedy decoding, and decode speed against plain, same run.

    python benchmarks/drafter_check.py --strategy ngrammys
    python benchmarks/drafter_check.py --strategy ngrammys --strategy medusa:heads=default --dtype bf16
    python benchmarks/drafter_check.py --strategy "ngrammys,prompt_lookup" --prompts 10 --new 64

Each ``--strategy`` is one configuration: a comma-separated list of strategy specs
(``name:field=value``). For every prompt, plain decoding and each configuration run one after
another, their order rotating from prompt to prompt, so a machine that drifts slows all alike.
Prints one line per configuration: mean tokens per verify step (bonus included), outputs
equal to plain out of the prompts, decode tok/s and its ratio to plain.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import accel  # noqa: E402
from accel.models import chat_ids, load_model  # noqa: E402
from accel.strategy import build_strategies  # noqa: E402
from speculative.train import held_out_prompts  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--strategy", action="append", required=True, help="comma-separated strategy specs (repeatable)")
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prompts", type=int, default=40, help="held-out chat prompts at most")
    ap.add_argument("--new", type=int, default=128, help="new tokens per prompt")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = load_model(args.model, dtype=args.dtype)
    configs = [build_strategies(s.split(",")) for s in args.strategy]
    names = ["plain"] + args.strategy
    runs = [[]] + configs
    warm = chat_ids(tok, "Hello!")
    for strategies in runs:  # first calls: tables, heads and kernels loaded before timing
        accel.generate(model, warm, strategies=strategies, max_new_tokens=4, tokenizer=tok)
    prompts = held_out_prompts()[: args.prompts]
    tokens = [0] * len(runs)
    seconds = [0.0] * len(runs)
    steps = [0] * len(runs)
    emitted = [0] * len(runs)
    exact = [0] * len(runs)
    print(f"{len(prompts)} held-out chat prompts, {args.new} new tokens, {args.model} {args.dtype}, "
          f"{torch.get_num_threads()} threads", flush=True)
    for i, prompt in enumerate(prompts):
        ids = chat_ids(tok, prompt)
        order = [(i + j) % len(runs) for j in range(len(runs))]
        results = {}
        for k in order:
            results[k] = accel.generate(model, ids, strategies=runs[k], max_new_tokens=args.new, tokenizer=tok)
        for k, r in results.items():
            tokens[k] += r.stats.decode_tokens
            seconds[k] += r.stats.decode_s
            steps[k] += r.stats.verify_steps
            emitted[k] += r.stats.accepted_tokens + r.stats.verify_steps
            exact[k] += int(torch.equal(r.sequences, results[0].sequences))
        print(f"  [{i:2d}] " + "  ".join(f"{names[k]} {results[k].stats.mean_accepted:.2f}/step" for k in range(1, len(runs))),
              flush=True)
    plain_rate = tokens[0] / seconds[0]
    print(f"plain: {plain_rate:.1f} tok/s")
    for k in range(1, len(runs)):
        rate = tokens[k] / seconds[k]
        print(f"{names[k]}: {emitted[k] / steps[k]:.2f} tokens/step | exact {exact[k]}/{len(prompts)} | "
              f"{rate:.1f} tok/s = {rate / plain_rate:.2f}x plain")


if __name__ == "__main__":
    main()
