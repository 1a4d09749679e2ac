"""Pass-key retrieval sweep on the default model: which SnapKV settings keep the needle.

Accuracy only (no timing), so it can run beside other work:
    python benchmarks/needle_sweep.py --lengths 4096 --depths 0.1 0.5 0.9 --budgets 512 1024
"""

from __future__ import annotations

import argparse
import random

import torch

import accel
from accel.models import chat_ids, load_default
from snapkv import SnapKV

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


def needle_prompt(tokenizer, length: int, depth: float, key: int) -> torch.Tensor:
    needle = f"The pass key is {key}. Remember it. {key} is the pass key. "
    question = "What is the pass key?"
    unit = len(tokenizer(FILLER).input_ids)
    reps = max(1, (length - 60) // unit)
    before = int(reps * depth)
    text = FILLER * before + needle + FILLER * (reps - before)
    msg = f"There is a pass key hidden in the following text. Find it and memorize it.\n\n{text}\n\n{question}"
    return chat_ids(tokenizer, msg)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096])
    ap.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.3, 0.5, 0.7, 0.9])
    ap.add_argument("--budgets", type=int, nargs="+", default=[256, 512, 1024])
    ap.add_argument("--kernels", type=int, nargs="+", default=[7, 15, 31])
    ap.add_argument("--windows", type=int, nargs="+", default=[32])
    ap.add_argument("--pooling", default="max")
    ap.add_argument("--gqa", nargs="+", default=["max"])
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    model, tok = load_default()
    rng = random.Random(args.seed)
    configs = {"full": []}
    for b in args.budgets:
        for k in args.kernels:
            for w in args.windows:
                for g in args.gqa:
                    configs[f"b{b}_k{k}_w{w}_{g}"] = [SnapKV(budget=b, window=w, kernel=k, pooling=args.pooling, gqa=g)]
    score = {name: 0 for name in configs}
    total = 0
    for length in args.lengths:
        for depth in args.depths:
            key = rng.randrange(10000, 99999)
            ids = needle_prompt(tok, length, depth, key)
            total += 1
            line = [f"len={ids.shape[1]} depth={depth} key={key}"]
            for name, strat in configs.items():
                res = accel.generate(model, ids, strategies=strat, max_new_tokens=16, tokenizer=tok)
                ok = str(key) in res.text[0]
                score[name] += ok
                line.append(f"{name}={'Y' if ok else 'n'}")
            print(" ".join(line), flush=True)
    print("accuracy:", {k: f"{v}/{total}" for k, v in score.items()})


if __name__ == "__main__":
    main()
