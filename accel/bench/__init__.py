"""YAML-configured speed-up experiments: ``accel bench CONFIG.yaml [--out DIR] [--set k=v]``.

Layout:

- :mod:`.schema`: the experiment file's schema (pydantic).
- :mod:`.experiment_file`: reading one: YAML, ``--set`` overrides, :class:`ConfigError` listing every problem.
- :mod:`.tasks`: needle / long_doc / chat / code_file items, generated from the seed (nothing downloaded).
- :mod:`.configurations`: the HF baselines and accel runs, and what each times.
- :mod:`.measurement`: what a timed call records, the instruments that time it, the machine it ran on.
- :mod:`.runner`: the warmed-up, interleaved grid.
- :mod:`.ray_grid`: the same grid's points as Ray tasks (``--ray``), resumable.
- :mod:`.batched`: how each configuration runs a batch, and requests arriving over time.
- :mod:`.continuous_batching`: the ``hf_generate_batch`` baseline, transformers' continuous batching.
- :mod:`.aggregate`: the figures (means, speed-ups against the reference, percentiles) from the rows.
- :mod:`.summary`: summary.md.
- :mod:`.plots`: the PNG plots.

Outputs, in the output folder: ``results.jsonl`` (one row per run; batched and arrivals rows
carry ``mode`` and a ``rows`` list), ``summary.md``, ``speedup_vs_length.png``,
``needle_<task>.png``, ``accepted_per_step.png``, ``throughput_vs_batch.png``, and
``experiment.json`` (the validated experiment, overrides applied).
"""

from __future__ import annotations

import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from .experiment_file import ConfigError, load_config
from .schema import Experiment

__all__ = ["run_cli", "run_experiment", "load_config", "ConfigError", "Experiment"]


def run_experiment(
    config: Experiment | str | Path,
    out: str | Path | None = None,
    *,
    model: Any = None,
    tokenizer: Any = None,
    command: str | None = None,
    quiet: bool = False,
    ray: bool = False,
    address: str | None = None,
) -> Path:
    """Run an experiment and write its outputs; returns the output folder.

    ``config``: a validated :class:`Experiment` or the path of an experiment file.
    ``out``: output folder (default: the experiment's ``output``, else ``runs/<name>``).
    ``model``, ``tokenizer``: an already-loaded pair to use instead of loading
    ``config.model`` (tests pass a tiny random model and a toy tokenizer this way).
    Everything that can fail before the grid (model, device, prompt lengths) is checked
    before the output folder is created.
    ``ray``: run the grid's points as Ray tasks (:mod:`.ray_grid`) on the cluster at ``address``
    (None: ``$RAY_ADDRESS``, else a local one); a rerun resumes the points not yet written.
    """
    import torch

    experiment = config if isinstance(config, Experiment) else load_config(config)
    if ray and experiment.generation.share_prefill:
        raise ValueError("generation.share_prefill: shared prefills run in this process's grid, not over --ray")
    out = Path(out if out is not None else (experiment.output or Path("runs") / (experiment.name or "bench")))
    threads = torch.get_num_threads()
    if experiment.threads is not None:
        torch.set_num_threads(experiment.threads)
    if ray:
        from ..cluster import connect

        if experiment.batched or experiment.arrivals is not None:
            raise ValueError("accel bench --ray runs the per-item grid: leave batch_sizes at [1] and arrivals unset")
        connect(address)
    try:
        return _run(experiment, out, model, tokenizer, command, quiet, ray)
    finally:
        torch.set_num_threads(threads)  # leave the process as we found it


