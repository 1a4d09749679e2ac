"""Packed linear passes of many row counts: memory and time, bucketed or not, on this machine.

oneDNN builds and caches a kernel for every input shape a packed weight meets
(``accel.kernels.cpu.PackedLinear``); a service prefills prompts of every length. This runs
``--passes`` passes of random row counts (``--min-rows`` to ``--max-rows``) through the
default model's four distinct decoder linear shapes, each pass packed, twice in a fresh
subprocess each: at the pass's own row count, and at ``accel.kernels.cpu.packed_rows``'s bucketed one
(zero rows padded, dropped after). It prints each subprocess's RSS before and after, and the
seconds of each of ``--rounds`` rounds over the same row counts (the kernel cache warm after
the first).

    python benchmarks/packed_shapes.py
    python benchmarks/packed_shapes.py --passes 500 --min-rows 33 --max-rows 2048
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time

SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536)]  # SmolLM2-135M: q/o, k/v, gate/up, down


def _rss_mib() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * 4096 / 2**20


def child(args: argparse.Namespace) -> None:
    import torch

    from accel.kernels import cpu

    torch.set_num_threads(args.threads)
    weights = [cpu._pack(torch.randn(o, i)) for o, i in SHAPES]
    rng = random.Random(args.seed)
    counts = [rng.randint(args.min_rows, args.max_rows) for _ in range(args.passes)]
    inputs = {(m, i): torch.randn(m, i) for m in set(counts) for i in {i for _, i in SHAPES}}
    before = _rss_mib()
    seconds = []
    for _ in range(args.rounds):
        t0 = time.perf_counter()
        for m in counts:
            rows = cpu.packed_rows(m) if args.bucketed else m
            for (_, i), w in zip(SHAPES, weights):
                x = inputs[(m, i)]
                if rows != m:
                    x = torch.cat([x, x.new_zeros(rows - m, i)])
                cpu._packed_linear(x, w, None)[:m]
        seconds.append(time.perf_counter() - t0)
    print(json.dumps(dict(before=before, after=_rss_mib(), seconds=seconds,
                          kernel_shapes=len({cpu.packed_rows(m) if args.bucketed else m for m in counts}))))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--passes", type=int, default=300)
    p.add_argument("--min-rows", type=int, default=33)
    p.add_argument("--max-rows", type=int, default=700)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--bucketed", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if not 1 <= args.min_rows <= args.max_rows or args.passes < 1 or args.rounds < 1:
        p.error("need 1 <= --min-rows <= --max-rows, --passes >= 1, --rounds >= 1")
    if args.child:
        child(args)
        return 0
    from accel.kernels.cpu import prepack_available

    if not prepack_available():
        print("this torch build cannot pack float32 weights for oneDNN")
        return 1
    base = [sys.executable, __file__, "--child"] + [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                                                    if k not in ("bucketed", "child")]
    for bucketed in (False, True):
        out = subprocess.run(base + (["--bucketed"] if bucketed else []), capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        label = "bucketed (accel.kernels.cpu.packed_rows)" if bucketed else "own row counts"
        print(f"{label}: {r['kernel_shapes']} row counts, RSS {r['before']:.0f} -> {r['after']:.0f} MiB "
              f"(+{r['after'] - r['before']:.0f}); seconds per round " + " / ".join(f"{s:.2f}" for s in r["seconds"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
