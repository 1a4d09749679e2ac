"""The figures of summary.md and the plots, aggregated from the rows of results.jsonl.

Speed-ups are ratios to the reference configuration measured in the same run, on the same
item and repeat: ``decode speed-up = decode_tok_s / reference decode_tok_s`` and
``e2e speed-up = reference e2e_s / e2e_s``, then the geometric mean over items x repeats.
Batched and arrivals rows (``mode``) are aggregated per (task, batch size): aggregate tok/s is
every new token over every call's wall time, its ratio the geometric mean of per-call ratios
to the reference's call on the same group and repeat; latency percentiles pool every request.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

from .measurement import percentile

__all__ = ["aggregate", "aggregate_calls", "item_ratios", "mean", "geomean", "ordered", "single_rows"]


def mean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def geomean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None and x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def ordered(values: list[Any]) -> list[Any]:
    return list(dict.fromkeys(values))


def single_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The per-item grid's rows (batched and arrivals rows carry a ``mode``)."""
    return [r for r in rows if r.get("mode", "single") == "single"]


def aggregate_calls(rows: list[dict[str, Any]], reference: str, mode: str) -> dict[tuple[str, int], dict[str, dict[str, Any]]]:
    """``{(task, batch size): {config: figures}}`` over the ``mode`` rows ("batch" or "arrivals")."""
    rows = [r for r in rows if r.get("mode") == mode]
    ref = {(r["task"], r["batch_size"], r["group"], r["repeat"]): r for r in rows
           if r["config"] == reference and not r["error"] and r["tok_s"]}
    table: dict[tuple[str, int], dict[str, dict[str, Any]]] = {}
    for key in ordered([(r["task"], r["batch_size"]) for r in rows]):
        table[key] = {}
        for config in ordered([r["config"] for r in rows]):
            rs = [r for r in rows if (r["task"], r["batch_size"]) == key and r["config"] == config]
            if not rs:
                continue
            ok = [r for r in rs if not r["error"]]
            per = [p for r in ok for p in r["rows"] if not p["error"]]
            ratios = []
            for r in ok:
                base = ref.get((r["task"], r["batch_size"], r["group"], r["repeat"]))
                if base is not None and r["tok_s"]:
                    ratios.append(r["tok_s"] / base["tok_s"])
            dec = [r for r in ok if r["decode_s"] and r["decode_tokens"]]
            steps = sum(p["verify_steps"] or 0 for p in per)
            emitted = sum((p["mean_accepted"] or 0) * (p["verify_steps"] or 0) for p in per)
            compared = sum(r["compared_rows"] or 0 for r in ok)
            lat = [p["latency_s"] for p in per]
            ttft = [p["first_token_s"] for p in per]
            e2e = sum(r["e2e_s"] for r in ok)
            table[key][config] = {
                "kind": rs[0]["kind"], "config_kind": rs[0]["config_kind"], "calls": len(ok),
                "requests": sum(len(r["rows"]) for r in ok),
                "errors": [r["error"] for r in rs if r["error"]] + [p["error"] for r in ok for p in r["rows"] if p["error"]],
                "new_tokens": mean([r["new_tokens"] for r in ok]),
                "tok_s": sum(r["new_tokens"] for r in ok) / e2e if e2e > 0 else None,
                "speedup": geomean(ratios),
                "decode_tok_s": sum(r["decode_tokens"] for r in dec) / sum(r["decode_s"] for r in dec) if dec else None,
                "mean_accepted": emitted / steps if steps else None,
                "latency_p50_s": percentile(lat, 50), "latency_p95_s": percentile(lat, 95),
                "latency_mean_s": mean(lat),
                "ttft_p50_s": percentile(ttft, 50), "ttft_p95_s": percentile(ttft, 95), "ttft_mean_s": mean(ttft),
                "kv_kept_mib": mean([r["kv_bytes_kept"] / 2**20 for r in ok if r["kv_bytes_kept"] is not None]),
                "kv_full_mib": mean([r["kv_bytes_full"] / 2**20 for r in ok if r["kv_bytes_full"] is not None]),
                "peak_rss_mib": max((r["peak_rss_mib"] for r in ok if r["peak_rss_mib"] is not None), default=None),
                "peak_gpu_mib": max((r["peak_gpu_mib"] for r in ok if r["peak_gpu_mib"] is not None), default=None),
                "exact": (sum(r["exact_rows"] or 0 for r in ok), compared) if compared else None,
                "agreement": mean([r["agreement"] for r in ok if r["agreement"] is not None]),
                "overhead_s": mean([r.get("overhead_s") for r in ok if r.get("overhead_s") is not None]),
                "correct": (sum(bool(p["correct"]) for p in per if p["correct"] is not None),
                            sum(1 for p in per if p["correct"] is not None)),
            }
    return table


