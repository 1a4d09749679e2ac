"""accel on the workloads of the vLLM CPU anchor (``../shared/anchors/vllm-cpu/bench.py``): the
same eight chat questions, the same budgets and the same figure, so the two can be set side by
side when both are measured on one machine, one after the other.

    python benchmarks/anchor_workloads.py --config plain:bfloat16 --config plain:bfloat16:compile \\
        --config plain:float32 --config medusa+prompt_lookup:bfloat16:compile --out anchor.jsonl

A configuration is ``STRATEGIES:DTYPE[:compile][:int4|int8]``; STRATEGIES is ``plain`` or drafters
joined by ``+`` (``prompt_lookup``, ``medusa``, ``ngrammys``, ``pass``). Figures, as the anchor computes them:
generated tokens / wall seconds of the call, prefill included, best of 2, every request making
its whole budget (end of sequence ignored), greedy.
- ``single_tok_s``: 4 requests one at a time, 96 tokens each;
- ``batch_tok_s``: 8 requests in one call, 64 tokens each.
Each configuration also reports whether its outputs equal the first configuration's of the same
dtype and quantization (greedy drafting is exact on the same model, so they should).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time

import torch

from accel.bench.measurement import cpu_model
import accel
from accel.kernels import compiled
from accel.models import chat_ids

# The anchor's own questions (bench.py's QUESTIONS), in its order.
QUESTIONS = ["How do vaccines train the immune system?", "Write a limerick about a lighthouse keeper.",
             "What are the trade-offs between SQL and NoSQL databases?", "Explain recursion to a ten-year-old.",
             "Give a recipe outline for vegetable soup.", "Why does ice float on water?",
             "Compare trains and planes for a 500 km trip.", "What does a compiler do, in brief?"]
DRAFTERS = {"prompt_lookup": "prompt_lookup", "medusa": "medusa:heads=default", "ngrammys": "ngrammys", "pass": "pass"}


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def parse_config(text: str) -> dict:
    """``"medusa+prompt_lookup:bfloat16:compile"`` -> its drafters, dtype, compile and quantize."""
    parts = text.split(":")
    if len(parts) < 2:
        raise SystemExit(f"--config {text!r}: expected STRATEGIES:DTYPE[:compile][:int4|int8]")
    names = [] if parts[0] == "plain" else parts[0].split("+")
    unknown = [n for n in names if n not in DRAFTERS]
    if unknown:
        raise SystemExit(f"--config {text!r}: unknown drafter {unknown[0]!r}; choices: plain, {', '.join(DRAFTERS)}")
    extra = set(parts[2:])
    bad = extra - {"compile", "int4", "int8"}
    if bad:
        raise SystemExit(f"--config {text!r}: unknown option {sorted(bad)[0]!r}; choices: compile, int4, int8")
    quantize = "int4" if "int4" in extra else "int8" if "int8" in extra else None
    return dict(name=text, strategies=[DRAFTERS[n] for n in names], dtype=parts[1], compile="compile" in extra,
                quantize=quantize)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", action="append", required=True)
    ap.add_argument("--model", default="default")
    ap.add_argument("--new", type=int, default=96, help="tokens per single request")
    ap.add_argument("--batch-new", type=int, default=64, help="tokens per request of the batch")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    configs = [parse_config(c) for c in args.config]
    cpu, commit = cpu_model(), _commit()
    loaded: dict[tuple, tuple] = {}
    reference: dict[tuple, tuple] = {}
    rows = []
    for cfg in configs:
        key = (cfg["dtype"], cfg["quantize"])
        if key not in loaded:
            loaded.clear()  # one model in memory at a time
            t = time.perf_counter()
            loaded[key] = accel.load_model(args.model, dtype=cfg["dtype"], quantize=cfg["quantize"])
            print(f"# loaded {args.model} {key} in {time.perf_counter() - t:.1f} s", flush=True)
        model, tokenizer = loaded[key]
        if cfg["compile"]:
            compiled.enable(model, "on")
        else:
            compiled.disable(model)
        prompts = [chat_ids(tokenizer, q)[0].tolist() for q in QUESTIONS]

        def run(ps, n):
            t = time.perf_counter()
            out = accel.generate(model, ps, strategies=cfg["strategies"], max_new_tokens=n, eos_token_id=[])
            secs = time.perf_counter() - t
            return out, len(ps) * n / secs

        t = time.perf_counter()
        run(prompts[:1], 16)
        run(prompts[:8], 16)  # compiles the batch's shapes too, where compiled
        warm_s = time.perf_counter() - t
        singles, single_outs = [], []
        for _ in range(2):
            n = secs = 0.0
            single_outs = []
            for p in prompts[:4]:
                s = time.perf_counter()
                out, _ = run([p], args.new)
                secs += time.perf_counter() - s
                n += args.new
                single_outs.append(out.sequences[0, -args.new:].tolist())
            singles.append(n / secs)
        batch = [run(prompts[:8], args.batch_new) for _ in range(2)]
        batch_outs = batch[-1][0].sequences[:, -args.batch_new:].tolist()
        stats = batch[-1][0].stats
        ref = reference.setdefault(key, (single_outs, batch_outs))
        row = dict(config=cfg["name"], cpu=cpu, commit=commit, threads=torch.get_num_threads(),
                   single_tok_s=round(max(singles), 2), batch_tok_s=round(max(b[1] for b in batch), 2),
                   batch_rows=8, warm_up_s=round(warm_s, 1), batch_tokens_per_step=round(stats.mean_accepted, 2),
                   equals_reference=single_outs == ref[0] and batch_outs == ref[1],
                   exact_verify=stats.exact_verify)
        if cfg["compile"]:
            step = compiled.step_of(model)
            row["compiled_failure"] = None if step is None else step.failure
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
