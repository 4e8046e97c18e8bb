"""``zipfusion bench`` on the CPU: dataset length distributions, percentiles, goodput, the serving
benchmark's per-rate numbers on synthetic records, one-line errors for bad input, and whole runs on
the demo model (tiny): ``throughput --compare`` (each mode in its own process), ``latency``, the
kernel's smoke run, and ``serve --compare`` against real ``zipfusion serve`` processes on loopback."""

import json
import math
import random
import statistics
import time

import pytest

from zipfusion.bench import KERNEL_MODES, client, datasets, parse_modes, report, serve, serve_results, server_process
from zipfusion.bench.stats import goodput, meets_slo, parse_goodput, percentile, summary
from zipfusion.cli import main


# -- datasets ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(datasets.DATASETS))
def test_named_length_distributions_have_their_medians_and_caps(name):
    d = datasets.DATASETS[name]
    p, o, clipped = datasets.lengths(d, 2000, seed=3)
    if d.prompt_cap:
        assert abs(statistics.median(p) / d.prompt - 1) < 0.1 and max(p) <= d.prompt_cap and min(p) >= 1
        assert abs(statistics.median(o) / d.output - 1) < 0.1 and max(o) <= d.output_cap
        assert statistics.pstdev(p) > 0.3 * d.prompt                       # spread, not one length
    else:
        assert set(p) == {d.prompt} and set(o) == {d.output}                # random: fixed lengths
    ds = datasets.build(datasets.resolve(name, input_len=40, output_len=8), name, 20, seed=3)
    assert ds.prompt_lens == [n + d.shared_prefix for n in datasets.lengths(
        datasets.resolve(name, input_len=40, output_len=8), 20, seed=3)[0]]
    assert all(len(ids) == n for ids, n in zip(ds.prompts, ds.prompt_lens))
    assert all(datasets.ID_RANGE_LOW <= t < 2048 - datasets.ID_RANGE_LOW for ids in ds.prompts for t in ids)
    s = ds.summary()
    assert s["requests"] == 20 and s["prompt_tokens"]["total"] == sum(ds.prompt_lens) and s["clipped_to_max_len"] == 0


def test_decode_heavy_and_prefill_heavy_datasets_lean_the_right_way():
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    lens = {n: datasets.lengths(datasets.DATASETS[n], 500) for n in ("reasoning", "agent", "long")}
    assert mean(lens["reasoning"][1]) > 5 * mean(lens["reasoning"][0])
    for n in ("agent", "long"):
        assert mean(lens[n][0]) + datasets.DATASETS[n].shared_prefix > 10 * mean(lens[n][1])


def test_dataset_overrides_seeds_prefix_clipping_and_text():
    dist = datasets.resolve("chat", input_len=30, output_len=5)
    assert (dist.prompt, dist.output) == (30, 5) and dist.prompt_cap == round(4096 * 30 / 300)
    a = datasets.build(dist, "chat", 50, seed=1, id_seed=7)
    b = datasets.build(dist, "chat", 50, seed=1, id_seed=8)
    assert a.prompt_lens == b.prompt_lens and a.output_lens == b.output_lens and a.prompts != b.prompts
    assert datasets.build(dist, "chat", 50, seed=1, id_seed=7).prompts == a.prompts        # a function of the seeds
    r = datasets.build(datasets.resolve("random", 100, 10), "random", 300, range_ratio=0.5)
    assert 50 <= min(r.prompt_lens) < 60 and 140 < max(r.prompt_lens) <= 150 and 5 <= min(r.output_lens)
    agent = datasets.build(datasets.resolve("agent", shared_prefix=16, group=4), "agent", 10, vocab=500)
    for i in range(10):
        assert agent.prompts[i][:16] == agent.prompts[i // 4 * 4][:16]
    assert agent.prompts[0][:16] != agent.prompts[4][:16]
    p, o, clipped = datasets.lengths(datasets.DATASETS["long"], 50, max_len=1024)
    assert all(a + b < 1024 for a, b in zip(p, o)) and clipped == 50
    assert datasets.fit(100, 5, 1024) == (100, 5) and datasets.fit(5000, 900, 1024) == (512, 511)
    assert datasets.fit(300, 900, 1024) == (300, 723)
    text = datasets.build(dist, "chat", 5, text=True)
    assert all(isinstance(t, str) and len(t.split()) == n for t, n in zip(text.prompts, text.prompt_lens))
    # text lengths are words: fitted with room for words of several tokens (the demo's tokenizer)
    from zipfusion.models import load_tokenizer, resolve_model
    tok = load_tokenizer(resolve_model("demo").tokenizer_dir)
    long = datasets.build(datasets.DATASETS["long"], "long", 8, text=True, max_len=1024)
    assert long.clipped == 8
    for t, o in zip(long.prompts, long.output_lens):
        assert len(tok.encode(t)) + o < 1024


@pytest.mark.parametrize("bad,words", [(dict(name="sharegpt"), "unknown dataset"),
                                       (dict(name="chat", input_len=0), "--input-len"),
                                       (dict(name="chat", group=0), "--prefix-group")])
def test_bad_dataset_input_is_one_clear_line(bad, words):
    with pytest.raises(ValueError, match=words):
        datasets.resolve(**{"input_len": None, "output_len": None, **bad})


def test_a_shared_prefix_past_half_the_context_says_what_to_pass():
    with pytest.raises(ValueError, match="pass --shared-prefix below 512"):
        datasets.lengths(datasets.DATASETS["agent"], 4, max_len=1024)


# -- percentiles, goodput, rates -----------------------------------------------------------------------

def test_percentiles_interpolate_as_numpy():
    np = pytest.importorskip("numpy")
    rng = random.Random(0)
    for n in (1, 2, 7, 100):
        xs = [rng.expovariate(1.0) for _ in range(n)]
        for q in (0, 50, 90, 99, 100):
            assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert math.isnan(percentile([], 50))
    assert summary([]) == {"mean": None, "p50": None, "p90": None, "p99": None, "max": None, "n": 0}
    assert summary([1.0, 3.0]) == {"mean": 2.0, "p50": 2.0, "p90": pytest.approx(2.8), "p99": pytest.approx(2.98),
                                   "max": 3.0, "n": 2}


def test_goodput_parsing_and_counting():
    assert parse_goodput(["ttft:2000", "tpot:50"]) == {"ttft": 2000.0, "tpot": 50.0}
    assert parse_goodput("e2el:1.5,ttft:10") == {"e2el": 1.5, "ttft": 10.0} and parse_goodput(None) == {}
    for bad in ("ttft", "ttft:", "ttft:abc", "itl:50", "tpot:-1", "tpot:0", "ttft:inf"):
        with pytest.raises(ValueError, match="KEY:MS") as e:
            parse_goodput([bad])
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="twice"):
        parse_goodput(["ttft:1", "ttft:2"])
    slo = {"ttft": 100.0, "tpot": 10.0}
    recs = [{"ok": True, "ttft_s": 0.05, "tpot_s": 0.005}, {"ok": True, "ttft_s": 0.2, "tpot_s": 0.005},
            {"ok": True, "ttft_s": 0.05, "tpot_s": 0.02}, {"ok": True, "ttft_s": 0.1, "tpot_s": None},
            {"ok": False, "ttft_s": 0.01, "tpot_s": 0.001}]
    assert [meets_slo(r, slo) for r in recs] == [True, False, False, True, False]
    assert goodput(recs, slo, 2.0) == {"good_requests": 2, "goodput_req_s": 1.0, "slo_attainment": 0.4}


