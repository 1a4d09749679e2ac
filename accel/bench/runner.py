"""Running the grid: configurations x task items x repeats, warmed up and interleaved.

The configurations and what each times are in :mod:`.configurations`; what a call records
and the memory probe in :mod:`.measurement`.

Order: one untimed warm-up per configuration on the first item (its prompt cut to its last
``WARMUP_PROMPT`` tokens: a warm-up loads and initialises, it need not repeat a long prefill),
then for each repeat r and
item i every configuration once, in the configuration order rotated by ``r + i`` so slow
drift of a shared machine spreads over all configurations.

Batched grid (``batch_sizes`` other than ``[1]``, :func:`run_batched_grid`): for each task and
batch size B the task's items form groups of B (:func:`make_groups`); for each repeat r and
group g every configuration that takes B rows runs the group once (one batched call, see
:mod:`.batched`), in the order rotated by ``r + g``. One results row per (group,
configuration, repeat), with the call's aggregate figures and a ``rows`` list of per-row
figures; exactness and agreement per row are against the reference's row in the same group.

Arrivals (:func:`run_arrivals`): per repeat, every configuration with a service form serves
the same requests at the same times, rotated by the repeat; one results row each.
"""

from __future__ import annotations

import contextlib
import json
import math
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from .. import adapter
from .configurations import Configuration
from ..steps import PrefillReuse, reusing_prefills
from .measurement import BatchMeasurement, Measurement, PeakMemory, error_line, percentile, resident_mib
from .schema import Arrivals, Experiment
from .tasks import TaskItem, score

__all__ = [
    "run_grid",
    "run_point",
    "shared_prefill",
    "warm_up",
    "schedule",
    "run_batched_grid",
    "run_arrivals",
    "make_groups",
]


# --------------------------------------------------------------------------- the grid


def _agreement(out: list[int], ref: list[int]) -> float:
    """Fraction of the reference's tokens that ``out`` reproduces as a common prefix."""
    if not ref:
        return 1.0 if not out else 0.0
    n = 0
    for a, b in zip(out, ref):
        if a != b:
            break
        n += 1
    return n / len(ref)


def schedule(configs: list[Configuration], items: list[TaskItem], repeats: int) -> Iterator[tuple[int, int, list[Configuration]]]:
    """Every point of the grid in run order: (repeat, item index, the runnable configurations
    rotated by ``repeat + item``)."""
    runnable = [c for c in configs if c.unavailable is None]
    for r in range(repeats):
        for i in range(len(items)):
            k = (r + i) % len(runnable) if runnable else 0
            yield r, i, runnable[k:] + runnable[:k]


@contextmanager
def _progress(total: int, quiet: bool) -> Iterator[Callable[[str, int], None]]:
    if quiet:
        yield lambda desc, advance: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TimeRemainingColumn(), console=Console(stderr=True), transient=False) as progress:
        tid = progress.add_task("bench", total=total)

        def update(desc: str, advance: int) -> None:
            progress.update(tid, description=desc, advance=advance)

        yield update


