"""benchmarks/load.py on the CPU (demo model, tiny sizes): each mode in its own process through the
public engine, the records and the cross-mode output check."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_smoke_burst_both_modes(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")}
    p = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "load.py"), "--smoke", "--scenarios", "burst",
                        "--requests", "8", "--out", str(tmp_path)], capture_output=True, text=True, env=env, timeout=180)
    assert p.returncode == 0, p.stderr[-2000:]
    result = json.loads((tmp_path / "load.json").read_text())
    recs = {r["mode"]: r for r in result["records"]}
    assert set(recs) == {"compressed", "uncompressed"}
    for r in recs.values():
        assert r["scenario"] == "burst" and r["requests"] == 8 and r["generated_tokens"] == 8 * 24
        assert r["peak_batch"] >= 1 and r["decode_tok_s"] > 0 and r["step_log"]
    # greedy decoding is bit-exact across modes, so the two processes generate the same ids
    assert recs["compressed"]["outputs_sha256"] == recs["uncompressed"]["outputs_sha256"]
    assert result["identical_outputs_across_modes"] == {"burst": True}
    assert recs["compressed"]["stored_ratio"] < 1.0 and recs["uncompressed"]["stored_ratio"] == 1.0
    assert (tmp_path / "load.png").stat().st_size > 0
