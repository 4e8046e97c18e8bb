"""benchmarks/seal.py on the CPU at a tiny size: both modes run, check their pages, agree on the
stored bytes, and write seal.json; waves encode once where batch by batch encodes per batch."""

import importlib.util
import json
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_seal_benchmark_smoke(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("seal_bench", os.path.join(ROOT, "benchmarks", "seal.py"))
    seal = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(seal)
    result = seal.main(["--cpu", "--layers", "2", "--heads", "1", "--head-dim", "64", "--pages", "8",
                        "--chunk-pages", "4", "--reps", "2", "--out", str(tmp_path)])
    assert json.loads((tmp_path / "seal.json").read_text())["rows"][0]["mode"] == "waves"
    waves, batches = result["rows"]
    for r in (waves, batches):
        assert r["checked"].startswith("every layer's pages read back") and len(r["reps"]) == 2
        assert r["median"]["GBps"] > 0 and r["open_bytes"] == 2 * 8 * 4096
    assert waves["median"]["encode_calls"] == 1 and batches["median"]["encode_calls"] == 2
    assert waves["median"]["stored_bytes"] == batches["median"]["stored_bytes"] < waves["open_bytes"]
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("| batch by batch |")


def test_seal_benchmark_small_seals_smoke(tmp_path):
    """--small: the page store's seals of a few pages, timed and profiled, every page placed."""
    spec = importlib.util.spec_from_file_location("seal_bench", os.path.join(ROOT, "benchmarks", "seal.py"))
    seal = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(seal)
    result = seal.main(["--cpu", "--layers", "2", "--heads", "1", "--head-dim", "64", "--small", "1,5",
                        "--chunk-pages", "4", "--reps", "2", "--pool", "16", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "seal_small.json").read_text())
    assert [r["pages"] for r in saved["rows"]] == [1, 5] and saved["slots_per_chunk"] == 4
    for r in result["rows"]:
        assert len(r["reps"]) == 2 and r["median"]["place_host_ms"] > 0
        assert "place_pages" in r["profile"] or "encode" in r["profile"]