def run_grid(
    experiment: Experiment,
    model: Any,
    tokenizer: Any,
    configs: list[Configuration],
    items: list[TaskItem],
    results_path: Path,
    quiet: bool = False,
) -> list[dict[str, Any]]:
    """Warm up, run the interleaved grid, append one row per run to ``results_path``."""
    device = adapter.geometry(model).device
    runnable = [c for c in configs if c.unavailable is None]
    warm = runnable if experiment.warmup_tokens > 0 and items else []
    gen = experiment.generation
    again = min(gen.one_forward_items, len(items)) if gen.share_prefill else 0
    passes = (len(items) + again) * (len(runnable) + gen.share_prefill)
    total = len(warm) + experiment.repeats * passes
    rows: list[dict[str, Any]] = []
    # shared prefills serve every chunk setting: a chunked prefill's cache is one forward's
    reuse = PrefillReuse(match_chunk=False) if gen.share_prefill else None

    with (torch.inference_mode(), _progress(total, quiet) as step, open(results_path, "w", encoding="utf-8") as out,
          reusing_prefills(reuse) if reuse is not None else contextlib.nullcontext()):
        warm_up(experiment, configs, items, step)
        for r, i, order in schedule(configs, items, experiment.repeats):
            runs = [(items[i], gen.prefill_chunk)]
            if i < again:
                runs.append((replace(items[i], item_id=f"{items[i].item_id}/one_forward"), None))
            for item, chunk in runs:
                group = []
                if reuse is not None:
                    group.append(shared_prefill(experiment, model, item, chunk, r, reuse, step))
                group += run_point(experiment, configs, item, r, order, tokenizer, device, step)
                for row in group:
                    out.write(json.dumps(row) + "\n")
                rows += group
                out.flush()
    return rows


def shared_prefill(experiment: Experiment, model: Any, items: TaskItem | list[TaskItem], chunk: int | None,
                   repeat: int, reuse: PrefillReuse, step: Callable[[str, int], None] = lambda desc, advance: None
                   ) -> dict[str, Any]:
    """Prefill the prompts of ``items`` (each distinct one once, together) uncompressed into
    ``reuse``: what the accel configurations of the item (or batch) then start from. Returns
    its results row (``mode: prefill``): seconds, the RSS before and at its peak, each
    prompt's greedy first token. Where ``reuse`` already holds every one of the prompts (an
    earlier group of another batch size, an earlier repeat), nothing reruns: the row is
    marked ``reused``, with the seconds of the prefill it reuses."""
    items = [items] if isinstance(items, TaskItem) else items
    unique = list({i.item_id: i for i in items}.values())
    name = "+".join(i.item_id for i in unique)
    desc = f"r{repeat} {items[0].task}/{name} prefill" + (f" (chunks of {chunk})" if chunk else " (one forward)")
    step(desc, 0)
    row = {"experiment": experiment.name, "mode": "prefill", "task": items[0].task, "kind": items[0].kind,
           "item": name, "batch_size": len(items), "repeat": repeat, "meta": unique[0].meta if len(unique) == 1 else None,
           "prompt_tokens": sum(i.prompt_tokens for i in unique), "prefill_chunk": chunk, "prefill_s": None,
           "rss_before_mib": None, "peak_rss_mib": None, "first_token": None, "reused": False, "error": None}
    device = adapter.geometry(model).device
    prompts = [i.input_ids.to(device).reshape(-1) for i in unique]
    if reuse.kept is not None and reuse.kept.matches(model, prompts, chunk):
        # an earlier group's (another batch size, another repeat): its figures stand, nothing reruns
        row.update(prefill_s=reuse.kept.seconds, reused=True)
        step(desc, 1)
        return row
    reuse.clear()
    try:
        row["rss_before_mib"] = resident_mib()
        with PeakMemory() as mem:
            kept = reuse.prefill(model, prompts, chunk)
        first = adapter.output_logits(model, kept.hidden).argmax(dim=-1).tolist()
        row.update(prefill_s=kept.seconds, peak_rss_mib=mem.peak_mib, first_token=first[0] if len(first) == 1 else first)
    except Exception as err:  # the configurations then prefill on their own, as without sharing
        row["error"] = error_line(err)
    step(desc, 1)
    return row


def warm_up(experiment: Experiment, configs: list[Configuration], items: list[TaskItem],
            step: Callable[[str, int], None] = lambda desc, advance: None) -> None:
    """One untimed call per runnable configuration on the first item (see the module docstring)."""
    if experiment.warmup_tokens <= 0 or not items:
        return
    for c in configs:
        if c.unavailable is not None:
            continue
        step(f"warm-up {c.name}", 0)
        try:
            c.generate(_warmup_item(items[0]), min(experiment.warmup_tokens, experiment.generation.max_new_tokens))
        except Exception:
            pass  # the timed runs record the error
        step(f"warm-up {c.name}", 1)