def _run(experiment: Experiment, out: Path, model: Any, tokenizer: Any, command: str | None, quiet: bool,
         ray: bool = False) -> Path:
    import torch

    from . import configurations, measurement, plots, runner, summary, tasks

    torch.manual_seed(experiment.seed)
    given = (model, tokenizer) if model is not None else None  # shipped to Ray workers as it is
    models, tokenizer = configurations.load_models(experiment, model, tokenizer)
    model = models[0][1]
    if tokenizer is None:
        raise ValueError(f"model {experiment.model!r} comes without a tokenizer; the bench tasks need one")

    items = tasks.build_items(experiment, tokenizer)
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit:
        too_long = [i for i in items if i.prompt_tokens + experiment.generation.max_new_tokens > limit]
        if too_long:
            worst = max(too_long, key=lambda i: i.prompt_tokens)
            raise ValueError(
                f"{len(too_long)} item(s) need more positions than the model has ({limit}): e.g. "
                f"{worst.task}/{worst.item_id} has {worst.prompt_tokens} prompt tokens + "
                f"{experiment.generation.max_new_tokens} new tokens; use shorter lengths"
            )
    configs = configurations.build_precision_configurations(experiment, models, tokenizer)
    ref = next(c for c in configs if c.name == experiment.reference)
    if ref.unavailable:
        raise ValueError(f"reference {ref.name!r} is unavailable: {ref.unavailable}")
    if experiment.batched:
        for b in experiment.batch_sizes:
            if not ref.takes(b):
                raise ValueError(f"reference {ref.name!r} cannot run batches of {b}"
                                 + (f" ({ref.batch_note})" if ref.batch_note else "") + "; pick another reference")
    if experiment.arrivals is not None and ref.serve is None:
        raise ValueError(f"reference {ref.name!r} cannot serve arrivals ({ref.serve_note}); pick another reference")

    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("needle_*.png"), out / "speedup_vs_length.png", out / "accepted_per_step.png",
                  out / "throughput_vs_batch.png"]:
        stale.unlink(missing_ok=True)  # plots of an earlier run that this one may not redraw
    spec = json.dumps(experiment.model_dump(mode="json"), indent=2) + "\n"
    same = (out / "experiment.json").exists() and (out / "experiment.json").read_text() == spec
    (out / "experiment.json").write_text(spec)
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    t0 = time.perf_counter()
    results = out / "results.jsonl"
    if ray:
        from .ray_grid import run_grid_ray

        rows = run_grid_ray(experiment, configs, items, results, loaded=given, resume=same, quiet=quiet)
    elif experiment.batched:
        results.write_text("", encoding="utf-8")
        rows = runner.run_batched_grid(experiment, model, tokenizer, configs, items, results, quiet=quiet)
    else:
        rows = runner.run_grid(experiment, model, tokenizer, configs, items, results, quiet=quiet)
    if experiment.arrivals is not None:
        rows += runner.run_arrivals(experiment, model, tokenizer, configs, items, results, quiet=quiet)
    wall = time.perf_counter() - t0

    meta = {
        "experiment": experiment.model_dump(mode="json"),
        "machine": measurement.machine_info(model, experiment),
        "command": command or f"accel bench <{experiment.name}>",
        "started": started,
        "wall_s": wall,
        "configurations": [
            {"name": c.name, "kind": c.kind, "spec": c.spec, "unavailable": c.unavailable,
             "max_batch": c.max_batch if c.batch is not None else 0, "batch_note": c.batch_note,
             "serves": c.serve is not None, "serve_note": c.serve_note}
            for c in configs
        ],
    }
    pngs = plots.write_plots(rows, experiment.reference, out)
    summary.write_summary(out / "summary.md", rows, meta, pngs)
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    return out


def _command(args: Any) -> str:
    parts = ["accel", "bench", args.config]
    if args.out:
        parts += ["--out", args.out]
    for item in args.set or []:
        parts += ["--set", item]
    if getattr(args, "quantize", None) is not None:
        parts += ["--quantize", args.quantize]
    if getattr(args, "ray", False):
        parts += ["--ray"] + (["--address", args.address] if args.address else [])
    return " ".join(shlex.quote(p) for p in parts)


def run_cli(args: Any) -> int:
    """``accel bench``: validate the file (nothing written if it is wrong), run, report."""
    overrides = list(args.set or [])
    if getattr(args, "quantize", None) is not None:
        overrides.append(f"quantize={args.quantize}")
    try:
        experiment = load_config(args.config, overrides)
    except ConfigError as err:
        n = len(err.problems)
        print(f"accel bench: {args.config} is not a valid experiment ({n} problem{'s' * (n != 1)}):", file=sys.stderr)
        print(str(err), file=sys.stderr)
        return 2
    out = run_experiment(experiment, args.out, command=_command(args), ray=getattr(args, "ray", False),
                         address=getattr(args, "address", None))
    rows = sum(1 for _ in open(out / "results.jsonl", encoding="utf-8"))
    plots = sorted(p.name for p in out.glob("*.png"))
    print(f"accel bench: wrote {out / 'results.jsonl'} ({rows} rows), {out / 'summary.md'}"
          + (f", plots: {', '.join(plots)}" if plots else ""), file=sys.stderr)
    return 0
