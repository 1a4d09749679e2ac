"""InfiniGen (``infinigen``) beside the full cache and SnapKV at the same fast-tier size, on
pass-key documents: what each decode step fetches, decode speed, needles found, greedy
agreement with the full cache and resident memory; then a follow-up question about the
document's first tenth, asked after the first answer, which SnapKV's compressed cache may
no longer hold.

    python benchmarks/infinigen.py --out docs/results/infinigen_zen3_f32.json

Part 1, per length and needle depth, each configuration in turn (never two at once; InfiniGen
with its slow tier in files and in memory):
``accel.engine.batch_steps`` of one row, greedy, ``--new`` tokens. Figures: prefill seconds,
decode tokens per second, whether the answer holds the pass key, how many leading tokens
equal the full cache's, the bytes the planned steps fetched against a full read of the same
entries, and the process's resident memory above what it held before the call (VmRSS,
sampled every 10 ms in a thread; the peak during the prefill and during the decode, and the
file-backed part of it: the slow tier's pages).

Part 2, the follow-up: a document with a pass key at 10% depth and a door code at 90%; the
first question asks for the door code (SnapKV selects with that question's queries), the
answer is generated, then a second user turn asks for the pass key and is answered on the
same cache (:func:`accel.steps.prefill_rest` runs the turn on top of it).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import random
import threading
import time
from pathlib import Path

import torch

from accel import adapter
from accel.bench.measurement import cpu_model
from accel.bench.schema import Experiment
from accel.bench.tasks import build_items
from accel.cache import SharedCache
from accel.engine import Row, batch_steps
from accel.models import chat_ids, load_model
from accel.strategy import plan_strategies
from accel.steps import forward_tokens, prefill, prefill_rest
from accel.tier import TieredCache
from snapkv import InfiniGen, SnapKV


def _status() -> dict[str, int]:
    """This process's resident memory (bytes): VmRSS and its file-backed part."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
                out[name] = int(rest.split()[0]) * 1024
    return out


