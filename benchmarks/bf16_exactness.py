"""Greedy drafting in bfloat16 against plain bf16 accel decoding, on the held-out chat prompts.

    python benchmarks/bf16_exactness.py                     # prompt lookup and Medusa: prompts equal, token for token
    python benchmarks/bf16_exactness.py --unpadded          # the same on sdpa, without accel.kernels.invariance's padding
    python benchmarks/bf16_exactness.py cost                # what ordered attention and the padding cost plain bf16 decoding

Options: --prompts N (default 40; cost: 8), --new N (default 32; cost: 64). ``cost`` times
plain bf16 decoding as accel runs it (ordered attention where accel.kernels.invariance.ordered, rows
padded as the probe chose) against the same decoding on sdpa, unpadded (rows x1, columns
unaligned), interleaved prompt by prompt, with float32 plain decoding for reference; ratios
are decode tok/s of the same run. Run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from accel.bench.measurement import cpu_model  # noqa: E402
import accel  # noqa: E402
from accel.kernels import invariance  # noqa: E402
from accel.models import chat_ids, load_default  # noqa: E402
from speculative import Medusa, PromptLookup  # noqa: E402
from speculative.train import held_out_prompts  # noqa: E402


@contextlib.contextmanager
def unpadded():
    """accel without its low-precision measures: sdpa attention (not accel.kernels.ordered), rows x1,
    columns unaligned."""
    real = invariance.verify_rows, invariance.kv_align, invariance.ordered
    invariance.verify_rows, invariance.kv_align = (lambda model, candidates=None: 1), (lambda model: 1)
    invariance.ordered = lambda model: False
    try:
        yield
    finally:
        invariance.verify_rows, invariance.kv_align, invariance.ordered = real


def agreement(model, tok, prompts: list[str], new: int, padded: bool) -> None:
    differ = {"prompt_lookup": 0, "medusa": 0}
    steps: dict[str, list[float]] = {k: [] for k in differ}
    t0 = time.time()
    with contextlib.nullcontext() if padded else unpadded():
        for i, p in enumerate(prompts):
            ids = chat_ids(tok, p)
            ref = accel.generate(model, ids, strategies=[], max_new_tokens=new)
            for name, strategies in (("prompt_lookup", [PromptLookup()]), ("medusa", [Medusa(heads="default")])):
                out = accel.generate(model, ids, strategies=strategies, max_new_tokens=new)
                steps[name].append(out.stats.mean_accepted)
                if not torch.equal(out.sequences[0], ref.sequences[0]):
                    differ[name] += 1
                    print(f"prompt {i}: {name} differs from plain bf16", flush=True)
    for name in differ:
        print(f"{name}: {len(prompts) - differ[name]}/{len(prompts)} prompts equal to plain bf16 "
              f"({'padded' if padded else 'unpadded'}), {sum(steps[name]) / len(prompts):.2f} tokens per step")
    print(f"{time.time() - t0:.0f} s")


def cost(model, tok, prompts: list[str], new: int) -> None:
    model32, _ = load_default(dtype=torch.float32)
    seconds = {"bf16 accel": 0.0, "bf16 unpadded": 0.0, "float32": 0.0}
    tokens = dict.fromkeys(seconds, 0)
    for p in prompts:
        ids = chat_ids(tok, p)
        for name in seconds:
            with unpadded() if name == "bf16 unpadded" else contextlib.nullcontext():
                out = accel.generate(model32 if name == "float32" else model, ids, strategies=[], max_new_tokens=new)
            seconds[name] += out.stats.decode_s
            tokens[name] += out.stats.decode_tokens
    base = tokens["bf16 unpadded"] / seconds["bf16 unpadded"]
    print(f"plain decoding, {len(prompts)} chat prompts x {new} tokens:")
    for name in seconds:
        rate = tokens[name] / seconds[name]
        print(f"  {name:14s} {rate:6.1f} tok/s  {rate / base:.2f}x bf16 unpadded")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("mode", nargs="?", choices=("agreement", "cost"), default="agreement")
    parser.add_argument("--prompts", type=int, default=None)
    parser.add_argument("--new", type=int, default=None)
    parser.add_argument("--unpadded", action="store_true", help="agreement without accel.kernels.invariance's padding")
    args = parser.parse_args()
    model, tok = load_default(dtype=torch.bfloat16)
    rows = invariance.verify_rows(model)  # probed once, before anything is timed
    attention = "ordered attention" if invariance.ordered(model) else "sdpa"
    setting = (f"{attention}, padded to a multiple of {rows} rows and {invariance.kv_align(model)} columns"
               if not args.unpadded else f"sdpa, unpadded (the probe chose {rows} rows)")
    print(f"{cpu_model()}, torch {torch.__version__}, {torch.get_num_threads()} threads; bf16 verify {setting}",
          flush=True)
    if args.mode == "cost":
        cost(model, tok, held_out_prompts()[: args.prompts or 8], args.new or 64)
    else:
        agreement(model, tok, held_out_prompts()[: args.prompts or 40], args.new or 32, padded=not args.unpadded)


if __name__ == "__main__":
    main()
