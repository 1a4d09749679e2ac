#!/usr/bin/env bash
# accel serve against transformers serve --continuous-batching on the same load, in
# alternating rounds (one server at a time, each alone on the machine):
#   bash benchmarks/serve_rounds.sh [ROUNDS] [extra accel serve arguments...]
# Each round starts `accel serve` (port 8011), runs benchmarks/serve_load.py with 16 clients x
# 4 chat requests of 64 tokens, non-streaming, stops it, then does the same with transformers'
# server (port 8012) on the default model's checkpoint, and prints both results, where accel's
# engine spent the run (verify steps, prefills: serve_load.py reads them from /metrics) and the
# ratio, and after several rounds the ratios' geometric mean. A VM's speed drifts over
# minutes, so compare rounds, not single runs. Run it from the repository's virtual
# environment (`make venv`), on an otherwise idle machine.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
rounds="${1:-2}"
shift || true
load=(--clients 16 --requests 4 --max-tokens 64 --no-stream)
folder="$(python -c 'from accel.models import default_checkpoint_dir; print(default_checkpoint_dir())' 2>/dev/null)"
[ -n "$folder" ] || { echo "the default model is not installed (make venv)"; exit 1; }
command -v transformers >/dev/null || { echo "transformers' CLI is not on PATH"; exit 1; }

wait_up() {  # port
  for _ in $(seq 120); do
    curl -s -o /dev/null "http://127.0.0.1:$1/health" && return 0
    sleep 2
  done
  echo "no server on port $1 after 240 s"
  return 1
}

tok_s() {  # the tokens/s figure of a serve_load.py report
  sed -n 's/.*tokens\/s \([0-9.]*\).*/\1/p' | tail -1
}

ratios=()
for round in $(seq "$rounds"); do
  accel serve --port 8011 --max-batch 16 "$@" >/dev/null 2>&1 &
  server=$!
  wait_up 8011 || { kill "$server"; exit 1; }
  a_report="$(python benchmarks/serve_load.py --url http://127.0.0.1:8011 "${load[@]}")"
  kill "$server"; wait "$server" 2>/dev/null

  HF_HUB_OFFLINE=1 transformers serve --continuous-batching --port 8012 --device cpu --dtype float32 \
    "$folder" >/dev/null 2>&1 &
  server=$!
  wait_up 8012 || { kill "$server"; exit 1; }
  t_report="$(python benchmarks/serve_load.py --url http://127.0.0.1:8012 --model "$folder" "${load[@]}")"
  kill "$server"; wait "$server" 2>/dev/null

  echo "round $round accel serve:        $(echo "$a_report" | head -2 | tr '\n' ' ')"
  echo "round $round accel engine:       $(echo "$a_report" | grep '^engine:')"
  echo "round $round transformers serve: $(echo "$t_report" | head -2 | tr '\n' ' ')"
  a="$(echo "$a_report" | tok_s)"; t="$(echo "$t_report" | tok_s)"
  ratios+=("$(awk -v a="$a" -v t="$t" 'BEGIN { print a / t }')")
  awk -v a="$a" -v t="$t" -v r="$round" -v x="${ratios[-1]}" \
    'BEGIN { printf "round %s: accel %.1f / transformers %.1f tok/s = %.2fx\n", r, a, t, x }'
done
if [ "${#ratios[@]}" -gt 1 ]; then
  printf '%s\n' "${ratios[@]}" |
    awk '{ s += log($1); n++ } END { printf "geometric mean of %d rounds: %.2fx\n", n, exp(s / n) }'
fi
