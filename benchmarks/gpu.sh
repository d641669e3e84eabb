#!/usr/bin/env bash
# One prepared run for a lent GPU host (≤ 5 minutes): the GPU tests, the served-decision kernels,
# and vge serve on CUDA vs the same host's CPU. Output goes to stdout and docs/benchmarks.md.
#   bash benchmarks/gpu.sh
set -uo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv >/dev/null 2>&1 || true
.venv/bin/pip install -q -e '.[test]' || exit 1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
.venv/bin/python -m pytest -q tests/gpu tests/models/test_predictor.py -p no:cacheprovider
.venv/bin/python -m benchmarks.decision --device cuda --compile
command -v wrk >/dev/null || { apt-get install -y -qq wrk >/dev/null 2>&1 || true; }
# vge on CUDA (default: auto) and pinned to the CPU, same host, single- and 64-image requests
.venv/bin/python -m benchmarks.serving --targets vge --vge-device cuda --levels 64 256 \
  --batch-levels 16 64 --rounds 1 --duration 5
.venv/bin/python -m benchmarks.serving --targets vge --vge-device cpu --levels 64 256 \
  --batch-levels 16 64 --rounds 1 --duration 5 --no-write
