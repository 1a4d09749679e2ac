"""Which query rows per verify step give the default model bit-identical logits on this
machine (:func:`accel.kernels.invariance.probe`), loaded as accel runs it (linear layers
packed where the calibration chose so, low-precision ones in row-invariant chunks).

    python benchmarks/invariance_rows.py bfloat16
    python benchmarks/invariance_rows.py int4
"""

from __future__ import annotations

import argparse

from accel.kernels.invariance import CANDIDATES, KV_ALIGN, probe
from accel.kernels.lowbit import SCHEMES
from accel.models import load_default


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", nargs="?", default="bfloat16", help="a dtype, or a quantization (int8, int4)")
    what = ap.parse_args().what
    quantize = what if what.partition(":")[0] in SCHEMES else None
    model, _ = load_default(dtype="float32" if quantize else what, quantize=quantize)
    for rows in CANDIDATES:
        for align in (1, KV_ALIGN):
            print(f"{what} rows {rows}, columns aligned to {align}: {'invariant' if probe(model, rows, align) else 'NOT'}")


if __name__ == "__main__":
    main()
