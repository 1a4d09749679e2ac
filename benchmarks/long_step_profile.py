"""Where a long prompt's prefill and a decode step over its long cache spend their time.

One pass-key document of ``--length`` tokens (``long_docs_anchor.py``'s first). Timed, one after
the other: the prefill alone; ``--new`` decode steps of accel on the full cache and, per
``--strategy`` set, on its cache; and the floor, a bare transformers forward of one token over a
DynamicCache of the same prompt. Then each runs once more under ``torch.profiler`` and the
operators that took the most self time are printed (``--top``), so attention, cache writes,
gathers, copies and SnapKV's scoring can be read off.

    python benchmarks/long_step_profile.py --length 7500 --new 16
    python benchmarks/long_step_profile.py --dtype bfloat16 --strategy snapkv:budget=1024
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import DynamicCache

sys.path.insert(0, str(Path(__file__).resolve().parent))
from long_docs_anchor import documents  # noqa: E402

import accel  # noqa: E402
from accel.bench.measurement import cpu_model  # noqa: E402
from accel.models import load_model  # noqa: E402


def bare_steps(model, ids: torch.Tensor, steps: int) -> tuple[float, float]:
    """transformers' own forward: prefill seconds, then ms per one-token step (greedy)."""
    with torch.inference_mode():
        t = time.perf_counter()
        cache = DynamicCache(config=model.config)
        out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        prefill = time.perf_counter() - t
        tok = out.logits[:, -1:].argmax(-1)
        t = time.perf_counter()
        for _ in range(steps):
            out = model(input_ids=tok, past_key_values=cache, use_cache=True)
            tok = out.logits[:, -1:].argmax(-1)
        return prefill, (time.perf_counter() - t) / steps * 1e3


def table(prof, top: int) -> str:
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=48)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--length", type=int, default=7500)
    ap.add_argument("--new", type=int, default=16, help="decode steps timed")
    ap.add_argument("--strategy", action="append", default=[], help="comma-separated specs (repeatable)")
    ap.add_argument("--top", type=int, default=14, help="operators printed per profile")
    ap.add_argument("--no-profile", action="store_true", help="timings only")
    args = ap.parse_args()
    model, tok = load_model(args.model, dtype=args.dtype)
    ids = documents(tok, args.length, 1)[0].input_ids
    configs = {"full": []} | {s: s.split(",") for s in args.strategy}
    print(f"{cpu_model()}, {args.model} {args.dtype}, {torch.get_num_threads()} threads, {ids.shape[1]} prompt tokens, "
          f"{args.new} decode steps", flush=True)
    accel.generate(model, ids[:, -128:], max_new_tokens=2, eos_token_id=[])  # first call: kernels, calibration
    for name, specs in configs.items():
        out = accel.generate(model, ids, strategies=specs, max_new_tokens=args.new + 1, eos_token_id=[])
        s = out.stats
        print(f"accel {name}: prefill {s.prefill_s:.2f} s, decode {s.decode_s / max(s.verify_steps, 1) * 1e3:.1f} ms "
              f"a step, {s.decode_tokens / s.decode_s:.1f} tok/s, KV {s.kv_bytes_kept / 2**20:.0f} MiB", flush=True)
    prefill, step = bare_steps(model, ids, args.new)
    print(f"transformers forward (DynamicCache): prefill {prefill:.2f} s, {step:.1f} ms a step", flush=True)
    if args.no_profile:
        return
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        accel.generate(model, ids, max_new_tokens=1, eos_token_id=[])
    print("\n== accel prefill, full cache\n" + table(prof, args.top))
    for name, specs in configs.items():
        # the prefill runs outside the profile: only the steps over the long cache are counted
        handle = accel.stream(model, ids, strategies=specs, max_new_tokens=args.new + 1, eos_token_id=[])
        next(iter(handle))
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in handle:
                pass
        print(f"\n== accel decode steps, {name}\n" + table(prof, args.top))


if __name__ == "__main__":
    main()
