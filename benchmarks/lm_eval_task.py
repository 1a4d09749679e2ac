"""Write a small multiple-choice task for lm-evaluation-harness, built here (nothing downloaded),
and print the command that scores ``accel serve`` on it with lm-eval's ``local-completions``.

The task (``accel_arith``): "Question: What is 7 plus 5?\\nAnswer:" with four numeric choices,
scored by log-likelihood (lm-eval sends each context + choice with ``echo``, ``logprobs=1``,
``max_tokens`` 1 or 0, and reads the choice tokens' prompt log-probabilities).

    python benchmarks/lm_eval_task.py --out /tmp/accel_task --n 200
    accel serve --port 8000 &            # or with --strategy snapkv:budget=1024, --quantize int4
    lm_eval --model local-completions --tasks accel_arith --include_path /tmp/accel_task \\
        --model_args model=default,base_url=http://127.0.0.1:8000/v1/completions,tokenizer=<printed>,...

Note: a log-likelihood task scores prompt tokens only, which come from the prefill before any
compression, so a prompt compressor (SnapKV) cannot change its scores; weight quantization can.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

_OPS = (("plus", lambda a, b: a + b), ("minus", lambda a, b: a - b), ("times", lambda a, b: a * b))


def questions(n: int, seed: int = 0) -> list[dict]:
    """``n`` arithmetic questions with four distinct choices each, the answer's index in ``answer``."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        name, op = rng.choice(_OPS)
        a, b = rng.randint(2, 12), rng.randint(1, 9)
        if name == "minus" and b > a:
            a, b = b, a
        right = op(a, b)
        wrong: set[int] = set()
        while len(wrong) < 3:
            w = right + rng.choice((-3, -2, -1, 1, 2, 3, 10, -10))
            if w >= 0 and w != right:
                wrong.add(w)
        choices = [right, *sorted(wrong)]
        rng.shuffle(choices)
        out.append({"question": f"Question: What is {a} {name} {b}?\nAnswer:",
                    "choices": [f" {c}" for c in choices], "answer": choices.index(right)})
    return out


def write_task(out: Path, n: int, seed: int) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    data = out / "accel_arith.jsonl"
    data.write_text("".join(json.dumps(q) + "\n" for q in questions(n, seed)))
    (out / "accel_arith.yaml").write_text(
        "task: accel_arith\n"
        "dataset_path: json\n"
        "dataset_kwargs:\n"
        f"  data_files:\n    test: {json.dumps(str(data.resolve()))}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\n'
        'doc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{answer}}"\n'
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
    )
    return data


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for the task's YAML and data")
    ap.add_argument("--n", type=int, default=200, help="questions (default 200)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--port", type=int, default=8000)
    args = ap.parse_args()
    data = write_task(args.out, args.n, args.seed)
    from accel.models import default_checkpoint_dir

    print(f"wrote {args.n} questions to {data}")
    print("score a running `accel serve` with:")
    print(f"lm_eval --model local-completions --tasks accel_arith --include_path {args.out.resolve()} "
          f"--model_args model=default,base_url=http://127.0.0.1:{args.port}/v1/completions,"
          f"tokenizer={default_checkpoint_dir()},tokenized_requests=True,num_concurrent=1,max_retries=1")


if __name__ == "__main__":
    main()
