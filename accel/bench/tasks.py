"""Task items: deterministic prompts (seeded by the experiment seed) and their scoring.

Every prompt goes through the model's chat template (:func:`accel.models.chat_ids`), and
prompt lengths are measured with the model's own tokenizer: a length target of 2048 means
the chat-formatted prompt is at most 2048 tokens (the longest that fits).

- ``needle``: seeded filler sentences with "The pass key is NNNNN. Remember it." at a depth
  fraction (0 = first sentence, 1 = after the last), then "What is the pass key?". Correct
  when the digits appear in the answer.
- ``long_doc``: a seeded report (named sections, people, numbers, action lists) and one of
  ``repeat`` (copy the section at ``repeat_section``; correct when its first 12 words appear
  in order in the answer),
  ``extract`` (list the people; score = fraction named, correct when all are) or
  ``summarise`` (no reference: agreement with the baseline only).
- ``chat``: short prompts, no reference answer.
"""

from __future__ import annotations

import random
import re
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from ..models import chat_ids
from .corpus import filler_sentences, make_report
from .prompts import CHAT_PROMPTS
from .schema import ChatTask, CodeFileTask, Experiment, LongDocTask, NeedleTask

__all__ = ["TaskItem", "build_items", "score"]


@dataclass
class TaskItem:
    """One prompt of one task.

    input_ids: LongTensor [1, n], chat-formatted prompt.
    meta: what the item is (target length, depth, instruction, ...), copied to results rows.
    expected: what ``score`` checks the answer against (pass key, names, words), or None.
    """

    task: str
    kind: str
    item_id: str
    input_ids: torch.Tensor
    meta: dict[str, Any] = field(default_factory=dict)
    expected: Any = None

    @property
    def prompt_tokens(self) -> int:
        return int(self.input_ids.shape[1])


def _norm(text: str) -> str:
    return " ".join(text.split())


def score(item: TaskItem, answer: str) -> tuple[bool | None, float | None]:
    """``(correct, score)`` of an answer; ``(None, None)`` where there is no reference."""
    if item.expected is None:
        return None, None
    if item.kind == "needle":
        ok = item.expected in re.sub(r"[\s,]", "", answer)
        return ok, float(ok)
    instruction = item.meta.get("instruction")
    if instruction == "extract":
        found = sum(1 for name in item.expected if name.lower() in answer.lower())
        return found == len(item.expected), found / len(item.expected)
    if instruction == "repeat":
        ok = _norm(item.expected) in _norm(answer)
        return ok, float(ok)
    return None, None


def _seed(*parts: Any) -> int:
    """A stable seed from the experiment seed and an item's identity (not Python's hash())."""
    return zlib.crc32(repr(parts).encode())


def _fit(make_text: Callable[[int], str], upper: int, target: int, tokenizer: Any, system: str | None) -> tuple[int, torch.Tensor]:
    """The largest n in [1, upper] whose chat prompt ``make_text(n)`` fits ``target`` tokens
    (n = 1 if none fits). Returns (n, ids [1, m])."""
    lo, hi = 1, upper
    best = None
    while lo <= hi:
        mid = (lo + hi) // 2
        ids = chat_ids(tokenizer, make_text(mid), system=system)
        if ids.shape[1] <= target:
            best, lo = (mid, ids), mid + 1
        else:
            hi = mid - 1
    if best is None:
        best = (1, chat_ids(tokenizer, make_text(1), system=system))
    return best


_NEEDLE_INTRO = (
    "There is a pass key hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the pass key."
)


# The filler of the original pass-key retrieval test.
_CLASSIC = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again.")


