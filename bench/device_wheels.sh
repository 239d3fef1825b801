#!/usr/bin/env bash
# Wheels for bench/run_device.sh on a GPU machine that reaches no package index: the packages
# kvkern needs that such an image's Python (3.12, x86-64, with torch, triton, numpy, aiohttp,
# prometheus-client, xxhash, nvidia-ml-py and pytest) lacks, at the versions of this
# checkout's .venv, into .whl/ (git-ignored; about 51 MB). Run it where PyPI is reachable,
# then carry .whl with the working tree: run_device.sh installs what it finds there.
# cuda-core, which ucxx's own progress thread start would use, is left out (14 MB more with
# cuda-bindings and cuda-pathfinder): kvkern starts that thread without it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
version() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))"; }
pins=()
for name in ucxx-cu12 libucxx-cu12 libucx-cu12 librmm-cu12 rapids-logger msgspec blake3 \
            pytest-asyncio; do
  pins+=("$name==$(version "$name")")
done
rm -rf .whl
mkdir -p .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .whl "${pins[@]}"
du -sh .whl
