#!/usr/bin/env bash
# Wheels the GPU machine lacks (it has no network) into .carry/ (git-ignored): FlashInfer's trimmed
# build, nvCOMP, and the pure-Python extras the server and GGUF tests need. Send .carry along
# (device tool: carry=[".carry"]); scripts/gpu/gpu_check.sh and scripts/gpu/e2e_gpu.sh install it there.
#   bash scripts/gpu/carry_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .carry/extra .git/info
grep -qx '/.carry/' .git/info/exclude 2>/dev/null || echo /.carry/ >> .git/info/exclude
cp ../shared/tools/flashinfer/carry/*.whl .carry/
pip download -q --no-deps -d .carry nvidia-nvcomp-cu13 nvidia-libnvcomp-cu13
# one by one without dependencies: the machine's own numpy, torch and friends must stay in charge
pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d .carry/extra \
  fastapi starlette pydantic pydantic-core annotated-types annotated-doc typing-inspection anyio sniffio \
  h11 uvicorn click httpx httpcore idna certifi prometheus-client gguf pyyaml opentelemetry-api importlib-metadata zipp
pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 -d .carry/extra llguidance          # structured output
du -sh .carry
