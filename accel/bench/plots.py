"""The PNG plots of a run, from the rows of results.jsonl: decode speed-up against prompt
length, needle retrieval per (length, depth), tokens per verify step, aggregate throughput
against batch size. Figures come from :mod:`.aggregate`. Plots use matplotlib's ``Figure``
directly (Agg canvas), never pyplot's global state.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

from .aggregate import aggregate_calls, geomean, item_ratios, mean, ordered, single_rows

__all__ = ["write_plots"]


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
    ratios = item_ratios(rows, reference)
    if not ratios:
        return None
    tasks = ordered([r["task"] for r in rows])
    configs = [c for c in ordered([r["config"] for r in rows]) if c != reference]
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
                ax.plot([mean(lengths[k]) for k in keys], [geomean(by_group[k]) for k in keys], marker="o", label=config)
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
    for task in ordered([r["task"] for r in rows if r["kind"] == "needle"]):
        rs = [r for r in rows if r["task"] == task and not r["error"] and r["correct"] is not None]
        configs = ordered([r["config"] for r in rs])
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
    configs = [c for c in ordered([r["config"] for r in rows if r["drafts"]])
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
    tasks = ordered([task for task, _ in table])
    if not tasks:
        return None
    fig, axes = _figure(len(tasks))
    for ax, task in zip(axes, tasks):
        sizes = sorted(b for t, b in table if t == task)
        for config in ordered([c for (t, _), cs in table.items() if t == task for c in cs]):
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
    single = single_rows(rows)
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
