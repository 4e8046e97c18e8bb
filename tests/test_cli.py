"""CLI: ``zipfusion generate`` on a tiny checkpoint, ``demo`` model half, errors."""

import pytest

pytest.importorskip("transformers")

import zipfusion  # noqa: E402
from zipfusion.cli import main, run_demo  # noqa: E402
from zipfusion.models.loader import DEMO_DIR  # noqa: E402
from zipfusion.models.testing import save_tiny_checkpoint, save_word_tokenizer  # noqa: E402


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
    assert main(["generate", "--model", str(tmp_path), "--prompt", "x", "--device", "cpu", "--dtype", "float32"]) == 2
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