def test_rates_and_modes_parse_or_fail_in_one_line():
    assert serve.parse_rates("1, 2.5,inf") == [1.0, 2.5, math.inf]
    for bad in ("0", "-1", "x", "1,,2", "nan"):
        with pytest.raises(ValueError, match="--request-rates"):
            serve.parse_rates(bad)
    assert parse_modes("compressed,uncompressed") == ["compressed", "uncompressed"]
    with pytest.raises(ValueError, match="unknown mode"):
        parse_modes("compressed,int4")
    assert parse_modes("compressed,fp8") == ["compressed", "fp8"]
    assert parse_modes("fp8,flashinfer_fp8", known=KERNEL_MODES) == ["fp8", "flashinfer_fp8"]
    assert parse_modes("fp8,flashinfer_fp8") == ["fp8", "flashinfer_fp8"]      # an engine mode too
    assert serve.parse_fractions("2,0.5,1") == [0.5, 1.0, 2.0]
    assert serve.sweep_rates(4.0, [0.5, 1, 2], []) == [2.0, 4.0, 8.0]
    # a later mode runs the first mode's grid, plus its own fractions past the grid's end
    assert serve.sweep_rates(6.0, [0.5, 1, 2], [2.0, 4.0, 8.0]) == [2.0, 4.0, 8.0, 12.0]


def synthetic_record(sent, first, gaps, tokens, ok=True, error=None):
    chunks = [sent + first]
    for g in gaps:
        chunks.append(chunks[-1] + g)
    rec = {"ok": ok, "error": error, "sent": sent, "chunks": chunks, "chunk_tokens": [1] * (len(chunks) - 1) + [
               tokens - len(chunks) + 1], "tokens": tokens, "output_tokens": tokens,
           "prompt_tokens": 10, "done": chunks[-1] + 0.001}
    return client.finish_record(rec)


def test_rate_row_counts_failed_and_lost_and_takes_latencies_in_ms():
    recs = [synthetic_record(0.0, 0.1, [0.01] * 4, 5), synthetic_record(0.5, 0.3, [0.02] * 4, 5),
            {"ok": False, "error": "HTTP 500: boom", "chunks": []},
            synthetic_record(1.0, 0.1, [0.01], 2, ok=False)]                 # no error, cut short: lost
    row = serve_results.rate_row(recs, 2.0, 4.0, {"ttft": 200.0})
    assert (row["completed"], row["failed"], row["lost"], row["num_requests"]) == (2, 1, 1, 4)
    assert row["errors"] == ["HTTP 500: boom"] and row["request_rate"] == 4.0
    assert row["ttft_ms"]["p50"] == pytest.approx(200.0) and row["ttft_ms"]["n"] == 2
    assert row["tpot_ms"]["mean"] == pytest.approx(15.0) and row["itl_ms"]["n"] == 8
    assert row["output_tok_s"] == pytest.approx(5.0) and row["requests_s"] == pytest.approx(1.0)
    assert row["good_requests"] == 1 and row["slo_attainment"] == 0.25
    row["server"] = {"peak_running": 3, "preemptions": 0, "metric_samples": 2}
    assert not serve_results.within_slo(row, 0.2)                   # a failed request: not sustained
    ok = serve_results.rate_row(recs[:2], 2.0, 2.0, {"ttft": 500.0})
    ok["server"] = {"peak_running": 2, "preemptions": 1, "metric_samples": 2}
    burst = serve_results.rate_row(recs[:2], 0.5, math.inf, {"ttft": 500.0})
    burst["server"] = {"peak_running": 4, "preemptions": 0, "metric_samples": 1}
    s = serve_results.mode_summary([ok, row, burst], {"ttft": 500.0}, 0.9)
    assert s["max_rate_within_slo"] == 2.0 and s["max_requests_s"] == pytest.approx(4.0) and s["peak_running"] == 4
    assert s["failed"] == 1 and s["lost"] == 1 and s["preemptions"] == 1 and burst["request_rate"] == "inf"
    for r in (ok, row, burst):                      # /metrics never sampled: no peak batch, not a 0
        r["server"]["metric_samples"] = 0
    assert serve_results.mode_summary([ok, row, burst], {"ttft": 500.0}, 0.9)["peak_running"] is None
    result = {"modes": {"compressed": {"rates": [dict(burst, memory_after={})]}}}
    assert serve_results.table_rows(result)[0]["peak_running"] == "not sampled"


