"""accel on the long-document anchor: pass-key documents of ~7.5K tokens, 64 new tokens each
(end of sequence ignored), greedy, one request at a time, beside vLLM CPU on the same token ids.

    python benchmarks/long_docs_anchor.py --ids-out docs.json --out accel_long.json
    source ../shared/anchors/vllm-cpu/env.sh
    "$VLLM_ANCHOR_DIR/venv/bin/python" ../shared/anchors/vllm-cpu/bench.py --model "$CKPT" --ids docs.json \\
        --max-model-len 8192 --new 64 --batch-new 64 --dtype bfloat16 --eager --out vllm.json
    python benchmarks/long_docs_anchor.py --table accel_long.json --vllm vllm.json   # both, one table

Run the two systems one after the other, never at once. Per configuration (default: the full
cache, SnapKV 1024, SnapKV 1024 + prompt lookup) and document, in an order that rotates from
document to document: prefill seconds, decode tok/s (the tokens after the prefill's first one
over the decode seconds), whole-request seconds and tok/s, and whether the answer holds the
pass key. vLLM's ``bench.py`` gives its whole-request figure (``single_tok_s``: its first 4
documents one at a time, best of 2); ``--table`` prints it beside accel's mean over the same
first 4 documents.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

import accel
from accel.bench.measurement import cpu_model
from accel.bench.schema import Experiment
from accel.bench.tasks import build_items, score
from accel.models import load_model

CONFIGS = {"full": [], "snapkv_1024": ["snapkv:budget=1024"], "snapkv_1024+prompt_lookup": ["snapkv:budget=1024", "prompt_lookup"]}
DEPTHS = [0.1, 0.25, 0.4, 0.55, 0.7, 0.85]


def documents(tokenizer, length: int, count: int) -> list:
    """``count`` pass-key documents of at most ``length`` tokens (chat template included), the
    needle at evenly spread depths: ``accel.bench``'s needle task, classic filler."""
    depths = DEPTHS[:count] if count <= len(DEPTHS) else [i / (count + 1) for i in range(1, count + 1)]
    exp = Experiment.model_validate({"tasks": [{"kind": "needle", "lengths": [length], "depths": depths}],
                                     "runs": {"plain": []}})
    return build_items(exp, tokenizer)


def measure(model, tokenizer, items, configs: dict[str, list[str]], new: int) -> dict:
    """Per configuration, one row per document: prefill_s, decode_tok_s, request_s, found."""
    warm = items[0].input_ids[:, -256:]
    for specs in configs.values():  # first calls: kernels, tables and calibration before timing
        accel.generate(model, warm, strategies=specs, max_new_tokens=4, eos_token_id=[], tokenizer=tokenizer)
    rows: dict[str, list[dict]] = {name: [] for name in configs}
    names = list(configs)
    for i, item in enumerate(items):
        for name in [names[(i + j) % len(names)] for j in range(len(names))]:
            t = time.perf_counter()
            out = accel.generate(model, item.input_ids, strategies=configs[name], max_new_tokens=new,
                                 eos_token_id=[], tokenizer=tokenizer)
            wall = time.perf_counter() - t
            s = out.stats
            rows[name].append({"doc": item.item_id, "prompt_tokens": item.prompt_tokens, "prefill_s": s.prefill_s,
                               "decode_tok_s": s.decode_tokens / s.decode_s if s.decode_s else 0.0,
                               "request_s": wall, "new_tokens": s.new_tokens, "found": bool(score(item, out.text[0])[0]),
                               "tokens_per_step": s.mean_accepted, "kv_kept_mib": s.kv_bytes_kept / 2**20})
            print(f"  {item.item_id} {name}: prefill {s.prefill_s:.2f} s, decode {rows[name][-1]['decode_tok_s']:.1f} tok/s, "
                  f"request {wall:.2f} s, pass key {'found' if rows[name][-1]['found'] else 'missed'}", flush=True)
    return rows


def table(result: dict, vllm: dict | None) -> str:
    """A markdown table: per configuration the means over all documents, and the whole-request
    tok/s over the first 4 (what vLLM's bench.py times)."""
    new = result["new"]
    lines = [f"{result['cpu']}, {result['model']} {result['dtype']}, {result['threads']} threads, commit {result['commit']}; "
             f"{len(result['docs'])} documents of {min(result['docs'])}-{max(result['docs'])} tokens, {new} new tokens each",
             "", "| system | prefill | decode tok/s | whole request | tok/s (first 4) | pass keys |", "|---|---|---|---|---|---|"]
    if vllm is not None:
        lines.append(f"| vLLM CPU {vllm.get('dtype', '')}{' eager' if vllm.get('eager') else ''} | | | "
                     f"{new / vllm['single_tok_s']:.2f} s | {vllm['single_tok_s']:.2f} | |")
    for name, rows in result["rows"].items():
        first = rows[:4]
        rate = new * len(first) / sum(r["request_s"] for r in first)
        lines.append(f"| accel {name} | {statistics.mean(r['prefill_s'] for r in rows):.2f} s | "
                     f"{statistics.mean(r['decode_tok_s'] for r in rows):.1f} | "
                     f"{statistics.mean(r['request_s'] for r in rows):.2f} s | {rate:.2f} | "
                     f"{sum(r['found'] for r in rows)}/{len(rows)} |")
    return "\n".join(lines)


def _commit() -> str:
    import subprocess

    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).resolve().parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--length", type=int, default=7500, help="tokens per document at most, chat template included")
    ap.add_argument("--docs", type=int, default=6)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--config", action="append", default=None,
                    help=f"NAME=SPEC[,SPEC...] ('NAME=' for the full cache); default: {', '.join(CONFIGS)}")
    ap.add_argument("--ids-out", default=None, help="write the documents' token ids (JSON list of lists) for vLLM's bench.py --ids")
    ap.add_argument("--out", default=None, help="write accel's rows as JSON")
    ap.add_argument("--table", default=None, help="print the table of an earlier --out file instead of measuring")
    ap.add_argument("--vllm", default=None, help="vLLM bench.py's --out JSON, printed beside accel's rows")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    vllm = json.loads(Path(args.vllm).read_text()) if args.vllm else None
    if args.table:
        print(table(json.loads(Path(args.table).read_text()), vllm))
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    configs = CONFIGS
    if args.config:
        configs = {}
        for text in args.config:
            name, sep, specs = text.partition("=")
            if not sep or not name:
                raise SystemExit(f"--config {text!r}: expected NAME=SPEC[,SPEC...]")
            configs[name] = [s for s in specs.split(",") if s]
    model, tokenizer = load_model(args.model, dtype=args.dtype)
    items = documents(tokenizer, args.length, args.docs)
    if args.ids_out:
        Path(args.ids_out).write_text(json.dumps([item.input_ids[0].tolist() for item in items]))
    print(f"{len(items)} documents of {min(i.prompt_tokens for i in items)}-{max(i.prompt_tokens for i in items)} tokens, "
          f"{args.new} new tokens, {args.model} {args.dtype}, {torch.get_num_threads()} threads, {cpu_model()}", flush=True)
    result = {"cpu": cpu_model(), "model": args.model, "dtype": args.dtype, "threads": torch.get_num_threads(),
              "commit": _commit(), "new": args.new, "docs": [i.prompt_tokens for i in items],
              "rows": measure(model, tokenizer, items, configs, args.new)}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    print(table(result, vllm))


if __name__ == "__main__":
    main()
