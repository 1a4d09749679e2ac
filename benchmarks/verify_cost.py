"""How much one verify pass costs as the draft tree grows, on this machine.

Times one forward of N+1 tokens (a chain tree) over a cache of C entries, relative to a
single-token decode step on the same cache. The draft caps (engine DEFAULT_MAX_DRAFT,
PromptLookup and Medusa defaults) are fitted to these figures.

    python benchmarks/verify_cost.py --contexts 512 4096 --sizes 1 2 4 8 16 32 64
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from accel import adapter
from accel.cache import SharedCache
from accel.steps import prefill, verify
from accel.kernels.cpu import is_prepacked
from accel.models import load_model
from accel.tree import DraftTree


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 4096])
    ap.add_argument("--sizes", type=int, nargs="+", default=[0, 1, 3, 7, 15, 31, 63])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--no-prepack", action="store_true", help="keep transformers' nn.Linear (no accel.kernels.cpu.prepack)")
    args = ap.parse_args()
    model, _ = load_model(args.model, dtype=getattr(torch, args.dtype), prepack=not args.no_prepack)
    geo = adapter.geometry(model)
    print(f"model={args.model} dtype={args.dtype} prepacked={is_prepacked(model)} threads={torch.get_num_threads()}")
    print("context  drafts  ms/verify  x single-token")
    with torch.inference_mode(), adapter.packed_gqa_attention(model):
        for ctx in args.contexts:
            cache = SharedCache(geo.num_layers)
            ids = torch.randint(100, 20000, (1, ctx), generator=torch.Generator().manual_seed(0))
            prefill(model, cache, ids, None)
            base = None
            for n in args.sizes:
                tree = DraftTree.chain(7, list(range(100, 100 + n)))
                times = []
                for _ in range(args.repeats):
                    t = time.perf_counter()
                    verify(model, cache, tree, geo.dtype)
                    adapter.output_logits(model, torch.zeros(n + 1, model.config.hidden_size, dtype=geo.dtype))
                    times.append(time.perf_counter() - t)
                    cache.rollback()
                ms = statistics.median(times) * 1e3
                base = base or ms
                print(f"{ctx:7d}  {n:6d}  {ms:9.1f}  {ms / base:6.2f}", flush=True)


if __name__ == "__main__":
    main()
