"""The prefill over several processes (KV-Runahead, ``prefill_ranks=``) beside one process with
the same total threads: time to first token on pass-key documents of 4K and 7.5K tokens, each
rank's chunk, seconds and bytes sent, the balanced split beside the even one, and whether greedy
output over ``--new`` tokens equals one process's (plain and SnapKV 1024).

    python benchmarks/runahead_prefill.py --out docs/results/runahead_zen3_f32.json

Configurations run one after the other (never at once), in an order that rotates from repeat to
repeat; TTFT is ``stats.prefill_s`` of a one-token generate (the prefill and the first token's
logits), the best of ``--repeats``. ``1 process, 1 thread`` is what one rank's share of the
machine does alone: with 2 cores, 2 ranks can gain only where that share runs the whole prompt
in less than twice the 2-thread time.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

import accel
from accel.bench.measurement import cpu_model
from accel.bench.schema import Experiment
from accel.bench.tasks import build_items
from accel.models import load_model
from accel.runahead import PrefillRanks


def document(tokenizer, length: int) -> torch.Tensor:
    """One pass-key document of at most ``length`` tokens (chat template included), needle at 40%."""
    exp = Experiment.model_validate({"tasks": [{"kind": "needle", "lengths": [length], "depths": [0.4]}],
                                     "runs": {"plain": []}})
    return build_items(exp, tokenizer)[0].input_ids


def ttft(model, ids, ranks, threads: int) -> tuple[float, list]:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = accel.generate(model, ids, max_new_tokens=1, eos_token_id=[], prefill_ranks=ranks)
    finally:
        torch.set_num_threads(before)
    report = [r.__dict__ for r in ranks.last] if ranks is not None else []
    return out.stats.prefill_s, report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 7500])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--new", type=int, default=32, help="greedy tokens compared with one process's")
    parser.add_argument("--configs", nargs="+", default=["one", "one-thread", "balanced", "even"],
                        choices=["one", "one-thread", "balanced", "even"],
                        help="one process on every thread / on one thread, the ranks balanced / even")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    threads = torch.get_num_threads()
    model, tokenizer = load_model(args.model, dtype="float32")
    t = time.perf_counter()
    balanced = PrefillRanks(model, args.ranks, split="balanced")
    even = PrefillRanks(model, args.ranks, split="even")
    start_s = (time.perf_counter() - t) / 2
    every = {"one": (f"1 process, {threads} threads", (None, threads)), "one-thread": ("1 process, 1 thread", (None, 1)),
             "balanced": (f"{args.ranks} ranks balanced", (balanced, threads)),
             "even": (f"{args.ranks} ranks even", (even, threads))}
    configs = dict(every[c] for c in ["one"] + [c for c in args.configs if c != "one"])  # the baseline first
    warm = document(tokenizer, 512)
    for ranks, n in configs.values():  # first calls: kernels, calibration, the helpers' first forward
        ttft(model, warm, ranks, n)
    result = {"cpu": cpu_model(), "torch_threads": threads, "model": args.model, "dtype": "float32",
              "ranks": args.ranks, "helpers_start_s": round(start_s, 2), "lengths": {}}
    names = list(configs)
    for length in args.lengths:
        ids = document(tokenizer, length)
        seconds = {name: [] for name in names}
        reports = {}
        for rep in range(args.repeats):
            for name in names[rep % len(names):] + names[: rep % len(names)]:
                s, report = ttft(model, ids, *configs[name])
                seconds[name].append(s)
                reports[name] = report
        row = {"tokens": int(ids.shape[1]), "ttft_s": {k: round(min(v), 3) for k, v in seconds.items()},
               "ranks": {k: v for k, v in reports.items() if v}}
        base = row["ttft_s"][names[0]]
        row["vs_one_process"] = {k: round(base / v, 3) for k, v in row["ttft_s"].items()}
        if length == args.lengths[0]:
            same = {}
            for specs in ([], ["snapkv:budget=1024"]):
                one = accel.generate(model, ids, strategies=specs, max_new_tokens=args.new, eos_token_id=[])
                two = accel.generate(model, ids, strategies=specs, max_new_tokens=args.new, eos_token_id=[],
                                     prefill_ranks=balanced)
                same["+".join(specs) or "plain"] = bool(torch.equal(one.sequences, two.sequences))
            row["greedy_equal"] = same
        result["lengths"][str(length)] = row
        print(json.dumps(row), flush=True)
    balanced.close()
    even.close()
    print(f"\n{result['cpu']}, {threads} torch threads, float32; helpers start {start_s:.1f} s (once)")
    print("| tokens | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for row in result["lengths"].values():
        print(f"| {row['tokens']} | " + " | ".join(f"{row['ttft_s'][n]:.2f} s ({row['vs_one_process'][n]:.2f}x)"
                                                    for n in names) + " |")
    for row in result["lengths"].values():
        for name, report in row["ranks"].items():
            parts = ", ".join(f"rank {r['rank']} [{r['start']}, {r['end']}) {r['seconds']:.2f} s "
                              f"{r['bytes_sent'] / 2**20:.1f} MiB sent" for r in report)
            print(f"{row['tokens']} tokens, {name}: {parts}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
