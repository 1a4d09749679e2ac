"""A long generation on a bounded cache: does ``decode_budget`` keep the cache, the speed and
the memory flat?

One row: a long prompt (a pass-key haystack of ``--prompt-tokens`` tokens, asked to be retold),
compressed by SnapKV to ``--budget`` entries per KV head at the prefill and evicted back to
``--decode-budget`` during decoding; then ``--new`` greedy tokens (end of sequence ignored),
one :class:`accel.engine.Batch` step at a time. Per window of ``--window`` generated tokens:
the committed entries per KV head (layer 0; now and the most after any step), the physical columns the cache holds, decode
tok/s over the window, and the process's resident memory.

    python benchmarks/long_generation.py --budget 1024 --decode-budget 1024 --new 2048

Printed at the end: the most entries per head after the budget was first reached, the last
window's speed over the first full window's, and the RSS growth after the first window.
"""

from __future__ import annotations

import argparse
import time

import torch

from accel import adapter, engine
from accel.bench.measurement import cpu_model
from accel.models import chat_ids, load_model
from accel.strategy import build_strategies

_FILLER = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again.")


def rss_mib() -> float:
    """This process's resident memory now, MiB (Linux)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def long_prompt(tokenizer, tokens: int) -> torch.Tensor:
    """A chat prompt of about ``tokens`` tokens: a haystack with a pass key, asked to be retold."""
    sentences = [_FILLER[i % len(_FILLER)] for i in range(tokens // 4)]
    sentences.insert(len(sentences) // 2, "The pass key is 48151. Remember it.")
    while True:
        ids = chat_ids(tokenizer, " ".join(sentences) + "\n\nRetell the text above, sentence by sentence.").reshape(-1)
        if ids.numel() <= tokens or len(sentences) < 8:
            return ids
        sentences = sentences[: len(sentences) - max(1, (ids.numel() - tokens) // 4)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prompt-tokens", type=int, default=4096)
    ap.add_argument("--budget", type=int, default=1024, help="SnapKV's entries per KV head after the prefill")
    ap.add_argument("--decode-budget", type=int, default=1024, help="entries per KV head kept while decoding")
    ap.add_argument("--new", type=int, default=2048, help="tokens to generate")
    ap.add_argument("--window", type=int, default=128, help="generated tokens per reported window")
    args = ap.parse_args()

    model, tokenizer = load_model(args.model, dtype=args.dtype)
    prompt = long_prompt(tokenizer, args.prompt_tokens)
    spec = f"snapkv:budget={args.budget},decode_budget={args.decode_budget}"
    plan = engine.plan_strategies(build_strategies([spec]))
    plan.check(model)
    print(f"model={args.model} dtype={model.dtype} cpu={cpu_model()!r} threads={torch.get_num_threads()} "
          f"prompt={prompt.numel()} tokens, {spec}, new={args.new}")
    row = engine.Row(prompt=prompt, plan=plan, max_new_tokens=args.new, eos=frozenset())
    batch = engine.Batch(model)
    windows = []
    with adapter.packed_gqa_attention(model), adapter.per_layer_masks(model, batch.cache), torch.inference_mode():
        start = time.perf_counter()
        batch.admit([row])
        print(f"prefill {time.perf_counter() - start:.1f} s, entries per head after it: "
              f"{batch.cache.entries_per_head(0, 0)}, RSS {rss_mib():.0f} MiB")
        print("generated | entries/head (most in the window) | columns | tok/s in window | RSS MiB")
        mark, t0 = len(row.generated), time.perf_counter()
        peak = 0  # most entries per head seen after any step of the window
        while batch.rows:
            batch.step()
            done = len(row.generated)
            peak = max(peak, batch.cache.entries_per_head(0, 0))
            if done - mark >= args.window or done >= args.new:
                now = time.perf_counter()
                cache = batch.cache
                w = {"generated": done, "entries": cache.entries_per_head(0, 0), "peak": peak, "columns": cache.physical_length(0),
                     "tok_s": (done - mark) / (now - t0), "rss": rss_mib()}
                windows.append(w)
                print(f"{w['generated']:9d} | {w['entries']} (most {peak}) | {w['columns']} | {w['tok_s']:.1f} | {w['rss']:.0f}")
                mark, t0, peak = done, time.perf_counter(), 0
            batch.retire_done()
    reached = next((i for i, w in enumerate(windows) if w["entries"] >= args.decode_budget), None)
    after = windows[reached:] if reached is not None else []
    print(f"most entries per head after the budget was reached: {max((w['peak'] for w in after), default=None)} "
          f"(budget {args.decode_budget} + slack)")
    if len(windows) >= 3:
        first, last = windows[0], windows[-2] if windows[-1]["generated"] - windows[-2]["generated"] < args.window else windows[-1]
        print(f"speed: last full window {last['tok_s']:.1f} tok/s / first {first['tok_s']:.1f} = {last['tok_s'] / first['tok_s']:.2f}; "
              f"RSS growth after the first window {windows[-1]['rss'] - first['rss']:+.0f} MiB")


if __name__ == "__main__":
    main()
