"""What int8 weights save a draft model's step on this machine.

Times a one-token step of a model (default: Qwen2.5-Coder-0.5B-Instruct, the packaged draft
model) over a cache of C entries with its weights as loaded and with the int8 copy
``accel.kernels.quant.int8_copy`` drafts with, alternating, and the output layer alone. Medians.

    python benchmarks/draft_int8.py --model qwen2.5-coder-0.5b-instruct --contexts 300 2048
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from accel.calibration import timing
from accel.calibration.calibrate import _machine
from accel.models import load_model
from accel.kernels.quant import int8_copy




def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--contexts", type=int, nargs="+", default=[300, 2048])
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    model, _ = load_model(args.model)
    quantized = int8_copy(model)
    print(f"model={args.model} threads={torch.get_num_threads()} cpu={_machine()['cpu']!r} torch={torch.__version__}")
    print("cached  float ms  int8 ms  ratio")
    for n in args.contexts:
        cache = timing.filled_cache(model, n)
        times: dict[str, list[float]] = {"float": [], "int8": []}
        for i in range(args.repeats):
            for name, m in (("float", model), ("int8", quantized)):
                times[name] += timing.time_pass(m, cache, 1, repeats=1, warmup=1 if i == 0 else 0)
        f, q = statistics.median(times["float"]), statistics.median(times["int8"])
        print(f"{n:6d}  {f:8.1f}  {q:7.1f}  {f / q:5.2f}x")
    hidden = torch.randn(1, model.config.hidden_size)
    for name, m in (("float", model), ("int8", quantized)):
        head = m.get_output_embeddings()
        with torch.inference_mode():
            head(hidden)
            ts = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                head(hidden)
                ts.append((time.perf_counter() - t0) * 1e3)
        print(f"output layer {tuple(head.weight.shape)} {name}: {statistics.median(ts):.1f} ms")


if __name__ == "__main__":
    main()
