"""The ``accel`` command line: ``accel generate``, ``accel bench``, ``accel train-heads``."""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def _generate(args: argparse.Namespace) -> int:
    import accel
    from accel.models import chat_ids, load_model

    strategies = accel.build_strategies(args.strategy)  # validate before loading the model
    model, tokenizer = load_model(args.model)
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
    g.set_defaults(func=_generate)

    b = sub.add_parser("bench", help="run a YAML-configured speed-up experiment")
    b.add_argument("config", help="experiment YAML file (see configs/)")
    b.add_argument("--out", default=None, help="output folder (default: the config's output folder)")
    b.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    b.set_defaults(func=_bench)

    t = sub.add_parser("train-heads", help="train Medusa draft heads by self-distillation")
    t.add_argument("--model", default="default")
    t.add_argument("--out", required=True)
    t.set_defaults(func=_train_heads, parser=t)
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