def run_point(experiment: Experiment, configs: list[Configuration], item: TaskItem, r: int,
              order: list[Configuration], tokenizer: Any, device: torch.device,
              step: Callable[[str, int], None] = lambda desc, advance: None) -> list[dict[str, Any]]:
    """One point of the grid: every configuration of ``order`` runs ``item`` once (repeat
    ``r``), one after the other; its rows in file order, compared with the reference's output."""
    gen = experiment.generation
    names = {c.name for c in configs if c.unavailable is None}
    group: dict[str, dict[str, Any]] = {}
    outputs: dict[str, list[int]] = {}
    for c in order:
        step(f"r{r} {item.task}/{item.item_id} {c.name}", 0)
        row = _row(experiment, c, item, r)
        try:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            with PeakMemory() as mem:
                m = c.generate(item, gen.max_new_tokens)
            row.update(_measured(m, mem, device, tokenizer, item))
            outputs[c.name] = m.new_ids
        except Exception as err:  # record and go on: one failure must not lose the grid
            row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        group[c.name] = row
        step(f"r{r} {item.task}/{item.item_id} {c.name}", 1)
    # sampled outputs are draws, not a reference to match: they are not compared
    ref = outputs.get(experiment.reference) if experiment.reference in names and gen.temperature == 0 else None
    for name, row in group.items():
        if name in outputs and ref is not None:
            row["agreement"] = _agreement(outputs[name], ref)
            row["exact"] = outputs[name] == ref
    return [group[c.name] for c in configs if c.name in group]  # file order, whatever the rotation


WARMUP_PROMPT = 256


def _warmup_item(item: TaskItem) -> TaskItem:
    """``item`` with its prompt cut to its last :data:`WARMUP_PROMPT` tokens."""
    if item.prompt_tokens <= WARMUP_PROMPT:
        return item
    return replace(item, input_ids=item.input_ids[:, -WARMUP_PROMPT:])


def _row(experiment: Experiment, c: Configuration, item: TaskItem, repeat: int) -> dict[str, Any]:
    return {
        "experiment": experiment.name, "config": c.name, "config_kind": c.kind, "strategies": c.spec,
        "precision": c.precision or experiment.precision, "drafts": c.drafts, "task": item.task, "kind": item.kind, "item": item.item_id, "repeat": repeat,
        "meta": item.meta, "prompt_tokens": item.prompt_tokens, "new_tokens": None, "prefill_s": None,
        "decode_s": None, "decode_tok_s": None, "e2e_s": None, "verify_steps": None, "mean_accepted": None,
        "accepted_per_step": None, "kv_bytes_kept": None, "kv_bytes_full": None, "peak_rss_mib": None,
        "peak_gpu_mib": None, "correct": None, "score": None, "agreement": None, "exact": None, "text": None,
        "error": None,
    }


def _measured(m: Measurement, mem: PeakMemory, device: torch.device, tokenizer: Any, item: TaskItem) -> dict[str, Any]:
    text = tokenizer.decode(m.new_ids, skip_special_tokens=True)
    correct, sc = score(item, text)
    return {
        "new_tokens": len(m.new_ids), "prefill_s": m.prefill_s, "decode_s": m.decode_s,
        "decode_tok_s": m.decode_tok_s, "e2e_s": m.e2e_s, "verify_steps": m.verify_steps,
        "mean_accepted": m.mean_accepted, "accepted_per_step": m.accepted_per_step,
        "kv_bytes_kept": m.kv_bytes_kept, "kv_bytes_full": m.kv_bytes_full, "peak_rss_mib": mem.peak_mib,
        "peak_gpu_mib": torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None,
        "correct": correct, "score": sc, "text": text,
    }


# --------------------------------------------------------------------------- batched grid


