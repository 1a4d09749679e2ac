"""The compiled step (accel.kernels.compiled) on a CUDA GPU or this CPU: exactness and speed against
accel's eager step and transformers' ``generate``, on a random model of the default model's
shape (SmolLM2-135M: the weights do not change the speed of plain decoding; no weights need
to travel to the GPU machine). bf16, greedy; one row and a batch of 8; prompts of 128 tokens.

    python benchmarks/compiled_step.py [--new 64] [--out FILE.jsonl]
    python benchmarks/compiled_step.py --device cpu --model default --batches 1 8

Prints per configuration: tokens per second (decode, prefill included), compile time of the
first call, and whether greedy prompt lookup on the compiled step equals plain compiled
decoding token for token.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from accel.bench.measurement import cpu_model
import accel
from accel.kernels import compiled
from speculative import PromptLookup

SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                    rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _timed(device, fn):
    _sync(device)
    t = time.perf_counter()
    out = fn()
    _sync(device)
    return out, time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", default=None)
    ap.add_argument("--model", default=None, help="a model accel.load_model knows (default: random weights of "
                    "SmolLM2-135M's shape)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.model:
        model, _ = accel.load_model(args.model, dtype=dtype, device=device, prepack=False)
    else:
        model = LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M, attn_implementation="sdpa")).to(device, dtype).eval()
    gen = torch.Generator().manual_seed(1)
    base = torch.randint(2, 49152, (32,), generator=gen)
    prompts = torch.stack([base.roll(i).repeat(4) for i in range(8)]).to(device)  # 128 tokens, repetitive
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else cpu_model()
    rows = []

    def record(**row):
        row.update(device=name, dtype=args.dtype, new_tokens=args.new)
        rows.append(row)
        print(json.dumps(row), flush=True)

    for batch in args.batches:
        ids = prompts[:batch]
        model.generation_config.pad_token_id = 0
        hf = lambda: model.generate(ids, max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False)  # noqa: E731
        _timed(device, hf)
        _, secs = _timed(device, hf)
        record(config="hf_generate", batch=batch, tok_s=batch * args.new / secs)
        compiled.disable(model)
        plain = lambda s=(): accel.generate(model, ids, max_new_tokens=args.new, strategies=list(s), eos_token_id=[])  # noqa: E731
        _timed(device, plain)
        eager, secs = _timed(device, plain)
        record(config="accel_eager", batch=batch, tok_s=batch * args.new / secs)
        step = compiled.enable(model, "on")
        first, compile_s = _timed(device, plain)
        out, secs = _timed(device, plain)
        record(config="accel_compiled", batch=batch, tok_s=batch * args.new / secs, first_call_s=compile_s,
               failure=step.failure, equals_eager=bool(torch.equal(out.sequences, eager.sequences)))
        _timed(device, lambda: plain([PromptLookup()]))
        drafted, secs = _timed(device, lambda: plain([PromptLookup()]))
        record(config="accel_compiled+prompt_lookup", batch=batch, tok_s=batch * args.new / secs,
               exact_vs_compiled_plain=bool(torch.equal(drafted.sequences, out.sequences)))
        compiled.disable(model)
    if args.out:
        with open(args.out, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    main()
