"""The experiment file's schema: pydantic models of its tasks, baselines, generation settings,
arrivals and the experiment itself.

An experiment YAML names the model, the tasks (generated in the repo, never downloaded),
the configurations to compare (named ``runs`` of strategies, validated by the same registry
as :func:`accel.generate`, and HF ``baselines``), generation settings, repeats, seed and
output folder. Reading a file, ``--set`` overrides and the error message listing every
problem are in :mod:`.experiment_file`.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

from ..dtypes import DTYPES, DtypeName, dtype_name
from ..kernels.lowbit import QuantizeSpec, quantize_name

__all__ = [
    "Experiment",
    "NeedleTask",
    "LongDocTask",
    "ChatTask",
    "CodeFileTask",
    "Task",
    "Generation",
    "HFGenerate",
    "HFGenerateUnpacked",
    "HFPromptLookup",
    "HFAssisted",
    "HFGenerateBatch",
    "KVPressSnapKV",
    "Arrivals",
    "BASELINE_NAMES",
]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.+-]*$")


# --------------------------------------------------------------------------- tasks


class NeedleTask(_Model):
    """Needle in a haystack (pass-key retrieval, Mohtashami & Jaggi 2023): filler text with
    "The pass key is NNNNN. Remember it. NNNNN is the pass key." at a depth fraction, then
    "What is the pass key?". Correct when the pass key's digits appear in the answer."""

    kind: Literal["needle"] = "needle"
    name: str | None = None
    """Task name in tables and plots (default: the kind)."""
    lengths: list[Annotated[int, Field(gt=0)]] = Field(default_factory=lambda: [1024, 2048, 4096], min_length=1)
    """Target prompt lengths in tokens of the model's tokenizer, chat template included."""
    depths: list[Annotated[float, Field(ge=0, le=1)]] = Field(default_factory=lambda: [0.1, 0.5, 0.9], min_length=1)
    """Where the needle goes: 0 = start of the haystack, 1 = end."""
    samples: int = Field(1, gt=0)
    """Items per (length, depth) cell, each with its own haystack and pass key."""
    filler: Literal["classic", "varied"] = "classic"
    """"classic": the pass-key test's repeated sentences ("The grass is green. The sky is
    blue. ..."); "varied": seeded sentences from word lists (harder: the default model
    answers with filler words beyond ~2K tokens even with the full cache)."""


class LongDocTask(_Model):
    """A generated report (named sections, people, numbers, lists) and an instruction about it:
    ``repeat`` (copy one section verbatim), ``extract`` (list every person named) or
    ``summarise``."""

    kind: Literal["long_doc"] = "long_doc"
    name: str | None = None
    """Task name in tables and plots (default: the kind)."""
    instructions: list[Literal["repeat", "extract", "summarise"]] = Field(
        default_factory=lambda: ["repeat", "extract", "summarise"], min_length=1
    )
    """Which instructions to ask, one item each per document."""
    lengths: list[Annotated[int, Field(gt=0)]] = Field(default_factory=lambda: [1000, 2000, 4000], min_length=1)
    """Target prompt lengths in tokens (the document fills all but the instruction)."""
    documents: int = Field(1, gt=0)
    """Different documents per length."""
    repeat_section: float = Field(0.0, ge=0, le=1)
    """Which section ``repeat`` asks for, as a fraction of the document: 0 = the first
    section, 0.5 = the middle one, 1 = the last (small models tend to copy the first)."""


class ChatTask(_Model):
    """Short chat prompts: the ~20 shipped in ``accel/bench/prompts.py``, or a text file of
    your own with one prompt per line. No reference answer: scored by agreement only."""

    kind: Literal["chat"] = "chat"
    name: str | None = None
    """Task name in tables and plots (default: the kind)."""
    prompts: int | None = Field(None, gt=0)
    """Use the first N prompts (default: all)."""
    file: str | None = None
    """A UTF-8 text file, one prompt per line (relative to the experiment file)."""