def item_ratios(rows: list[dict[str, Any]], reference: str) -> dict[tuple[str, str, int], dict[str, float | None]]:
    """Per (config, item, repeat): decode and e2e speed-ups against the reference row."""
    ref = {(r["task"], r["item"], r["repeat"]): r for r in rows if r["config"] == reference and not r["error"]}
    out = {}
    for r in rows:
        base = ref.get((r["task"], r["item"], r["repeat"]))
        if r["error"] or base is None:
            continue
        dec = r["decode_tok_s"] / base["decode_tok_s"] if r["decode_tok_s"] and base["decode_tok_s"] else None
        e2e = base["e2e_s"] / r["e2e_s"] if r["e2e_s"] and base["e2e_s"] else None
        out[(r["config"], r["task"], r["item"], r["repeat"])] = {"decode": dec, "e2e": e2e}
    return out


def aggregate(rows: list[dict[str, Any]], reference: str) -> dict[str, dict[str, dict[str, Any]]]:
    """``{task: {config: figures}}`` for the summary tables."""
    ratios = item_ratios(rows, reference)
    table: dict[str, dict[str, dict[str, Any]]] = defaultdict(dict)
    for task in ordered([r["task"] for r in rows]):
        for config in ordered([r["config"] for r in rows]):
            rs = [r for r in rows if r["task"] == task and r["config"] == config]
            if not rs:
                continue
            ok = [r for r in rs if not r["error"]]
            steps = sum(r["verify_steps"] or 0 for r in ok)
            accepted = sum(sum(r["accepted_per_step"] or []) for r in ok)
            correct = [r["correct"] for r in ok if r["correct"] is not None]
            scores = [r["score"] for r in ok if r["score"] is not None]
            agree = [r["agreement"] for r in ok if r["agreement"] is not None]
            exact = [r["exact"] for r in ok if r["exact"] is not None]
            rat = [ratios[k] for k in ratios if k[0] == config and k[1] == task]
            table[task][config] = {
                "kind": rs[0]["kind"], "config_kind": rs[0]["config_kind"], "strategies": rs[0]["strategies"],
                "n": len(ok), "errors": [r["error"] for r in rs if r["error"]],
                "prompt_tokens": mean([r["prompt_tokens"] for r in ok]),
                "new_tokens": mean([r["new_tokens"] for r in ok]),
                "prefill_s": mean([r["prefill_s"] for r in ok]),
                "decode_tok_s": mean([r["decode_tok_s"] for r in ok]),
                "e2e_s": mean([r["e2e_s"] for r in ok]),
                "decode_speedup": geomean([x["decode"] for x in rat]),
                "e2e_speedup": geomean([x["e2e"] for x in rat]),
                "mean_accepted": (accepted + steps) / steps if steps else None,
                "kv_kept_mib": mean([r["kv_bytes_kept"] / 2**20 for r in ok if r["kv_bytes_kept"] is not None]),
                "kv_full_mib": mean([r["kv_bytes_full"] / 2**20 for r in ok if r["kv_bytes_full"] is not None]),
                "peak_rss_mib": max((r["peak_rss_mib"] for r in ok if r["peak_rss_mib"] is not None), default=None),
                "peak_gpu_mib": max((r["peak_gpu_mib"] for r in ok if r["peak_gpu_mib"] is not None), default=None),
                "correct": (sum(correct), len(correct)) if correct else None,
                "score": mean(scores) if scores else None,
                "agreement": mean(agree) if agree else None,
                "exact": (sum(exact), len(exact)) if exact else None,
            }
    return table
