#!/usr/bin/env bash
# Which part of async scheduling hangs the long workload on the H200 (docs/benchmarks.md,
# 2026-12-05: `long` compressed with async_scheduling on stopped twice, the GPU 93-100 % busy and
# the host waiting on an event; with CUDA_LAUNCH_BLOCKING=1 it finished). Each variant is one
# benchmarks/workloads.py worker process (long / compressed, 16 x 32K prompts) with a time limit;
# shortly before it a watchdog prints the GPU's utilisation (busy: a kernel runs on; idle: the
# host waits) and cuda-gdb names the kernels on the GPU, and the worker prints every thread's
# stack (faulthandler). One device call, ~8 min:
#   bash scripts/gpu/hang_bisect.sh [variant ...]   # $OUT/<variant>.err|out, the summary on stdout
set -u
OUT=${OUT:-/tmp/hang_out}; mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-src} PYTHONUNBUFFERED=1

job() {   # mode [key=json ...] -> the worker's job (long scenario)
  python3 - "$@" <<'P'
import json, sys
sys.path.insert(0, "benchmarks")
import workloads as w
job = w.make_job(w.parse(["--scenarios", "long"]), "long", sys.argv[1])
for kv in sys.argv[2:]:
    k, v = kv.split("=", 1)
    job[k] = json.loads(v)
print(json.dumps(job))
P
}

variant() {   # name limit_s mode [key=json ...]
  local name=$1 lim=$2; shift 2
  local spec; spec=$(job "$@")
  echo "== $name"
  # a run still alive ATTACH s before its limit has stalled (it finishes in ~70 s): the GPU's
  # utilisation, then cuda-gdb attached to the worker names the kernels resident on the GPU
  local at=$((lim - ${ATTACH:-45}))
  ( sleep $at; echo "-- GPU utilisation at $at s:"
    for _ in 1 2 3; do nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader; sleep 1; done
    local pid; pid=$(pgrep -f "workloads.py --worker" | head -1)
    if [ -n "$pid" ] && command -v cuda-gdb >/dev/null; then
      echo "-- cuda-gdb attached to $pid (full output: $OUT/$name.gdb)"
      timeout 35 cuda-gdb -p "$pid" -batch -ex "info cuda kernels" -ex "info cuda blocks" \
        -ex "info cuda threads" > "$OUT/$name.gdb" 2>&1
      grep -A6 -i "kernel" "$OUT/$name.gdb" | head -20 | cut -c1-240
    fi ) &
  local wd=$! t0=$SECONDS
  timeout -k 3 "$lim" python3 benchmarks/workloads.py --worker "$spec" $((lim - 4)) > "$OUT/$name.out" 2> "$OUT/$name.err"
  echo "rc $? after $((SECONDS - t0)) s"; kill $wd 2>/dev/null
  grep -h -E "requests done|RESULT" "$OUT/$name.err" "$OUT/$name.out" | tail -3 | cut -c1-300
  grep -h -A14 "Timeout" "$OUT/$name.err" | head -30
}

run_variant() {   # name: one of the variants below
  case $1 in
  async) variant async ${LIMIT:-120} compressed ;;
  async_checked) variant async_checked ${LIMIT:-120} compressed 'engine={"check_pages": true}' ;;  # a bad page location: an assert, not a spin
  async_blocking) CUDA_LAUNCH_BLOCKING=1 variant async_blocking ${LIMIT:-120} compressed ;;
  async_eager) variant async_eager ${LIMIT:-120} compressed 'engine={"enforce_eager": true}' ;;
  async_no_host_tier) variant async_no_host_tier ${LIMIT:-120} compressed host_gb=0 ;;
  plain) variant plain ${LIMIT:-120} compressed_sync ;;
  *) echo "unknown variant $1"; return 2 ;;
  esac
}
for v in ${*:-async async_checked async_blocking async_eager async_no_host_tier plain}; do run_variant "$v"; done