def _needle_items(task: NeedleTask, name: str, seed: int, tokenizer: Any, system: str | None) -> list[TaskItem]:
    items = []
    for length in task.lengths:
        for s in range(task.samples):
            # One haystack per (length, sample); only the needle's position moves with depth.
            count = max(8, length // 4 + 8)
            if task.filler == "classic":
                sentences = [_CLASSIC[i % len(_CLASSIC)] for i in range(count)]
            else:
                sentences = filler_sentences(random.Random(_seed(seed, name, length, s)), count)
            for depth in task.depths:
                key = str(random.Random(_seed(seed, name, length, s, depth)).randint(10000, 99999))
                needle = f"The pass key is {key}. Remember it. {key} is the pass key."

                def make_text(n: int, depth=depth, needle=needle) -> str:
                    hay = sentences[:n]
                    at = round(depth * n)
                    hay = hay[:at] + [needle] + hay[at:]
                    return f"{_NEEDLE_INTRO}\n\n{' '.join(hay)}\n\nWhat is the pass key?"

                n, ids = _fit(make_text, len(sentences), length, tokenizer, system)
                items.append(TaskItem(
                    task=name, kind="needle", item_id=f"L{length}-d{depth:g}-s{s}", input_ids=ids,
                    meta={"target_length": length, "depth": depth, "sample": s, "pass_key": key, "sentences": n},
                    expected=key,
                ))
    return items


_DOC_INSTRUCTIONS = {
    "repeat": 'Copy the section titled "{title}" word for word, exactly as it is written in the report.',
    "extract": "List the full names of all the people mentioned in the report, one per line.",
    "summarise": "Summarise the report in three sentences.",
}


def _long_doc_items(task: LongDocTask, name: str, seed: int, tokenizer: Any, system: str | None) -> list[TaskItem]:
    items = []
    for length in task.lengths:
        for d in range(task.documents):
            report = make_report(random.Random(_seed(seed, name, length, d)), n_sections=max(2, length // 40 + 2))
            for instruction in task.instructions:

                def pick(n: int) -> int:
                    return round(task.repeat_section * (n - 1))

                def make_text(n: int, instruction=instruction) -> str:
                    title = report.sections[pick(n)][0]
                    ask = _DOC_INSTRUCTIONS[instruction].format(title=title)
                    return f"Read the following report.\n\n{report.text(n)}\n\n{ask}"

                n, ids = _fit(make_text, len(report.sections), length, tokenizer, system)
                meta: dict[str, Any] = {"target_length": length, "document": d, "instruction": instruction, "sections": n}
                expected: Any = None
                if instruction == "repeat":
                    title, body = report.sections[pick(n)]
                    meta["section"] = title
                    expected = " ".join(body.split()[:12])
                elif instruction == "extract":
                    expected = list(report.people_in(n))
                    meta["people"] = expected
                items.append(TaskItem(
                    task=name, kind="long_doc", item_id=f"L{length}-doc{d}-{instruction}", input_ids=ids,
                    meta=meta, expected=expected,
                ))
    return items


def _chat_items(task: ChatTask, name: str, tokenizer: Any, system: str | None) -> list[TaskItem]:
    if task.file is not None:
        prompts = [l.strip() for l in Path(task.file).read_text(encoding="utf-8").splitlines() if l.strip()]
    else:
        prompts = list(CHAT_PROMPTS)
    if task.prompts is not None:
        prompts = prompts[: task.prompts]
    return [
        TaskItem(task=name, kind="chat", item_id=f"p{i:02d}", input_ids=chat_ids(tokenizer, p, system=system),
                 meta={"prompt": p})
        for i, p in enumerate(prompts)
    ]


def _code_file_items(task: CodeFileTask, name: str, tokenizer: Any, system: str | None) -> list[TaskItem]:
    items = []
    for path in task.files:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
        for length in task.lengths:

            def make_text(n: int, lines=lines) -> str:
                code = "\n".join(lines[:n])
                return f"```python\n{code}\n```\n\n{task.instruction}"

            n, ids = _fit(make_text, max(len(lines), 1), length, tokenizer, system)
            items.append(TaskItem(
                task=name, kind="code_file", item_id=f"{Path(path).stem}-L{length}", input_ids=ids,
                meta={"file": Path(path).name, "target_length": length, "lines": n},
            ))
    return items


def build_items(experiment: Experiment, tokenizer: Any) -> list[TaskItem]:
    """Every item of every task, in file order. Same seed, same tokenizer: same items."""
    system = experiment.generation.system
    items: list[TaskItem] = []
    for i, task in enumerate(experiment.tasks):
        name = experiment.task_name(i)
        if isinstance(task, NeedleTask):
            items += _needle_items(task, name, experiment.seed, tokenizer, system)
        elif isinstance(task, LongDocTask):
            items += _long_doc_items(task, name, experiment.seed, tokenizer, system)
        elif isinstance(task, CodeFileTask):
            items += _code_file_items(task, name, tokenizer, system)
        else:
            items += _chat_items(task, name, tokenizer, system)
    return items
