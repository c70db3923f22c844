#!/usr/bin/env bash
# The RAG case (64 x (3500 shared + 80 unique), 200 out, concurrency 64) through `prefixrt serve` (engine in its
# own process, streamed over SSE) and in-process, with the same `prefixrt bench` client code, one run each, streamed
# as text (detokenize on, --text) unless TEXT=0.
#   bash benchmarks/gpu_serve.sh [MODEL] [OUTDIR]        # on the GPU host; MODEL defaults to llama-3-8b (dummy)
#   SMOKE=1 bash benchmarks/gpu_serve.sh /path/to/tiny    # tiny shapes on the CPU, to test the script
case "${1:-}" in -h|--help) sed -n '2,/^set /{/^#/s/^# \{0,1\}//p}' "$0"; exit 0;; esac
set -euo pipefail
model=${1:-llama-3-8b}
out=${2:-${OUT:-/tmp}}
port=${PORT:-30123}
if [ -n "${SMOKE:-}" ]; then
  shape=(--workload shared-prefix --groups 2 --prompts-per-group 4 --system-len 64 --question-len 8 --output-len 8)
  eng=(--model "$model" --device cpu --kv-cache-tokens 4096 ${LOAD_FORMAT:+--load-format $LOAD_FORMAT})
else
  shape=(--workload rag --concurrency 64)
  eng=(--model "$model" --load-format dummy)
fi
if [ "${TEXT:-1}" != 0 ]; then
  shape+=(--text)
fi
python -m prefixrt.cli serve "${eng[@]}" --port "$port" > "$out/serve.log" 2>&1 &
server=$!
trap 'kill -TERM $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT
for _ in $(seq 600); do
  python -c "import urllib.request,sys; urllib.request.urlopen('http://127.0.0.1:$port/health', timeout=2)" 2>/dev/null && break
  kill -0 $server 2>/dev/null || { cat "$out/serve.log"; exit 1; }
  sleep 0.5
done
python -m prefixrt.cli bench "${shape[@]}" --url "http://127.0.0.1:$port" --json "$out/bench_http.json" --no-progress
kill -TERM $server; wait $server || true; trap - EXIT
bench_eng=("${eng[@]}")
python -m prefixrt.cli bench "${shape[@]}" "${bench_eng[@]}" --baselines radix --json "$out/bench_inprocess.json" --no-progress
python - "$out" <<'PY'
import json, sys
out = sys.argv[1]
h = json.load(open(f"{out}/bench_http.json")); i = json.load(open(f"{out}/bench_inprocess.json"))
rh, ri = h["results"][0], i["results"][0]
th, ti = rh["output_throughput"], ri["output_throughput"]
print(f"HTTP {th:.0f} out tok/s (TTFT p50 {rh['ttft_ms']['p50']:.0f} ms) vs in-process {ti:.0f} "
      f"(TTFT p50 {ri['ttft_ms']['p50']:.0f} ms): {100 * th / ti:.0f}%")
PY
