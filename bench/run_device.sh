#!/usr/bin/env bash
# The one prepared call that validates kvkern's GPU path; every result is JSON under $OUT.
#   GPU machine:  bash bench/run_device.sh            (under 8 minutes on an H200)
#   CPU check:    bash bench/run_device.sh --dry-run  (every step end to end, tiny sizes)
# Steps (bench/device_run.py): env, NVML facts, UCX transports, two-process pulls of 16-256 MiB
# against raw UCXX with the reshards, the demo's exactness check, the gpu-marked tests, the
# kernel sweep with bit-exact checks, the stream with a wider in-flight window, the autotuner
# if time is left; then
# targets.json and summary.json. A failing step is recorded in its JSON and the next one
# runs. $OUT defaults to a new temporary directory.
# Interpreter: $PYTHON, else the project's .venv, else python3. On a machine that reaches no
# package index, the wheels bench/device_wheels.sh put in .whl/ (carried along) are installed
# first, into a directory of their own on PYTHONPATH.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$(mktemp -d "${TMPDIR:-/tmp}/kvkern-device.XXXXXX")}
mkdir -p "$OUT"
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x .venv/bin/python ]; then PY=.venv/bin/python
else PY=python3
fi
export PYTHONPATH=. PYTHONUNBUFFERED=1 OUT
if compgen -G ".whl/*.whl" >/dev/null; then
  SITE=${TMPDIR:-/tmp}/kvkern-site
  if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
       --target "$SITE" .whl/*.whl; then
    PYTHONPATH=".:$SITE"
  else
    echo "run_device: the wheels in .whl did not install; going on without them"
  fi
fi
KVKERN_COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
export KVKERN_COMMIT
echo "run_device: $PY, results in $OUT"
command -v nvidia-smi >/dev/null 2>&1 \
  && nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem \
       --format=csv > "$OUT/nvidia-smi.txt" 2>&1
"$PY" bench/device_run.py --out "$OUT" "$@" 2>&1 | tee "$OUT/run_device.log"
exit "${PIPESTATUS[0]}"