class CodeFileTask(_Model):
    """Long code prompts: each source file in ``files``, cut at a line boundary to fit each
    of ``lengths`` tokens, followed by ``instruction``. No reference answer: scored by
    agreement only."""

    kind: Literal["code_file"] = "code_file"
    name: str | None = None
    """Task name in tables and plots (default: the kind)."""
    files: list[str] = Field(min_length=1)
    """UTF-8 source files (relative to the experiment file)."""
    lengths: list[Annotated[int, Field(gt=0)]] = Field(default_factory=lambda: [4000], min_length=1)
    """Target prompt lengths in tokens."""
    instruction: str = Field(
        "Return the code above unchanged, except that each function gets a one-line comment above it "
        "saying what it does.", min_length=1)
    """What to do with the code."""


Task = Annotated[Union[NeedleTask, LongDocTask, ChatTask, CodeFileTask], Field(discriminator="kind")]


# --------------------------------------------------------------------------- baselines


class HFGenerate(_Model):
    """``model.generate(ids, do_sample=False, max_new_tokens=...)``: plain greedy decoding.
    Batched: one call on the batch, left-padded, with an attention mask. Arrivals: static
    batching (the requests that have arrived, up to ``arrivals.max_batch``, run as one such
    call while later arrivals wait for it to finish)."""

    name: Literal["hf_generate"] = "hf_generate"


class HFGenerateUnpacked(_Model):
    """``hf_generate`` with the model's linear layers on plain kernels (``F.linear``) however
    ``prepack`` packed them: ``model.generate`` as the model runs when loaded by plain
    transformers, the speed a user gets without accel."""

    name: Literal["hf_generate_unpacked"] = "hf_generate_unpacked"


class HFGenerateBatch(_Model):
    """transformers' continuous batching: ``model.generate_batch`` on a batch, and the manager
    of ``model.init_continuous_batching`` (``add_request`` as requests arrive) for arrivals. A
    paged KV cache sized to the workload; the model's attention implementation is restored
    afterwards."""

    name: Literal["hf_generate_batch"] = "hf_generate_batch"
    max_batch_tokens: int = Field(2048, gt=0)
    """``ContinuousBatchingConfig.max_batch_tokens``: tokens in one forward at most (longer
    prefills are split). Without flash attention one forward attends over the concatenation
    of every request in it (with a block mask), so on CPU a small value keeps several long
    prompts out of one forward."""
    page_size: int = Field(256, ge=4)
    """``ContinuousBatchingConfig.page_size``: tokens per cache page."""


class HFPromptLookup(_Model):
    """``model.generate(..., prompt_lookup_num_tokens=num_tokens)``: transformers' prompt lookup."""

    name: Literal["hf_prompt_lookup"] = "hf_prompt_lookup"
    num_tokens: int = Field(10, gt=0)
    """``prompt_lookup_num_tokens``: draft length."""
    max_ngram: int = Field(2, gt=0)
    """``max_matching_ngram_size``: longest n-gram matched."""


class HFAssisted(_Model):
    """``model.generate(..., assistant_model=DRAFT, num_assistant_tokens=num_tokens)``:
    transformers' assisted generation with a draft model of the same tokenizer."""

    name: Literal["hf_assisted"] = "hf_assisted"
    model: str
    """The draft model: a name or path for ``accel.load_model`` (e.g.
    ``qwen2.5-coder-0.5b-instruct``), loaded in the experiment's dtype on its device."""
    num_tokens: int = Field(5, gt=0)
    """``num_assistant_tokens``: draft length."""
    schedule: Literal["constant", "heuristic"] = "constant"
    """``num_assistant_tokens_schedule``: ``constant`` drafts ``num_tokens`` every step, like
    accel's ``draft_model``; ``heuristic`` grows and shrinks the length with acceptance."""
    confidence_threshold: float = Field(0.0, ge=0, lt=1)
    """``assistant_confidence_threshold``: stop drafting below this draft probability (0: never;
    transformers' own default is 0.4)."""


class KVPressSnapKV(_Model):
    """kvpress's SnapKVPress around ``model.generate``, keeping ``budget`` prompt entries per
    head (only if the optional ``kvpress`` package imports with this transformers)."""

    name: Literal["kvpress_snapkv"] = "kvpress_snapkv"
    budget: int = Field(1024, gt=0)
    """Prompt entries kept per KV head (converted to kvpress's ``compression_ratio``)."""
    window: int = Field(64, gt=0)
    """kvpress ``window_size``."""
    kernel: int = Field(5, gt=0)
    """kvpress ``kernel_size``."""


