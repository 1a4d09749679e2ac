"""Three ways to multiply a few rows by a model's linear weights, timed on this machine.

For each distinct linear shape of a model (default: the default model) and each row count M,
the median milliseconds of

- ``F.linear(x, W)``: what transformers' ``nn.Linear`` runs (W [out, in]);
- ``torch.mm(x, W.T)`` with ``W.T`` stored contiguous [in, out] (another BLAS layout);
- ``accel.cpu.PackedLinear``: the weight packed once for oneDNN.

Which wins depends on the CPU and on M; ``accel calibrate`` chooses between the first and
the last for a model's decode and verify passes.

    python benchmarks/linear_kernels.py --rows 1 2 4 8 16
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from accel.cpu import PackedLinear
from accel.calibrate import _machine
from accel.models import load_model


def _ms(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)




def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    model, _ = load_model(args.model, prepack=False)
    shapes = sorted({tuple(m.weight.shape) for m in model.modules() if isinstance(m, torch.nn.Linear)})
    print(f"model={args.model} threads={torch.get_num_threads()} cpu={_machine()['cpu']!r} torch={torch.__version__}")
    print("weight [out, in]   rows  F.linear  mm(x, W.T contiguous)  packed   (ms)")
    with torch.inference_mode():
        for out_f, in_f in shapes:
            w = torch.randn(out_f, in_f)
            wt = w.t().contiguous()
            packed = PackedLinear.from_weight(w)
            for m in args.rows:
                x = torch.randn(m, in_f)
                a = _ms(lambda: torch.nn.functional.linear(x, w), args.repeats)
                b = _ms(lambda: torch.mm(x, wt), args.repeats)
                c = _ms(lambda: packed(x), args.repeats)
                print(f"{str([out_f, in_f]):18s} {m:4d}  {a:8.3f}  {b:21.3f}  {c:6.3f}")


if __name__ == "__main__":
    main()
