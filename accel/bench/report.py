"""summary.md and PNG plots from the rows of results.jsonl.

Speed-ups are ratios to the reference configuration measured in the same run, on the same
item and repeat: ``decode speed-up = decode_tok_s / reference decode_tok_s`` and
``e2e speed-up = reference e2e_s / e2e_s``, then the geometric mean over items x repeats.
Batched and arrivals rows (``mode``) get their own sections: aggregate tok/s is every new
token over every call's wall time, its ratio the geometric mean of per-call ratios to the
reference's call on the same group and repeat; latency percentiles pool every request.
Plots use matplotlib's ``Figure`` directly (Agg canvas), never pyplot's global state.
"""

from __future__ import annotations

import math
import os
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

from .batched import percentile

__all__ = ["write_summary", "write_plots", "aggregate", "aggregate_calls"]


def _mean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _geomean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None and x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def _fmt(x: float | None, digits: int = 2, suffix: str = "") -> str:
    return "–" if x is None else f"{x:.{digits}f}{suffix}"


def _ordered(values: list[Any]) -> list[Any]:
    return list(dict.fromkeys(values))


def _single(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The per-item grid's rows (batched and arrivals rows carry a ``mode``)."""
    return [r for r in rows if r.get("mode", "single") == "single"]


def aggregate_calls(rows: list[dict[str, Any]], reference: str, mode: str) -> dict[tuple[str, int], dict[str, dict[str, Any]]]:
    """``{(task, batch size): {config: figures}}`` over the ``mode`` rows ("batch" or "arrivals")."""
    rows = [r for r in rows if r.get("mode") == mode]
    ref = {(r["task"], r["batch_size"], r["group"], r["repeat"]): r for r in rows
           if r["config"] == reference and not r["error"] and r["tok_s"]}
    table: dict[tuple[str, int], dict[str, dict[str, Any]]] = {}
    for key in _ordered([(r["task"], r["batch_size"]) for r in rows]):
        table[key] = {}
        for config in _ordered([r["config"] for r in rows]):
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
                "new_tokens": _mean([r["new_tokens"] for r in ok]),
                "tok_s": sum(r["new_tokens"] for r in ok) / e2e if e2e > 0 else None,
                "speedup": _geomean(ratios),
                "decode_tok_s": sum(r["decode_tokens"] for r in dec) / sum(r["decode_s"] for r in dec) if dec else None,
                "mean_accepted": emitted / steps if steps else None,
                "latency_p50_s": percentile(lat, 50), "latency_p95_s": percentile(lat, 95),
                "latency_mean_s": _mean(lat),
                "ttft_p50_s": percentile(ttft, 50), "ttft_p95_s": percentile(ttft, 95), "ttft_mean_s": _mean(ttft),
                "kv_kept_mib": _mean([r["kv_bytes_kept"] / 2**20 for r in ok if r["kv_bytes_kept"] is not None]),
                "kv_full_mib": _mean([r["kv_bytes_full"] / 2**20 for r in ok if r["kv_bytes_full"] is not None]),
                "peak_rss_mib": max((r["peak_rss_mib"] for r in ok if r["peak_rss_mib"] is not None), default=None),
                "peak_gpu_mib": max((r["peak_gpu_mib"] for r in ok if r["peak_gpu_mib"] is not None), default=None),
                "exact": (sum(r["exact_rows"] or 0 for r in ok), compared) if compared else None,
                "agreement": _mean([r["agreement"] for r in ok if r["agreement"] is not None]),
                "overhead_s": _mean([r.get("overhead_s") for r in ok if r.get("overhead_s") is not None]),
                "correct": (sum(bool(p["correct"]) for p in per if p["correct"] is not None),
                            sum(1 for p in per if p["correct"] is not None)),
            }
    return table


