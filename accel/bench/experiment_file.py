"""Reading an experiment file: YAML, ``--set`` overrides, validation, and one clean error message.

:func:`load_config` reads the file, applies ``--set key.path=value`` overrides
(:func:`apply_overrides`), validates it against :mod:`.schema` and every run's strategies
against the strategy registry, and reports *every* problem in one :class:`ConfigError`, one
line per problem::

    configs/bad.yaml: runs.snapkv_small[0]: snapkv.budget: Input should be greater than 0
    configs/bad.yaml: runs.snapkv_small[0]: snapkv.windw: Extra inputs are not permitted
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from .schema import ChatTask, CodeFileTask, Experiment, Task

__all__ = ["ConfigError", "load_config", "apply_overrides", "resolve_path"]


class ConfigError(ValueError):
    """An experiment file is wrong. ``str(err)`` is one line per problem:
    ``"<file>: <field.path>: <reason>"``; ``err.problems`` lists the lines."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))



def _loc(parts: tuple[Any, ...] | list[Any]) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "(file)"


def _split_key(key: str) -> list[str | int]:
    """``"tasks[0].lengths"`` or ``"tasks.0.lengths"`` -> ``["tasks", 0, "lengths"]``."""
    parts: list[str | int] = []
    for piece in key.split("."):
        m = re.fullmatch(r"([^\[\]]*)((?:\[\d+\])*)", piece)
        if not m or (not m.group(1) and not m.group(2)):
            raise ValueError(f"bad key {key!r}")
        if m.group(1):
            parts.append(int(m.group(1)) if m.group(1).isdigit() else m.group(1))
        parts.extend(int(i) for i in re.findall(r"\[(\d+)\]", m.group(2)))
    return parts


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> list[str]:
    """Set ``key.path=value`` items (value parsed as YAML) in ``data``, in place.

    Returns problem lines (``"--set ITEM: reason"``); empty when all applied.
    """
    problems = []
    for item in overrides:
        key, eq, text = item.partition("=")
        if not eq or not key.strip():
            problems.append(f"--set {item}: expected KEY=VALUE, e.g. generation.max_new_tokens=32")
            continue
        try:
            path = _split_key(key.strip())
            value = yaml.safe_load(text) if text.strip() else ""
        except (ValueError, yaml.YAMLError) as err:
            problems.append(f"--set {item}: {str(err).splitlines()[0]}")
            continue
        node: Any = data
        try:
            for i, part in enumerate(path[:-1]):
                if isinstance(node, dict):
                    if not isinstance(node.get(part), (dict, list)):
                        node[part] = [] if isinstance(path[i + 1], int) else {}
                    node = node[part]
                elif isinstance(node, list) and isinstance(part, int):
                    node = node[part]
                else:
                    raise KeyError(part)
            last = path[-1]
            if isinstance(node, list) and isinstance(last, int):
                node[last] = value
            elif isinstance(node, dict):
                node[last] = value
            else:
                raise KeyError(last)
        except (KeyError, IndexError):
            problems.append(f"--set {item}: {key.strip()} does not name a field that can be set")
    return problems


def _strategy_problems(runs: Any) -> list[str]:
    """Validate every strategy spec of every run through the strategy registry."""
    from accel.engine import plan_strategies
    from accel.strategy import StrategyError, build_strategy

    if not isinstance(runs, dict):
        return []  # pydantic reports the type
    problems = []
    for run, specs in runs.items():
        if not isinstance(specs, list):
            continue  # pydantic reports the type
        built = []
        for i, spec in enumerate(specs):
            where = f"runs.{run}[{i}]: "
            try:
                built.append(build_strategy(spec, where=where))
            except StrategyError as err:
                # build_strategy joins several field errors with "; " and prefixes each with `where`.
                text = str(err)
                parts = text.split(f"; {where}") if text.startswith(where) else [text]
                problems.extend(p if p.startswith(where) else f"{where}{p}" for p in parts)
        if len(built) == len(specs):
            try:
                plan_strategies(built)
            except ValueError as err:
                problems.append(f"runs.{run}: {err}")
    return problems


def load_config(path: str | Path, overrides: list[str] | None = None) -> Experiment:
    """Read, override and validate an experiment file. Writes nothing.

    Raises :class:`ConfigError` naming the file, the field path and the reason of every
    problem found (schema errors and strategy errors together).
    """
    path = Path(path)
    label = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as err:
        raise ConfigError([f"{label}: cannot read the file ({err.strerror or err})"]) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else "(file)"
        reason = getattr(err, "problem", None) or str(err)
        raise ConfigError([f"{label}: {where}: YAML syntax error: {reason}"]) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError([f"{label}: (file): the file must hold a mapping of fields, got {type(data).__name__}"])

    problems = [f"{label}: {p}" for p in apply_overrides(data, list(overrides or []))]
    data.setdefault("name", path.stem)

    experiment = None
    try:
        experiment = Experiment.model_validate(data)
    except ValidationError as err:
        for e in err.errors():
            msg = e["msg"].removeprefix("Value error, ")
            loc = _loc(e["loc"])
            for line in msg.splitlines():
                # Model-level checks already name their field ("runs.x: ...").
                problems.append(f"{label}: {line}" if not e["loc"] else f"{label}: {loc}: {line}")
    problems += [f"{label}: {p}" for p in _strategy_problems(data.get("runs"))]

    if experiment is not None:
        for i, task in enumerate(experiment.tasks):
            if isinstance(task, ChatTask) and task.file is not None:
                f = resolve_path(task.file, path)
                if not f.is_file():
                    problems.append(f"{label}: tasks[{i}].file: no such file: {f}")
            if isinstance(task, CodeFileTask):
                for j, name in enumerate(task.files):
                    f = resolve_path(name, path)
                    if not f.is_file():
                        problems.append(f"{label}: tasks[{i}].files[{j}]: no such file: {f}")
    if problems:
        raise ConfigError(problems)
    assert experiment is not None
    # Relative task files are kept relative to the experiment file.
    def resolved(t: Task) -> Task:
        if isinstance(t, ChatTask) and t.file:
            return t.model_copy(update={"file": str(resolve_path(t.file, path))})
        if isinstance(t, CodeFileTask):
            return t.model_copy(update={"files": [str(resolve_path(f, path)) for f in t.files]})
        return t

    tasks = [resolved(t) for t in experiment.tasks]
    return experiment.model_copy(update={"tasks": tasks})


def resolve_path(name: str, config_path: Path) -> Path:
    p = Path(name).expanduser()
    return p if p.is_absolute() else (config_path.parent / p)
