"""An EAGLE draft on the held-out chat prompts: first-draft acceptance, accuracy per depth,
tokens per verify step, exactness and decode speed against plain decoding, same run.

    python benchmarks/eagle_check.py                          # the shipped draft, float32
    python benchmarks/eagle_check.py --draft DIR --dtype bf16 --prompts 10 --new 64
    python benchmarks/eagle_check.py --also medusa:heads=default   # a second drafter beside it

For every prompt, plain decoding and each configuration run one after another, their order
rotating from prompt to prompt, so a machine that drifts slows all alike. Then the draft reads
the target's features over plain decoding's text (one target forward, as training reads them)
and its top-1 at each unrolled depth is compared with the text: depth 1's rate is the
first-draft acceptance of a chain, depth d's the rate given a right path above it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from accel.models import load_model  # noqa: E402
from accel.strategy import build_strategies  # noqa: E402
from speculative import Eagle  # noqa: E402
from speculative.eagle import load_eagle  # noqa: E402
from speculative.eagle.train import target_features, ttt_hits  # noqa: E402
from speculative.train import held_out_prompts  # noqa: E402
from drafter_check import compare, report  # noqa: E402  (this folder)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", default="default", help="EAGLE draft folder (default: the shipped draft)")
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prompts", type=int, default=40, help="held-out chat prompts at most")
    ap.add_argument("--new", type=int, default=128, help="new tokens per prompt")
    ap.add_argument("--depths", type=int, default=4, help="unrolled depths whose accuracy is printed")
    ap.add_argument("--also", action="append", default=[], help="another configuration (comma-separated specs)")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = load_model(args.model, dtype=args.dtype)
    eagle = Eagle(draft=args.draft)
    eagle.check(model)
    names = ["plain", "eagle"] + args.also
    runs = [[], [eagle]] + [build_strategies(s.split(",")) for s in args.also]
    layer = load_eagle(args.draft, torch.float32)
    embed = model.get_input_embeddings().weight.detach().float()
    hits = [[0, 0] for _ in range(args.depths)]
    hits8 = [0, 0]  # depth 1, the right token among the draft's best 8 (what a tree's root can reach)

    def accuracy(ids, results):
        seq = results[0].sequences[0, : ids.shape[1] + results[0].row_stats[0].new_tokens].unsqueeze(0)
        learn = torch.zeros_like(seq, dtype=torch.bool)
        learn[0, ids.shape[1] + 1:] = True  # the first new token is the prefill's, never drafted
        with torch.no_grad():
            feats = target_features(model, seq, [seq.shape[1]], layer.spec.layer_ids)
            for d, (h, n) in enumerate(ttt_hits(layer, embed, feats, seq, learn, args.depths)):
                hits[d][0] += h
                hits[d][1] += n
            h, n = ttt_hits(layer, embed, feats, seq, learn, 1, top_k=8)[0]
            hits8[0] += h
            hits8[1] += n

    prompts = held_out_prompts()[: args.prompts]
    print(f"{len(prompts)} held-out chat prompts, {args.new} new tokens, {args.model} {args.dtype}, "
          f"{torch.get_num_threads()} threads, draft {args.draft}", flush=True)
    tally = compare(model, tok, names, runs, prompts, args.new, after_prompt=accuracy)
    print("draft top-1 accuracy on plain decoding's text, per depth (depth 1 = first-draft acceptance): "
          + ", ".join(f"{d + 1}: {h / n:.3f}" for d, (h, n) in enumerate(hits) if n)
          + f"; depth 1 within the best 8: {hits8[0] / max(hits8[1], 1):.3f}")
    report(names, tally)


if __name__ == "__main__":
    main()
