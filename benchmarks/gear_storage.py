"""GEAR's packed KV storage on the default model: what the cache's tensors hold, the process's
resident memory while decoding, decode speed and greedy agreement with the full cache.

    python benchmarks/gear_storage.py --tokens 4096 --prompts 4 --new 48

Each configuration (full cache, SnapKV 1024, GEAR 4-bit, SnapKV 1024 + GEAR 4-bit) runs in
a process of its own, one after the other (never two at once), so its resident memory is
its own. Per prompt it reports:

- ``stored``: bytes of every tensor the cache held when the request finished
  (``Stats.kv_bytes_stored``: the sum of their storages, spare room and scratch included);
- ``decode RSS``: the process's peak resident set while decoding (``accel.bench.measurement.
  PeakMemory`` from the first token to the end: the kernel's high-water mark, reset at the
  first token), and its growth over the resident set before the request;
- decode tok/s (the engine's decode seconds), prefill seconds;
- the first token where the greedy output leaves the full cache's (48: agrees throughout).

The child processes set ``MALLOC_MMAP_THRESHOLD_`` (glibc) so that freed buffers go back
to the system in every configuration alike; without it glibc's adaptive threshold keeps
some of the prefill's freed memory resident and the RSS figures say less about the cache.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
from pathlib import Path

CONFIGS = {
    "full": [],
    "snapkv1024": ["snapkv:budget=1024"],
    "gear4": ["gear:bits=4"],
    "snapkv1024+gear4": ["snapkv:budget=1024", "gear:bits=4"],
}


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def prompts(tokenizer, tokens: int, count: int) -> list:
    """Alternately a pass-key needle prompt and a prose document with a question."""
    sys.path.insert(0, str(Path(__file__).parent))
    from needle_sweep import needle_prompt

    from accel.bench.corpus import filler_sentences
    from accel.models import chat_ids

    out = []
    for i in range(count):
        if i % 2 == 0:
            out.append(needle_prompt(tokenizer, tokens, depth=(0.2, 0.7)[i // 2 % 2], key=73519 + 1111 * i))
            continue
        rng = random.Random(i)
        sentences = []
        while True:
            sentences += filler_sentences(rng, 20)
            msg = " ".join(sentences) + "\n\nSummarize the text above in three sentences."
            ids = chat_ids(tokenizer, msg)
            if ids.shape[1] >= tokens - 40:
                out.append(ids)
                break
    return out


def child(name: str, tokens: int, count: int, new: int) -> None:
    import torch

    import accel
    from accel.bench.measurement import PeakMemory
    from accel.models import load_default

    torch.set_num_threads(int(os.environ.get("ACCEL_THREADS", torch.get_num_threads())))
    model, tokenizer = load_default()
    items = prompts(tokenizer, tokens, count)
    rows = []
    for ids in items:
        before = _rss()
        peak = PeakMemory()
        with accel.Engine(model, max_batch=1, eos_token_id=[]) as engine:
            handle = engine.submit(ids[0], max_new_tokens=new, strategies=CONFIGS[name])
            started = False
            for _ in handle.stream():  # the first delta comes with the first token: decoding starts
                if not started:
                    peak.__enter__()
                    started = True
            result = handle.result()
        peak.__exit__(None, None, None)
        s = result.stats
        rows.append({"prompt_tokens": int(ids.shape[1]), "tokens": list(result.tokens),
                     "stored": s.kv_bytes_stored, "kept": s.kv_bytes_kept, "full": s.kv_bytes_full,
                     "decode_rss": int(peak.peak_mib * 2**20), "rss_before": before, "prefill_s": s.prefill_s,
                     "decode_tok_s": s.decode_tokens_per_s})
    print(json.dumps({"config": name, "threads": torch.get_num_threads(), "rows": rows}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096, help="prompt length (tokens, about)")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--new", type=int, default=48, help="tokens generated per prompt")
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--json", type=Path, help="also write every row here")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.tokens, args.prompts, args.new)
        return
    from accel.bench.measurement import cpu_model

    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
    results = {}
    for name in args.configs:
        print(f"running {name} ...", file=sys.stderr, flush=True)
        out = subprocess.run([sys.executable, __file__, "--child", name, "--tokens", str(args.tokens),
                              "--prompts", str(args.prompts), "--new", str(args.new)],
                             env=env, check=True, capture_output=True, text=True)
        results[name] = json.loads(out.stdout.strip().splitlines()[-1])
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    mib = 2**20
    print(f"{cpu_model()}, {results[args.configs[0]]['threads']} threads, float32, prompts of ~{args.tokens} tokens, "
          f"{args.new} new tokens")
    full = results.get("full")
    head = f"{'config':18} {'stored MiB':>10} {'of full':>8} {'decode RSS MiB':>14} {'RSS growth':>10} " \
           f"{'decode tok/s':>12} {'prefill s':>9}  first divergence from full (per prompt)"
    print(head)
    for name, res in results.items():
        rows = res["rows"]
        n = len(rows)
        stored = sum(r["stored"] for r in rows) / n
        full_bytes = sum(r["full"] for r in rows) / n
        rss = sum(r["decode_rss"] for r in rows) / n
        growth = sum(r["decode_rss"] - r["rss_before"] for r in rows) / n
        tok_s = sum(r["decode_tok_s"] for r in rows) / n
        prefill = sum(r["prefill_s"] for r in rows) / n
        div = []
        if full is not None:
            for r, f in zip(rows, full["rows"]):
                same = [a == b for a, b in zip(r["tokens"], f["tokens"])]
                div.append(str(same.index(False)) if False in same else str(len(same)))
        print(f"{name:18} {stored / mib:10.1f} {full_bytes / stored:7.1f}x {rss / mib:14.0f} {growth / mib:10.0f} "
              f"{tok_s:12.1f} {prefill:9.1f}  {' '.join(div)}")


if __name__ == "__main__":
    main()
