"""CLI: ``zipfusion generate`` on a tiny checkpoint, ``demo`` model half, errors."""

import re

import pytest

pytest.importorskip("transformers")

import zipfusion  # noqa: E402
from zipfusion.cli import main, run_demo  # noqa: E402
from zipfusion.models.loader import DEMO_DIR  # noqa: E402
from helpers import save_tiny_checkpoint, save_word_tokenizer  # noqa: E402


def test_generate_prints_what_the_api_returns(tmp_path, capsys):
    save_tiny_checkpoint(tmp_path)
    save_word_tokenizer(tmp_path)
    args = ["generate", "--model", str(tmp_path), "--prompt", "w5 w6 w7", "--prompt", "w9", "--device", "cpu",
            "--dtype", "float32", "--no-kv-compression", "--max-tokens", "6", "--ignore-eos"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    llm = zipfusion.LLM(str(tmp_path), device="cpu", dtype="float32", kv_compression=False)
    outs = llm.generate(["w5 w6 w7", "w9"], zipfusion.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                        use_tqdm=False)
    for o in outs:
        assert o.text and o.text in printed


def test_cli_errors_are_short(tmp_path, capsys):
    save_tiny_checkpoint(tmp_path)
    assert main(["generate", "--model", str(tmp_path), "--prompt-token-ids", "1,2", "--device", "cpu",
                 "--dtype", "float32"]) == 2
    assert "bfloat16" in capsys.readouterr().err
    assert main(["generate", "--model", str(tmp_path / "nope"), "--prompt", "x", "--device", "cpu"]) == 2
    assert "no such folder" in capsys.readouterr().err


@pytest.mark.skipif(not (DEMO_DIR / "model.safetensors").is_file(), reason="demo model not in the package")
def test_demo_model_compressed_equals_uncompressed():
    lines = []
    res = run_demo(max_tokens=20, prompts=["In the beginning God created the heaven and the earth."],
                   echo=lines.append)
    assert res["identical"]
    assert res["stats"]["stored_pages"] > 0 and res["stats"]["stored_ratio"] < 1
    assert any("identical: yes" in line for line in lines)


@pytest.mark.skipif(not (DEMO_DIR / "model.safetensors").is_file(), reason="demo model not in the package")
def test_generate_with_chat_template_on_the_demo_model(capsys):
    assert main(["generate", "--model", "demo", "--prompt", "Who made the heaven?", "--chat", "--device", "cpu",
                 "--max-tokens", "8", "--seed", "3", "--temperature", "0.7"]) == 0
    out = capsys.readouterr()
    assert out.out.strip() and "tokens in" in out.err
    from zipfusion.models import Tokenizer
    chat = Tokenizer(DEMO_DIR).apply_chat_template([{"role": "user", "content": "Who made the heaven?"}])
    assert chat.endswith("Assistant:") and "User: Who made the heaven?" in chat


# -- issue 14: fast help, versions, one-line errors ---------------------------------------------------

import os  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

SRC = str(Path(zipfusion.__file__).resolve().parents[1])


def _run(args, timeout=60, **env):
    e = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), **env}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=e)


def test_help_is_fast_and_imports_no_torch():
    r = _run(["-c", "import sys, zipfusion, zipfusion.cli; zipfusion.cli.build_parser(); "
                    "print('torch' in sys.modules, 'fastapi' in sys.modules)"])
    assert r.stdout.split() == ["False", "False"], r.stderr
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        r = _run(["-m", "zipfusion", "--help"])
        best = min(best, time.perf_counter() - t0)
        assert r.returncode == 0 and "generate" in r.stdout
    assert best < 0.5, f"zipfusion --help took {best:.2f} s"
    assert _run(["-m", "zipfusion", "--version"]).stdout.strip() == f"zipfusion {zipfusion.__version__}"


