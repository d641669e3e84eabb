#!/usr/bin/env bash
# One prepared run for a lent GPU host: the GPU tests, the served-decision kernels, where vge's CPU
# goes, and vge serve on CUDA (one and two batches in flight) beside LitServe scaled out and beside
# the same host's CPU. On an H100 host (2026-11-26) everything but the decision step and the
# vge-overlap target took 6 min 32 s (the tests 2 min): narrow it with GPU_STEPS and GPU_TESTS.
# Results go to stdout and docs/benchmarks.md (a copy and the log to $OUT when it is set).
#   bash benchmarks/gpu.sh
# Offline hosts: `bash benchmarks/gpu_wheels.sh` here puts wheels of what the host's python3 lacks
# in .whl/ (and wrk in .whl/bin with its libluajit in .whl/lib); carry .whl: they are installed to
# /tmp/site and the image's torch is used.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/vge-gpu}
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu.log") 2>&1
# GPU_STEPS picks steps and their order (default: tests decision serving engine profile cpu; also
# peer, a short vge-vs-LitServe check, and sweep, benchmarks/oe_sweep.py), e.g.
#   GPU_STEPS="tests serving" GPU_TESTS=tests/gpu bash benchmarks/gpu.sh
# GPU_TARGETS: the servers of the serving step (benchmarks.serving --targets; "vge@KEY=VALUE,..."
# runs vge with VGE_ settings).
STEPS=" ${GPU_STEPS:-tests decision serving engine profile cpu} "
TARGETS=${GPU_TARGETS:-vge vge-overlap litserve-scaled}
step() { echo; echo "=== $* ($(date +%T))"; }
save() { cp docs/benchmarks.md "$OUT/benchmarks.md"; }
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD PATH=$PWD/.whl/bin:/tmp/site/bin:$PATH
  export LD_LIBRARY_PATH=$PWD/.whl/lib:${LD_LIBRARY_PATH:-}
  PY=python3
else
  python3 -m venv .venv >/dev/null 2>&1 || true
  .venv/bin/pip install -q -e '.[test,bench]' || exit 1
  PY=.venv/bin/python
  command -v wrk >/dev/null || apt-get install -y -qq wrk >/dev/null 2>&1 || true
fi
export PYTHONUNBUFFERED=1
step environment
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
nproc
$PY -c "import torch, torchvision, fastapi, uvicorn, litserve, service.frontend.app; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available(), 'torchvision', torchvision.__version__)"
run_tests() {
  step GPU tests
  local xdist
  xdist=$($PY -c "import xdist" 2>/dev/null && echo "-n 4")
  # GPU_TESTS narrows the tests (default: the GPU tests and the models' serving and predictor tests)
  # shellcheck disable=SC2086 # word lists
  timeout 150 $PY -m pytest -q -p no:cacheprovider -p no:logging $xdist \
    ${GPU_TESTS:-tests/gpu tests/models/test_serving.py tests/models/test_predictor.py}
}
run_decision() {
  step served decision kernels
  timeout 100 $PY -m benchmarks.decision --device cuda --compile; local rc=$?; save; return $rc
}
run_serving() {
  step "vge on CUDA ($TARGETS; LitServe scaled out: 2 workers, 8 API servers)"
  # shellcheck disable=SC2086 # TARGETS is a list
  timeout 270 $PY -m benchmarks.serving --targets $TARGETS --vge-device cuda \
    --litserve-scale 2 8 --wrk-threads 4 --levels 64 256 --batch-levels 16 64 --rounds 1 \
    --duration 3 --section "GPU host"; local rc=$?; save; return $rc
}
run_engine() {
  step "the engine alone on CUDA: CPU per single-image request, no HTTP"
  # On CUDA the engine compiles its buckets at load (about a minute): the timeout allows for it.
  timeout 200 $PY -m benchmarks.engine --device cuda --model cnn4-lle-vgn-doe-mnist --clients 15 \
    --conc 256 --rounds 2 --seconds 3
}
run_profile() {
  step "where vge's CPU goes on CUDA at c=256 (py-spy)"
  command -v py-spy >/dev/null || { echo "no py-spy here: step skipped"; return 0; }
  timeout 75 $PY -m benchmarks.profile_serve --device cuda --conc 256 --seconds 4 \
    --raw "$OUT/profile-raw.txt"
}
run_peer() {
  step "vge and the LitServe peer on CUDA, one level each (the peer answered only errors before issue 26)"
  timeout "${PEER_TIMEOUT:-170}" $PY -m benchmarks.serving --targets vge litserve --vge-device cuda \
    --wrk-threads 4 --levels 64 --batch-levels 16 --rounds 1 --duration 3 --no-write
}
run_sweep() {
  step "outlier-exposure recipe sweep on CUDA (issue 25; benchmarks/oe_sweep.py)"
  timeout "${SWEEP_TIMEOUT:-250}" $PY -m benchmarks.oe_sweep --device cuda --parallel 7 \
    --timeout 230 --out /tmp/oe-sweep
  local rc=$?
  cp /tmp/oe-sweep/sweep.jsonl "$OUT/" 2>/dev/null  # the rows measured, also when cut off
  return $rc
}
run_cpu() {
  step "vge on the same host's CPU"
  timeout 80 $PY -m benchmarks.serving --targets vge --vge-device cpu --wrk-threads 4 \
    --levels 64 256 --batch-levels 16 --rounds 1 --duration 3 --section "GPU host, vge on its CPU"
  local rc=$?
  save
  return $rc
}
# The steps run in the order GPU_STEPS names them (put first what must not be cut off); every
# name is checked before the first runs.
for s in $STEPS; do
  case $s in
    tests | decision | serving | engine | profile | cpu | peer | sweep) ;;
    *) echo "unknown step $s (tests decision serving engine profile cpu peer sweep)"; exit 2 ;;
  esac
done
# Every step runs even when one fails (a GPU host's time is scarce), but the script fails loudly:
# each failed step is named at the end and the exit status is 1.
failed=""
for s in $STEPS; do "run_$s" || failed="$failed $s"; done
step done
if [ -n "$failed" ]; then
  echo "FAILED steps:$failed (their numbers above are not results)"
  exit 1
fi
