"""benchmarks/e2e.py: the CPU smoke run (fused and twin through the public API and the
synthetic-KV decode steps) and the composite arithmetic of the decompress-then-attend methods."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..")
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

from e2e_methods import composite_batch, composite_step, unfused_kv_gb  # noqa: E402

KEYS = ("method", "model", "kv_budget_gb", "compressible_fraction", "max_batch", "decode_tok_s", "total_tok_s",
        "speedup_vs_uncompressed_flashinfer", "roofline_fraction")


def test_smoke_run_writes_records(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")}
    p = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "e2e.py"), "--smoke", "--out",
                        str(tmp_path), "--methods", "fused,uncompressed-twin", "--fractions", "0.6"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    result = json.loads((tmp_path / "e2e.json").read_text())
    recs = result["records"]
    assert {r["method"] for r in recs} == {"fused", "uncompressed-twin"}
    assert all(k in r for r in recs for k in KEYS), [r for r in recs if "error" in r]
    points = {(r["method"], r["point"]) for r in recs}
    assert points == {(m, p) for m in ("fused", "uncompressed-twin") for p in ("model", "0.6")}
    fused = {r["point"]: r for r in recs if r["method"] == "fused"}
    assert abs(fused["0.6"]["compressible_fraction"] - 0.6) < 0.05 and fused["0.6"]["decode_tok_s"] > 0
    assert fused["model"]["total_tok_s"] > 0 and fused["model"]["max_batch"] >= 1
    assert (tmp_path / "e2e.md").read_text().count("| fused |") == len(fused)


def test_composite_batch_counts_pages_and_one_layer_workspace():
    # 10 units per request open, 2 layers: ratio 0.5 -> 10 * (0.5 + 0.5) + 1 = 11 per request
    assert composite_batch(110, 10, 1, 2, 0.5) == 10
    assert composite_batch(109, 10, 1, 2, 0.5) == 9
    assert composite_batch(5, 10, 1, 2, 0.5) == 0


def test_composite_step_adds_decompression_of_the_batch():
    assert composite_step(0.010, 4, 1e9, 1e12) == pytest.approx(0.014)
    assert composite_step(0.010, 0, 1e9, 1e12) != composite_step(0.010, 0, 1e9, 1e12)     # NaN


def test_unfused_budget_leaves_room_for_one_layer():
    kv = unfused_kv_gb(52.0, 32, 1.0)                  # all compressible: r = 0.75
    assert kv + kv / (32 * 0.75) == pytest.approx(52.0)
    assert unfused_kv_gb(52.0, 32, 0.0) == pytest.approx(52.0 / (1 + 1 / 32))