def _ratios(rows: list[dict[str, Any]], reference: str) -> dict[tuple[str, str, int], dict[str, float | None]]:
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
    ratios = _ratios(rows, reference)
    table: dict[str, dict[str, dict[str, Any]]] = defaultdict(dict)
    for task in _ordered([r["task"] for r in rows]):
        for config in _ordered([r["config"] for r in rows]):
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
                "prompt_tokens": _mean([r["prompt_tokens"] for r in ok]),
                "new_tokens": _mean([r["new_tokens"] for r in ok]),
                "prefill_s": _mean([r["prefill_s"] for r in ok]),
                "decode_tok_s": _mean([r["decode_tok_s"] for r in ok]),
                "e2e_s": _mean([r["e2e_s"] for r in ok]),
                "decode_speedup": _geomean([x["decode"] for x in rat]),
                "e2e_speedup": _geomean([x["e2e"] for x in rat]),
                "mean_accepted": (accepted + steps) / steps if steps else None,
                "kv_kept_mib": _mean([r["kv_bytes_kept"] / 2**20 for r in ok if r["kv_bytes_kept"] is not None]),
                "kv_full_mib": _mean([r["kv_bytes_full"] / 2**20 for r in ok if r["kv_bytes_full"] is not None]),
                "peak_rss_mib": max((r["peak_rss_mib"] for r in ok if r["peak_rss_mib"] is not None), default=None),
                "peak_gpu_mib": max((r["peak_gpu_mib"] for r in ok if r["peak_gpu_mib"] is not None), default=None),
                "correct": (sum(correct), len(correct)) if correct else None,
                "score": _mean(scores) if scores else None,
                "agreement": _mean(agree) if agree else None,
                "exact": (sum(exact), len(exact)) if exact else None,
            }
    return table


# --------------------------------------------------------------------------- summary.md


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
    all_rows, rows = rows, _single(rows)
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
        f"- **Generation:** "
        + ("greedy" if not gen.get("temperature") else
           f"sampled at temperature {gen['temperature']}" + (f", top_p {gen['top_p']}" if gen.get("top_p") else "")
           + " (seeded per item; outputs not compared token by token)")
        + f", max_new_tokens {gen['max_new_tokens']}, max_draft_tokens "
        f"{gen['max_draft_tokens']}; {exp['repeats']} repeat(s); seed {exp['seed']}; warm-up "
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


# --------------------------------------------------------------------------- plots


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text)


def _figure(n: int, width: float = 4.2, height: float = 3.4):
    from matplotlib.figure import Figure

    cols = min(n, 3)
    rows = math.ceil(n / cols)
    fig = Figure(figsize=(width * cols, height * rows), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for ax in axes[n:]:
        ax.set_visible(False)
    return fig, axes[:n]


def _plot_speedup(rows: list[dict[str, Any]], reference: str, out: Path) -> Path | None:
    ratios = _ratios(rows, reference)
    if not ratios:
        return None
    tasks = _ordered([r["task"] for r in rows])
    configs = [c for c in _ordered([r["config"] for r in rows]) if c != reference]
    if not configs:
        return None
    fig, axes = _figure(len(tasks))
    for ax, task in zip(axes, tasks):
        # Items are grouped by their length target (chat: one group), x = the group's mean
        # prompt length, y = geometric mean of the group's per-item, per-repeat speed-ups.
        task_rows = [r for r in rows if r["task"] == task]
        group = {r["item"]: r["meta"].get("target_length", 0) for r in task_rows}
        lengths: dict[int, list[int]] = defaultdict(list)
        for r in task_rows:
            if r["config"] == reference:
                lengths[group[r["item"]]].append(r["prompt_tokens"])
        for config in configs:
            by_group: dict[int, list[float]] = defaultdict(list)
            for (c, t, item, _), x in ratios.items():
                if c == config and t == task and x["decode"] is not None:
                    by_group[group[item]].append(x["decode"])
            keys = sorted(k for k in by_group if lengths.get(k))
            if keys:
                ax.plot([_mean(lengths[k]) for k in keys], [_geomean(by_group[k]) for k in keys], marker="o", label=config)
        ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
        ax.set_title(task)
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel(f"decode speed-up vs {reference}")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize="small")
    path = out / "speedup_vs_length.png"
    fig.savefig(path, dpi=110)
    return path