@pytest.mark.parametrize("command", ["generate", "demo", "serve", "analyze"])
def test_every_subcommand_help_shows_defaults(command, capsys):
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "default" in out and "(default: None)" not in out and "turn off:" not in out
    flat = " ".join(out.split())
    if command in ("generate", "serve"):          # issue 48: a --no-* flag says what it does
        assert "--no-kv-compression keep KV pages uncompressed" in flat
        assert "--no-enable-prefix-caching compute every prompt in full" in flat
        assert "0 on the CPU" in flat                                   # --kv-host-memory-gb's real default
        assert "only with --deterministic" in flat                      # when a seed repeats
    if command == "analyze":
        assert ".gguf file" in flat and "{auto,safetensors,gguf,random}" in flat
    if command == "generate":
        assert "temperature 0" in out and "1.0" in out                 # its greedy default, said plainly
    if command == "serve":
        assert "ZIPFUSION_API_KEY" in out and "--served-model-name" in out and "(default: auto)" in out


def test_lazy_package_attributes():
    assert zipfusion.SamplingParams().temperature == 1.0
    assert {"LLM", "SamplingParams", "EngineConfig"} <= set(dir(zipfusion))
    with pytest.raises(AttributeError):
        zipfusion.nothing_here


def _one_error_line(err: str, *words):
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err and all(w in lines[0] for w in words), err


def _too_much_gb() -> str:
    from zipfusion.engine.build import free_memory_gb
    import torch
    return str(max(60, int(free_memory_gb(torch.device("cpu"))) + 100))


def test_too_much_kv_memory_is_one_clear_line(capsys):
    gb = _too_much_gb()
    # issue 48: the README snippet once asked for 60 GiB; more than is free is one line that says what to do
    with pytest.raises(ValueError, match="kv_memory_gb") as e:
        zipfusion.LLM(model="demo", kv_compression=True, kv_memory_gb=float(gb), dtype="bfloat16", device="cpu")
    assert "\n" not in str(e.value) and "leave it out" in str(e.value)
    assert main(["generate", "--model", "demo", "--device", "cpu", "--prompt", "x", "--kv-memory-gb", gb]) == 2
    _one_error_line(capsys.readouterr().err, "kv_memory_gb")
    pytest.importorskip("uvicorn")
    assert main(["serve", "--model", "demo", "--device", "cpu", "--port", "0", "--kv-memory-gb", gb]) == 2
    _one_error_line(capsys.readouterr().err, "kv_memory_gb")


def test_max_model_len_beyond_the_model_is_one_line(capsys):
    assert main(["generate", "--model", "demo", "--device", "cpu", "--prompt", "x", "--max-model-len", "5000"]) == 2
    _one_error_line(capsys.readouterr().err, "max_model_len", "1024")


def test_missing_extras_say_what_to_install(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "uvicorn", None)            # as if not installed
    assert main(["serve", "--model", "demo"]) == 2
    _one_error_line(capsys.readouterr().err, "pip install -e '.[server]'", "checkout")
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["analyze", "--model", "demo", "--plot", "kv.png"]) == 2
    _one_error_line(capsys.readouterr().err, "pip install", "matplotlib")


def test_serve_on_a_busy_port_fails_before_loading_the_model(monkeypatch, capsys):
    pytest.importorskip("uvicorn")
    import zipfusion.server

    def must_not_load(*a, **k):
        raise AssertionError("the model was loaded before the port was checked")

    monkeypatch.setattr(zipfusion.server, "serve", must_not_load)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert main(["serve", "--model", "demo", "--port", str(port)]) == 2
    _one_error_line(capsys.readouterr().err, f"port {port}", "in use")