@dataclass
class Group:
    """B items of one task that run as one batched call."""

    task: str
    kind: str
    batch_size: int
    index: int  # within (task, batch size)
    items: list[TaskItem]


def make_groups(items: list[TaskItem], batch_sizes: list[int]) -> list[Group]:
    """For each task (file order) and batch size (as listed): the task's N items in
    ``ceil(N / B)`` groups of B consecutive items, cycling through the task's items to fill the
    last group (so a task with fewer than B items makes one group, its items repeated)."""
    groups = []
    for task in dict.fromkeys(i.task for i in items):
        its = [i for i in items if i.task == task]
        for b in batch_sizes:
            for g in range(math.ceil(len(its) / b)):
                groups.append(Group(task, its[0].kind, b, g, [its[(g * b + j) % len(its)] for j in range(b)]))
    return groups


def _batch_row(experiment: Experiment, c: Configuration, task: str, kind: str, batch_size: int, group: int,
               items: list[TaskItem], repeat: int, mode: str) -> dict[str, Any]:
    return {
        "experiment": experiment.name, "mode": mode, "config": c.name, "config_kind": c.kind, "strategies": c.spec,
        "precision": c.precision or experiment.precision, "drafts": c.drafts, "task": task, "kind": kind, "batch_size": batch_size, "group": group,
        "items": [i.item_id for i in items], "repeat": repeat, "prompt_tokens": sum(i.prompt_tokens for i in items),
        "new_tokens": None, "e2e_s": None, "tok_s": None, "prefill_s": None, "decode_s": None, "decode_tokens": None,
        "decode_tok_s": None, "latency_mean_s": None, "latency_p50_s": None, "latency_p95_s": None,
        "ttft_mean_s": None, "ttft_p50_s": None, "ttft_p95_s": None, "verify_steps": None, "mean_accepted": None,
        "kv_bytes_kept": None, "kv_bytes_full": None, "peak_rss_mib": None, "peak_gpu_mib": None,
        "overhead_s": None, "failures": None, "exact_rows": None, "compared_rows": None, "agreement": None,
        "rows": [], "error": None,
    }


def _mean_of(xs: list[float | None]) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _batch_measured(m: BatchMeasurement, mem: PeakMemory, device: torch.device, tokenizer: Any,
                    items: list[TaskItem]) -> dict[str, Any]:
    per = []
    for item, r in zip(items, m.rows):
        text = tokenizer.decode(r.new_ids, skip_special_tokens=True)
        correct, sc = score(item, text) if r.error is None else (None, None)
        steps = r.verify_steps
        per.append({
            "item": item.item_id, "prompt_tokens": item.prompt_tokens, "new_tokens": len(r.new_ids),
            "first_token_s": r.first_token_s, "latency_s": r.latency_s, "verify_steps": steps,
            "mean_accepted": (sum(r.accepted_per_step) + steps) / steps if steps else None,
            "kv_bytes_kept": r.kv_bytes_kept, "kv_bytes_full": r.kv_bytes_full, "correct": correct, "score": sc,
            "exact": None, "agreement": None, "text": text, "error": r.error,
        })
    ok = [p for p in per if p["error"] is None]
    lat = [p["latency_s"] for p in ok]
    ttft = [p["first_token_s"] for p in ok]
    steps = sum(r.verify_steps for r in m.rows)
    accepted = sum(sum(r.accepted_per_step) for r in m.rows)
    return {
        "new_tokens": m.new_tokens, "e2e_s": m.e2e_s, "tok_s": m.new_tokens / m.e2e_s if m.e2e_s > 0 else None,
        "prefill_s": m.prefill_s, "decode_s": m.decode_s, "decode_tokens": m.decode_tokens,
        "decode_tok_s": m.decode_tokens / m.decode_s if m.decode_s and m.decode_tokens else None,
        "latency_mean_s": _mean_of(lat), "latency_p50_s": percentile(lat, 50), "latency_p95_s": percentile(lat, 95),
        "ttft_mean_s": _mean_of(ttft), "ttft_p50_s": percentile(ttft, 50), "ttft_p95_s": percentile(ttft, 95),
        "verify_steps": steps, "mean_accepted": (accepted + steps) / steps if steps else None,
        "kv_bytes_kept": sum(r.kv_bytes_kept for r in m.rows), "kv_bytes_full": sum(r.kv_bytes_full for r in m.rows),
        "peak_rss_mib": mem.peak_mib,
        "peak_gpu_mib": torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None,
        "overhead_s": m.overhead_s, "failures": len(per) - len(ok), "rows": per,
    }


