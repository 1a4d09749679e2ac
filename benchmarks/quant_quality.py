"""What int8 / int4 weights (and bfloat16) cost in quality on the default model, against float32.

    python benchmarks/quant_quality.py                        # int8, int4: 40 chat prompts x 64 tokens, 6 needles at 4K
    python benchmarks/quant_quality.py --precisions bfloat16 int8 int4 int4:lm_head=true
    python benchmarks/quant_quality.py --prompts 2 --new 16 --needles 1   # a quick look

For each precision, greedy plain decoding (accel, no drafts: exact drafting makes its
output the same) of the held-out chat prompts (``speculative.train.held_out_prompts``)
against float32's: how many prompts give the same tokens throughout, and the mean index of
the first token that differs (an equal prompt counts its whole length). Then pass-key
retrieval with SnapKV(budget=1024) at ``--needle-length`` tokens (the bench's needle task,
depths spread over the haystack), float32 and each precision: how many needles each finds.

Quality only, no timing: it can run beside other work. Prints one line per precision and,
with ``--out FILE``, writes the figures as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
# quality does not depend on measured costs: no calibration is run (or cached) for it, and the
# float32 reference runs on the kernels as loaded
os.environ.setdefault("ACCEL_CALIBRATION", "off")

from accel.bench.measurement import cpu_model  # noqa: E402
import accel  # noqa: E402
from accel.bench.schema import Experiment, NeedleTask, precision_name  # noqa: E402
from accel.bench.tasks import build_items, score  # noqa: E402
from accel.dtypes import DTYPES  # noqa: E402
from accel.kernels.lowbit import quantization_of  # noqa: E402
from accel.models import chat_ids, load_default  # noqa: E402
from snapkv import SnapKV  # noqa: E402
from speculative.train import held_out_prompts  # noqa: E402


def load(precision: str):
    if precision in DTYPES:
        return load_default(dtype=precision)
    return load_default(quantize=precision)


def first_divergence(a: list[int], b: list[int]) -> int:
    """Index of the first position where ``a`` and ``b`` differ (the shorter length where
    one is a prefix of the other, their length where they are equal)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b)) if len(a) != len(b) else len(a)


def chat_outputs(model, tok, prompts: list[str], new: int) -> list[list[int]]:
    outs = []
    for p in prompts:
        ids = chat_ids(tok, p)
        out = accel.generate(model, ids, strategies=[], max_new_tokens=new, tokenizer=tok)
        outs.append(out.sequences[0, ids.shape[1]:].tolist())
    return outs


def needles_found(model, tok, items, budget: int) -> list[bool]:
    found = []
    for item in items:
        out = accel.generate(model, item.input_ids, strategies=[SnapKV(budget=budget)], max_new_tokens=16,
                             tokenizer=tok)
        found.append(bool(score(item, out.text[0])[0]))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--precisions", nargs="+", default=["int8", "int4"],
                        help="dtypes or quantizations to compare with float32 (default: int8 int4)")
    parser.add_argument("--prompts", type=int, default=40, help="held-out chat prompts (default 40)")
    parser.add_argument("--new", type=int, default=64, help="greedy tokens per chat prompt (default 64)")
    parser.add_argument("--needles", type=int, default=6, help="pass keys, at depths spread evenly (default 6; 0: none)")
    parser.add_argument("--needle-length", type=int, default=4096, help="needle prompt tokens (default 4096)")
    parser.add_argument("--budget", type=int, default=1024, help="SnapKV budget for the needles (default 1024)")
    parser.add_argument("--out", default=None, help="also write the figures to this JSON file")
    args = parser.parse_args()
    precisions = [precision_name(p) for p in args.precisions]
    t0 = time.time()

    model, tok = load("float32")
    prompts = held_out_prompts()[: args.prompts]
    depths = [round(i / max(1, args.needles - 1), 3) for i in range(args.needles)] if args.needles else []
    items = build_items(Experiment(tasks=[NeedleTask(lengths=[args.needle_length], depths=depths)]), tok) \
        if depths else []
    print(f"{cpu_model()}, torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"{len(prompts)} chat prompts x {args.new} tokens, {len(items)} needles at {args.needle_length} tokens "
          f"(SnapKV budget {args.budget})", flush=True)
    ref = chat_outputs(model, tok, prompts, args.new)
    ref_needles = needles_found(model, tok, items, args.budget)
    results = {"float32": {"needles_found": sum(ref_needles), "needles": len(items)}}
    print(f"float32: needles {sum(ref_needles)}/{len(items)}", flush=True)
    del model

    for precision in precisions:
        model, _ = load(precision)
        quant = quantization_of(model)
        outs = chat_outputs(model, tok, prompts, args.new)
        equal = sum(o == r for o, r in zip(outs, ref))
        first = [first_divergence(o, r) for o, r in zip(outs, ref)]
        found = needles_found(model, tok, items, args.budget)
        results[precision] = {
            "equal_prompts": equal, "prompts": len(prompts), "mean_first_divergence": sum(first) / max(1, len(first)),
            "first_divergence": first, "needles_found": sum(found), "needles": len(items),
            "needles_lost": sum(r and not f for r, f in zip(ref_needles, found)),
            "group_size": quant.group_size if quant else None, "kept_layers": list(quant.kept) if quant else None,
        }
        r = results[precision]
        print(f"{precision}: {equal}/{len(prompts)} prompts equal to float32 over {args.new} tokens, mean first "
              f"divergence {r['mean_first_divergence']:.1f} tokens; needles {r['needles_found']}/{len(items)} "
              f"({r['needles_lost']} of float32's lost)"
              + (f"; int4 groups of {quant.group_size}" if quant and quant.group_size else "")
              + (f"; kept in bf16: {', '.join(quant.kept)}" if quant and quant.kept else ""), flush=True)
        del model
    print(f"{time.time() - t0:.0f} s")
    if args.out:
        meta = {"cpu": cpu_model(), "torch": torch.__version__, "threads": torch.get_num_threads(),
                "prompts": len(prompts), "new": args.new, "needle_length": args.needle_length,
                "budget": args.budget, "command": " ".join(sys.argv)}
        Path(args.out).write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