def test_steady_output_counts_tokens_streamed_while_arrivals_last():
    """The steady rate leaves out the ramp (before the first quarter's last arrival) and the tail
    (after the last arrival): a run whose batch drains alone for long reads its sustained rate."""
    recs = [synthetic_record(float(i), 0.5, [1.0] * 9, 10) for i in range(8)]      # one token a second each
    recs.append(synthetic_record(8.0, 0.5, [1.0] * 99, 100))                     # a long tail alone
    a, b = 2.0, 8.0                                               # arrivals of request 9 // 4 = 2 and the last
    expect = sum(1 for r in recs for t in r["chunks"] if a <= t <= b)
    assert serve_results.steady_output_tok_s(recs) == pytest.approx(expect / (b - a))
    whole = serve_results.rate_row(recs, recs[-1]["done"], 1.0, {})
    assert whole["steady_output_tok_s"] > 2 * whole["output_tok_s"]               # the tail dilutes the whole
    assert serve_results.steady_output_tok_s([synthetic_record(0.0, 0.1, [0.01], 2)] * 8) is None   # at once
    # a closed loop of 4: the first 4 go at once, the rest as requests finish (the 5th at 3.0);
    # the window starts at the 5th send, not at the 9 // 4 = 2nd (still the ramp, at 0.0)
    loop = [synthetic_record(0.0 if i < 4 else float(i - 1), 0.5, [1.0] * 9, 10) for i in range(9)]
    a, b = 3.0, 7.0
    expect = sum(1 for r in loop for t in r["chunks"] if a <= t <= b)
    assert serve_results.steady_output_tok_s(loop, max_concurrency=4) == pytest.approx(expect / (b - a))
    assert serve_results.steady_output_tok_s(loop) == pytest.approx(
        sum(1 for r in loop for t in r["chunks"] if 0.0 <= t <= b) / b)
    whole["server"] = {"peak_running": 9, "preemptions": 0}
    s = serve_results.mode_summary([whole], {}, 0.9)
    assert s["max_steady_output_tok_s"] == whole["steady_output_tok_s"]


def test_metrics_text_and_memory_flatness():
    text = ('# HELP x\nzipfusion:num_requests_running{model_name="m"} 3.0\n'
            'zipfusion:kv_compressible_fraction{layer="0",model_name="m"} 0.5\n'
            'zipfusion:kv_compressible_fraction{layer="1",model_name="m"} 1.0\n'
            'zipfusion:kv_compressible_fraction{layer="2",model_name="m"} NaN\n')
    m = server_process.parse_metrics(text)
    assert m == {"zipfusion:num_requests_running": 3.0, "zipfusion:kv_compressible_fraction": 0.75}
    assert server_process.memory_check({"rss_mib": 1000.0}, {"rss_mib": 1100.0})["flat"] is True
    assert server_process.memory_check({"rss_mib": 1000.0}, {"rss_mib": 1400.0})["flat"] is False
    # judged after the first rate (its kernel builds are no leak), the whole growth reported
    m = server_process.memory_check({"rss_mib": 1000.0, "gpu_used_mib": 9000.0},
                                    {"rss_mib": 1400.0, "gpu_used_mib": 9500.0},
                                    {"rss_mib": 1350.0, "gpu_used_mib": 9000.0})
    assert m["growth_mib"] == {"rss_mib": 400.0, "gpu_used_mib": 500.0} and m["flat"] is False
    assert m["growth_after_first_rate_mib"] == {"rss_mib": 50.0, "gpu_used_mib": 500.0}
    assert server_process.memory_check({"rss_mib": None}, {"rss_mib": None})["flat"] is None
    assert server_process.process_memory(__import__("os").getpid())["rss_mib"] > 0


