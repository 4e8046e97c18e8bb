# Sourced by the scripts here (`. scripts/gpu/env.sh`): the GPU machine's environment, run from
# the tree, with .carry installed where it was sent along (scripts/gpu/carry_wheels.sh: FlashInfer's
# trimmed build, nvCOMP, the server and GGUF extras; the device has no network).
export PYTHONPATH=src PYTHONUNBUFFERED=1 ZIPFUSION_KERNEL_CACHE=${ZIPFUSION_KERNEL_CACHE:-/tmp/zfcache}
if [ -d .carry ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .carry/*.whl \
    $(ls .carry/extra/*.whl 2>/dev/null) || { echo "installing .carry failed" >&2; return 1; }
  export PYTHONPATH=/tmp/site:src PATH=/opt/torch/.venv/bin:$PATH CUDA_HOME=/usr/local/cuda \
         FLASHINFER_WORKSPACE_BASE=/tmp MAX_JOBS=16
fi
