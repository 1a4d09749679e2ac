"""summary.md from the rows of results.jsonl: the run's command, machine and settings, the
configurations, one table per task, the batched and arrivals sections, what the columns
measure, and the plots. The figures come from :mod:`.aggregate`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .aggregate import aggregate, aggregate_calls, single_rows

__all__ = ["write_summary"]


def _fmt(x: float | None, digits: int = 2, suffix: str = "") -> str:
    return "–" if x is None else f"{x:.{digits}f}{suffix}"



def _machine_line(m: dict[str, Any]) -> str:
    where = f"{m['cpu']} ({m['affinity'] or m['cpu_count']} usable cores of {m['cpu_count']})"
    if m.get("gpu"):
        where += f", GPU {m['gpu']}"
    return (f"{where}; {m['platform']}; Python {m['python']}, torch {m['torch']} "
            f"({m['torch_threads']} thread{'s' * (m['torch_threads'] != 1)}), transformers {m['transformers']}")


def write_summary(path: Path, rows: list[dict[str, Any]], meta: dict[str, Any], plots: list[Path]) -> None:
    exp, machine, reference = meta["experiment"], meta["machine"], meta["experiment"]["reference"]
    gen = exp["generation"]
    batched = exp.get("batch_sizes", [1]) != [1]
    all_rows, rows = rows, single_rows(rows)
    lines = [f"# Benchmark: {exp['name']}", ""]
    if exp.get("description"):
        lines += [exp["description"].strip(), ""]
    params = machine["parameters"] / 1e6
    lines += [
        f"- **Command:** `{meta['command']}`",
        f"- **Machine:** {_machine_line(machine)}",
        f"- **Model:** {machine['model']} ({_model_name(machine)}{machine['model_class']}, {params:.1f}M parameters), "
        f"{_precision_text(machine)} on {machine['device']}"
        + ("; linear weights stored column-major (`accel.kernels.cpu.transpose_weights`), baselines included"
           if machine.get("transposed") else "")
        + ("; linear weights prepacked for oneDNN (`accel.kernels.cpu.prepack`), baselines included" if machine.get("prepacked") else ""),
        "- **Generation:** "
        + ("greedy" if not gen.get("temperature") else
           f"sampled at temperature {gen['temperature']}" + (f", top_p {gen['top_p']}" if gen.get("top_p") else "")
           + " (seeded per item; outputs not compared token by token)")
        + f", max_new_tokens {gen['max_new_tokens']}, max_draft_tokens "
        f"{gen['max_draft_tokens']}" + (f", prefill_chunk {gen['prefill_chunk']}" if gen.get("prefill_chunk") else "")
        + f"; {exp['repeats']} repeat(s); seed {exp['seed']}; warm-up "
        f"{exp['warmup_tokens']} tokens per configuration; configurations interleaved (rotated order per "
        + (f"group of B items; batch sizes {', '.join(map(str, exp['batch_sizes']))})" if batched else "item)"),
        (f"- **Reference:** `{reference}`. Speed-ups are ratios to it measured in the same run on the same "
         "item and repeat (decode: tok/s ÷ its tok/s; e2e: its seconds ÷ these seconds), geometric mean over "
         "items × repeats." if not batched else
         f"- **Reference:** `{reference}`. Ratios are to its aggregate tok/s on the same group of items (or the "
         "same arrivals) and repeat, at the same batch size, geometric mean over groups × repeats."),
        f"- **Started:** {meta['started']}; grid wall time {meta['wall_s']:.0f} s",
        "",
        "## Configurations",
        "",
        "| configuration | kind | what runs |",
        "|---|---|---|",
    ]
    for c in meta["configurations"]:
        what = c["spec"] + (f" — **unavailable:** {c['unavailable']}" if c["unavailable"] else "")
        lines.append(f"| `{c['name']}` | {c['kind']} | {what} |")
    lines.append("")

    table = aggregate(rows, reference)
    gpu = any(v["peak_gpu_mib"] is not None for t in table.values() for v in t.values())
    for task, configs in table.items():
        first = next(iter(configs.values()))
        items = len({r["item"] for r in rows if r["task"] == task})
        lines += [f"## Task `{task}` ({first['kind']}, {items} item(s) × {exp['repeats']} repeat(s))", ""]
        head = ["configuration", "prompt tok", "new tok", "prefill s", "decode tok/s", "decode speed-up",
                "e2e s", "e2e speed-up", "tokens/step", "KV MiB kept/full", "peak RSS MiB"]
        if gpu:
            head.append("peak GPU MiB")
        head += ["correct", "agreement (exact)"]
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for name, v in configs.items():
            correct = "–"
            if v["correct"] is not None:
                correct = f"{v['correct'][0]}/{v['correct'][1]}"
                if v["score"] is not None and first["kind"] == "long_doc" and v["score"] != v["correct"][0] / v["correct"][1]:
                    correct += f" (score {v['score']:.2f})"
            agree = "–"
            if v["agreement"] is not None:
                agree = f"{v['agreement']:.2f} ({v['exact'][0]}/{v['exact'][1]})"
            label = f"`{name}`" + (" (ref)" if name == reference else "")
            if v["errors"]:
                label += f" ⚠ {len(v['errors'])} failed"
            cells = [label, _fmt(v["prompt_tokens"], 0), _fmt(v["new_tokens"], 1), _fmt(v["prefill_s"], 3),
                     _fmt(v["decode_tok_s"], 1), _fmt(v["decode_speedup"], 2, "×"), _fmt(v["e2e_s"], 2),
                     _fmt(v["e2e_speedup"], 2, "×"), _fmt(v["mean_accepted"], 2),
                     f"{_fmt(v['kv_kept_mib'], 1)}/{_fmt(v['kv_full_mib'], 1)}", _fmt(v["peak_rss_mib"], 0)]
            if gpu:
                cells.append(_fmt(v["peak_gpu_mib"], 0))
            cells += [correct, agree]
            lines.append("| " + " | ".join(cells) + " |")
        errors = [(n, e) for n, v in configs.items() for e in v["errors"]]
        if errors:
            lines += ["", "Failures: " + "; ".join(f"`{n}`: {e}" for n, e in _ordered_pairs(errors))]
        lines.append("")

    lines += _batched_sections(all_rows, meta)
    lines += _prefill_section(all_rows)

    lines += ["## What the columns measure", ""]
    if rows or not batched:
        lines += [
            "- **prefill s**: accel runs: prompt forward (with compression) + first token, from `Stats.prefill_s`. "
            "HF baselines: time from the `model.generate` call until a streamer receives the first new token(s) "
            "(for `hf_prompt_lookup` and `hf_assisted` that first forward also verifies the first draft).",
            "- **decode tok/s**: tokens after the first one(s) ÷ the time after the prefill (accel: "
            "`Stats.decode_tokens / Stats.decode_s`; HF: (new tokens − first chunk) ÷ (e2e − prefill)).",
            "- **e2e s**: the whole `accel.generate` / `model.generate` call. Lossy configurations may "
            "generate a different number of tokens than the reference (see *new tok*).",
            "- **tokens/step**: tokens emitted per verify step, bonus token included (1.00 = no draft accepted).",
            "- **KV MiB kept/full**: cache bytes held vs what an uncompressed cache holds for the same tokens.",
            "- **peak RSS MiB**: the process's peak resident memory during the call, model weights included.",
            "- **correct**: needle: the pass key's digits appear in the answer; long_doc repeat: the section's "
            "first 12 words appear in order; extract: every person is named (score: fraction named); "
            "summarise and chat: no reference answer.",
            f"- **agreement**: fraction of the reference's (`{reference}`) tokens reproduced as a common prefix, "
            "and in brackets how many outputs equal it token for token.",
            "",
        ]
    if any(r.get("mode") in ("batch", "arrivals") for r in all_rows):
        lines += _BATCHED_COLUMNS + [""]
    if plots:
        lines += ["## Plots", ""]
        lines += [f"![{p.stem}]({p.name})" for p in plots]
        lines.append("")
    path.write_text("\n".join(lines), encoding="utf-8")


def _ordered_pairs(pairs: list[tuple[str, str]]) -> list[tuple[str, str]]:
    return list(dict.fromkeys(pairs))


_BATCHED_COLUMNS = [
    "Batched and arrivals tables:",
    "",
    "- **tok/s**: every new token of every row ÷ the wall time of the calls (batched: the whole "
    "`accel.generate` / `model.generate` call, `hf_generate_batch` from the first `add_request` to the last "
    "result; arrivals: first submit to last completion). **vs ref**: geometric mean of each call's tok/s ÷ "
    "the reference's on the same group and repeat.",
    "- **decode tok/s**: tokens after every row's first ÷ the time after the last row's first token "
    "(accel: `Stats.decode_tokens / Stats.decode_s`; `hf_generate`: from its streamer; `hf_generate_batch`: "
    "from its per-token timestamps).",
    "- **latency p50/p95 s** and **TTFT p50/p95 s**: each request's last and first new token, from the "
    "start of its batched call, or (arrivals) from its submit; pooled over every request of every call.",
    "- **KV MiB kept/full**: per call, summed over its rows; `hf_generate` keeps every row at the "
    "padded batch length for every step, `hf_generate_batch` whole pages.",
    "- **exact rows**: rows whose tokens equal the reference's row for the same item in the same call "
    "group, of the rows compared (mean agreement in brackets).",
]


def _prefill_section(rows: list[dict[str, Any]]) -> list[str]:
    """The shared prefills (``generation.share_prefill``): one line per item and repeat."""
    rows = [r for r in rows if r.get("mode") == "prefill"]
    if not rows:
        return []
    lines = ["## Shared prefills", "",
             "Each item's prompt prefilled once, uncompressed; every accel configuration of the item started "
             "from it (its *prefill s* above is its own copy and selection). RSS includes the model weights.", "",
             "| item | prompt tok | prefill | prefill s | RSS before MiB | peak RSS MiB | peak − before MiB | first token |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        how = f"chunks of {r['prefill_chunk']}" if r["prefill_chunk"] else "one forward"
        grew = r["peak_rss_mib"] - r["rss_before_mib"] if r["peak_rss_mib"] is not None and r["rss_before_mib"] else None
        first = str(r["first_token"]) if r["error"] is None else f"⚠ {r['error']}"
        if r.get("reused"):
            how += ", reused (from an earlier group)"
        lines.append(f"| {r['task']}/{r['item']} (r{r['repeat']}) | {r['prompt_tokens']} | {how} | "
                     f"{_fmt(r['prefill_s'], 1)} | {_fmt(r['rss_before_mib'], 0)} | {_fmt(r['peak_rss_mib'], 0)} | "
                     f"{_fmt(grew, 0)} | {first} |")
    return lines + [""]


def _precision_text(machine: dict[str, Any]) -> str:
    """What the model ran in: its dtype, its quantization, or the precisions compared."""
    if machine.get("precisions"):
        return (f"precisions {', '.join(machine['precisions'])} (one model each, quantized ones from "
                f"{machine['dtype']}; configurations named NAME@PRECISION)")
    if machine.get("quantize"):
        return f"{machine['quantize']} weights (quantized from {machine['dtype']})"
    return machine["dtype"]


def _model_name(machine: dict[str, Any]) -> str:
    """The model's own name, with a comma, where it says more than the experiment's name for
    it; a local folder by its last component (no machine's paths in a report)."""
    name = machine.get("model_name") or ""
    if os.path.isabs(name):
        name = os.path.basename(os.path.normpath(name))
    return f"{name}, " if name and name != machine["model"] else ""


def _batched_table(configs: dict[str, dict[str, Any]], reference: str, arrivals: bool, gpu: bool) -> list[str]:
    head = ["configuration", "requests", "new tok/call", "tok/s", "vs ref", "decode tok/s", "tokens/step",
            "latency p50/p95 s", "TTFT p50/p95 s", "KV MiB kept/full", "peak RSS MiB"]
    if arrivals:
        head[3:3] = ["latency mean s"]
        head.remove("decode tok/s")
    if gpu:
        head.append("peak GPU MiB")
    head += ["correct", "exact rows"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, v in configs.items():
        label = f"`{name}`" + (" (ref)" if name == reference else "")
        if v["errors"]:
            label += f" ⚠ {len(v['errors'])} failed"
        exact = "–"
        if v["exact"] is not None:
            exact = f"{v['exact'][0]}/{v['exact'][1]}" + (f" ({v['agreement']:.2f})" if v["agreement"] is not None else "")
        cells = [label, str(v["requests"]), _fmt(v["new_tokens"], 0), _fmt(v["tok_s"], 1), _fmt(v["speedup"], 2, "×"),
                 _fmt(v["decode_tok_s"], 1), _fmt(v["mean_accepted"], 2),
                 f"{_fmt(v['latency_p50_s'], 2)}/{_fmt(v['latency_p95_s'], 2)}",
                 f"{_fmt(v['ttft_p50_s'], 2)}/{_fmt(v['ttft_p95_s'], 2)}",
                 f"{_fmt(v['kv_kept_mib'], 1)}/{_fmt(v['kv_full_mib'], 1)}", _fmt(v["peak_rss_mib"], 0)]
        if arrivals:
            cells[3:3] = [_fmt(v["latency_mean_s"], 2)]
            del cells[6]  # decode tok/s: no prefill/decode split while requests keep arriving
        if gpu:
            cells.append(_fmt(v["peak_gpu_mib"], 0))
        cells += [f"{v['correct'][0]}/{v['correct'][1]}" if v["correct"][1] else "–", exact]
        lines.append("| " + " | ".join(cells) + " |")
    overhead = [(n, v["overhead_s"]) for n, v in configs.items() if v["overhead_s"] is not None]
    if overhead:
        lines += ["", "Outside the timed window: " + "; ".join(
            f"`{n}` {x:.2f} s per call (continuous-batching manager setup and stop)" for n, x in overhead)]
    errors = [(n, e) for n, v in configs.items() for e in v["errors"]]
    if errors:
        lines += ["", "Failures: " + "; ".join(f"`{n}`: {e}" for n, e in _ordered_pairs(errors))]
    return lines


def _batched_sections(rows: list[dict[str, Any]], meta: dict[str, Any]) -> list[str]:
    """summary.md's batched and arrivals sections (nothing when the rows have neither)."""
    exp, reference = meta["experiment"], meta["experiment"]["reference"]
    configs_meta = [c for c in meta["configurations"] if not c["unavailable"]]
    gpu = any(r.get("peak_gpu_mib") is not None for r in rows if r.get("mode"))
    lines: list[str] = []
    table = aggregate_calls(rows, reference, "batch")
    for (task, b), configs in table.items():
        calls = [r for r in rows if r.get("mode") == "batch" and r["task"] == task and r["batch_size"] == b]
        groups = len({r["group"] for r in calls})
        kind = next(iter(configs.values()))["kind"]
        lines += [f"## Batched: task `{task}` ({kind}), batch size {b} ({groups} group(s) of {b} × "
                  f"{exp['repeats']} repeat(s))", ""]
        lines += _batched_table(configs, reference, False, gpu)
        skipped = [c for c in configs_meta if c["name"] not in configs and "max_batch" in c]
        if skipped:
            lines += ["", "Not run at this batch size: " + "; ".join(
                f"`{c['name']}` ({c['batch_note'] or 'no batched form'})" for c in skipped)]
        lines.append("")
    arrivals = aggregate_calls(rows, reference, "arrivals")
    for (task, b), configs in arrivals.items():
        first = next(r for r in rows if r.get("mode") == "arrivals" and r["task"] == task)
        lines += [f"## Arrivals: {first['requests']} `{task}` requests, one every {first['interval_s']:g} s, "
                  f"at most {b} decoded together ({exp['repeats']} repeat(s))", "",
                  "`hf_generate` runs static batches: whenever it is free, the requests that have arrived "
                  f"(at most {b}) run as one left-padded `model.generate` call while later ones wait; accel runs "
                  "use `accel.Engine`, `hf_generate_batch` transformers' continuous-batching manager.", ""]
        lines += _batched_table(configs, reference, True, gpu)
        skipped = [c for c in configs_meta if c["name"] not in configs and "serves" in c]
        if skipped:
            lines += ["", "Not run: " + "; ".join(f"`{c['name']}` ({c['serve_note'] or 'no service form'})"
                                                   for c in skipped)]
        lines.append("")
    return lines
