#!/usr/bin/env bash
# Prepare .whl/ for benchmarks/gpu.sh on an offline GPU host whose python3 (3.12) already holds
# torch, torchvision, numpy, scipy, scikit-learn, prometheus-client, httpx, uvloop and pytest:
# wheels of the rest of vge-serve's dependencies, LitServe (the peer) and py-spy, plus this
# machine's wrk and its libluajit. Run here (PyPI reachable), in the repository root:
#   bash benchmarks/gpu_wheels.sh
# then carry .whl with the run (it is git-ignored through .git/info/exclude).
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
rm -rf .whl && mkdir -p .whl/bin .whl/lib
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64 manylinux_2_17_x86_64 \
  manylinux2014_x86_64 manylinux_2_5_x86_64 manylinux1_x86_64; do platforms+=(--platform "$p"); done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d .whl \
  fastapi starlette pydantic pydantic-core pydantic-settings python-dotenv python-multipart \
  uvicorn httptools annotated-types typing-inspection typing-extensions annotated-doc \
  opentelemetry-api litserve pyzmq py-spy pytest-xdist execnet
cp "$(command -v wrk)" .whl/bin/
cp -L "$(ldd "$(command -v wrk)" | awk '/libluajit/ {print $3}')" .whl/lib/
du -sh .whl