class Sampler:
    """Peak resident memory in a thread, per phase (``phase`` names where samples go)."""

    def __init__(self):
        self.phase = "idle"
        self.peak: dict[str, dict[str, int]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.wait(0.01):
            self.sample()

    def sample(self):
        s = _status()
        p = self.peak.setdefault(self.phase, {})
        for k, v in s.items():
            p[k] = max(p.get(k, 0), v)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def needle_items(tokenizer, lengths, depths):
    exp = Experiment.model_validate({"tasks": [{"kind": "needle", "lengths": list(lengths), "depths": list(depths)}],
                                     "runs": {"plain": []}})
    return build_items(exp, tokenizer)


def run_one(model, tokenizer, ids, strategies, new: int) -> dict:
    plan = plan_strategies(strategies)
    row = Row(prompt=ids.reshape(-1), plan=plan, max_new_tokens=new, eos=frozenset(adapter.default_eos(model, tokenizer)),
              warp=None, generator=None)
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # what earlier configurations freed leaves the count
    base = _status()
    with Sampler() as sampler:
        sampler.phase = "prefill"
        t0 = time.perf_counter()
        steps = batch_steps(model, [row])
        next(steps)
        prefill_s = time.perf_counter() - t0
        sampler.sample()
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # what the prefill freed is not the decode's
        sampler.phase = "decode"
        for _ in steps:
            sampler.sample()
    s = row.stats
    peak = {phase: {k: v - base.get(k, 0) for k, v in p.items()} for phase, p in sampler.peak.items()}
    return {
        "tokens": list(row.generated), "text": tokenizer.decode(row.generated, skip_special_tokens=True),
        "prefill_s": round(prefill_s, 3), "decode_tok_s": round(s.decode_tokens_per_s, 2),
        "decode_tokens": s.decode_tokens, "kv_bytes_full": s.kv_bytes_full, "kv_bytes_kept": s.kv_bytes_kept,
        "fetched_fraction": round(s.kv_bytes_fetched / s.kv_bytes_fetch_full, 4) if s.kv_bytes_fetch_full else None,
        "cache_resident_bytes": s.kv_bytes_resident or s.kv_bytes_stored,
        "rss_above_start": peak,
    }


def two_turns(model, tokenizer, doc: str, strategy, new: int) -> dict:
    """The follow-up case (see the module docstring): the two answers on one cache."""
    geo = adapter.geometry(model)
    first = chat_ids(tokenizer, f"{doc}\n\nWhat is the door code?")[0]
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(strategy, InfiniGen):
        cache = TieredCache(geo.num_layers, strategy, strategy.projections(model))
    else:
        cache = SharedCache(geo.num_layers)
    compressor = strategy if isinstance(strategy, SnapKV) else None
    seq = first.tolist()
    answers = []
    tiered = isinstance(cache, TieredCache)

    def greedy(hidden):
        out = []
        token = int(adapter.output_logits(model, hidden).argmax(-1)[0])
        while True:
            out.append(token)
            seq.append(token)
            if token == end or len(out) >= new:
                return out
            ids = torch.tensor([[token]])
            pos = torch.tensor([[len(seq) - 1]])
            if tiered:
                with cache.planning(model):
                    h = forward_tokens(model, cache, ids, pos, None, geo.dtype)
            else:
                h = forward_tokens(model, cache, ids, pos, None, geo.dtype)
            cache.commit([[0]])
            token = int(adapter.output_logits(model, h[:, -1]).argmax(-1)[0])

    with adapter.packed_gqa_attention(model), adapter.per_layer_masks(model, cache), torch.inference_mode():
        hidden = prefill(model, cache, [first], [compressor])
        answers.append(greedy(hidden))
        turn = "" if seq[-1] == end else "<|im_end|>"
        turn += "\n<|im_start|>user\nAnd what is the pass key?<|im_end|>\n<|im_start|>assistant\n"
        follow = tokenizer(turn, add_special_tokens=False).input_ids
        # the last answer token is not in the cache yet: the turn's forward starts with it
        seq.extend(follow)
        hidden = prefill_rest(model, cache, [torch.tensor(seq)], geo.dtype)
        answers.append(greedy(hidden))
    return {"answers": [tokenizer.decode(a, skip_special_tokens=True) for a in answers],
            "fetched_fraction": round(cache.fetched_bytes / cache.full_bytes, 4)
            if isinstance(cache, TieredCache) and cache.full_bytes else None}


def follow_up_document(tokenizer, length: int, seed: int) -> tuple[str, str, str]:
    rng = random.Random(seed)
    key, code = str(rng.randint(10000, 99999)), str(rng.randint(100, 999))
    filler = ["The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again."]
    unit = len(tokenizer(" ".join(filler)).input_ids) / len(filler)
    n = int((length - 120) / unit)
    hay = [filler[i % len(filler)] for i in range(n)]
    hay.insert(int(0.9 * n), f"The door code is {code}. Remember it. {code} is the door code.")
    hay.insert(int(0.1 * n), f"The pass key is {key}. Remember it. {key} is the pass key.")
    doc = "There is a pass key and a door code hidden in the following text. Memorize both.\n\n" + " ".join(hay)
    return doc, key, code


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 7500])
    ap.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.5, 0.9])
    ap.add_argument("--budget", type=int, default=1024, help="fast-tier entries per KV head (SnapKV's budget)")
    ap.add_argument("--new", type=int, default=24)
    ap.add_argument("--follow-length", type=int, default=4096)
    ap.add_argument("--follow-budgets", type=int, nargs="*", default=[256, 1024])
    ap.add_argument("--skip-needles", action="store_true")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    model, tokenizer = load_model(args.model)
    configs = {"full": [], f"snapkv_{args.budget}": [SnapKV(budget=args.budget)],
               f"infinigen_{args.budget}_file": [InfiniGen(budget=args.budget)],
               f"infinigen_{args.budget}_memory": [InfiniGen(budget=args.budget, tier="memory")]}
    InfiniGen(budget=args.budget).projections(model)  # calibrated once, before anything is timed
    report = {"machine": cpu_model(), "threads": torch.get_num_threads(), "dtype": str(adapter.geometry(model).dtype),
              "budget": args.budget, "new_tokens": args.new, "needles": [], "follow_up": []}
    if not args.skip_needles:
        for item in needle_items(tokenizer, args.lengths, args.depths):
            full = None
            for name, strategies in configs.items():
                r = run_one(model, tokenizer, item.input_ids, strategies, args.new)
                r.update(config=name, item=item.item_id, prompt_tokens=int(item.input_ids.shape[1]),
                         found=item.expected in r["text"])
                if full is None:
                    full = r["tokens"]
                agree = 0
                for a, b in zip(r["tokens"], full):
                    if a != b:
                        break
                    agree += 1
                r["agrees_with_full"] = f"{agree}/{len(full)}"
                report["needles"].append(r)
                rss = r["rss_above_start"].get("decode", {})
                print(f"{item.item_id:>14} {name:>21}: found={r['found']!s:5} prefill {r['prefill_s']:6.1f}s decode "
                      f"{r['decode_tok_s']:5.1f} tok/s agree {r['agrees_with_full']:>5} fetched "
                      f"{r['fetched_fraction']} RSS+ decode {rss.get('VmRSS', 0) / 2**20:.0f} MiB "
                      f"(file {rss.get('RssFile', 0) / 2**20:.0f})", flush=True)
    doc, key, code = follow_up_document(tokenizer, args.follow_length, seed=7)
    for name, strategy in [("full", None)] + [(f"{kind}_{b}", cls(budget=b)) for b in args.follow_budgets
                                             for kind, cls in (("snapkv", SnapKV), ("infinigen", InfiniGen))]:
        if isinstance(strategy, InfiniGen):
            strategy = strategy.model_copy(update={"tier": "memory"})  # the same answers as the file tier's
        r = two_turns(model, tokenizer, doc, strategy, args.new)
        r.update(config=name, pass_key=key, door_code=code, door_code_found=code in r["answers"][0],
                 pass_key_found=key in r["answers"][1])
        report["follow_up"].append(r)
        print(f"follow-up {name:>15}: door code {r['door_code_found']!s:5} pass key {r['pass_key_found']!s:5} "
              f"answers {r['answers']}", flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
