"""The Hopper weight GEMM (kernels/weight_gemm_sm90.py, Gluon) built for sm_90a on any machine: its
wgmmas stay asynchronous (one group in flight, no "wgmma serialized" warning from ptxas) and nothing
spills. Its results are checked on the GPU (test_weight_linear.py: SM90 cases). The build runs in a
child process: this run's Triton may be the interpreter, which Gluon cannot compile through."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import triton

pytest.importorskip("triton.experimental.gluon", reason="needs Triton's Gluon (Triton 3.5+)")
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
SRC = str(Path(__file__).resolve().parents[1] / "src")


BUILD = """
import sys, triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from zipfusion.kernels import weight_gemm_sm90 as sm90


def _desc(dtype, block):
    lay = gl.NVMMASharedLayout.get_default_for(block, {"bf16": gl.bfloat16, "i64": gl.int64, "i32": gl.int32}[dtype])
    return f"tensordesc<{dtype}[{block[0]}, {block[1]}],{lay!r}>"


def _build(BM, BN, warps, stages, reduce, bias):
    sig = {"x_desc": _desc("bf16", [BM, sm90.BK]), "lo_desc": _desc("i64", [BN, sm90.BK // 8]),
           "code_desc": _desc("i32", [BN, sm90.BK // 8]), "x_ptr": "*bf16", "base_ptr": "*u8",
           "eptr_ptr": "*i32", "erow_ptr": "*i32", "ecol_ptr": "*i32", "eval_ptr": "*i16", "bias_ptr": "*bf16",
           "out_ptr": "*bf16", "ws_ptr": "*fp32", "cnt_ptr": "*i32", "M": "i32", "N": "i32", "Kp": "i32",
           "stride_xm": "i32", "tiles_per_split": "i32"}
    consts = dict(HAS_BIAS=bias, REDUCE=reduce, STAGES=stages, RC=32, num_warps=warps)
    sig.update({k: "constexpr" for k in consts})
    return triton.compile(GluonASTSource(sm90._kernel, sig, consts), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps})


BM, BN, warps, stages, reduce, bias, out = sys.argv[1:]
open(out, "w").write(_build(int(BM), int(BN), int(warps), int(stages), int(reduce), bias == "1").asm["ptx"])
"""


@pytest.mark.skipif(not os.path.exists(PTXAS), reason="Triton's bundled ptxas is missing")
@pytest.mark.parametrize("BM,BN,warps,stages,reduce,bias", [(64, 64, 4, 3, 2, True)])   # split-K, bias, escapes
def test_builds_pipelined_without_spills(tmp_path, BM, BN, warps, stages, reduce, bias):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([SRC, env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-c", BUILD, *map(str, (BM, BN, warps, stages, reduce, int(bias))),
                        str(tmp_path / "k.ptx")], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-800:]
    ptx = (tmp_path / "k.ptx").read_text()
    assert "wgmma.mma_async" in ptx
    assert re.search(r"wgmma\.wait_group\.sync\.aligned 1;", ptx), "no wgmma left in flight"
    r = subprocess.run([PTXAS, "-arch=sm_90a", "-v", str(tmp_path / "k.ptx"), "-o", str(tmp_path / "k.cubin")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-500:]
    assert "C7515" not in r.stderr, "ptxas serializes the wgmmas: " + r.stderr[-400:]
    assert "0 bytes spill stores" in r.stderr, r.stderr[-400:]
