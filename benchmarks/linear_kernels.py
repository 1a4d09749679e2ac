"""Four ways to multiply a few rows by a model's linear weights, timed on this machine.

For each distinct linear shape of a model (default: the default model) and each row count M,
the median milliseconds of

- ``F.linear(x, W)``: what transformers' ``nn.Linear`` runs (W [out, in]);
- ``torch.mm(x, W.T)`` with ``W.T`` stored contiguous [in, out] (another BLAS path; what
  ``F.linear`` runs on weights stored column-major by ``accel.kernels.cpu.transpose_weights``);
- ``accel.kernels.cpu.PackedLinear``: the weight packed once for oneDNN;
- ``accel.kernels.cpu.split_linear``: one ``torch.bmm`` over the two halves of W (viewed, not copied).

Which wins depends on the CPU and on M; ``accel calibrate`` chooses among the four for a
model's decode and verify passes. ``--passes`` also times whole verify passes
(``accel.calibration.timing.time_pass``, ``--cached`` entries) of one copy of the model with every linear
layer on each kernel (plain, transposed, packed, split), the kernels alternating pass by pass:
the fastest and the median of ``--rounds`` each.

    python benchmarks/linear_kernels.py --rows 1 2 4 8 16 --passes
    python benchmarks/linear_kernels.py --rows 1 2 --repeats 1 --passes --rounds 30 --cached 256 2048
    python benchmarks/linear_kernels.py --rows 1 2 2048 --repeats 3 --dtype bfloat16   # bf16 weights and rows

``--dtype bfloat16`` times the first three kernels on bf16 weights and rows (packed: only where
the CPU has bf16 instructions, ``accel.kernels.cpu.bf16_native``; elsewhere oneDNN would convert on
the fly), for comparison with the float32 run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from accel.calibration import timing
from accel.kernels.cpu import PackedLinear, split_linear
from accel.calibration.calibrate import _machine
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


def _passes(name: str, rows: list[int], rounds: int, cache_lens: list[int]) -> None:
    """Whole verify passes of one model on each kernel (:func:`accel.calibration.timing.linear_kernels`
    switches them in place), the kernels alternating pass by pass: fastest and median ms."""
    from accel.calibration.cost_model import KERNELS
    from accel.kernels.cpu import prepack_available

    model = load_model(name, prepack=False)[0]
    kernels = [k for k in KERNELS if prepack_available() or k in ("plain", "transposed")]
    for cached in cache_lens:
        cache = timing.filled_cache(model, cached)
        print(f"\nwhole verify passes, {cached} cached: fastest / median ms of {rounds} alternating\n"
              "tokens  " + "  ".join(f"{k:>13s}" for k in kernels))
        with torch.inference_mode(), timing.linear_kernels(model) as use:
            for t in rows:
                times: dict[str, list[float]] = {k: [] for k in kernels}
                for i in range(rounds):
                    for k in kernels:
                        use(k)
                        times[k] += timing.time_pass(model, cache, t, repeats=1, warmup=1 if i == 0 else 0)
                print(f"{t:6d}  " + "  ".join(f"{min(v):6.1f}/{statistics.median(v):6.1f}" for v in times.values()))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--passes", action="store_true", help="also time whole verify passes on each kernel")
    ap.add_argument("--rounds", type=int, default=15, help="passes per kernel and token count (--passes)")
    ap.add_argument("--cached", type=int, nargs="+", default=[256], help="cached entries of the passes (--passes)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    model, _ = load_model(args.model, prepack=False)
    shapes = sorted({tuple(m.weight.shape) for m in model.modules() if isinstance(m, torch.nn.Linear)})
    print(f"model={args.model} dtype={args.dtype} threads={torch.get_num_threads()} cpu={_machine()['cpu']!r} "
          f"torch={torch.__version__}")
    print("weight [out, in]   rows  F.linear  mm(x, W.T contiguous)  packed   split   (ms)")
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
                d = _ms(lambda: split_linear(x, w, None), args.repeats) if out_f % 2 == 0 else float("nan")
                print(f"{str([out_f, in_f]):18s} {m:4d}  {a:8.3f}  {b:21.3f}  {c:6.3f}  {d:6.3f}")
    if args.passes:
        _passes(args.model, args.rows, args.rounds, args.cached)


if __name__ == "__main__":
    main()
