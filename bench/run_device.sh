#!/usr/bin/env bash
# One prepared call for a lent GPU machine (torch + Triton preinstalled, nothing else):
#   device run: bash bench/run_device.sh      (timeout_s ~420; writes under $OUT)
# 1. the kernel sweep with bit-exact checks (CSV, PNG if matplotlib, summary table last)
# 2. the autotuner (table printed; written to $OUT/tuned_configs.json for review)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/out}
mkdir -p "$OUT"
export PYTHONPATH=. PYTHONUNBUFFERED=1 KVKERN_COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem --format=csv | tee "$OUT/nvidia-smi.txt"
timeout 300 python3 bench/gpu_kernels.py --out "$OUT" 2>&1 | tee "$OUT/gpu_kernels.log"
timeout 120 python3 bench/autotune.py --write --table "$OUT/tuned_configs.json" 2>&1 | tee "$OUT/autotune.log"
