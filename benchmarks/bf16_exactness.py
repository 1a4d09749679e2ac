"""Greedy exactness in bfloat16: prompt lookup and Medusa against plain bf16 accel decoding
on the held-out chat prompts, token for token (accel.invariance makes verification
batch-invariant; this checks it on the real default model).

    python benchmarks/bf16_exactness.py [PROMPTS] [NEW_TOKENS]      # default 40 prompts, 32 tokens
    python benchmarks/bf16_exactness.py cost [PROMPTS] [NEW_TOKENS]  # what the padding costs plain decoding

``cost`` times plain bf16 decoding with the invariant settings against the same decoding
unpadded (rows 1, columns unaligned), interleaved prompt by prompt, and float32 plain
decoding for reference; ratios are decode tok/s of the same run.
"""

from __future__ import annotations

import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import accel  # noqa: E402
from accel import invariance  # noqa: E402
from accel.models import chat_ids, load_default  # noqa: E402
from speculative import Medusa, PromptLookup  # noqa: E402
from speculative.train import held_out_prompts  # noqa: E402


def cost(n: int, new: int) -> None:
    model, tok = load_default(dtype=torch.bfloat16)
    model32, _ = load_default(dtype=torch.float32)
    rows, align = invariance.verify_rows(model), invariance.kv_align(model)
    real = (invariance.verify_rows, invariance.kv_align)
    seconds = {"bf16 invariant": 0.0, "bf16 unpadded": 0.0, "float32": 0.0}
    tokens = dict.fromkeys(seconds, 0)
    prompts = held_out_prompts()[:n]
    for p in prompts:
        ids = chat_ids(tok, p)
        for name in seconds:
            if name == "bf16 unpadded":
                invariance.verify_rows, invariance.kv_align = (lambda m, c=None: 1), (lambda m: 1)
            try:
                out = accel.generate(model32 if name == "float32" else model, ids, strategies=[], max_new_tokens=new)
            finally:
                invariance.verify_rows, invariance.kv_align = real
            seconds[name] += out.stats.decode_s
            tokens[name] += out.stats.decode_tokens
    base = tokens["bf16 unpadded"] / seconds["bf16 unpadded"]
    print(f"plain decoding, {len(prompts)} chat prompts x {new} tokens (bf16 rows x{rows}, columns /{align}):")
    for name in seconds:
        rate = tokens[name] / seconds[name]
        print(f"  {name:15s} {rate:6.1f} tok/s  {rate / base:.2f}x bf16 unpadded")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "cost":
        return cost(int(sys.argv[2]) if len(sys.argv) > 2 else 8, int(sys.argv[3]) if len(sys.argv) > 3 else 64)
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 40
    new = int(sys.argv[2]) if len(sys.argv) > 2 else 32
    model, tok = load_default(dtype=torch.bfloat16)
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"verify rows padded to a multiple of {invariance.verify_rows(model)}, "
          f"columns to {invariance.kv_align(model)}; exact: {invariance.is_exact(model)}", flush=True)
    prompts = held_out_prompts()[:n]
    differ = {"prompt_lookup": 0, "medusa": 0}
    accepted: dict[str, list[float]] = {k: [] for k in differ}
    t0 = time.time()
    for i, p in enumerate(prompts):
        ids = chat_ids(tok, p)
        ref = accel.generate(model, ids, strategies=[], max_new_tokens=new)
        for name, strategies in (("prompt_lookup", [PromptLookup()]), ("medusa", [Medusa(heads="default")])):
            out = accel.generate(model, ids, strategies=strategies, max_new_tokens=new)
            accepted[name].append(out.stats.mean_accepted)
            if not torch.equal(out.sequences[0], ref.sequences[0]):
                differ[name] += 1
                print(f"prompt {i}: {name} differs from plain bf16", flush=True)
    for name in differ:
        print(f"{name}: {len(prompts) - differ[name]}/{len(prompts)} prompts equal to plain bf16, "
              f"{sum(accepted[name]) / len(prompts):.2f} tokens per step")
    print(f"{time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
