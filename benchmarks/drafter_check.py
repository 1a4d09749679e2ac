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


class Tally:
    """Per configuration: decode tokens and seconds, verify steps, tokens emitted, exact outputs."""

    def __init__(self, n: int):
        self.tokens, self.seconds = [0] * n, [0.0] * n
        self.steps, self.emitted, self.exact = [0] * n, [0] * n, [0] * n
        self.prompts = 0


def compare(model, tok, names, runs, prompts, new: int, after_prompt=None) -> Tally:
    """Runs every configuration of ``runs`` (``runs[0]`` plain decoding) on each prompt, their
    order rotating from prompt to prompt, after one warm-up call each; prints a line per prompt.
    ``after_prompt(ids, results)`` sees each prompt's results (index -> GenerateOutput)."""
    warm = chat_ids(tok, "Hello!")
    for strategies in runs:  # first calls: tables, heads and kernels loaded before timing
        accel.generate(model, warm, strategies=strategies, max_new_tokens=4, tokenizer=tok)
    t = Tally(len(runs))
    for i, prompt in enumerate(prompts):
        ids = chat_ids(tok, prompt)
        results = {}
        for k in [(i + j) % len(runs) for j in range(len(runs))]:
            results[k] = accel.generate(model, ids, strategies=runs[k], max_new_tokens=new, tokenizer=tok)
        for k, r in results.items():
            t.tokens[k] += r.stats.decode_tokens
            t.seconds[k] += r.stats.decode_s
            t.steps[k] += r.stats.verify_steps
            t.emitted[k] += r.stats.accepted_tokens + r.stats.verify_steps
            t.exact[k] += int(torch.equal(r.sequences, results[0].sequences))
        t.prompts += 1
        if after_prompt is not None:
            after_prompt(ids, results)
        print(f"  [{i:2d}] " + "  ".join(f"{names[k]} {results[k].stats.mean_accepted:.2f}/step" for k in range(1, len(runs))),
              flush=True)
    return t


def report(names, t: Tally) -> None:
    """One line for plain decoding's rate, one per configuration: tokens per verify step
    (bonus included), exact outputs, decode tok/s and its ratio to plain."""
    plain_rate = t.tokens[0] / t.seconds[0]
    print(f"plain: {plain_rate:.1f} tok/s")
    for k in range(1, len(names)):
        rate = t.tokens[k] / t.seconds[k]
        print(f"{names[k]}: {t.emitted[k] / t.steps[k]:.2f} tokens/step | exact {t.exact[k]}/{t.prompts} | "
              f"{rate:.1f} tok/s = {rate / plain_rate:.2f}x plain")


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
    names = ["plain"] + args.strategy
    runs = [[]] + [build_strategies(s.split(",")) for s in args.strategy]
    prompts = held_out_prompts()[: args.prompts]
    print(f"{len(prompts)} held-out chat prompts, {args.new} new tokens, {args.model} {args.dtype}, "
          f"{torch.get_num_threads()} threads", flush=True)
    report(names, compare(model, tok, names, runs, prompts, args.new))


if __name__ == "__main__":
    main()
