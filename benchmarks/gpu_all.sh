#!/usr/bin/env bash
# The main H200 figures of docs/benchmarks.md in one run (Llama-3-8B shape, dummy bf16): the engine loop
# (gpu_engine.py), the RAG case through `prefixrt serve` vs in-process (gpu_serve.sh), EXTEND graphs / TTFT /
# jump-forward (gpu_graphs.py), fused kernels / batch-1 / batch-256 / long-context (gpu_fused.py).
# Each part has its own time limit so one slow part cannot starve the rest. Logs and JSON of every part are
# written under a work folder and packed into $OUT/gpu_all.tgz after each part.
#   PYTHONPATH=$PWD bash benchmarks/gpu_all.sh [PARTS]   # on the GPU host, from the repo root; PARTS: a comma-separated
#                                                        # subset of engine,serve,graphs,fused (default: all)
case "${1:-}" in -h|--help) sed -n '2,/^set /{/^#/s/^# \{0,1\}//p}' "$0"; exit 0;; esac
set -uo pipefail
dest=${OUT:-/tmp}
work=/tmp/gpu-all; mkdir -p "$work"
export OUT=$work  # the parts write their JSON to $OUT
parts=${1:-engine,serve,graphs,fused}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
run() {  # run NAME LIMIT_S CMD...
  local name=$1 limit=$2; shift 2
  case ",$parts," in *",$name,"*) ;; *) return ;; esac
  local t0=$SECONDS
  timeout "$limit" "$@" > "$work/part-$name.log" 2>&1; local rc=$?
  echo "== $name: rc=$rc in $((SECONDS - t0)) s"; tail -n "${TAIL:-28}" "$work/part-$name.log"
  tar czf "$dest/gpu_all.tgz" -C /tmp gpu-all
}
run engine "${T_ENGINE:-200}" python benchmarks/gpu_engine.py
run serve "${T_SERVE:-150}" bash benchmarks/gpu_serve.sh llama-3-8b "$work"
run graphs "${T_GRAPHS:-140}" python benchmarks/gpu_graphs.py
run fused "${T_FUSED:-100}" python benchmarks/gpu_fused.py
