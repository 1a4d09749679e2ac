#!/usr/bin/env bash
# The resident memory of `accel serve` over many requests:
#   bash benchmarks/serve_memory.sh [RUNS] [extra accel serve arguments...]
# Starts `accel serve --max-batch 16` (port 8011), prints its RSS idle, then runs
# benchmarks/serve_load.py RUNS times (default 8) with 16 clients x 8 chat requests of 16 tokens,
# non-streaming (streaming, over SSE, with STREAM=1 in the environment), and prints the server's
# RSS (`ps -o rss=`) after each run of 128 requests, then the change from the first run to the
# last and the largest. Run it from the repository's virtual environment (`make venv`), on an
# otherwise idle machine.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
runs="${1:-8}"
shift || true
load=(--clients 16 --requests 8 --max-tokens 16)
[ "${STREAM:-0}" = 1 ] || load+=(--no-stream)
echo "load: ${load[*]}"

accel serve --port 8011 --max-batch 16 "$@" >/dev/null 2>&1 &
server=$!
trap 'kill "$server" 2>/dev/null' EXIT
for _ in $(seq 120); do
  curl -s -o /dev/null http://127.0.0.1:8011/health && break
  sleep 2
done
curl -s -o /dev/null http://127.0.0.1:8011/health || { echo "no server on port 8011 after 240 s"; exit 1; }
rss_mib() { echo $(( $(ps -o rss= -p "$server") / 1024 )); }
echo "idle: $(rss_mib) MiB"
sizes=()
for run in $(seq "$runs"); do
  report="$(python benchmarks/serve_load.py --url http://127.0.0.1:8011 "${load[@]}")"
  sleep 1
  sizes+=("$(rss_mib)")
  echo "run $run ($(( run * 128 )) requests): ${sizes[-1]} MiB; $(echo "$report" | head -1)"
done
printf '%s\n' "${sizes[@]}" | awk 'NR == 1 { first = $1 } { if ($1 > top) top = $1; last = $1 }
  END { printf "first run %d MiB, last %d MiB (%+.1f%%), largest %d MiB (%+.1f%%)\n",
        first, last, 100 * (last - first) / first, top, 100 * (top - first) / first }'
