"""The ``accel`` command line: ``accel generate``, ``accel bench``, ``accel train-heads``, ``accel train-eagle``, ``accel train-pass``,
``accel calibrate``, ``accel serve``."""

from __future__ import annotations

import argparse
import sys

from accel.dtypes import dtype_arg
from accel.kernels.lowbit import quantize_arg

__all__ = ["main"]

_COMPILE_HELP = ("run decode and verify steps as one compiled graph (accel.kernels.compiled): on, auto (where it "
                 "covers the architecture) or off (default)")


def _generate(args: argparse.Namespace) -> int:
    import accel
    from accel.models import chat_ids, load_model

    from accel.runahead import check_prefill_ranks

    strategies = accel.build_strategies(args.strategy)  # validate before loading the model
    check_prefill_ranks(args.prefill_ranks)
    model, tokenizer = load_model(args.model, dtype=args.dtype, quantize=args.quantize, compile=args.compile)
    if args.raw:
        ids = tokenizer(args.prompt, return_tensors="pt").input_ids
    else:
        ids = chat_ids(tokenizer, args.prompt)
    result = accel.generate(
        model,
        ids,
        strategies=strategies,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        tokenizer=tokenizer,
        seed=args.seed,
        prefill_ranks=args.prefill_ranks,
    )
    print(result.text[0].strip())
    names = ", ".join(s.name for s in strategies) or "plain decoding"
    print(f"[{names}] {result.stats.summary()}", file=sys.stderr)
    return 0


def _bench(args: argparse.Namespace) -> int:
    from accel.bench import run_cli

    return run_cli(args)


def _train_heads(args: argparse.Namespace) -> int:
    from speculative.train import run_cli

    return run_cli(args)


def _train_eagle(args: argparse.Namespace) -> int:
    from speculative.eagle.train import run_cli

    return run_cli(args)


def _train_pass(args: argparse.Namespace) -> int:
    from speculative.lookahead.train import run_cli

    return run_cli(args)


def _calibrate(args: argparse.Namespace) -> int:
    import torch
    from rich.console import Console
    from rich.table import Table

    from accel.calibration.calibrate import calibration_enabled, calibration_key, calibration_path, cost_table
    from accel.models import load_model

    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    model, _ = load_model(args.model, dtype=args.dtype, device=args.device, prepack=False, quantize=args.quantize)
    table = cost_table(model, force=args.force)
    key = calibration_key(model)
    console = Console()
    unit = "ms" if table.measured else "nominal units"
    grid = Table(title=f"one verify pass ({unit}), {table.kernels} kernels: query tokens x cached entries")
    grid.add_column("cached", justify="right")
    for t in table.tokens:
        grid.add_column(str(t), justify="right")
    for c, row in zip(table.cache_lens, table.ms):
        grid.add_row(str(c), *(f"{x:.1f}" for x in row))
    console.print(grid)
    if table.kernel_ms:
        kern = Table(title=f"linear kernels compared ({unit})")
        kern.add_column("cached", justify="right")
        kern.add_column("tokens", justify="right")
        for name in table.kernel_ms:
            kern.add_column(name, justify="right")
        for ci, c in enumerate(table.cache_lens):
            for ti, t in enumerate(table.kernel_tokens):
                kern.add_row(str(c), str(t), *(f"{g[ci][ti]:.1f}" for g in table.kernel_ms.values()))
        console.print(kern)
    if table.batch_ms:
        batch = Table(title=f"batch passes ({unit}), {table.batch_cache} cached entries per row: rows x tokens per row "
                            "(in brackets: x the one-row pass of as many tokens)")
        batch.add_column("rows", justify="right")
        for t in table.batch_tokens:
            batch.add_column(str(t), justify="right")
        for r, row in zip(table.batch_rows, table.batch_ms):
            batch.add_row(str(r), *(f"{x:.1f} ({table.batch_factor(r, t):.2f}x)" for t, x in zip(table.batch_tokens, row)))
        console.print(batch)
    machine = key["machine"]
    quant = f" with {key['quantize']['scheme']} weights" if key.get("quantize") else ""
    console.print(f"model {args.model} ({key['model']['class']}), {key['device']['type']} {key['dtype']}{quant}, "
                  f"{key['threads']} threads, {machine['cpu']} ({machine['cores']} cores), torch {machine['torch']}")
    console.print(f"transposed weights: {table.transposed}, prefer_prepack: {table.prefer_prepack} "
                  f"(linear kernels: {table.kernels})")
    if table.load is not None and table.load > (machine["cores"] or 1):
        console.print(f"[yellow]warning: the load average was {table.load:.1f} on {machine['cores']} cores while "
                      f"measuring; the timings are disturbed (rerun with --force on a quieter machine)[/yellow]")
    if calibration_enabled():
        console.print(f"cached at {calibration_path(key)} (the measurement took {table.seconds:.1f} s)")
    else:
        console.print("ACCEL_CALIBRATION=off: static defaults (not measured, not cached)")
    return 0


