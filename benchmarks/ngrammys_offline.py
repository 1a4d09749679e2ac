"""N-Grammys' acceptance on held-out chat prompts, replayed offline: no timing, so any machine
(a busy one too) gives the same figures.

    python benchmarks/ngrammys_offline.py --prompts 40 --new 96
    python benchmarks/ngrammys_offline.py --greedy runs/greedy.json --top-k 2 4 8 --budget 4 8 15 30

The default model decodes each prompt greedily once (plain decoding; the outputs are kept in
``--greedy`` and reused when it exists). Then, for every step of each answer, N-Grammys drafts
a tree from the text so far with a budget of ``--budget`` nodes, and the step accepts the
longest path of the tree that the greedy answer follows, plus the bonus token: what the
engine's verify step would accept at that budget. Prints mean tokens per step (bonus
included) for each (top_k, budget). The engine sizes each step's budget from the measured
cost table, so a live run's tokens per step lie between these rows' (benchmarks/drafter_check.py
measures it, and the speed).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import accel  # noqa: E402
from accel.models import chat_ids, load_model  # noqa: E402
from accel.strategy import DraftContext, DraftProposal  # noqa: E402
from speculative import NGrammys  # noqa: E402
from speculative.ngrammys import bigram_table, model_bigrams  # noqa: E402
from speculative.train import held_out_prompts  # noqa: E402


def accepted_depth(prop: DraftProposal | None, truth: list[int]) -> int:
    """How many tokens of ``truth`` a path of the draft tree follows from the root."""
    if prop is None:
        return 0
    tokens, parents = prop.tokens.tolist(), prop.parents.tolist()
    node = depth = 0
    while depth < len(truth):
        child = next((j + 1 for j, (t, p) in enumerate(zip(tokens, parents)) if p == node and t == truth[depth]), None)
        if child is None:
            break
        node, depth = child, depth + 1
    return depth


def tokens_per_step(drafter: NGrammys, state, answers: list[tuple[list[int], int]], budget: int) -> float:
    steps = emitted = 0
    for seq, prompt_len in answers:
        i = prompt_len  # seq[i] is the pending root after the prefill
        while i < len(seq) - 1:
            ctx = DraftContext(tokens=torch.tensor(seq[: i + 1]), hidden=None, max_tokens=budget)
            a = accepted_depth(drafter.propose(state, ctx), seq[i + 1 :])
            steps, emitted, i = steps + 1, emitted + a + 1, i + a + 1
    return emitted / steps


def table_hits(table, answers: list[tuple[list[int], int]], ks=(1, 2, 4, 8)) -> str:
    """How often the answer's next token is among the table row's top k for the current token."""
    pairs = torch.tensor([(seq[i], seq[i + 1]) for seq, n in answers for i in range(n, len(seq) - 1)])
    rows = table.tokens[pairs[:, 0]]
    hit = rows == pairs[:, 1:]
    return ", ".join(f"top-{k} {hit[:, :k].any(-1).float().mean():.1%}" for k in ks if k <= table.top_k)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=40)
    ap.add_argument("--new", type=int, default=96)
    ap.add_argument("--greedy", default=None, help="JSON file of the greedy answers (written if missing)")
    ap.add_argument("--top-k", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--budget", type=int, nargs="+", default=[4, 8, 15, 30])
    args = ap.parse_args()
    model, tok = load_model("default")
    path = Path(args.greedy) if args.greedy else None
    if path is not None and path.exists():
        answers = [tuple(a) for a in json.loads(path.read_text())]
    else:
        answers = []
        for i, prompt in enumerate(held_out_prompts()[: args.prompts]):
            ids = chat_ids(tok, prompt)
            out = accel.generate(model, ids, max_new_tokens=args.new, tokenizer=tok)
            answers.append((out.sequences[0].tolist(), int(ids.shape[1])))
            print(f"greedy answer {i + 1}/{args.prompts}", file=sys.stderr, flush=True)
        if path is not None:
            path.write_text(json.dumps(answers))
    print(f"{len(answers)} held-out chat prompts, up to {args.new} new tokens each (greedy), default model")
    print("the next token among the bigram table's top k of the current token: "
          f"after BOS {table_hits(bigram_table(model, 8, progress=False), answers)}; "
          f"alone (format 1) {table_hits(model_bigrams(model, 8, progress=False, after_bos=False), answers)}")
    for k in args.top_k:
        drafter = NGrammys(top_k=k, num_tokens=max(args.budget))
        state = drafter.start(model, torch.tensor(answers[0][0][:1]))
        cells = [f"budget {b}: {tokens_per_step(drafter, state, answers, b):.2f}" for b in args.budget]
        print(f"top_k={k}: " + " | ".join(cells) + " tokens/step")


if __name__ == "__main__":
    main()
