"""Three ways to multiply a few rows by a model's linear weights, timed on this machine.

For each distinct linear shape of a model (default: the default model) and each row count M,
the median milliseconds of

- ``F.linear(x, W)``: what transformers' ``nn.Linear`` runs (W [out, in]);
- ``torch.mm(x, W.T)`` with ``W.T`` stored contiguous [in, out] (another BLAS path; what
  ``F.linear`` runs on weights stored column-major by ``accel.cpu.transpose_weights``);
- ``accel.cpu.PackedLinear``: the weight packed once for oneDNN.

Which wins depends on the CPU and on M; ``accel calibrate`` chooses among the three for a
model's decode and verify passes. ``--passes`` also times whole verify passes
(``accel.timing.time_pass``, 256 cached entries) of the model with every linear layer on each
kernel, alternating, medians of 5.

    python benchmarks/linear_kernels.py --rows 1 2 4 8 16 --passes
    python benchmarks/linear_kernels.py --rows 1 2 2048 --repeats 3 --dtype bfloat16   # bf16 weights and rows

``--dtype bfloat16`` times the three kernels on bf16 weights and rows (packed: only where
the CPU has bf16 instructions, ``accel.cpu.bf16_native``; elsewhere oneDNN would convert on
the fly), for comparison with the float32 run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from accel import timing
from accel.cpu import PackedLinear, prepack, transpose_weights
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


def _passes(name: str, rows: list[int]) -> None:
    models = {"F.linear": load_model(name, prepack=False)[0],
              "transposed": transpose_weights(load_model(name, prepack=False)[0]),
              "packed": prepack(load_model(name, prepack=False)[0])}
    cache = timing.filled_cache(models["F.linear"], 256)
    print("\nwhole verify passes, 256 cached (ms)\ntokens  " + "  ".join(f"{k:>10s}" for k in models))
    for t in rows:
        times: dict[str, list[float]] = {k: [] for k in models}
        for i in range(5):
            for k, m in models.items():
                times[k] += timing.time_pass(m, cache, t, repeats=1, warmup=1 if i == 0 else 0)
        print(f"{t:6d}  " + "  ".join(f"{statistics.median(v):10.1f}" for v in times.values()))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--passes", action="store_true", help="also time whole verify passes on each kernel")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    model, _ = load_model(args.model, prepack=False)
    shapes = sorted({tuple(m.weight.shape) for m in model.modules() if isinstance(m, torch.nn.Linear)})
    print(f"model={args.model} dtype={args.dtype} threads={torch.get_num_threads()} cpu={_machine()['cpu']!r} "
          f"torch={torch.__version__}")
    print("weight [out, in]   rows  F.linear  mm(x, W.T contiguous)  packed   (ms)")
    with torch.inference_mode():
        for out_f, in_f in shapes:
            w = torch.randn(out_f, in_f).to(dtype)
            wt = w.t().contiguous()
            packed = PackedLinear.from_weight(w)
            for m in args.rows:
                x = torch.randn(m, in_f).to(dtype)
                a = _ms(lambda: torch.nn.functional.linear(x, w), args.repeats)
                b = _ms(lambda: torch.mm(x, wt), args.repeats)
                c = _ms(lambda: packed(x), args.repeats)
                print(f"{str([out_f, in_f]):18s} {m:4d}  {a:8.3f}  {b:21.3f}  {c:6.3f}")
    if args.passes:
        _passes(args.model, args.rows)


if __name__ == "__main__":
    main()