def _serve(args: argparse.Namespace) -> int:
    if args.ray:
        from accel.serving.ray_serve import run_cli
    else:
        from accel.serving.serve import run_cli

    return run_cli(args)


_QUANTIZE_HELP = ("weight-only int8 / int4 linear layers, the rest in bfloat16 (quantized from the checkpoint loaded "
                  "in --dtype): int8, int4, or with options, e.g. int4:group_size=64,lm_head=true; none (default)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="accel",
        description="Faster, leaner generation for Hugging Face causal LMs: SnapKV prompt compression "
        "and speculative decoding on one shared KV cache.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    g = sub.add_parser("generate", help="generate an answer to one prompt and print stats")
    g.add_argument("prompt", help="the user message (wrapped in the model's chat template unless --raw)")
    g.add_argument("--model", default="default", help="'default' (SmolLM2-135M-Instruct), a local folder or a .gguf file")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--strategy", action="append", default=[], metavar="NAME[:key=val,...]",
                   help="e.g. snapkv:budget=512 or prompt_lookup:num_tokens=8 (repeatable)")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--raw", action="store_true", help="feed the prompt as plain text, without the chat template")
    g.add_argument("--dtype", type=dtype_arg, default="float32",
                   help="weights and KV cache dtype (greedy drafting stays exact in each; see accel.kernels.invariance)")
    g.add_argument("--quantize", type=quantize_arg, default=None, help=_QUANTIZE_HELP)
    g.add_argument("--compile", choices=("auto", "on", "off"), default="off", help=_COMPILE_HELP)
    g.add_argument("--prefill-ranks", type=int, default=None, metavar="N",
                   help="run the prompt's prefill over N processes, each on its share of the threads (KV-Runahead)")
    g.set_defaults(func=_generate)

    b = sub.add_parser("bench", help="run a YAML-configured speed-up experiment")
    b.add_argument("config", help="experiment YAML file (see configs/)")
    b.add_argument("--out", default=None, help="output folder (default: the config's output folder)")
    b.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    b.add_argument("--quantize", type=quantize_arg, default=None,
                   help="the experiment's quantization (as --set quantize=...): " + _QUANTIZE_HELP)
    b.add_argument("--ray", action="store_true", help="run each point of the grid as a Ray task; rerunning an "
                   "interrupted sweep runs only the points not yet written (docs/SCALE.md; pip install 'accel[ray]')")
    b.add_argument("--address", default=None, help="with --ray: the cluster to join (HOST:PORT, ray://HOST:PORT or "
                   "auto; default: $RAY_ADDRESS, else a local cluster)")
    b.set_defaults(func=_bench)

    t = sub.add_parser("train-heads", help="train Medusa draft heads by self-distillation",
                       description="Medusa-1 heads (base model frozen) trained on the model's own greedy answers to "
                       "the shipped prompts. Resumable: rerun the same command to continue. Unset options take the "
                       "defaults of speculative.train.TrainConfig.")
    t.add_argument("--model", default="default")
    t.add_argument("--out", required=True, help="output folder (heads, config, cached data, checkpoint)")
    t.add_argument("--heads", type=int, default=None, help="number of heads, i.e. draft depth (default 3)")
    t.add_argument("--layers", type=int, default=None, help="residual blocks per head (default 1)")
    t.add_argument("--own-lm-head", action="store_true", help="give every head its own output layer (large files)")
    t.add_argument("--distill", action="store_true",
                   help="learn the base model's next-token distribution at every target, not only its greedy token")
    t.add_argument("--independent", action="store_true",
                   help="the Medusa paper's independent heads, which see only the hidden state (default: sequential, "
                        "Hydra-style heads that also read the draft tokens above the node they draft)")
    t.add_argument("--prompts", default=None, help="prompt file, one a line (default: speculative/data/train_prompts.txt)")
    t.add_argument("--max-prompts", type=int, default=None)
    t.add_argument("--self-prompts", type=int, default=None, metavar="N",
                   help="add N user requests the model writes itself (sampled from its chat template; default 0)")
    t.add_argument("--self-prompt-temperature", type=float, default=None, help="sampling temperature for them (default 1.0)")
    t.add_argument("--max-new-tokens", type=int, default=None, help="greedy tokens per prompt (default 192)")
    t.add_argument("--gen-batch-size", type=int, default=None, help="prompts per generate call (default 64)")
    t.add_argument("--epochs", type=float, default=None, help="passes over the data (default 6)")
    t.add_argument("--batch-size", type=int, default=None, help="positions per training step (default 256)")
    t.add_argument("--lr", type=float, default=None, help="peak learning rate (default 1e-3)")
    t.add_argument("--checkpoint-every", type=int, default=None, help="steps between checkpoints (default 50)")
    t.add_argument("--seed", type=int, default=None)
    t.add_argument("--threads", type=int, default=None, help="torch CPU threads (1 is faster on a busy machine)")
    t.add_argument("--data-dtype", choices=("auto", "float32", "bfloat16", "float16"), default=None,
                   help="dtype the model generates the training data in (default auto: bfloat16 where the CPU is fast at it)")
    t.add_argument("--full-vocab", action="store_true", help="train and draft over the whole vocabulary, not only "
                   "the tokens seen in the training data")
    t.add_argument("--no-bf16", action="store_true", help="keep the vocabulary projection in float32")
    t.add_argument("--save-dtype", choices=("float32", "bfloat16", "float16"), default=None)
    t.add_argument("--restart", action="store_true", help="discard cached data and checkpoints in --out")
    t.set_defaults(func=_train_heads, parser=t)

    e = sub.add_parser("train-eagle", help="train an EAGLE-3 draft layer by self-distillation",
                       description="An EAGLE-3 draft (target frozen) trained on the model's own greedy answers to the "
                       "shipped prompts, with training-time test; saved in the EAGLE-3 format. Resumable: rerun the "
                       "same command to continue. Unset options take the defaults of "
                       "speculative.eagle.train.EagleTrainConfig.")
    e.add_argument("--model", default="default")
    e.add_argument("--out", required=True, help="output folder (draft, cached answers, checkpoint)")
    e.add_argument("--prompts", default=None, help="prompt file, one a line (default: speculative/data/train_prompts.txt)")
    e.add_argument("--max-prompts", type=int, default=None)
    e.add_argument("--max-new-tokens", type=int, default=None, help="greedy tokens per prompt (default 192)")
    e.add_argument("--gen-batch-size", type=int, default=None, help="prompts answered together (default 32)")
    e.add_argument("--draft-vocab", type=int, default=None, help="tokens the draft predicts (default 8192)")
    e.add_argument("--ttt-steps", type=int, default=None, help="unrolled steps of training-time test (default 3)")
    e.add_argument("--max-len", type=int, default=None, help="tokens per training sequence at most (default 384)")
    e.add_argument("--batch-size", type=int, default=None, help="sequences per step (default 4)")
    e.add_argument("--epochs", type=float, default=None, help="passes over the data (default 2)")
    e.add_argument("--lr", type=float, default=None, help="peak learning rate (default 3e-4)")
    e.add_argument("--checkpoint-every", type=int, default=None, help="steps between checkpoints (default 50)")
    e.add_argument("--seed", type=int, default=None)
    e.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    e.add_argument("--save-dtype", choices=("float32", "bfloat16", "float16"), default=None)
    e.add_argument("--init", choices=("target", "frozen", "random"), default=None,
                   help="target (default): start from the target's own head and final norm; frozen: the same, "
                        "kept fixed while the rest learns; random: a random start")
    e.add_argument("--restart", action="store_true", help="discard cached answers and checkpoints in --out")
    e.set_defaults(func=_train_eagle, parser=e)

    p = sub.add_parser("train-pass", help="train PaSS look-ahead embeddings by self-distillation",
                       description="L look-ahead input embeddings (the model frozen) trained on the model's own greedy "
                       "answers to the shipped prompts (cached in OUT/data). Unset options take the defaults of "
                       "speculative.lookahead.train.PassTrainConfig.")
    p.add_argument("--model", default="default")
    p.add_argument("--out", required=True, help="output folder (embeddings, cached answers)")
    p.add_argument("--prompts", default=None, help="prompt file, one a line (default: speculative/data/train_prompts.txt)")
    p.add_argument("--max-prompts", type=int, default=None, help="prompts answered (default 640)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="greedy tokens per prompt (default 192)")
    p.add_argument("--gen-batch-size", type=int, default=None, help="prompts answered together (default 32)")
    p.add_argument("--positions", type=int, default=None, help="look-ahead embeddings L (default 4)")
    p.add_argument("--anchors", type=int, default=None, help="anchor positions per sequence and forward (default 48)")
    p.add_argument("--max-len", type=int, default=None, help="tokens per training sequence at most (default 384)")
    p.add_argument("--batch-size", type=int, default=None, help="sequences per step (default 4)")
    p.add_argument("--epochs", type=float, default=None, help="passes over the data (default 1)")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default 1e-2)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.set_defaults(func=_train_pass, parser=p)

    c = sub.add_parser("calibrate", help="measure verify-pass costs on this machine and cache them",
                       description="Time verify passes of the model (plain, transposed, packed and split linear kernels, a grid of "
                       "query tokens x cached entries) and cache the table that accel's cost-based choices read. "
                       "Runs once per model, device, dtype, threads and machine; later calls read the cache.")
    c.add_argument("--model", default="default", help="'default' (SmolLM2-135M-Instruct), a local folder or a .gguf file")
    c.add_argument("--threads", type=int, default=None, help="torch CPU threads to measure with (default: torch's choice)")
    c.add_argument("--dtype", type=dtype_arg, default="float32")
    c.add_argument("--quantize", type=quantize_arg, default=None, help=_QUANTIZE_HELP)
    c.add_argument("--device", default="cpu")
    c.add_argument("--force", action="store_true", help="measure again even if a cached table exists")
    c.set_defaults(func=_calibrate)

    s = sub.add_parser("serve", help="serve an OpenAI-compatible HTTP API (chat, completions, SSE streaming)",
                       description="OpenAI-compatible server (FastAPI + uvicorn) on an accel Engine: "
                       "/v1/chat/completions, /v1/completions, /v1/models, /health, /metrics. Needs the "
                       "'serve' extra (pip install 'accel[serve]').")
    s.add_argument("--model", default="default", help="'default' (SmolLM2-135M-Instruct), a local folder, a .gguf "
                   "file or a hub id already in the local cache")
    s.add_argument("--strategy", action="append", default=[], metavar="NAME[:key=val,...]",
                   help="the server's strategies, e.g. snapkv:budget=512 (repeatable); a request's 'accel' field "
                   "replaces them")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--max-batch", type=int, default=8, help="requests decoded together (default 8)")
    s.add_argument("--prefix-cache-mb", type=float, default=None, help="MiB of recent prompts' KV entries kept so "
                   "that a prompt starting like an earlier one is prefilled only past the shared tokens "
                   "(float32; default 256, 0: off)")
    s.add_argument("--prefill-chunk", type=int, default=None, metavar="N", help="prefill prompts N tokens per "
                   "forward, so activation memory follows N, not the prompt (default: one forward)")
    s.add_argument("--dtype", type=dtype_arg, default="float32")
    s.add_argument("--quantize", type=quantize_arg, default=None, help=_QUANTIZE_HELP)
    s.add_argument("--compile", choices=("auto", "on", "off"), default="off", help=_COMPILE_HELP + "; the server "
                   "compiles its steps before it starts listening")
    s.add_argument("--max-tokens", type=int, default=None, help="max_tokens of requests that give none (default 256)")
    s.add_argument("--model-name", default=None, help="the model id clients send and /v1/models lists "
                   "(default: from --model)")
    s.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    r = s.add_argument_group("on Ray (docs/SCALE.md; needs the 'ray' extra: pip install 'accel[ray]')")
    r.add_argument("--ray", action="store_true", help="serve from Ray Serve replicas behind one endpoint that "
                   "routes requests sharing a prompt prefix to the same replica")
    r.add_argument("--replicas", type=int, default=None, help="model replicas (default 1)")
    r.add_argument("--autoscale", default=None, metavar="MIN:MAX", help="autoscale between MIN and MAX replicas "
                   "instead of --replicas")
    r.add_argument("--address", default=None, help="Ray cluster to join (HOST:PORT, ray://HOST:PORT or auto; "
                   "default: $RAY_ADDRESS, else a local cluster)")
    r.add_argument("--replica-cpus", type=float, default=1.0, help="CPUs per replica, fractions allowed; torch "
                   "threads per replica = max(1, int(CPUs)) (default 1)")
    r.add_argument("--replica-gpus", type=float, default=0.0, help="GPUs per replica (default 0: CPU)")
    s.set_defaults(func=_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    from accel.strategy import StrategyError

    try:
        return args.func(args)
    except (StrategyError, ValueError, FileNotFoundError) as err:
        print(f"accel {args.command}: error: {err}", file=sys.stderr)
        return 2
    except ImportError as err:
        print(f"accel {args.command}: not available: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