Baseline = Annotated[Union[HFGenerate, HFGenerateUnpacked, HFPromptLookup, HFAssisted, HFGenerateBatch, KVPressSnapKV],
                     Field(discriminator="name")]
BASELINE_NAMES = ("hf_generate", "hf_generate_unpacked", "hf_prompt_lookup", "hf_assisted", "hf_generate_batch",
                  "kvpress_snapkv")


# --------------------------------------------------------------------------- experiment


def precision_name(value: Any) -> str:
    """The canonical name of a precision: a dtype (``float32``, ``bfloat16``, ``float16``, or
    an alias such as ``bf16``) or a weight quantization (``int8``, ``int4``,
    ``int4:lm_head=true``). Raises ValueError naming the choices."""
    if not isinstance(value, str):
        raise ValueError(f"a precision is a name, got {type(value).__name__}")
    try:
        return dtype_name(value)
    except ValueError:
        pass
    try:
        name = quantize_name(value)
    except ValueError:
        name = None
    if name is None:
        raise ValueError(f"unknown precision {value!r}; choose a dtype ({', '.join(DTYPES)}) or a quantization "
                         "(int8, int4, e.g. int4:lm_head=true)")
    return name


PrecisionName = Annotated[str, BeforeValidator(precision_name)]



class Generation(_Model):
    """Generation settings shared by every configuration (greedy unless ``temperature`` > 0)."""

    max_new_tokens: int = Field(64, gt=0)
    """Tokens generated per item at most (all configurations stop at the model's eos too)."""
    max_draft_tokens: int | None = Field(None, gt=0)
    """accel runs: the most draft nodes a row verifies in one pass (None: no limit but the
    engine's; the measured cost table sizes each step, ``accel.engine.draft_budgets``)."""
    prefill_chunk: int | None = Field(None, gt=0)
    """accel runs: prompt tokens per prefill forward (None: the whole prompt in one), so
    activation memory follows the chunk; the output is that of one forward (``accel.steps.prefill``)."""
    share_prefill: bool = False
    """accel runs start from one uncompressed prefill of each item's prompt (or a batch's
    distinct prompts: ``accel.steps.reusing_prefills``), made before the item's (group's)
    configurations run and reported in a row of its own (``mode: prefill``: seconds, peak RSS), each configuration's
    compressor selecting from it as after a chunked prefill: a grid of compressors and
    drafters over a long prompt costs one prefill per item instead of one per configuration.
    The configurations' ``prefill_s`` is then their own copy and selection only."""
    one_forward_items: int = Field(0, ge=0)
    """With ``share_prefill`` and ``prefill_chunk``: the first this many items are also
    prefilled in one forward (its own prefill row), and every accel configuration runs on them
    again from that prefill, as item ``<id>/one_forward``: the chunk's time, memory and
    answers beside one forward's."""
    system: str | None = None
    """Optional system message for the chat template (default: the template's own)."""
    temperature: float = Field(0.0, ge=0)
    """0: greedy. Above 0: every configuration samples (``do_sample=True`` for the baselines),
    seeded per item and repeat from the experiment's ``seed``; outputs are then not compared
    token by token (lossless sampling keeps the distribution, not the tokens: its check is
    the engine-level distribution test). One request at a time only."""
    top_p: float | None = Field(None, gt=0, le=1)
    """Nucleus sampling with ``temperature`` > 0 (None: off)."""


class Arrivals(_Model):
    """Requests arriving over time: a client thread submits ``requests`` prompts of one task,
    ``interval_s`` apart, to a service. accel runs: ``accel.Engine(max_batch=...)``;
    ``hf_generate_batch``: the continuous-batching manager's ``add_request``; ``hf_generate``:
    static batches (see :class:`HFGenerate`). Latency and time to first token count from each
    request's submit; throughput is every token over first submit to last completion."""

    requests: int = Field(16, gt=0)
    """How many requests (the task's items in order, cycled if it has fewer)."""
    interval_s: float = Field(0.25, ge=0)
    """Seconds between consecutive submits (0: all at once)."""
    max_batch: int | None = Field(None, gt=0)
    """Requests decoded together at most (default: ``requests``)."""
    task: str | None = None
    """The task whose items are the requests (default: the first task)."""