# -- the command line ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv,words", [
    (["serve", "--dataset", "sharegpt"], "unknown dataset"),
    (["serve", "--goodput", "ttft=2000"], "--goodput takes KEY:MS"),
    (["serve", "--request-rates", "0,1"], "--request-rates"),
    (["serve", "--compare", "compressed,bogus"], "unknown mode"),
    (["serve", "--url", "http://127.0.0.1:1", "--compare"], "one mode"),
    (["serve", "--url", "http://127.0.0.1:1", "--endpoint", "chat"], "--prompt-format text"),
    (["throughput", "--dataset", "nope", "--device", "cpu"], "unknown dataset"),
    (["serve", "--dataset", "multi_turn", "--device", "cpu"], "conversations run in zipfusion bench throughput"),
    (["throughput", "--dataset", "multi_turn", "--prompt-format", "text", "--device", "cpu", "--num-prompts", "2",
      "--input-len", "8", "--output-len", "2"], "--prompt-format ids"),
    (["throughput", "--num-prompts", "0", "--device", "cpu"], "--num-prompts"),
    (["throughput", "--engine-args", '{"kv_compression": false}', "--device", "cpu"], "--engine-args sets"),
    (["latency", "--batch-size", "0", "--device", "cpu"], "--batch-size"),
    (["kernel", "--device", "cpu", "--fractions", "2"], "--fractions"),
    (["kernel", "--linear", "--device", "cpu", "--models", "llama-9b"], "--models takes"),
    (["kernel", "--linear", "--device", "cpu", "--ms", "0"], "--ms takes"),
])
def test_bad_input_is_one_error_line(argv, words, capsys):
    assert main(["bench", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and words in err and "\n" not in err, err


@pytest.mark.parametrize("command", ["serve", "throughput", "latency", "kernel", "steps"])
def test_every_bench_subcommand_has_help_with_an_example(command, capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", command, "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "examples:" in out and f"zipfusion bench {command}" in out and "--compare" in out


def test_kernel_without_a_gpu_says_so(capsys):
    import torch
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    assert main(["bench", "kernel"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


# -- whole runs on the demo model (tiny) ---------------------------------------------------------------------

TINY = ["--model", "demo", "--device", "cpu", "--dataset", "random", "--input-len", "24", "--output-len", "6"]


def test_throughput_compare_on_the_demo_model(tmp_path, capsys):
    out = tmp_path / "tp"
    assert main(["bench", "throughput", *TINY, "--compare", "compressed,uncompressed,weights", "--num-prompts", "6",
                 "--kv-memory-gb", "0.002", "--out", str(out)]) == 0
    result = json.loads((tmp_path / "tp.json").read_text())
    assert (tmp_path / "tp.png").stat().st_size > 0
    meta = result["meta"]
    assert meta["benchmark"] == "zipfusion bench throughput" and meta["command"].startswith("zipfusion bench")
    assert all(k in meta for k in ("device_name", "torch", "triton", "git_commit", "date"))
    recs = {r["mode"]: r for r in result["records"]}
    assert set(recs) == {"compressed", "uncompressed", "weights"}
    w = recs.pop("weights")                 # weights compressed too: its KV gets what they saved
    assert "error" not in w and w["output_tokens"] == 36 and w["kv_memory_gb_asked"] == 0.002
    assert w["kv_memory_gb"] == pytest.approx(0.002 + w["weights_gb"] - w["weights_stored_gb"])
    assert w["weights_stored_gb"] < w["weights_gb"] == recs["compressed"]["weights_stored_gb"]
    assert w["outputs_sha256"] == recs["compressed"]["outputs_sha256"]
    steps = json.loads((tmp_path / "tp_steps.json").read_text())       # every step, by mode, apart
    del steps["weights"]
    assert set(steps) == set(recs) and "step_log" not in recs["compressed"]
    for mode, r in recs.items():
        assert len(steps[mode]["rows"]) == r["steps"] and "decode_rows" in steps[mode]["fields"]
        assert "error" not in r, r.get("error")
        assert r["requests"] == r["finished"] == 6 and r["output_tokens"] == r["expected_output_tokens"] == 36
        assert r["total_tok_s"] > r["output_tok_s"] > 0 and r["peak_batch"] >= 1 and r["wall_s"] > 0
        assert r["dataset"]["prompt_tokens"]["total"] == r["prompt_tokens"] == 6 * 24
        assert r["kv_memory_gb"] == 0.002 and "preemptions" in r
    assert recs["compressed"]["stored_ratio"] < 1.0 == recs["uncompressed"]["stored_ratio"]
    assert 0 < recs["compressed"]["compressible_fraction"] <= 1
    ratio = result["ratios"]["compressed/uncompressed"]
    assert set(ratio) == {"total_tok_s", "output_tok_s", "requests_s", "decode_tok_s_at_peak_batch", "peak_batch"}
    assert ratio["total_tok_s"] == pytest.approx(recs["compressed"]["total_tok_s"] / recs["uncompressed"]["total_tok_s"])
    assert result["identical_outputs"] is True                  # greedy, one schedule: the same tokens
    printed = capsys.readouterr().out.strip().splitlines()
    at = printed.index("identical tokens across modes: True")
    assert "compressed/uncompressed" in printed[at - 2] and "compressed/weights" in printed[at - 1]
    short = any(r["wall_s"] < 1 for r in [*recs.values(), w])     # a run under a second: its ratios are noise
    assert (result["ratio_note"] is not None) == short == any(line.startswith("NOTE: ") for line in printed)


@pytest.mark.parametrize("steps", ["1:3", "0:2"])
def test_throughput_profile_steps_writes_a_trace_and_the_top_operators(tmp_path, capsys, steps):
    import gzip
    out = tmp_path / "tp"
    assert main(["bench", "throughput", *TINY, "--mode", "compressed", "--num-prompts", "4", "--kv-memory-gb",
                 "0.002", "--profile-steps", steps, "--out", str(out)]) == 0
    (rec,) = json.loads((tmp_path / "tp.json").read_text())["records"]
    prof = rec["profile"]
    assert prof["steps"] == [int(x) for x in steps.split(":")]
    assert prof["trace"] == str(out) + "_compressed.trace.json.gz"
    assert json.loads(gzip.open(prof["trace"]).read())["traceEvents"]        # a Chrome trace
    assert prof["top_ops"] and all(op["calls"] > 0 for op in prof["top_ops"])
    for bad in ("3:1", "x", "1:2:3", "-1:2"):
        assert main(["bench", "throughput", *TINY, f"--profile-steps={bad}"]) == 2
        assert "--profile-steps takes START:END" in capsys.readouterr().err


def test_throughput_compares_the_lossy_fp8_kv_cache(tmp_path):
    """fp8 (E4M3 KV pages, vLLM's --kv-cache-dtype fp8) beside the lossless mode, same memory."""
    assert main(["bench", "throughput", *TINY, "--compare", "compressed,fp8,flashinfer_fp8", "--num-prompts",
                 "6", "--kv-memory-gb", "0.002", "--out", str(tmp_path / "tp")]) == 0
    result = json.loads((tmp_path / "tp.json").read_text())
    recs = {r["mode"]: r for r in result["records"]}
    assert set(recs) == {"compressed", "fp8", "flashinfer_fp8"}
    assert "CUDA" in recs.pop("flashinfer_fp8")["skipped"]      # FlashInfer's FP8 decode: CUDA only
    for r in recs.values():
        assert "error" not in r, r.get("error")
        assert r["requests"] == r["finished"] == 6 and r["output_tokens"] == 36
    assert "compressed/fp8" in result["ratios"]


# benchmarks/workloads.py's scenarios as `bench throughput` runs: (dataset, --num-prompts, other flags)
WORKLOADS = {"burst": ("burst", 72, {}), "mix": ("mix", 600, {}), "long": ("long32k", 16, {}),
             "deterministic": ("burst", 24, {"output_len": 128}), "long_generation": ("long_generation", 64, {}),
             "shared_prefix": ("shared_prefix", 512, {}), "multi_turn": ("multi_turn", 64, {}),
             "long_swap": ("long32k", 16, {}), "long_recompute": ("long32k", 16, {})}


def test_steps_tables_decode_steps_at_equal_rows(tmp_path, capsys):
    """`bench steps`: prefill steps left out; per (rows, mode) the wall-time percentiles in ms, the
    seal's mean, the context a row (nan where the log has no context column); bad files: one line."""
    fields = ["decode_rows", "prefill_tokens", "seconds", "seal_s", "context_tokens"]
    rows = [[2, 0, 0.001, 0.0001, 100], [2, 0, 0.003, 0.0003, 300], [2, 64, 9.0, 0.0, 0], [1, 0, 0.002, 0.0, 50]]
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"compressed": {"fields": fields, "rows": rows},
                                "old": {"fields": fields[:4], "rows": [r[:4] for r in rows]}}))
    assert main(["bench", "steps", str(path)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[2:] == ["| 1 | compressed | 1 | 2.00 | 2.00 | 2.00 | 0.000 | 50 |",
                         "| 1 | old | 1 | 2.00 | 2.00 | 2.00 | 0.000 | nan |",
                         "| 2 | compressed | 2 | 2.00 | 2.80 | 2.98 | 0.200 | 100 |",
                         "| 2 | old | 2 | 2.00 | 2.80 | 2.98 | 0.200 | nan |"]
    path.write_text('{"records": []}')
    for bad, words in ((path, "is not a step log"), (tmp_path / "none.json", "No such file")):
        assert main(["bench", "steps", str(bad)]) == 2
        assert words in capsys.readouterr().err


def test_the_workload_scenarios_are_datasets_drawing_the_committed_runs_requests():
    """Each committed workloads.py record's prompt and output tokens are what `bench throughput
    --dataset` draws for its mapping (seed 0; a conversation's turn prompts hold what came before)."""
    from pathlib import Path
    path = Path(__file__).parents[1] / "benchmarks/results/workloads_h200/workloads.json"
    records = {r["scenario"]: r for r in json.loads(path.read_text())["records"] if "prompt_tokens" in r}
    assert set(WORKLOADS) <= set(records)
    for scenario, (name, n, flags) in WORKLOADS.items():
        dist = datasets.resolve(name, **{"input_len": None, "output_len": None, **flags})
        plens, olens, clipped = datasets.lengths(dist, n, seed=0, max_len=33792)
        turns = range(dist.turns)
        prompt = sum(dist.shared_prefix + p + t * (dist.turn_prompt + o) for p, o in zip(plens, olens) for t in turns)
        r = records[scenario]
        assert (r["requests"], r["prompt_tokens"], r["output_tokens"], clipped) == (
            n * dist.turns, prompt, sum(olens) * dist.turns, 0), scenario


@pytest.mark.parametrize("name,extra", [("burst", []), ("mix", []), ("long32k", []), ("long_generation", []),
                                        ("shared_prefix", ["--shared-prefix", "32", "--prefix-group", "2",
                                                           "--max-num-batched-tokens", "64"]),  # a prompt a step
                                        ("multi_turn", [])])
def test_throughput_runs_each_workload_dataset_on_the_demo_model(name, extra, tmp_path, monkeypatch):
    """`bench throughput --dataset NAME` end to end, tiny (the worker in this process, the JSON it
    would send back): every request and turn finishes; shared prompts hit the prefix cache."""
    import torch

    from zipfusion.bench import offline, throughput
    threads = torch.get_num_threads()
    monkeypatch.setattr(offline, "run_job", lambda kind, job, timeout, threads=0: {"process_s": 0.0, **json.loads(
        json.dumps(throughput.worker(json.loads(json.dumps(job))), default=float))})
    try:
        assert main(["bench", "throughput", "--model", "demo", "--device", "cpu", "--dataset", name, "--input-len",
                     "24", "--output-len", "3", "--num-prompts", "4", "--kv-memory-gb", "0.002", "--cpu-threads",
                     "1", "--mode", "compressed", *extra, "--out", str(tmp_path / "tp")]) == 0
    finally:
        torch.set_num_threads(threads)
    (r,) = json.loads((tmp_path / "tp.json").read_text())["records"]
    turns = datasets.DATASETS[name].turns
    assert "error" not in r, r.get("error")
    assert r["requests"] == r["finished"] == 4 * turns and r["output_tokens"] == r["expected_output_tokens"]
    assert r["expected_output_tokens"] == 12 * turns or datasets.DATASETS[name].output_cap     # mix: drawn
    assert (r["prefix_hit_tokens"] > 0) == (name in ("shared_prefix", "multi_turn"))


def test_conversations_scale_their_turns_and_refuse_text_prompts_and_a_context_they_overrun():
    d = datasets.resolve("multi_turn", input_len=24, output_len=3)
    assert (d.prompt, d.output, d.turns, d.turn_prompt) == (24, 3, 8, 6)      # 256 of 1,024 a turn: 6 of 24
    ds = datasets.build(d, "multi_turn", 3, seed=2)
    assert [len(t) for t in ds.turns] == [7] * 3 and all(len(m) == 6 for t in ds.turns for m in t)
    assert ds.turns[0] != ds.turns[1] and datasets.build(d, "multi_turn", 3, seed=2).turns == ds.turns
    with pytest.raises(ValueError, match="--prompt-format ids"):
        datasets.build(datasets.DATASETS["multi_turn"], "multi_turn", 2, text=True)
    with pytest.raises(ValueError, match="8 turns of 256 \\+ 256 tokens .* --max-model-len"):
        datasets.lengths(datasets.DATASETS["multi_turn"], 2, max_len=4096)


def test_latency_on_the_demo_model(tmp_path):
    assert main(["bench", "latency", "--model", "demo", "--device", "cpu", "--batch-size", "3", "--input-len", "20",
                 "--output-len", "4", "--num-iters", "2", "--kv-memory-gb", "0.002", "--out", str(tmp_path / "lat")]) == 0
    (rec,) = json.loads((tmp_path / "lat.json").read_text())["records"]
    assert rec["mode"] == "compressed" and len(rec["iterations"]) == 2 and rec["batch_size"] == 3
    assert 0 < rec["prefill_s_p50"] < rec["e2e_s_p50"] and rec["decode_ms_per_token_p50"] > 0
    assert all(it["output_tokens"] == 12 for it in rec["iterations"])


def test_kernel_smoke_on_the_cpu(tmp_path):
    assert main(["bench", "kernel", "--device", "cpu", "--fractions", "1", "--out", str(tmp_path / "k")]) == 0
    result = json.loads((tmp_path / "k.json").read_text())
    assert result["config"]["smoke"] and "CUDA" in result["config"]["flashinfer_skipped"]
    kernels = {r["kernel"]: r for r in result["records"]}
    assert set(kernels) == {"fused", "uncompressed"} and kernels["fused"]["bit_identical_to_uncompressed"] is True
    (case,) = result["cases"]
    assert case["compressed/uncompressed"] == pytest.approx(kernels["uncompressed"]["median_ms"]
                                                            / kernels["fused"]["median_ms"])
    assert case["stored_ratio"] < 1.0


def test_kernel_smoke_head_dim_256(tmp_path):
    assert main(["bench", "kernel", "--device", "cpu", "--fractions", "1", "--head-dim", "256", "--compare",
                 "compressed,uncompressed", "--out", str(tmp_path / "k")]) == 0
    result = json.loads((tmp_path / "k.json").read_text())
    assert result["config"]["shape"]["d"] == 256
    assert all(r["bit_identical_to_uncompressed"] for r in result["records"] if r["kernel"] == "fused")
def test_kernel_linear_smoke_on_the_cpu(tmp_path):
    """--linear: the fused kernel and the dispatch beside cuBLAS's stand-in, restore bit-identical."""
    assert main(["bench", "kernel", "--linear", "--device", "cpu", "--out", str(tmp_path / "w")]) == 0
    result = json.loads((tmp_path / "w.json").read_text())
    assert result["config"]["smoke"]
    restore = next(r for r in result["records"] if r["kernel"] == "restore")
    assert restore["bit_identical"] is True and restore["stored_ratio"] < 1.0     # K=300 pads to 384
    assert all(r["rel_err_vs_cublas"] < 1e-2 for r in result["records"] if "rel_err_vs_cublas" in r)
    for case in result["cases"]:
        assert case["cublas/fused"] == pytest.approx(case["cublas"] / case["fused"])


def test_kernel_smoke_fp8_modes_on_the_cpu(tmp_path):
    """The lossy FP8 kernel beside the uncompressed one: timed, its quantization error reported
    (small, not zero on random values); FlashInfer's FP8 mode is skipped off CUDA, with a note."""
    assert main(["bench", "kernel", "--device", "cpu", "--fractions", "1", "--compare",
                 "uncompressed,fp8,flashinfer_fp8", "--out", str(tmp_path / "k")]) == 0
    result = json.loads((tmp_path / "k.json").read_text())
    assert "CUDA" in result["config"]["flashinfer_skipped"]
    kernels = {r["kernel"]: r for r in result["records"]}
    assert set(kernels) == {"uncompressed", "fp8"}
    assert 0 < kernels["fp8"]["rel_err_vs_uncompressed"] < 0.1
    assert kernels["fp8"]["bytes_read"] * 2 == kernels["uncompressed"]["bytes_read"]
    (case,) = result["cases"]
    assert case["fp8"] == kernels["fp8"]["median_ms"] and case["fp8/flashinfer_fp8"] is None


def test_kernel_smoke_fp8_lossless_on_the_cpu(tmp_path):
    """Our kernel over the E4M3 pages encoded in the lossless FP8 block format beside the open
    ones: the same bits, fewer bytes read, its ratio columns filled."""
    assert main(["bench", "kernel", "--device", "cpu", "--fractions", "1", "--compare", "fp8,fp8_lossless",
                 "--out", str(tmp_path / "k")]) == 0
    result = json.loads((tmp_path / "k.json").read_text())
    kernels = {r["kernel"]: r for r in result["records"]}
    assert set(kernels) == {"fp8", "fp8_lossless"} and kernels["fp8_lossless"]["bit_identical_to_fp8"] is True
    stored = kernels["fp8_lossless"]["fp8_lossless_stored_ratio"]
    assert 0.5 < stored < 1.0 and kernels["fp8_lossless"]["bytes_read"] == stored * kernels["fp8"]["bytes_read"]
    (case,) = result["cases"]
    assert case["fp8_lossless/fp8"] == pytest.approx(kernels["fp8"]["median_ms"] / kernels["fp8_lossless"]["median_ms"])
    assert case["fp8_lossless_stored_ratio"] == stored


def test_serve_against_a_real_server_on_loopback(tmp_path, capsys):
    """A ``zipfusion serve --model demo --device cpu --no-kv-compression`` process (the mode's
    flag), text prompts (the demo model has a tokenizer), one Poisson rate, an SLO."""
    for module in ("fastapi", "uvicorn", "prometheus_client", "httpx"):
        pytest.importorskip(module, reason=f"zipfusion bench serve's test needs {module} (pip install -e '.[test]')")
    out = tmp_path / "serve"
    rc = main(["bench", "serve", *TINY, "--mode", "uncompressed", "--num-prompts", "6", "--request-rates", "8",
               "--warmup", "1", "--prompt-format", "text", "--kv-memory-gb", "0.01", "--goodput", "ttft:60000",
               "tpot:60000", "--metrics-interval", "0.2", "--timeout", "120", "--startup-timeout", "120",
               "--out", str(out)])
    printed = capsys.readouterr()
    assert rc == 0, printed.err[-3000:]
    result = json.loads((tmp_path / "serve.json").read_text())
    assert (tmp_path / "serve.png").stat().st_size > 0
    assert result["config"]["goodput"] == {"ttft": 60000.0, "tpot": 60000.0} and result["meta"]["git_commit"]
    m = result["modes"]["uncompressed"]
    assert m["server"]["max_model_len"] == 1024 and "--kv-memory-gb 0.01 --no-kv-compression" in m["server"]["command"]
    (row,) = m["rates"]
    assert row["request_rate"] == 8.0 and row["completed"] == 6 and row["failed"] == row["lost"] == 0
    assert row["output_tokens"] == 36 and row["input_tokens"] > 0 and row["ttft_ms"]["n"] == 6
    assert row["tpot_ms"]["p50"] > 0 and row["itl_ms"]["p99"] >= row["itl_ms"]["p50"] > 0
    assert row["goodput_req_s"] == pytest.approx(row["requests_s"]) and row["slo_attainment"] == 1.0
    assert row["server"]["generation_tokens"] == 36 and row["server"]["metric_samples"] >= 1
    assert row["server"]["stored_ratio"] == 1.0                         # uncompressed: pages stored as they are
    assert row["memory_after"]["rss_mib"] > 0 and m["memory"]["flat"] is True
    assert m["summary"]["max_rate_within_slo"] == 8.0 and result["comparison"]["ratios"] == {}
    assert "uncompressed     8" in printed.out


def test_the_comparison_of_modes_and_their_server_flags():
    """--compare: one server per mode, its flags; the highest rate each sustains within the SLO and the ratios."""
    import argparse
    args = argparse.Namespace(kv_memory_gb=16.0, max_num_seqs=None, max_num_batched_tokens=None, max_model_len=4096,
                              server_args="--max-num-seqs 128 --no-enable-prefix-caching")
    assert server_process.server_flags(args, "compressed") == ["--kv-memory-gb", "16.0", "--max-model-len", "4096",
                                                               "--no-weight-compression", "--max-num-seqs", "128",
                                                               "--no-enable-prefix-caching"]
    assert server_process.server_flags(args, "weights")[4:6] == ["--weight-compression", "--kv-gets-weight-savings"]
    assert server_process.server_flags(args, "flashinfer")[4:7] == ["--no-kv-compression", "--attention-backend",
                                                                    "flashinfer"]
    result = {"config": {"goodput": {}},
              "modes": {"compressed": {"summary": {"max_rate_within_slo": 6.0, "max_output_tok_s": 900.0}},
                        "uncompressed": {"summary": {"max_rate_within_slo": 4.0, "max_output_tok_s": 600.0}},
                        "flashinfer": {"skipped": "FlashInfer runs on CUDA only"}}}
    comp = serve_results.comparison(result, ["compressed", "uncompressed", "flashinfer"])
    assert set(comp["per_mode"]) == {"compressed", "uncompressed"}
    ratio = comp["ratios"]["compressed/uncompressed"]
    assert ratio["max_rate_within_slo"] == 1.5 and ratio["max_output_tok_s"] == 1.5
    assert math.isnan(ratio["peak_running"]) and "compressed/flashinfer" not in comp["ratios"]


def test_merge_of_runs_one_mode_each(tmp_path, capsys):
    """--merge: one mode per call (a time limit per call), then one comparison; runs of another
    workload are refused in one line."""
    def run_json(path, mode, rate_ok, kv=16.0):
        row = serve_results.rate_row([synthetic_record(0.0, 0.1, [0.01] * 4, 5)], 1.0, rate_ok, {"ttft": 500.0})
        row.update(server={"peak_running": 2, "preemptions": 0}, memory_after={"rss_mib": 100.0})
        config = {"model": "m", "dataset": "reasoning", "length_dist": {}, "num_prompts": 1, "prompt_format": "ids",
                  "kv_memory_gb": kv, "max_concurrency": None, "goodput": {"ttft": 500.0}, "slo_attainment": 0.9,
                  "seed": 0, "modes": [mode], "num_prompts_note": None}
        summary = serve_results.mode_summary([row], {"ttft": 500.0}, 0.9)
        path.write_text(json.dumps({"meta": {"command": f"run {mode}", "device_name": "gpu"}, "config": config,
                                    "modes": {mode: {"rates": [row], "summary": summary}}}))
    run_json(tmp_path / "u.json", "uncompressed", 2.0)
    run_json(tmp_path / "c.json", "compressed", 3.0)
    assert main(["bench", "serve", "--merge", str(tmp_path / "u.json"), str(tmp_path / "c.json"),
                 "--out", str(tmp_path / "both")]) == 0
    merged = json.loads((tmp_path / "both.json").read_text())
    assert merged["config"]["modes"] == ["compressed", "uncompressed"]              # compressed first: the ratios
    assert merged["comparison"]["ratios"]["compressed/uncompressed"]["max_rate_within_slo"] == 1.5
    assert merged["meta"]["command"] == "run uncompressed; run compressed"
    assert "compressed/uncompressed" in capsys.readouterr().out.strip().splitlines()[-1]
    run_json(tmp_path / "c8.json", "compressed", 3.0, kv=8.0)
    assert main(["bench", "serve", "--merge", str(tmp_path / "u.json"), str(tmp_path / "c8.json")]) == 2
    assert "kv_memory_gb" in capsys.readouterr().err


def test_the_highest_rate_within_the_slo_needs_every_lower_rate_within_it_too():
    slo = {"ttft": 150.0}
    fast, slow = synthetic_record(0.0, 0.1, [0.01], 2), synthetic_record(0.0, 0.3, [0.01], 2)
    rows = []
    for rate, rec in ((1.0, slow), (2.0, fast), (4.0, fast)):
        row = serve_results.rate_row([rec], 1.0, rate, slo)
        row["server"] = {}
        rows.append(row)
    assert serve_results.mode_summary(rows, slo, 0.9)["max_rate_within_slo"] == 0.0   # the lowest rate missed it
    assert serve_results.mode_summary(rows[1:], slo, 0.9)["max_rate_within_slo"] == 4.0
    assert serve_results.mode_summary(rows[1:], {}, 0.9)["max_rate_within_slo"] is None
    # a run cut short (a time limit): summarised from the rates it finished, marked partial
    result = {"config": {"goodput": slo, "slo_attainment": 0.9},
              "modes": {"compressed": {"rates": rows[1:], "partial": True},
                        "uncompressed": {"summary": serve_results.mode_summary(rows[1:2], slo, 0.9)}}}
    comp = serve_results.comparison(result, ["compressed", "uncompressed"])
    assert comp["per_mode"]["compressed"]["partial"] and comp["ratios"]["compressed/uncompressed"][
        "max_rate_within_slo"] == 2.0


def test_run_requests_keeps_at_most_max_in_flight_unfinished():
    """A closed loop: the next request is added only as one finishes; every request completes."""
    from zipfusion import LLMEngine
    from zipfusion.bench.offline import run_requests
    eng = LLMEngine("demo", device="cpu", kv_memory_gb=0.01, max_model_len=128)
    seen = []
    on_step = lambda e, res: seen.append(len(e.scheduler.running) + len(e.scheduler.waiting))  # noqa: E731
    reqs, steps, _ = run_requests(eng, [[5 + i] * 6 for i in range(7)], [3, 5, 2, 4, 3, 2, 6], on_step=on_step,
                                  progress_s=1e9, max_in_flight=3)
    assert len(reqs) == 7 and all(r.finish_reason == "length" for r in reqs)
    assert [len(r.output_ids) for r in reqs] == [3, 5, 2, 4, 3, 2, 6]
    assert max(seen) == 3 and len(steps) > 6


def test_serve_url_with_an_api_key_chat_endpoint_and_a_sharegpt_file(tmp_path, capsys, monkeypatch):
    """--url of a running server that wants a key ($OPENAI_API_KEY), /v1/chat/completions, a
    ShareGPT-style file; the result labeled with what the server reports, the key not recorded."""
    for module in ("fastapi", "uvicorn", "prometheus_client", "httpx"):
        pytest.importorskip(module, reason=f"this test needs {module} (pip install -e '.[test]')")
    import threading

    import uvicorn

    from zipfusion.engine import LLMEngine
    from zipfusion.server import bind_socket
    from zipfusion.server.openai import create_app
    engine = LLMEngine("demo", device="cpu", kv_memory_gb=0.02, max_model_len=256, kv_compression=False,
                       dtype="float32")
    sock = bind_socket("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(create_app(engine, "zf", api_key="sekret"), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    conversations = [{"conversations": [{"from": "human", "value": f"Tell me of the land of {w} and its rivers"},
                                        {"from": "gpt", "value": "And the river went out of the garden " * (1 + i)}]}
                     for i, w in enumerate(["Egypt", "Canaan", "Moab", "Edom", "Ur"])]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(conversations))
    try:
        while not server.started:
            time.sleep(0.01)
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        argv = ["bench", "serve", "--url", url, "--endpoint", "chat", "--dataset-path", str(path), "--num-prompts",
                "4", "--request-rates", "inf", "--warmup", "1", "--metrics-interval", "0.2", "--timeout", "120",
                "--out", str(tmp_path / "s")]
        monkeypatch.delenv("OPENAI_API_KEY", raising=False)
        assert main(argv) == 2 and "--api-key" in capsys.readouterr().err       # 401: says what to pass
        monkeypatch.setenv("OPENAI_API_KEY", "sekret")
        rc = main(argv)
        printed = capsys.readouterr()
        assert rc == 0, printed.err[-3000:]
    finally:
        server.should_exit = True
        thread.join(timeout=15)
        sock.close()
    result = json.loads((tmp_path / "s.json").read_text())
    assert list(result["modes"]) == ["uncompressed"]                   # the server's mode, not the default
    assert result["config"]["model"] == "zf" and result["config"]["kv_memory_gb"] == pytest.approx(0.02)
    assert result["config"]["dataset"] == "sharegpt" and result["config"]["endpoint"] == "chat"
    (row,) = result["modes"]["uncompressed"]["rates"]
    assert row["completed"] == 4 and row["failed"] == row["lost"] == 0 and row["output_tokens"] >= 4 * 4
    assert "sekret" not in (tmp_path / "s.json").read_text()
    for words in ("uncompressed, rate inf", "Mean TTFT (ms):", "Median TPOT (ms):",
                  "P99 ITL (ms):", "Total generated tokens:"):
        assert words in printed.out, words


def test_help_examples_continue_their_lines_and_name_their_subcommand():
    from zipfusion.bench.cli import EXAMPLES
    for name, text in EXAMPLES.items():
        assert text.startswith(f"zipfusion bench {name}, examples:")
        lines = text.splitlines()
        for line, nxt in zip(lines, lines[1:]):
            if nxt.startswith("      --"):               # a continued command: its line ends with a backslash
                assert line.endswith(" \\"), (name, line)


def test_the_plot_draws_only_what_it_has_and_keeps_noise_small(tmp_path, monkeypatch):
    """p50 and p99 in different styles, no legend entry for a line with no points (no steady
    rate), latency axes spanning at least a decade, throughputs from zero."""
    pytest.importorskip("matplotlib")
    figs = []
    plt = report.pyplot()
    monkeypatch.setattr(plt, "close", figs.append)
    lat = lambda v: {"p50": v, "p99": v * 1.02, "mean": v, "p90": v, "max": v, "n": 4}  # noqa: E731
    rows = [{"request_rate": r, "requests_s": r, "output_tok_s": 100.0 + r, "steady_output_tok_s": None,
             "ttft_ms": lat(50.0 + r), "tpot_ms": lat(20.0), "server": {}} for r in (1.0, 2.0)]
    result = {"config": {"goodput": {}, "max_concurrency": None, "model": "m", "dataset": "chat", "num_prompts": 4,
                         "kv_memory_gb": 1}, "meta": {"device_name": "cpu"}, "modes": {"compressed": {"rates": rows}}}
    assert serve_results.plot(result, str(tmp_path / "p.png"))
    (fig,) = figs
    ttft, tpot, tok, req = fig.axes
    styles = {line.get_label(): (line.get_linestyle(), line.get_marker()) for line in tpot.get_lines()}
    assert styles["compressed p50"] != styles["compressed p99"]
    labels = [t.get_text() for t in tok.get_legend().get_texts()]
    assert labels == ["compressed"]                         # no "while arrivals last": nothing to draw
    lo, hi = tpot.get_ylim()
    assert hi / lo >= 9.99 and tok.get_ylim()[0] == 0 and req.get_ylim()[0] == 0


def test_cpu_throughput_defaults_and_the_noise_note():
    from types import SimpleNamespace

    from zipfusion.bench import throughput
    args = SimpleNamespace(num_prompts=None, input_len=None, output_len=8)
    throughput.size_defaults(args, "cpu")
    assert (args.num_prompts, args.input_len, args.output_len) == (16, 64, 8)       # what was given is kept
    args = SimpleNamespace(num_prompts=None, input_len=None, output_len=None)
    throughput.size_defaults(args, "cuda")
    assert args.num_prompts == 200 and args.input_len is None
    assert throughput.noise_note([{"mode": "compressed", "wall_s": 0.4}, {"mode": "uncompressed", "wall_s": 3.0}])
    assert throughput.noise_note([{"mode": "compressed", "wall_s": 2.0}, {"mode": "x", "error": "boom"}]) is None


def test_the_bench_extra_runs_the_readme_bench_lines():
    """`pip install -e ".[bench]"` alone: the server the benchmark starts and the models it loads."""
    import tomllib
    from pathlib import Path
    extras = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    names = {d.split(">")[0].split("=")[0].split("[")[0] for d in extras["bench"]}
    needed = {d.split(">")[0] for d in extras["server"] + extras["models"]} | {"httpx", "matplotlib"}
    assert needed <= names, needed - names
