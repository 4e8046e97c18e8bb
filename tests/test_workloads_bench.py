"""benchmarks/workloads.py on the CPU (--smoke: demo model, tiny sizes): each (scenario, mode) in its
own process through the public engine; the records, the cross-mode output check, the report files;
and --merge of two runs."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "workloads.py")
KEYS = ("scenario", "mode", "requests", "total_tok_s", "output_tok_s", "decode_tok_s", "decode_tok_s_at_peak_batch",
        "peak_batch", "mean_batch", "preemptions", "prefill_tokens_computed", "prompt_tokens", "prefill_steps_s",
        "seal_s", "compaction_bytes", "compressible_fraction", "stored_ratio", "outputs_sha256", "wall_s")


def run(*args, timeout=120):
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")}
    p = subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, env=env, timeout=timeout)
    assert p.returncode == 0, p.stderr[-3000:]
    return p


def test_smoke_both_modes_identical_deterministic_outputs(tmp_path):
    p = run("--smoke", "--scenarios", "deterministic,burst", "--out", str(tmp_path))
    result = json.loads((tmp_path / "workloads.json").read_text())
    recs = {(r["scenario"], r["mode"]): r for r in result["records"]}
    assert set(recs) == {(s, m) for s in ("deterministic", "burst")
                         for m in ("compressed", "uncompressed", "flashinfer")}
    for s in ("deterministic", "burst"):
        assert "CUDA" in recs[(s, "flashinfer")]["skipped"]                   # the CPU: skipped, with the reason
        for m in ("compressed", "uncompressed"):
            r = recs[(s, m)]
            assert "error" not in r, r.get("error")
            assert all(k in r for k in KEYS), sorted(set(KEYS) - set(r))
            assert r["requests"] == r["job"]["requests"] >= 2 and r["peak_batch"] >= 1
            assert r["total_tok_s"] > r["output_tok_s"] > 0
            assert r["prefill_tokens_computed"] >= r["prompt_tokens"] > 0
    # deterministic mode: the same ids in both modes (one SHA-256 of every output id, in request order)
    det = [recs[("deterministic", m)]["outputs_sha256"] for m in ("compressed", "uncompressed")]
    assert det[0] == det[1]
    assert result["identical_outputs"]["deterministic"] is True
    assert recs[("burst", "compressed")]["stored_ratio"] < 1.0 == recs[("burst", "uncompressed")]["stored_ratio"]
    assert set(result["ratios"]) == {"deterministic", "burst"}
    assert result["meta"]["scale"] == 1.0 and result["meta"]["smoke"] and result["meta"]["torch"]
    steps = json.loads((tmp_path / "steps.json").read_text())
    assert len(steps["burst/compressed"]["rows"]) == recs[("burst", "compressed")]["steps"]
    assert "| deterministic | compressed |" in (tmp_path / "workloads.md").read_text()
    assert (tmp_path / "workloads.png").stat().st_size > 0
    assert "burst" in p.stdout.splitlines()[-3]                              # the short table comes last


def test_smoke_prefix_cache_scenarios_on_and_off(tmp_path):
    """shared_prefix and multi_turn with the prefix cache and without: the same outputs, fewer
    prompt tokens computed with it, and the cache on/off ratios."""
    run("--smoke", "--scenarios", "shared_prefix,multi_turn", "--modes", "compressed", "--prefix-cache", "on,off",
        "--out", str(tmp_path))
    result = json.loads((tmp_path / "workloads.json").read_text())
    recs = {(r["scenario"], r["prefix_cache"]): r for r in result["records"]}
    assert set(recs) == {(s, c) for s in ("shared_prefix", "multi_turn") for c in (True, False)}
    for s in ("shared_prefix", "multi_turn"):
        on, off = recs[(s, True)], recs[(s, False)]
        assert on["outputs_sha256"] == off["outputs_sha256"] and on["prompt_tokens"] == off["prompt_tokens"]
        assert off["prefill_tokens_computed"] >= off["prompt_tokens"] > on["prefill_tokens_computed"]
        assert on["prefix_hit_tokens"] > 0 == off["prefix_hit_tokens"] and on["hits"] > 0
        assert "compressed: cache on/off" in result["ratios"][s]
    turns = recs[("multi_turn", True)]
    assert turns["requests"] == 4 * 3 and turns["new_prompt_tokens"] == 4 * 40 + 4 * 2 * 20


def test_merge_keeps_each_pair(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for d, scen in ((a, "burst"), (b, "mix")):
        d.mkdir()
        recs = [{"scenario": scen, "mode": m, "requests": 2, "total_tok_s": 10.0 + i, "output_tok_s": 1.0,
                 "decode_tok_s": 5.0, "decode_tok_s_at_peak_batch": 5.0, "peak_batch": 2, "outputs_sha256": "x"}
                for i, m in enumerate(("compressed", "uncompressed"))]
        meta = {"command": f"run {scen}", "scale": 0.5, "model": "demo", "device": "cpu", "date": "d", "torch": "t",
                "triton": None, "flashinfer": None, "max_num_seqs": 256, "batched_tokens": 256}
        (d / "workloads.json").write_text(json.dumps({"meta": meta, "records": recs}))
    run("--merge", str(a / "workloads.json"), str(b / "workloads.json"), "--out", str(tmp_path / "m"), timeout=60)
    merged = json.loads((tmp_path / "m" / "workloads.json").read_text())
    assert {(r["scenario"], r["mode"]) for r in merged["records"]} == {
        (s, m) for s in ("burst", "mix") for m in ("compressed", "uncompressed")}
    assert abs(merged["ratios"]["mix"]["compressed/uncompressed"]["total_tok_s"] - 10 / 11) < 1e-9
    assert merged["meta"]["command"] == "run burst; run mix" and len(merged["meta"]["parts"]) == 2
    assert "runs" not in merged["ratios"]["mix"]["compressed/uncompressed"]          # one call: side by side
    # a later call's compressed record beside an earlier uncompressed one: the ratio says so
    c = tmp_path / "c"
    c.mkdir()
    recs = [{"scenario": "mix", "mode": "compressed", "requests": 2, "total_tok_s": 12.0, "output_tok_s": 1.0,
             "decode_tok_s": 5.0, "decode_tok_s_at_peak_batch": 5.0, "peak_batch": 2, "outputs_sha256": "x"}]
    (c / "workloads.json").write_text(json.dumps({"meta": {**meta, "date": "later"}, "records": recs}))
    run("--merge", str(tmp_path / "m" / "workloads.json"), str(c / "workloads.json"), "--out", str(tmp_path / "n"),
        timeout=60)
    again = json.loads((tmp_path / "n" / "workloads.json").read_text())
    assert again["ratios"]["mix"]["compressed/uncompressed"]["runs"] == ["later", "d"]
    assert "(runs of later and d)" in (tmp_path / "n" / "workloads.md").read_text()


def test_a_worker_out_of_time_says_where_it_was(tmp_path):
    """A (scenario, mode) past --timeout is killed; its record keeps the worker's stacks, printed
    (faulthandler) before the kill, so a hang says where it hangs."""
    run("--smoke", "--scenarios", "mix", "--modes", "compressed", "--timeout", "1.5", "--out", str(tmp_path))
    (rec,) = json.loads((tmp_path / "workloads.json").read_text())["records"]
    # (stopped while importing torch: a stack, though not always down to workloads.py: faulthandler
    # prints at most 100 frames; its watchdog reads the frames of an import in progress without the
    # GIL, which can crash the worker after the dump, seen once on CI: "worker exit -11")
    assert rec["error"].startswith(("timed out after 1.5 s", "worker exit -11")) and '  File "' in rec["error"]


def test_identical_outputs_needs_two_runs_of_a_scenario():
    sys.path.insert(0, os.path.dirname(SCRIPT))
    import workloads
    recs = [{"scenario": "a", "outputs_sha256": "x"}, {"scenario": "a", "outputs_sha256": "x"},
            {"scenario": "b", "outputs_sha256": "x"}, {"scenario": "b", "outputs_sha256": "y"},
            {"scenario": "c", "outputs_sha256": "x"}]
    assert workloads.identical_outputs(recs) == {"a": True, "b": False}      # c ran once: nothing to compare


def test_engine_args_that_the_benchmark_sets_are_refused_in_one_line(capsys):
    """--engine-args naming an option that a mode or flag sets (kv_compression, kv_memory_gb, ...)
    would meet Python's duplicate-keyword TypeError deep in the worker; it is refused at parse time,
    as is anything but a JSON object."""
    sys.path.insert(0, os.path.dirname(SCRIPT))
    import pytest
    import workloads
    for bad, why in (('{"kv_compression": false}', "kv_compression"), ('{"kv_memory_gb": 3}', "kv_memory_gb"),
                     ("[1]", "JSON object"), ("{x", "not JSON")):
        with pytest.raises(SystemExit):
            workloads.parse(["--smoke", "--engine-args", bad])
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert why in err and "error: --engine-args" in err, err
    assert workloads.parse(["--smoke", "--engine-args", '{"enforce_eager": true}']).engine_args


def test_smoke_long_swap_against_recompute_counts_what_preemption_cost(tmp_path):
    """The long scenario under pressure with the host tier and without: both preempt; the tier
    brings pages back (few tokens recomputed: the open last pages), recompute computes them
    again; each record says what preemption cost, and the report compares the two."""
    run("--smoke", "--scenarios", "long_swap,long_recompute", "--modes", "compressed", "--out", str(tmp_path))
    result = json.loads((tmp_path / "workloads.json").read_text())
    swap, recompute = ({r["scenario"]: r for r in result["records"]}[s] for s in ("long_swap", "long_recompute"))
    assert swap["preemptions"] > 0 and recompute["preemptions"] > 0
    assert swap["swapped_in_pages"] > 0 and swap["swap_s"] > 0 == recompute["swap_s"]
    assert recompute["recomputed_tokens"] > swap["recomputed_tokens"] and recompute["recompute_s"] > 0
    assert recompute["prefill_tokens_computed"] - recompute["prompt_tokens"] >= recompute["recomputed_tokens"]
    cost = result["preemption_cost"]["compressed"]
    assert cost["swap_s"] == swap["preemption_s"] == swap["recompute_s"] + swap["swap_s"]
    assert cost["swap/recompute"] == cost["swap_s"] / recompute["preemption_s"]
    assert "Preemption cost, compressed:" in (tmp_path / "workloads.md").read_text()