class Experiment(_Model):
    """One experiment: a grid of configurations x task items x repeats."""

    name: str | None = None
    """Experiment name (default: the file's stem)."""
    description: str = ""
    """Free text, copied into summary.md."""
    model: str = "default"
    """``default`` (SmolLM2-135M-Instruct), a local checkpoint folder, a .gguf file, or a hub
    id already in the local Hugging Face cache (nothing is downloaded)."""
    dtype: DtypeName = "float32"
    """Model weights and KV cache dtype: ``float32``, ``bfloat16`` (``bf16``) or ``float16`` (``fp16``).
    With ``quantize``: the dtype the checkpoint is loaded in before its linear weights are
    quantized (the quantized model computes in bfloat16)."""
    quantize: QuantizeSpec = None
    """Weight-only quantization of the model's linear layers (``accel.kernels.lowbit``):
    ``int8``, ``int4``, with options as in ``int4:group_size=64,lm_head=true`` or a mapping of
    them, or null (default: none). Baselines run on the same quantized model."""
    precisions: list[PrecisionName] = Field(default_factory=list)
    """Compare precisions in one run: each a dtype (``float32``, ``bfloat16``, ``float16``) or a
    quantization (``int8``, ``int4``, ``int4:lm_head=true``; loaded from ``dtype``), one model
    loaded per entry. Every baseline and run then runs on each, named ``NAME@PRECISION``
    (``accel_plain@int4``; ``reference`` names one of those). Empty (default): the one model
    of ``dtype`` and ``quantize``."""
    prepack: bool | Literal["auto"] = "auto"
    """Pack float32 linear weights for oneDNN once (``accel.kernels.cpu.prepack``; CPU only): true,
    false, or ``auto`` (where this machine's calibration measured packed kernels faster). The
    baselines run on the same model, so they get the same kernels."""
    compile: Literal["auto", "on", "off"] = "off"
    """accel's decode and verify steps as one compiled graph (``accel.kernels.compiled``): ``on``,
    ``auto`` (where it covers the architecture) or ``off`` (default). Baselines run transformers'
    own forward either way; compiling happens in the warm-up, not in the timed runs."""
    device: str = "cpu"
    """torch device, e.g. ``cpu`` or ``cuda:0``."""
    threads: int | None = Field(None, gt=0)
    """torch intra-op threads (default: torch's choice)."""
    tasks: list[Task] = Field(min_length=1)
    """What to generate for: needle, long_doc, chat and code_file tasks."""
    runs: dict[str, list[Any]] = Field(default_factory=dict)
    """Named accel configurations: each a list of strategy specs (``"snapkv:budget=512"`` or
    ``{name: snapkv, budget: 512}``), ``[]`` for accel's plain decoding."""
    baselines: list[Baseline] = Field(default_factory=lambda: [HFGenerate()])
    """HF reference configurations: ``hf_generate``, ``hf_prompt_lookup``, ``hf_assisted``,
    ``kvpress_snapkv``."""
    reference: str = "hf_generate"
    """The configuration every speed-up is a ratio to (a baseline or run name)."""
    generation: Generation = Field(default_factory=Generation)
    """Generation settings."""
    repeats: int = Field(1, gt=0)
    """Timed passes over the whole grid."""
    batch_sizes: list[Annotated[int, Field(gt=0)]] = Field(default_factory=lambda: [1], min_length=1)
    """Rows decoded together. ``[1]``: one item per call (the per-item grid). Otherwise, for
    each size B, the items of each task are grouped into batches of B consecutive items (a
    task's items cycled to fill the last batch, or a batch bigger than the task), and every
    configuration runs each group in one batched call (B = 1 included)."""
    arrivals: Arrivals | None = None
    """Also run the requests-arriving-over-time scenario (None: not run)."""
    warmup_tokens: int = Field(16, ge=0)
    """Untimed warm-up of every configuration on the first item (its prompt's last 256
    tokens), generating this many tokens (0: no warm-up)."""
    seed: int = 0
    """Seeds task generation (haystacks, pass keys, documents) and torch."""
    output: str | None = None
    """Output folder (default ``runs/<name>``); ``accel bench --out`` overrides it."""

    @field_validator("baselines", mode="before")
    @classmethod
    def _names_to_mappings(cls, value: Any) -> Any:
        if isinstance(value, list):
            return [{"name": v} if isinstance(v, str) else v for v in value]
        return value

    @field_validator("device")
    @classmethod
    def _valid_device(cls, value: str) -> str:
        import torch

        try:
            torch.device(value)
        except (RuntimeError, TypeError) as err:
            raise ValueError(f"not a torch device: {err}") from None
        return value

    @model_validator(mode="after")
    def _names(self) -> "Experiment":
        problems = []
        for run in self.runs:
            if not _NAME.match(run):
                problems.append(f"runs.{run}: names use letters, digits and _ . + - only")
            if run in BASELINE_NAMES:
                problems.append(f"runs.{run}: {run!r} is a baseline name; pick another run name")
        seen: set[str] = set()
        for b in self.baselines:
            if b.name in seen:
                problems.append(f"baselines: {b.name} is listed twice")
            seen.add(b.name)
        names = [t.name or t.kind for t in self.tasks]
        for n in sorted({n for n in names if names.count(n) > 1}):
            problems.append(f"tasks: two tasks are named {n!r}; give them distinct `name`s")
        for b in sorted({b for b in self.batch_sizes if self.batch_sizes.count(b) > 1}):
            problems.append(f"batch_sizes: {b} is listed twice")
        if self.arrivals is not None and self.arrivals.task is not None and self.arrivals.task not in names:
            problems.append(f"arrivals.task: {self.arrivals.task!r} is not a task (have: {', '.join(names)})")
        if self.generation.temperature > 0 and (self.batch_sizes != [1] or self.arrivals is not None):
            problems.append("generation.temperature: sampled runs are measured one request at a time; "
                            "leave batch_sizes at [1] and arrivals unset")
        if self.generation.share_prefill and (self.arrivals is not None or self.precisions):
            problems.append("generation.share_prefill: shared prefills run in the grid of one model; "
                            "leave arrivals and precisions unset")
        if self.generation.one_forward_items and not (self.generation.share_prefill and self.generation.prefill_chunk
                                                      and self.batch_sizes == [1]):
            problems.append("generation.one_forward_items: compares a chunked shared prefill with one forward in "
                            "the per-item grid; needs generation.share_prefill, generation.prefill_chunk and "
                            "batch_sizes [1]")
        if self.generation.top_p is not None and self.generation.temperature == 0:
            problems.append("generation.top_p: needs generation.temperature > 0")
        for p in sorted({p for p in self.precisions if self.precisions.count(p) > 1}):
            problems.append(f"precisions: {p} is listed twice")
        if self.precisions and self.quantize is not None:
            problems.append("quantize: with precisions, name the quantizations there (precisions: [float32, int4])")
        if self.reference not in self.configuration_names():
            problems.append(
                f"reference: {self.reference!r} is neither a baseline nor a run "
                f"(have: {', '.join(self.configuration_names()) or 'none'})"
            )
        if problems:
            raise ValueError("\n".join(problems))
        return self

    def configuration_names(self) -> list[str]:
        """Baselines first, then runs, in file order; with ``precisions``, each once per
        precision (``NAME@PRECISION``), precision by precision."""
        names = [b.name for b in self.baselines] + list(self.runs)
        if not self.precisions:
            return names
        return [f"{n}@{p}" for p in self.precisions for n in names]

    @property
    def precision(self) -> str:
        """The precision of the one model (no ``precisions``): the quantization's name, else
        the dtype."""
        return str(self.quantize) if self.quantize is not None else self.dtype

    def task_name(self, index: int) -> str:
        task = self.tasks[index]
        return task.name or task.kind

    @property
    def batched(self) -> bool:
        """True when the grid runs batches (``batch_sizes`` other than ``[1]``)."""
        return self.batch_sizes != [1]