def _compare_rows(group: dict[str, dict[str, Any]], reference: str) -> None:
    """Per-row exactness and agreement against the reference's row at the same position."""
    ref = group.get(reference)
    if ref is None or ref["error"] or not ref["rows"]:
        return
    for row in group.values():
        if row["error"] or not row["rows"]:
            continue
        compared = []
        for mine, theirs in zip(row["rows"], ref["rows"]):
            if mine["error"] or theirs["error"]:
                continue
            mine["exact"] = mine["_ids"] == theirs["_ids"]
            mine["agreement"] = _agreement(mine["_ids"], theirs["_ids"])
            compared.append(mine)
        row["exact_rows"] = sum(r["exact"] for r in compared)
        row["compared_rows"] = len(compared)
        row["agreement"] = _mean_of([r["agreement"] for r in compared])


def _timed_batch(call: Callable[[], BatchMeasurement], row: dict[str, Any], device: torch.device, tokenizer: Any,
                 items: list[TaskItem]) -> None:
    """Run ``call`` under PeakMemory and fill ``row`` (or its error)."""
    try:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        with PeakMemory() as mem:
            m = call()
        row.update(_batch_measured(m, mem, device, tokenizer, items))
        for r, result in zip(row["rows"], m.rows):
            r["_ids"] = result.new_ids  # for the comparison; not written
    except Exception as err:  # record and go on
        row["error"] = error_line(err)


def _write_group(out: Any, configs: list[Configuration], group: dict[str, dict[str, Any]], reference: str,
                 rows: list[dict[str, Any]]) -> None:
    _compare_rows(group, reference)
    for c in configs:  # file order, whatever the rotation
        if c.name in group:
            row = group[c.name]
            for r in row["rows"]:
                r.pop("_ids", None)
            out.write(json.dumps(row) + "\n")
            rows.append(row)
    out.flush()


def _cycled(items: list[TaskItem], n: int) -> list[TaskItem]:
    return [items[k % len(items)] for k in range(n)]


