"""``accel serve``: load a model, start an :class:`accel.Engine` and serve it over the
OpenAI-compatible HTTP app of :mod:`.app` with uvicorn (flags in :mod:`accel.cli`)."""

from __future__ import annotations

import logging
from typing import Any

from ..strategy import build_strategies
from .app import DEFAULT_MAX_TOKENS, create_app

__all__ = ["create_app", "run_cli", "served_name"]

log = logging.getLogger(__name__)


def served_name(spec: str) -> str:
    """The model id clients send for a ``--model`` spec: the default model's name, a GGUF file's stem,
    a folder's name, else the spec itself."""
    from pathlib import Path

    from ..models import DEFAULT_MODEL_NAME

    if spec == "default":
        return DEFAULT_MODEL_NAME
    path = Path(spec)
    return path.stem if path.suffix.lower() == ".gguf" else (path.name if path.exists() else spec)


def warm_up(engine, tokenizer) -> float:
    """Compile the steps a server runs before it listens: a request alone, then two together
    (one token per row and, with drafters, trees). Returns the seconds it took."""
    import time

    import torch

    start = time.perf_counter()
    log.info("compiling the decode steps (the first start takes minutes; Inductor's cache makes later ones faster)")
    ids = (tokenizer("Warm-up: count from one to ten.", return_tensors="pt").input_ids[0] if tokenizer is not None
           else torch.arange(2, 18))
    engine.submit(ids, max_new_tokens=8).result()
    for handle in [engine.submit(ids[: max(2, len(ids) - k)], max_new_tokens=8) for k in (0, 3)]:
        handle.result()
    seconds = time.perf_counter() - start
    log.info("decode steps compiled in %.1f s", seconds)
    return seconds


def run_cli(args: Any) -> int:
    """``accel serve`` (flags in :mod:`accel.cli`): load the model, start an Engine, serve until interrupted."""
    import uvicorn

    import accel
    from ..models import load_model

    strategies = build_strategies(args.strategy)  # validate before loading the model
    if args.max_batch <= 0:
        raise ValueError(f"--max-batch must be > 0, got {args.max_batch}")
    max_tokens = DEFAULT_MAX_TOKENS if args.max_tokens is None else args.max_tokens
    if max_tokens <= 0:
        raise ValueError(f"--max-tokens must be > 0, got {max_tokens}")
    from .service import DEFAULT_PREFIX_CACHE_MB

    prefix_mb = DEFAULT_PREFIX_CACHE_MB if args.prefix_cache_mb is None else args.prefix_cache_mb
    if not 0 <= prefix_mb < float("inf"):
        raise ValueError(f"--prefix-cache-mb must be >= 0, got {prefix_mb}")
    if args.prefill_chunk is not None and args.prefill_chunk < 1:
        raise ValueError(f"--prefill-chunk must be >= 1, got {args.prefill_chunk}")
    compile_mode = getattr(args, "compile", "off")
    model, tokenizer = load_model(args.model, dtype=args.dtype, quantize=getattr(args, "quantize", None),
                                  compile=compile_mode)
    if tokenizer is None:
        log.warning("%s has no tokenizer: only /v1/completions with token ids will work", args.model)
    context = int(getattr(model.config, "max_position_embeddings", 0) or 0)
    if context <= 0:
        raise ValueError(f"{args.model}: its config has no max_position_embeddings")
    name = args.model_name or served_name(args.model)
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning("binding %s: the server has no authentication", args.host)
    with accel.Engine(model, strategies=strategies, max_batch=args.max_batch, tokenizer=tokenizer,
                      prefix_cache_mb=prefix_mb, prefill_chunk=args.prefill_chunk) as engine:
        if compile_mode != "off":
            warm_up(engine, tokenizer)
        app = create_app(engine, tokenizer, model_id=name, context_length=context,
                         vocab_size=getattr(model.config, "vocab_size", None),
                         aliases=tuple({"default", args.model} - {name}), default_max_tokens=max_tokens)
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