def _plot_needles(rows: list[dict[str, Any]], out: Path) -> list[Path]:
    import numpy as np

    paths = []
    for task in _ordered([r["task"] for r in rows if r["kind"] == "needle"]):
        rs = [r for r in rows if r["task"] == task and not r["error"] and r["correct"] is not None]
        configs = _ordered([r["config"] for r in rs])
        if not configs:
            continue
        lengths = sorted({r["meta"]["target_length"] for r in rs})
        depths = sorted({r["meta"]["depth"] for r in rs})
        fig, axes = _figure(len(configs), width=max(3.2, 0.9 * len(lengths) + 1.8), height=max(2.6, 0.45 * len(depths) + 1.4))
        image = None
        for ax, config in zip(axes, configs):
            grid = np.full((len(depths), len(lengths)), np.nan)
            for di, d in enumerate(depths):
                for li, n in enumerate(lengths):
                    cell = [r["correct"] for r in rs if r["config"] == config
                            and r["meta"]["depth"] == d and r["meta"]["target_length"] == n]
                    if cell:
                        grid[di, li] = sum(cell) / len(cell)
            image = ax.imshow(grid, cmap="RdYlGn", vmin=0, vmax=1, aspect="auto")
            for di in range(len(depths)):
                for li in range(len(lengths)):
                    if not np.isnan(grid[di, li]):
                        ax.text(li, di, f"{grid[di, li]:.0%}", ha="center", va="center", fontsize=7)
            ax.set_xticks(range(len(lengths)), [str(n) for n in lengths], fontsize=7)
            ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths], fontsize=7)
            ax.set_xlabel("prompt tokens (target)")
            ax.set_ylabel("needle depth")
            ax.set_title(config, fontsize=9)
        if image is not None:
            fig.colorbar(image, ax=list(axes), label="pass key found", shrink=0.8)
        path = out / f"needle_{_slug(task)}.png"
        fig.savefig(path, dpi=110)
        paths.append(path)
    return paths


def _plot_accepted(rows: list[dict[str, Any]], out: Path) -> Path | None:
    configs = [c for c in _ordered([r["config"] for r in rows if r["drafts"]])
               if any(r["accepted_per_step"] for r in rows if r["config"] == c and not r["error"])]
    if not configs:
        return None
    fig, axes = _figure(len(configs))
    for ax, config in zip(axes, configs):
        steps = [a + 1 for r in rows if r["config"] == config and not r["error"] for a in (r["accepted_per_step"] or [])]
        top = max(steps)
        ax.hist(steps, bins=[b - 0.5 for b in range(1, top + 2)], color="tab:blue", edgecolor="white")
        ax.set_title(f"{config} (mean {sum(steps) / len(steps):.2f})", fontsize=9)
        ax.set_xlabel("tokens per verify step (accepted drafts + bonus)")
        ax.set_ylabel("verify steps")
        ax.grid(alpha=0.3, axis="y")
    path = out / "accepted_per_step.png"
    fig.savefig(path, dpi=110)
    return path


def _plot_batch(rows: list[dict[str, Any]], reference: str, out: Path) -> Path | None:
    table = aggregate_calls(rows, reference, "batch")
    tasks = _ordered([task for task, _ in table])
    if not tasks:
        return None
    fig, axes = _figure(len(tasks))
    for ax, task in zip(axes, tasks):
        sizes = sorted(b for t, b in table if t == task)
        for config in _ordered([c for (t, _), cs in table.items() if t == task for c in cs]):
            pts = [(b, table[(task, b)][config]["tok_s"]) for b in sizes
                   if config in table[(task, b)] and table[(task, b)][config]["tok_s"]]
            if pts:
                ax.plot([b for b, _ in pts], [y for _, y in pts], marker="o",
                        label=config + (" (ref)" if config == reference else ""))
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(b) for b in sizes])
        ax.set_title(task)
        ax.set_xlabel("batch size (rows per call)")
        ax.set_ylabel("aggregate tok/s (all rows)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize="small")
    path = out / "throughput_vs_batch.png"
    fig.savefig(path, dpi=110)
    return path


def write_plots(rows: list[dict[str, Any]], reference: str, out: Path) -> list[Path]:
    """Write every plot the rows allow; returns their paths."""
    paths = []
    single = _single(rows)
    p = _plot_speedup(single, reference, out)
    if p is not None:
        paths.append(p)
    paths += _plot_needles(single, out)
    p = _plot_accepted(single, out)
    if p is not None:
        paths.append(p)
    p = _plot_batch(rows, reference, out)
    if p is not None:
        paths.append(p)
    return paths