def run_batched_grid(
    experiment: Experiment,
    model: Any,
    tokenizer: Any,
    configs: list[Configuration],
    items: list[TaskItem],
    results_path: Path,
    quiet: bool = False,
) -> list[dict[str, Any]]:
    """Warm up, run every group with every configuration that takes its batch size, in
    rotated order; append one row per (group, configuration, repeat) to ``results_path``."""
    gen = experiment.generation
    device = adapter.geometry(model).device
    groups = make_groups(items, experiment.batch_sizes)
    takers = {b: [c for c in configs if c.takes(b)] for b in experiment.batch_sizes}
    warm = [c for c in configs if c.takes(1)] if experiment.warmup_tokens > 0 and items else []
    total = len(warm) + experiment.repeats * sum(len(takers[g.batch_size]) + gen.share_prefill for g in groups)
    first = [i for i in items if i.task == items[0].task] if items else []
    rows: list[dict[str, Any]] = []
    reuse = PrefillReuse(match_chunk=False) if gen.share_prefill else None

    with (torch.inference_mode(), _progress(total, quiet) as step, open(results_path, "a", encoding="utf-8") as out,
          reusing_prefills(reuse) if reuse is not None else contextlib.nullcontext()):
        for c in warm:  # a batch of two where it can, so batched code paths are warm too
            step(f"warm-up {c.name}", 0)
            try:
                c.batch(_cycled(first, 2 if c.takes(2) else 1), min(experiment.warmup_tokens, gen.max_new_tokens))
            except Exception:
                pass  # the timed runs record the error
            step(f"warm-up {c.name}", 1)

        for r in range(experiment.repeats):
            for gi, g in enumerate(groups):
                runnable = takers[g.batch_size]
                k = (r + gi) % len(runnable) if runnable else 0
                group: dict[str, dict[str, Any]] = {}
                if reuse is not None:
                    prefill_row = shared_prefill(experiment, model, g.items, gen.prefill_chunk, r, reuse, step)
                    prefill_row["group"] = g.index
                    out.write(json.dumps(prefill_row) + "\n")
                    rows.append(prefill_row)
                for c in runnable[k:] + runnable[:k]:
                    desc = f"r{r} {g.task} B={g.batch_size} #{g.index} {c.name}"
                    step(desc, 0)
                    row = _batch_row(experiment, c, g.task, g.kind, g.batch_size, g.index, g.items, r, "batch")
                    _timed_batch(lambda: c.batch(g.items, gen.max_new_tokens), row, device, tokenizer, g.items)
                    group[c.name] = row
                    step(desc, 1)
                _write_group(out, configs, group, experiment.reference, rows)
    return rows


def arrival_items(experiment: Experiment, items: list[TaskItem]) -> list[TaskItem]:
    """The arrivals' requests: the task's items in order, cycled to ``arrivals.requests``."""
    arrivals = experiment.arrivals
    assert arrivals is not None
    task = arrivals.task or experiment.task_name(0)
    return _cycled([i for i in items if i.task == task], arrivals.requests)


def run_arrivals(
    experiment: Experiment,
    model: Any,
    tokenizer: Any,
    configs: list[Configuration],
    items: list[TaskItem],
    results_path: Path,
    quiet: bool = False,
) -> list[dict[str, Any]]:
    """Every configuration with a service form serves the same requests at the same times
    (order rotated per repeat); one row each per repeat, appended to ``results_path``."""
    arrivals = experiment.arrivals
    assert arrivals is not None
    gen = experiment.generation
    device = adapter.geometry(model).device
    requests = arrival_items(experiment, items)
    servers = [c for c in configs if c.unavailable is None and c.serve is not None]
    warm = servers if experiment.warmup_tokens > 0 else []
    total = len(warm) + experiment.repeats * len(servers)
    max_batch = arrivals.max_batch or arrivals.requests
    rows: list[dict[str, Any]] = []

    with torch.inference_mode(), _progress(total, quiet) as step, open(results_path, "a", encoding="utf-8") as out:
        for c in warm:
            step(f"warm-up {c.name} (arrivals)", 0)
            try:
                c.serve(requests[:2], Arrivals(requests=2, interval_s=0.0, max_batch=2),
                        min(experiment.warmup_tokens, gen.max_new_tokens))
            except Exception:
                pass
            step(f"warm-up {c.name} (arrivals)", 1)
        for r in range(experiment.repeats):
            k = r % len(servers) if servers else 0
            group: dict[str, dict[str, Any]] = {}
            for c in servers[k:] + servers[:k]:
                desc = f"r{r} arrivals {len(requests)} x {arrivals.interval_s:g}s {c.name}"
                step(desc, 0)
                row = _batch_row(experiment, c, requests[0].task, requests[0].kind, max_batch, 0, requests, r, "arrivals")
                row.update(requests=arrivals.requests, interval_s=arrivals.interval_s)
                _timed_batch(lambda: c.serve(requests, arrivals, gen.max_new_tokens), row, device, tokenizer, requests)
                group[c.name] = row
                step(desc, 1)
            _write_group(out, configs, group, experiment.reference, rows)
    return rows
