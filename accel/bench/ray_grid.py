"""``accel bench CONFIG --ray``: the grid's points as Ray tasks, the driver writing the results.

A point is one item at one repeat, every configuration running it once in the rotated order
(:func:`.runner.run_point`): a run and its baseline share a task, a machine and a warm
process, interleaved as in a local grid, so their ratios mean what they mean locally. A task
asks for the experiment's ``threads`` CPUs (1 if unset) and one GPU when its device is CUDA;
Ray reruns it when its worker dies (:data:`MAX_RETRIES`). A worker process loads the model,
builds the items and configurations and warms them up once (:func:`.runner.warm_up`), then
serves every point it is given.

The driver appends each finished point's rows to ``results.jsonl`` and flushes, so an
interrupted sweep keeps what it finished: the same command again (same experiment, compared
through ``experiment.json``) runs only the points whose rows are not all there. When every
point is in, the file is rewritten in the local grid's order.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from ..cluster import import_ray
from ..files import write_text_atomic
from .configurations import Configuration
from .schema import Experiment
from .tasks import TaskItem

ray = import_ray("accel bench --ray")

__all__ = ["run_grid_ray", "finished_points", "MAX_RETRIES"]

#: Times Ray reruns a point whose worker died.
MAX_RETRIES = 3

_WORKER: dict[str, Any] = {}  # per worker process: the experiment's key and what it built


def _key(experiment: Experiment) -> str:
    return experiment.model_dump_json()


def _state(experiment: Experiment, loaded: tuple[Any, Any] | None) -> dict[str, Any]:
    """This worker's models, items and warmed-up configurations for ``experiment``."""
    import torch

    from .. import adapter
    from .configurations import build_precision_configurations, load_models
    from .runner import warm_up
    from .tasks import build_items

    if _WORKER.get("key") != _key(experiment):
        _WORKER.clear()
        if experiment.threads is not None:
            torch.set_num_threads(experiment.threads)
        torch.manual_seed(experiment.seed)
        models, tokenizer = load_models(experiment, *(loaded or (None, None)))
        items = build_items(experiment, tokenizer)
        configs = build_precision_configurations(experiment, models, tokenizer)
        with torch.inference_mode():
            warm_up(experiment, configs, items)
        _WORKER.update(key=_key(experiment), tokenizer=tokenizer, items=items, configs=configs,
                       device=adapter.geometry(models[0][1]).device)
    return _WORKER


def _point(experiment: Experiment, loaded: tuple[Any, Any] | None, r: int, i: int) -> list[dict[str, Any]]:
    """The Ray task: point (repeat ``r``, item ``i``) of the grid; its rows in file order."""
    import torch

    from .runner import run_point, schedule

    state = _state(experiment, loaded)
    order = next(o for rr, ii, o in schedule(state["configs"], state["items"], experiment.repeats)
                 if (rr, ii) == (r, i))
    with torch.inference_mode():
        return run_point(experiment, state["configs"], state["items"][i], r, order, state["tokenizer"],
                         state["device"])


def _point_key(row: dict[str, Any]) -> tuple[int, str, str]:
    return row["repeat"], row["task"], str(row["item"])


def finished_points(results: Path, configs: list[Configuration]) -> dict[tuple[int, str, str], list[dict[str, Any]]]:
    """Rows of ``results`` grouped by point (repeat, task, item), for the points that have a
    row of every runnable configuration; unreadable lines and partial points are left out."""
    wanted = {c.name for c in configs if c.unavailable is None}
    points: dict[tuple[int, str, str], list[dict[str, Any]]] = {}
    if not results.exists():
        return {}
    for line in results.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
            key = _point_key(row)
        except (ValueError, KeyError, TypeError):
            continue  # a line cut short by the interruption
        points.setdefault(key, []).append(row)
    return {k: rows for k, rows in points.items() if {r["config"] for r in rows} == wanted and len(rows) == len(wanted)}


def run_grid_ray(
    experiment: Experiment,
    configs: list[Configuration],
    items: list[TaskItem],
    results_path: Path,
    *,
    loaded: tuple[Any, Any] | None = None,
    resume: bool = False,
    quiet: bool = False,
) -> list[dict[str, Any]]:
    """Run the grid's points as Ray tasks on the cluster this process is connected to (see
    the module docstring); returns every row, in the local grid's order.

    ``loaded``: a ``(model, tokenizer)`` to ship to the workers instead of their loading
    ``experiment.model``. ``resume``: keep the finished points of ``results_path``.
    """
    from .runner import _progress, schedule

    points = [(r, i) for r, i, _ in schedule(configs, items, experiment.repeats)]
    key = {(r, i): (r, items[i].task, str(items[i].item_id)) for r, i in points}
    done = finished_points(results_path, configs) if resume else {}
    done = {k: v for k, v in done.items() if k in set(key.values())}
    order = {c.name: n for n, c in enumerate(configs)}

    def ordered() -> list[dict[str, Any]]:
        return [row for p in points if key[p] in done for row in sorted(done[key[p]], key=lambda x: order[x["config"]])]

    write_text_atomic(results_path, "".join(json.dumps(row) + "\n" for row in ordered()))
    todo = [p for p in points if key[p] not in done]
    cpus, gpus = experiment.threads or 1, 1 if experiment.device.startswith("cuda") else 0
    have = ray.cluster_resources()
    if cpus > have.get("CPU", 0) or gpus > have.get("GPU", 0):
        raise ValueError(f"each grid point needs {cpus} CPU(s) and {gpus} GPU(s); the Ray cluster has "
                         f"{have.get('CPU', 0):g} CPU(s) and {have.get('GPU', 0):g} GPU(s) in all")
    task = ray.remote(_point).options(num_cpus=cpus, num_gpus=gpus, max_retries=MAX_RETRIES, retry_exceptions=False)
    shipped = ray.put(loaded) if loaded is not None else None
    pending = {task.remote(experiment, shipped, r, i): (r, i) for r, i in todo}
    with _progress(len(todo), quiet) as step, open(results_path, "a", encoding="utf-8") as out:
        _collect(pending, key, done, out, step)
    write_text_atomic(results_path, "".join(json.dumps(row) + "\n" for row in ordered()))
    return ordered()


def _collect(pending: dict[Any, tuple[int, int]], key: dict[tuple[int, int], tuple[int, str, str]],
             done: dict[tuple[int, str, str], list[dict[str, Any]]], out: Any, step: Callable[[str, int], None]) -> None:
    """Append each point's rows as its task finishes; a task that failed for good stops the
    sweep (what finished stays in the file)."""
    try:
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            r, i = pending.pop(ready[0])
            try:
                rows = ray.get(ready[0])
            except ray.exceptions.RayError as err:
                raise RuntimeError(f"grid point r{r} {key[(r, i)][1]}/{key[(r, i)][2]} failed on Ray: "
                                   f"{str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__}"
                                   ) from None
            for row in rows:
                out.write(json.dumps(row) + "\n")
            out.flush()
            done[key[(r, i)]] = rows
            step(f"r{r} {key[(r, i)][1]}/{key[(r, i)][2]}", 1)
    finally:
        for ref in pending:
            ray.cancel(ref)