def test_llm_demo_with_default_device_runs():
    llm = zipfusion.LLM(model="demo", kv_memory_gb=0.01)          # device="auto": the CPU here
    import torch
    assert llm.engine.device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    out = llm.generate(["In the beginning"], zipfusion.SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert len(out[0].token_ids) >= 1


def test_serve_end_to_end_logs_and_api_key_from_env():
    """The real command in a subprocess: start-up lines on stderr, ZIPFUSION_API_KEY enforced."""
    pytest.importorskip("uvicorn")
    import httpx
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    e = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), "ZIPFUSION_API_KEY": "k1"}
    proc = subprocess.Popen([sys.executable, "-m", "zipfusion", "serve", "--model", "demo", "--device", "cpu",
                             "--kv-memory-gb", "0.01", "--port", str(port), "--served-model-name", "kjv"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=e)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, proc.communicate()[1]
            assert time.monotonic() < deadline, "server did not come up"
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        assert httpx.get(url + "/v1/models", timeout=10).status_code == 401
        r = httpx.get(url + "/v1/models", headers={"Authorization": "Bearer k1"}, timeout=10)
        assert r.json()["data"][0]["id"] == "kjv"
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert "zipfusion engine: model demo" in err and "bfloat16 on cpu" in err       # the engine's start-up line
    assert f"serving kjv on http://127.0.0.1:{port}" in err and "free pages" in err


# -- issue 24: a newcomer's first minutes ---------------------------------------------------------------

def test_a_tokenizer_less_model_is_refused_before_its_weights_are_built(monkeypatch, capsys):
    import zipfusion.models.loader as loader

    def must_not_build(*a, **k):
        raise AssertionError("the weights were built before the tokenizer was checked")

    monkeypatch.setattr(loader, "build_model", must_not_build)
    monkeypatch.setattr("zipfusion.engine.llm_engine.build_model", must_not_build)
    t0 = time.perf_counter()
    assert main(["generate", "--model", "llama-3.1-8b-random", "--prompt", "hi", "--device", "cpu"]) == 2
    assert time.perf_counter() - t0 < 5
    _one_error_line(capsys.readouterr().err, "no tokenizer", "--prompt-token-ids")
    assert main(["generate", "--model", "demo", "--device", "cpu"]) == 2
    _one_error_line(capsys.readouterr().err, "--prompt")


def test_generate_takes_prompt_token_ids(tmp_path, capsys):
    save_tiny_checkpoint(tmp_path)                                     # no tokenizer files
    args = ["generate", "--model", str(tmp_path), "--prompt-token-ids", "5,6,7", "--prompt-token-ids", "9 3",
            "--device", "cpu", "--dtype", "float32", "--no-kv-compression", "--max-tokens", "4", "--ignore-eos"]
    assert main(args) == 0
    out = capsys.readouterr().out
    llm = zipfusion.LLM(str(tmp_path), device="cpu", dtype="float32", kv_compression=False)
    ref = llm.generate([[5, 6, 7], [9, 3]], zipfusion.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                       use_tqdm=False)
    for o in ref:
        assert " ".join(map(str, o.token_ids)) in out
    with pytest.raises(SystemExit):
        main(["generate", "--model", "demo", "--prompt-token-ids", "1,x"])
    assert "token ids like 1,2,3" in capsys.readouterr().err


def test_a_long_model_build_logs_its_progress(caplog):
    import torch

    from zipfusion.models.loader import BuildProgress
    caplog.set_level("INFO", logger="zipfusion.models")
    with BuildProgress("big-model", every=0.05, what="random weights, bfloat16") as progress:
        for i in range(5):
            progress.step("random weights", i, 5)
            time.sleep(0.06)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "loading model big-model (random weights, bfloat16) ..."      # issue 48: never silent
    assert any("building model big-model: random weights:" in line and "% of 0.00B parameters" in line
               for line in lines), lines
    assert "model big-model loaded in" in lines[-1]
    caplog.clear()
    with BuildProgress("quick", every=30):
        pass
    lines = [r.getMessage() for r in caplog.records]                   # a quick build: start and end only
    assert lines[0] == "loading model quick ..." and "model quick loaded in" in lines[1] and len(lines) == 2
    assert torch.get_num_threads() >= 1


def test_cpu_threads_default_and_option(monkeypatch):
    import torch

    from zipfusion.cli import set_cpu_threads
    from zipfusion.config import default_cpu_threads
    before = torch.get_num_threads()
    try:
        monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(2)), raising=False)
        assert default_cpu_threads() == 1                              # 2 cores: 1 thread (measured)
        monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(64)), raising=False)
        assert default_cpu_threads() == 8
        assert set_cpu_threads(3) == 3 and torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


