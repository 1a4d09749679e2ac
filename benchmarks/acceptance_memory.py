"""One-row requests with and without the engine's acceptance memory, alternating, in one process.

    python benchmarks/acceptance_memory.py --strategy medusa:heads=default --strategy prompt_lookup --rounds 3

A warm-up runs the anchor's questions (benchmarks/anchor_workloads.py) as one row, then as a batch
of 8, so the memory holds what those rows accepted. Then, per round, 4 one-row requests of
``--new`` tokens with ``engine.start_from_memory`` as shipped and with it switched off (order
alternating), and one plain request. Prints tok/s and tokens per step of each. Since 3c1c30a a
row alone never reads the memory, so both halves should agree, except that the draft guard's state
also carries over between requests (the first half after the warm-up may differ for that reason);
at e7fc0b0 they did not (see docs/BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import accel  # noqa: E402
from accel import engine  # noqa: E402
from accel.bench.measurement import cpu_model  # noqa: E402
from accel.models import chat_ids  # noqa: E402
from anchor_workloads import QUESTIONS  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--strategy", action="append", required=True, help="NAME:k=v, as for accel generate")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new", type=int, default=96)
    args = ap.parse_args()
    model, tok = accel.load_model("default", dtype=args.dtype)
    prompts = [chat_ids(tok, q)[0].tolist() for q in QUESTIONS]
    shipped = engine.start_from_memory

    def run(ps, n, strategies):
        t = time.perf_counter()
        out = accel.generate(model, ps, strategies=strategies, max_new_tokens=n, eos_token_id=[])
        return out, len(ps) * n / (time.perf_counter() - t)

    run(prompts[:1], 16, args.strategy)
    run(prompts[:8], 16, args.strategy)
    print(f"cpu={cpu_model()!r} dtype={args.dtype} strategies={args.strategy}")
    try:
        for r in range(args.rounds):
            for on in (True, False) if r % 2 == 0 else (False, True):
                engine.start_from_memory = shipped if on else (lambda model, row: None)
                speeds, steps = [], []
                for p in prompts[:4]:
                    out, speed = run([p], args.new, args.strategy)
                    speeds.append(speed)
                    steps.append(round(out.stats.mean_accepted, 2))
                _, plain = run([prompts[0]], args.new, [])
                print(f"round {r + 1}, memory {'on ' if on else 'off'}: {sum(speeds) / len(speeds):.1f} tok/s, "
                      f"tokens/step {steps}; plain {plain:.1f} tok/s", flush=True)
    finally:
        engine.start_from_memory = shipped


if __name__ == "__main__":
    main()
