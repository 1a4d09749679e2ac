"""Medusa heads on the default model: verify cost, acceptance, speed-up, and SnapKV stacking.

Timing ratios are measured in the same run, baseline and Medusa interleaved prompt by
prompt, so a busy machine slows both alike. On a shared CPU, pass ``--threads 1`` (or set
OMP_WAIT_POLICY=PASSIVE): with 2 spinning OpenMP threads and other processes competing for
the cores, a forward pass can get 10x slower at random.

    python benchmarks/medusa_check.py verify-cost            # verify time vs tree size, ~500 / ~4K context
    python benchmarks/medusa_check.py chat                   # held-out chat prompts: accepted/step, tok/s ratio
    python benchmarks/medusa_check.py accuracy               # the heads' accuracies on those prompts' greedy text
    python benchmarks/medusa_check.py snapkv                 # 4K-token document: SnapKV x Medusa
    python benchmarks/medusa_check.py sweep --configs auto:8 dynamic:8 dynamic:10 --prompt-set dev
                                                             # settings side by side, on development prompts
    python benchmarks/medusa_check.py all --threads 1

Options: --heads DIR (default: the shipped heads), --max-nodes N, --tree NAME, --new N.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import accel  # noqa: E402
from accel import adapter  # noqa: E402
from accel.models import chat_ids, load_default  # noqa: E402
from snapkv import SnapKV  # noqa: E402
from speculative import Medusa  # noqa: E402
from speculative.medusa import load_heads  # noqa: E402
from speculative.train import DATA_DIR, held_out_prompts, load_prompts  # noqa: E402

DEV_PROMPTS = DATA_DIR / "dev_prompts.txt"  # for choosing settings; the chat prompts stay a test set


def _medusa(args) -> Medusa:
    kw = {"heads": args.heads}
    if args.max_nodes:
        kw["max_nodes"] = args.max_nodes
    if args.tree:
        kw["tree"] = args.tree
    return Medusa(**kw)


# --------------------------------------------------------------------------- verify cost


def verify_cost(model, args) -> None:
    from accel.cache import SharedCache
    from accel.steps import prefill, verify
    from accel.tree import DraftTree

    geo = adapter.geometry(model)
    sizes = [1, 2, 3, 4, 6, 8, 12, 16, 32, 64]
    gen = torch.Generator().manual_seed(0)
    print(f"verify forward + output logits, median of {args.reps} x 3 (ms); tree = root + N-1 drafts")
    for ctx in (500, 4000):
        prompt = torch.randint(100, 40000, (1, ctx), generator=gen)
        cache = SharedCache(geo.num_layers)
        times: dict[int, list[float]] = {n: [] for n in sizes}
        with torch.inference_mode():
            prefill(model, cache, prompt, None)
            for _ in range(args.reps):
                for n in sizes:  # interleaved, so load changes hit every size alike
                    toks = torch.randint(100, 40000, (n,), generator=gen)
                    parents = torch.tensor([-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)])
                    tree = DraftTree(toks, parents)
                    for _ in range(3):
                        t = time.perf_counter()
                        hidden = verify(model, cache, tree, geo.dtype)
                        adapter.output_logits(model, hidden)
                        times[n].append(time.perf_counter() - t)
                        cache.commit([0])
        base = statistics.median(times[1])
        row = "  ".join(f"{n}:{1000 * statistics.median(times[n]):.0f}ms ({statistics.median(times[n]) / base:.2f}x)" for n in sizes)
        print(f"context {ctx}: {row}", flush=True)

    # the heads' own cost per propose (K heads x vocabulary projection)
    loaded = load_heads(args.heads)
    medusa = _medusa(args)
    h = torch.randn(loaded.hidden_size)
    for dtype in ("float32", "bfloat16"):
        m = medusa.model_copy(update={"head_dtype": dtype})
        state = m.start(model, torch.tensor([1]))
        ctx = accel.strategy.DraftContext(tokens=torch.tensor([1]), hidden=h, max_tokens=64)
        with torch.inference_mode():
            for _ in range(3):
                m.propose(state, ctx)
            ts = []
            for _ in range(20):
                t = time.perf_counter()
                m.propose(state, ctx)
                ts.append(time.perf_counter() - t)
        print(f"propose ({loaded.num_heads} heads, {dtype} projection, {len(state.paths)} nodes): "
              f"{1000 * statistics.median(ts):.1f} ms", flush=True)


# --------------------------------------------------------------------------- chat prompts


@torch.no_grad()
def accuracy(model, tok, args) -> None:
    """Per-head accuracies and the acceptance a tree would get, on the chat prompts' greedy
    continuations (the same measure train-heads reports on its held-out training sequences)."""
    from accel.adapter import default_eos
    from speculative.medusa import MedusaHeads
    from speculative.medusa.trees import build_tree, rank_accuracies
    from speculative.train import Sequences, evaluate_heads, generate_batch, make_examples, simulate_acceptance

    heads = MedusaHeads.from_pretrained(args.heads).eval()
    prompts = held_out_prompts()[: args.prompts]
    toks, states = [], []
    for lo in range(0, len(prompts), 10):
        t, h = generate_batch(model, tok, prompts[lo:lo + 10], args.new, None, default_eos(model, tok))
        toks += t
        states += h
    seqs = Sequences(torch.cat(toks), torch.cat(states), torch.tensor([t.numel() for t in toks]), torch.arange(len(toks)))
    x, y = make_examples(seqs, heads.num_heads)
    lm = model.get_output_embeddings().weight.detach()
    lm = (lm[heads.vocab_subset] if heads.vocab_subset is not None else lm).to(torch.bfloat16)
    embed = model.get_input_embeddings().weight.detach()
    acc = evaluate_heads(heads, x, y, lm, mm_dtype=torch.bfloat16, embed=embed)
    print(f"{len(prompts)} chat prompts, {x.shape[0]} positions, {'sequential' if heads.sequential else 'independent'} heads")
    for k, row in enumerate(acc, 1):
        print(f"  head {k}: top-1 {row[0]:.3f}  top-5 {row[4]:.3f}  top-10 {row[9]:.3f}")
    ranks = rank_accuracies(heads.topk_accuracy or acc)
    for n in (5, 8, 16):
        sim = simulate_acceptance(heads, x, y, lm, build_tree(ranks, n), mm_dtype=torch.bfloat16, embed=embed)
        print(f"  {n}-node tree: {1 + sim:.2f} tokens per step if every position were a step")


def _pair(model, tok, ids, strategies, new) -> tuple[accel.GenerateResult, accel.GenerateResult]:
    return (accel.generate(model, ids, strategies=strategies[0], max_new_tokens=new, tokenizer=tok),
            accel.generate(model, ids, strategies=strategies[1], max_new_tokens=new, tokenizer=tok))


def chat(model, tok, args) -> None:
    medusa = _medusa(args)
    prompts = held_out_prompts()[: args.prompts]
    base_tok = base_s = med_tok = med_s = 0.0
    steps = emitted = 0
    mismatches = 0
    warm = chat_ids(tok, "Hello!")
    accel.generate(model, warm, strategies=[medusa], max_new_tokens=4, tokenizer=tok)
    print(f"{len(prompts)} held-out chat prompts, {args.new} new tokens, {medusa.spec()}")
    for i, p in enumerate(prompts):
        ids = chat_ids(tok, p)
        order = [[], [medusa]] if i % 2 == 0 else [[medusa], []]
        a, b = _pair(model, tok, ids, order, args.new)
        base, med = (a, b) if i % 2 == 0 else (b, a)
        mismatches += int(not torch.equal(base.sequences, med.sequences))
        base_tok += base.stats.decode_tokens
        base_s += base.stats.decode_s
        med_tok += med.stats.decode_tokens
        med_s += med.stats.decode_s
        steps += med.stats.verify_steps
        emitted += med.stats.accepted_tokens + med.stats.verify_steps
        print(f"  [{i:2d}] accepted/step {med.stats.mean_accepted:.2f}  plain {base.stats.decode_tokens_per_s:5.1f} tok/s  "
              f"medusa {med.stats.decode_tokens_per_s:5.1f} tok/s  {p[:50]!r}", flush=True)
    plain_rate, med_rate = base_tok / base_s, med_tok / med_s
    print(f"chat: mean accepted tokens per verify step {emitted / steps:.2f} | decode plain {plain_rate:.1f} tok/s, "
          f"medusa {med_rate:.1f} tok/s, speed-up {med_rate / plain_rate:.2f}x | outputs differing: {mismatches}")


def sweep(model, tok, args) -> None:
    """Plain decoding and Medusa settings (``tree:max_nodes``), interleaved prompt by prompt
    (the order rotates), on the development prompts or the held-out chat prompts: tokens per
    step, decode speed against plain decoding, and drafting time per step."""
    settings = {c: Medusa(heads=args.heads, tree=c.split(":")[0], max_nodes=int(c.split(":")[1]))
                for c in args.configs}
    prompts = (load_prompts(DEV_PROMPTS) if args.prompt_set == "dev" else held_out_prompts())[: args.prompts]
    draft_s = {c: 0.0 for c in settings}
    by_id = {id(m): c for c, m in settings.items()}
    propose = Medusa.propose

    def timed(self, state, ctx):
        t = time.perf_counter()
        out = propose(self, state, ctx)
        draft_s[by_id[id(self)]] += time.perf_counter() - t
        return out

    names = ["plain", *settings]
    totals = {c: [0, 0, 0.0] for c in names}  # tokens, steps, seconds
    warm = chat_ids(tok, "Hello!")
    for m in settings.values():
        accel.generate(model, warm, strategies=[m], max_new_tokens=4, tokenizer=tok)
    print(f"{len(prompts)} {args.prompt_set} prompts, {args.new} new tokens, heads {args.heads}")
    Medusa.propose = timed
    try:
        for i, p in enumerate(prompts):
            ids = chat_ids(tok, p)
            for c in names[i % len(names):] + names[: i % len(names)]:
                out = accel.generate(model, ids, strategies=[settings[c]] if c in settings else [],
                                     max_new_tokens=args.new, tokenizer=tok)
                totals[c][0] += out.stats.decode_tokens
                totals[c][1] += out.stats.verify_steps
                totals[c][2] += out.stats.decode_s
    finally:
        Medusa.propose = propose
    base = totals["plain"][0] / totals["plain"][2]
    print("setting          tokens/step  tok/s  x plain  ms/step  drafting ms/step")
    for c in names:
        t, steps, sec = totals[c]
        draft = f"{1000 * draft_s[c] / steps:16.1f}" if c in settings else f"{'-':>16}"
        print(f"{c:16s} {t / steps:11.2f}  {t / sec:5.1f}  {t / sec / base:6.2f}x  {1000 * sec / steps:7.1f}  {draft}")


# --------------------------------------------------------------------------- SnapKV x Medusa


def _document(tok, target: int, seed: int) -> torch.Tensor:
    try:
        from accel.bench.corpus import make_report

        report = make_report(random.Random(seed), n_sections=target // 40 + 2)
        n = len(report.sections)
        while n > 1:
            ids = chat_ids(tok, f"Read the following report.\n\n{report.text(n)}\n\nSummarise the report in three sentences.")
            if ids.shape[1] <= target:
                return ids
            n -= 1
    except ImportError:
        pass
    rng = random.Random(seed)
    words = ["river", "market", "bridge", "garden", "engine", "report", "budget", "harbour", "school", "train"]
    text = ""
    while len(tok(text).input_ids) < target - 40:
        text += " ".join(rng.choice(words) for _ in range(12)) + ". "
    return chat_ids(tok, f"Read the following text.\n\n{text}\n\nSummarise it in three sentences.")


def snapkv(model, tok, args) -> None:
    medusa = _medusa(args)
    snap = SnapKV(budget=args.budget, window=32, kernel=7)
    configs = {"plain": [], "snapkv": [snap], "medusa": [medusa], "snapkv+medusa": [snap, medusa]}
    totals = {k: [0.0, 0.0, 0, 0] for k in configs}  # decode tokens, decode s, steps, emitted
    for d in range(args.docs):
        ids = _document(tok, args.doc_tokens, seed=d)
        names = list(configs)
        if d % 2:
            names.reverse()
        outs = {}
        for name in names:
            r = accel.generate(model, ids, strategies=configs[name], max_new_tokens=args.new, tokenizer=tok)
            outs[name] = r
            t = totals[name]
            t[0] += r.stats.decode_tokens
            t[1] += r.stats.decode_s
            t[2] += r.stats.verify_steps
            t[3] += r.stats.accepted_tokens + r.stats.verify_steps
        same = torch.equal(outs["snapkv"].sequences, outs["snapkv+medusa"].sequences) and torch.equal(
            outs["plain"].sequences, outs["medusa"].sequences)
        print(f"  doc {d}: {ids.shape[1]} prompt tokens | " + " | ".join(
            f"{n} {outs[n].stats.decode_tokens_per_s:.1f} tok/s" for n in configs) + f" | exact: {same}", flush=True)
    rate = {k: v[0] / v[1] for k, v in totals.items()}
    acc = {k: v[3] / v[2] for k, v in totals.items()}
    s_snap = rate["snapkv"] / rate["plain"]
    s_med = rate["medusa"] / rate["plain"]
    s_both = rate["snapkv+medusa"] / rate["plain"]
    print(f"snapkv (budget {args.budget}) on ~{args.doc_tokens}-token documents, {args.new} new tokens:")
    print("  decode tok/s: " + ", ".join(f"{k} {v:.1f}" for k, v in rate.items()))
    print(f"  accepted/step: medusa {acc['medusa']:.2f}, snapkv+medusa {acc['snapkv+medusa']:.2f}")
    print(f"  speed-ups vs plain: snapkv {s_snap:.2f}x, medusa {s_med:.2f}x, product {s_snap * s_med:.2f}x, "
          f"measured together {s_both:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["verify-cost", "chat", "accuracy", "snapkv", "sweep", "all"])
    ap.add_argument("--heads", default="default")
    ap.add_argument("--max-nodes", type=int, default=None)
    ap.add_argument("--tree", default=None)
    ap.add_argument("--new", type=int, default=128, help="new tokens per prompt")
    ap.add_argument("--prompts", type=int, default=40, help="chat prompts at most")
    ap.add_argument("--docs", type=int, default=3)
    ap.add_argument("--doc-tokens", type=int, default=4096)
    ap.add_argument("--budget", type=int, default=1024, help="SnapKV budget")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--configs", nargs="+", default=["auto:8", "dynamic:8", "dynamic:10", "dynamic:12"],
                    help="sweep: Medusa settings as TREE:MAX_NODES")
    ap.add_argument("--prompt-set", choices=["dev", "chat"], default="dev", help="sweep: which prompts")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = load_default()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    if args.what in ("verify-cost", "all"):
        verify_cost(model, args)
    if args.what in ("chat", "all"):
        chat(model, tok, args)
    if args.what in ("accuracy", "all"):
        accuracy(model, tok, args)
    if args.what in ("snapkv", "all"):
        snapkv(model, tok, args)
    if args.what == "sweep":
        sweep(model, tok, args)


if __name__ == "__main__":
    main()