def test_serve_help_shows_limits_and_the_serving_chunk_budget(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for flag in ("--max-request-bytes", "--max-sequences-per-request", "--max-stop", "--cpu-threads",
                 "--served-model-name"):
        assert flag in out, flag
    assert "zipfusion serve: 8192 on a GPU with >= 70 GiB, 2048 on a smaller one, 128 on the CPU" in out
    assert "never its path" in out
    from zipfusion.config import EngineConfig, serving_max_num_batched_tokens
    assert EngineConfig().max_num_batched_tokens == 8192                # offline default
    assert serving_max_num_batched_tokens("cpu") == 128


def test_settings_are_config_fields_checked_once_with_expert_ones_out_of_help(capsys):
    """Every knob is an EngineConfig field, checked when the config is made; the tuning and
    debugging ones (``expert``) are accepted on the command line but not listed by --help."""
    import argparse
    from zipfusion.config import EngineConfig, add_cli_args, config_from_args
    for name, bad in (("prefill_split_min_tokens", 0), ("prefill_split_grain", 1.5), ("tp_timeout_s", 0),
                      ("tp_start_method", "fork"), ("check_pages", 1)):
        with pytest.raises(ValueError, match=name):
            EngineConfig(**{name: bad})
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    out = capsys.readouterr().out
    assert "--tp-timeout-s" in out and "--check-pages" not in out and "--prefill-split-grain" not in out
    p = argparse.ArgumentParser()
    add_cli_args(p)
    cfg = config_from_args(p.parse_args(["--check-pages", "--prefill-split-grain", "1", "--tp-start-method",
                                         "forkserver"]))
    assert cfg.check_pages and cfg.prefill_split_grain == 1 and cfg.tp_start_method == "forkserver"


@pytest.mark.parametrize("name,bad,says", [
    ("max_num_seqs", True, "an int >= 1"), ("max_num_batched_tokens", 0, "an int >= 1"),
    ("max_logprobs", -1, "an int >= 0"), ("max_model_len", 1, "an int >= 2"), ("kv_memory_gb", 0, "a number > 0"),
    ("kv_memory_gb", "1", "a number > 0"), ("watchdog_timeout_s", -1, "a number >= 0 (0: off)"),
    ("tp_timeout_s", 0, "a number > 0")])
def test_numeric_options_are_checked_by_one_rule(name, bad, says):
    from zipfusion.config import EngineConfig
    with pytest.raises(ValueError, match=rf"^{name} must be {re.escape(says)}, got {re.escape(repr(bad))}$"):
        EngineConfig(**{name: bad})


def test_tuning_knobs_are_one_dataclass_checked_and_off_the_command_line():
    import argparse
    from zipfusion.config import EngineConfig, Tuning, add_cli_args
    assert EngineConfig().tuning == Tuning() and EngineConfig(tuning=Tuning(fill_streams=1)).tuning.fill_streams == 1
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match=f"tuning.fill_streams must be an int >= 1, got {bad!r}"):
            Tuning(fill_streams=bad)
    assert Tuning(min_spared_pages=0).min_spared_pages == 0            # 0: pack however few reads it spares
    with pytest.raises(ValueError, match="tuning must be a zipfusion.config.Tuning, got dict"):
        EngineConfig(tuning={"fill_streams": 1})
    p = argparse.ArgumentParser()
    add_cli_args(p)
    assert not [a for a in p._actions if "tuning" in a.dest]


def test_generate_runs_the_kv_cache_dtype_it_was_given(capsys):
    """``--kv-cache-dtype fp8_lossless`` reaches the engine as given: FP8 pages, full ones
    compressed (a built config re-made from its fields would read as lossy fp8, uncompressed);
    the summary line reports the engine's own config."""
    assert main(["generate", "--model", "demo", "--device", "cpu", "--kv-cache-dtype", "fp8_lossless",
                 "--prompt-token-ids", "5,6,7", "--max-tokens", "2", "--kv-memory-gb", "0.01"]) == 0
    assert "kv_compression=True, kv_cache_dtype=fp8 (lossy)" in capsys.readouterr().err
