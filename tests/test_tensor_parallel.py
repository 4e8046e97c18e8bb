"""Tensor parallelism on the CPU (gloo): TP=2/4 against TP=1, compression on/off, a worker
that dies, shutdown, and the lock-step page accounting (docs/distributed.md).

The engines start real worker processes. They fork from a forkserver that has imported torch
and zipfusion once (``tp_start_method="forkserver"``) -- a spawned worker imports them anew,
seconds each on a small box; the dying-worker test uses the default, ``spawn``. Every
collective times out after ``tp_timeout_s`` (60 s here), so nothing hangs.
The demo model has 2 KV heads (TP=2); TP=4 runs a tiny random Llama with 4 KV heads, written
as a safetensors checkpoint and as a GGUF file.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import time

import numpy as np
import pytest
import torch

pytestmark = [pytest.mark.tp,
              pytest.mark.skipif("spawn" not in multiprocessing.get_all_start_methods()
                                 or not torch.distributed.is_available()
                                 or not torch.distributed.is_gloo_available(),
                                 reason="needs torch.distributed with gloo and the spawn start method")]

from zipfusion import LLM, SamplingParams  # noqa: E402
from zipfusion.config import EngineConfig  # noqa: E402

TINY4 = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=384, hidden_size=128,
             intermediate_size=256, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
             head_dim=64, max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0,
             tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
TP = dict(tp_timeout_s=60, tp_start_method="forkserver")


def _hf_state_dict(seed: int = 0, std: float = 0.15) -> dict:
    """Random weights under Hugging Face names (q/k/v and gate/up apart)."""
    g = torch.Generator().manual_seed(seed)
    c = TINY4
    h, i, V, D = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * D, c["num_key_value_heads"] * D
    sd = {"model.embed_tokens.weight": (V, h), "model.norm.weight": None, "lm_head.weight": (V, h)}
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        sd.update({p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                   p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                   p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                   p + "mlp.down_proj.weight": (h, i),
                   p + "input_layernorm.weight": None, p + "post_attention_layernorm.weight": None})
    return {k: (torch.ones(h) if s is None else torch.randn(s, generator=g) * std) for k, s in sd.items()}


def _write_gguf(path, sd: dict) -> None:
    """The same weights as llama.cpp lays a Llama out (q/k rows permuted per head)."""
    from gguf import GGUFWriter
    c = TINY4
    w = GGUFWriter(str(path), "llama")
    w.add_block_count(c["num_hidden_layers"])
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_key_length(c["head_dim"])
    w.add_value_length(c["head_dim"])
    w.add_rope_dimension_count(c["head_dim"])
    w.add_rope_freq_base(c["rope_theta"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    glob = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}
    for name, t in sd.items():
        t = t.float().numpy()
        if name in glob:
            w.add_tensor(glob[name], np.ascontiguousarray(t))
            continue
        parts = name.split(".")
        mod = ".".join(parts[3:-1])
        if mod in ("self_attn.q_proj", "self_attn.k_proj"):
            n = c["num_attention_heads"] if mod == "self_attn.q_proj" else c["num_key_value_heads"]
            t = t.reshape(n, 2, t.shape[0] // n // 2, t.shape[1]).swapaxes(1, 2).reshape(t.shape)
        w.add_tensor(f"blk.{parts[2]}.{names[mod]}.weight", np.ascontiguousarray(t, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from safetensors.torch import save_file
    root = tmp_path_factory.mktemp("tp")
    sd = _hf_state_dict()
    folder = root / "tiny4"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(TINY4))
    save_file(sd, str(folder / "model.safetensors"))
    out = {"demo": "demo", "tiny4": str(folder)}
    try:
        _write_gguf(root / "tiny4.gguf", sd)
        out["tiny4-gguf"] = str(root / "tiny4.gguf")
    except ImportError:
        pass
    return out


def _prompts(vocab: int, n: int = 6) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab, (int(k),), generator=g).tolist() for k in (5, 19, 33, 2, 47, 12)[:n]]


def _run(model, prompts, params=GREEDY, device_override="cpu", **options):
    """Generate, then close the LLM; (token lists, kv stats, preemptions, engine)."""
    with LLM(model, device=device_override, **TP, **options) as llm:
        eng = llm.engine
        outs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.kv_stats()
    if eng.tp is not None:
        assert not any(p.is_alive() for p in eng.tp.procs), "a worker outlived close()"
    assert not torch.distributed.is_initialized()
    return [o.token_ids for o in outs], stats, eng.scheduler.num_preemptions, eng


# -- TP=N against TP=1 (fp32) ----------------------------------------------------------------
@pytest.mark.parametrize("name,tp", [("demo", 2), ("tiny4", 4), ("tiny4-gguf", 2)])
def test_fp32_greedy_tokens_match_tp1(models, name, tp):
    if name not in models:
        pytest.skip("gguf is not installed")
    vocab = 2048 if name == "demo" else TINY4["vocab_size"]
    prompts = _prompts(vocab)
    ref, _, _, _ = _run(models[name], prompts, dtype="float32", kv_compression=False)
    got, _, _, eng = _run(models[name], prompts, dtype="float32", kv_compression=False, tensor_parallel_size=tp)
    assert got == ref
    assert eng.cache.num_kv_heads == (2 if name == "demo" else 4) // tp      # rank 0 holds its heads only


# -- compression on/off at every TP size (bf16) -----------------------------------------------
@pytest.mark.parametrize("name,tp,gb,max_tokens", [("demo", 2, 0.00025, 48), ("tiny4", 4, 0.00012, 40)])
def test_compression_on_off_identical(models, name, tp, gb, max_tokens):
    """bf16, deterministic mode (a request's tokens do not depend on the batch), and a budget
    small enough that pages are compressed and requests preempted -- differently with and
    without compression. Page ids must stay in agreement across ranks throughout (a worker
    whose ids diverge dies, failing the run)."""
    vocab = 2048 if name == "demo" else TINY4["vocab_size"]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    kw = dict(kv_memory_gb=gb, tensor_parallel_size=tp, admission="optimistic", deterministic=True)
    on, stats, pre_on, _ = _run(models[name], _prompts(vocab), params, kv_compression=True, **kw)
    off, _, pre_off, _ = _run(models[name], _prompts(vocab), params, kv_compression=False, **kw)
    assert on == off
    assert stats["stored_pages"] > 0
    assert pre_on > 0 and pre_off > 0                             # memory did bind


def test_weight_compression_on_off_identical_each_rank_its_shard(models):
    """bf16, TP=2: every rank compresses its own shard after loading (rank 0's here: its rows of
    q|k|v, its columns of o_proj, its half of the vocabulary); the same tokens as uncompressed."""
    from zipfusion.format.weights import CompressedWeight
    prompts = _prompts(2048, 4)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    kw = dict(kv_memory_gb=0.01, tensor_parallel_size=2)
    off, _, _, _ = _run("demo", prompts, params, weight_compression=False, **kw)
    on, _, _, eng = _run("demo", prompts, params, weight_compression=True, **kw)
    assert on == off
    attn, full = eng.model.model.layers[0].self_attn, eng.model_config
    assert isinstance(attn.qkv_proj.weight, CompressedWeight) and isinstance(attn.o_proj.weight, CompressedWeight)
    assert attn.qkv_proj.weight.shape == ((full.q_size + 2 * full.kv_size) // 2, full.hidden_size)
    assert attn.o_proj.weight.shape == (full.hidden_size, full.q_size // 2)
    assert eng.model.model.embed_tokens.weight.shape == (full.vocab_size // 2, full.hidden_size)


# -- failures and shutdown --------------------------------------------------------------------
def test_worker_death_is_a_clear_error_and_nothing_is_left():
    from zipfusion.distributed import TPWorkerError
    llm = LLM("demo", device="cpu", dtype="float32", kv_compression=False, tensor_parallel_size=2,
              tp_timeout_s=60)
    eng = llm.engine
    procs = list(eng.tp.procs)
    try:
        assert len(llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].token_ids) == 24
        os.kill(procs[0].pid, signal.SIGKILL)
        procs[0].join(10)
        t0 = time.monotonic()
        with pytest.raises(TPWorkerError, match=r"worker rank 1 \(pid \d+\) died with exit code -9"):
            llm.generate([[5, 6, 7, 8]], GREEDY, use_tqdm=False)
        assert time.monotonic() - t0 < 30
        with pytest.raises(TPWorkerError):                      # and stays broken, at once
            llm.generate([[5, 6]], GREEDY, use_tqdm=False)
        assert not eng.has_work()
    finally:
        eng.shutdown()
    assert not any(p.is_alive() for p in procs)
    assert not torch.distributed.is_initialized()


def test_engines_one_after_another_in_one_process():
    """torch.distributed has one default group a process: a TP engine leaves it when its LLM
    is closed (``with``), or, dropped without that, when it is collected."""
    import gc
    import weakref
    kw = dict(device="cpu", dtype="float32", kv_compression=False, tensor_parallel_size=2, **TP)
    with LLM("demo", **kw) as llm:
        first = llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].token_ids
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
    llm = LLM("demo", **kw)                                  # again, then dropped without close()
    procs, engine = list(llm.engine.tp.procs), weakref.ref(llm.engine)
    assert llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].token_ids == first
    del llm
    gc.collect()
    assert engine() is None and not any(p.is_alive() for p in procs)
    assert not torch.distributed.is_initialized()
    llm = LLM("demo", **kw)                                  # a third: dropped, then collected at start
    del llm
    with LLM("demo", **kw) as llm:
        assert llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].token_ids == first
    assert not torch.distributed.is_initialized()


def test_refuses_a_size_that_does_not_divide_the_kv_heads():
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 does not divide the model's 2 KV heads; "
                                         r"pass one of \[1, 2\]"):
        LLM("demo", device="cpu", tensor_parallel_size=4)
    with pytest.raises(ValueError, match="tensor_parallel_size must be an int >= 1"):
        EngineConfig(tensor_parallel_size=0)
    assert not torch.distributed.is_initialized()


def test_cli_option():
    import argparse
    from zipfusion.config import add_cli_args, config_from_args
    p = argparse.ArgumentParser()
    add_cli_args(p)
    assert config_from_args(p.parse_args(["--tensor-parallel-size", "2"])).tensor_parallel_size == 2


# -- the page accounting, in one process ------------------------------------------------------
class _FakeDriver:
    """Stands in for the driver: 'sends' the log to another cache and reports its capacity."""

    def __init__(self, other):
        self.other, self.left, self.cache, self.reports = other, set(), None, None

    def send_ops(self):
        from zipfusion.distributed.lockstep import apply_ops, report_of
        apply_ops(self.other, self.cache.take_log(), self.left)
        self.reports = np.array([[0, 0, 0, 0], list(report_of(self.other)) + [0]], dtype=np.float64)

    def comm_finish_report(self):
        return self.reports


def test_lockstep_ids_agree_and_capacity_is_the_tightest_ranks():
    """Two caches whose pages compress differently (zeros vs noise) under one op sequence:
    the worker's ids follow rank 0's, it seals what rank 0 seals into the same fill streams, and
    the capacity rank 0 reports never exceeds what the worker really has, so its allocations
    never fail."""
    from zipfusion.memory.kv_cache import ArenaKVCache
    from zipfusion.distributed.lockstep import LockstepCache
    L, H, D = 2, 1, 64
    binding = 0
    a = ArenaKVCache(L, H, D, 80 * 4096 * L, "cpu", kv_compression=True)
    b = ArenaKVCache(L, H, D, 80 * 4096 * L, "cpu", kv_compression=True)
    a.arena.zero_()                                            # rank 0: pages of zeros compress well
    b.arena.copy_(torch.randint(0, 256, b.arena.shape, dtype=torch.uint8))   # the worker: noise, not at all
    drv = _FakeDriver(b)
    cache = drv.cache = LockstepCache(a, drv)
    drv.send_ops()
    rng = np.random.default_rng(0)
    live: list[list[int]] = []
    sealed: set[int] = set()
    for step in range(300):
        cap = cache.capacity_new_pages(keep_reserve=True)
        assert cap <= b.capacity_new_pages(keep_reserve=True) and cap <= a.capacity_new_pages(keep_reserve=True)
        binding += cap < a.capacity_new_pages(keep_reserve=True)
        r = rng.random()
        if r < 0.5 and cap > 0:
            n = int(rng.integers(1, min(cap, 4) + 1))
            live.append(cache.alloc(n))
        elif r < 0.75 and live:
            ids = live.pop(int(rng.integers(len(live))))
            cache.free(ids)
            sealed.difference_update(ids)
        else:
            full = [i for ids in live for i in ids[:-1] if i not in sealed]
            sealed.update(full)
            cache.manager.set_streams(full, [i % 3 for i in full])    # as the page store does
            cache.manager.place_pages(cache.manager.analyze_pages(full))
        if rng.random() < 0.3:
            drv.send_ops()
    drv.send_ops()
    assert a.stats()["pages_in_use"] == b.stats()["pages_in_use"]
    assert a.stats()["stored_pages"] > 10 and a.stored_ratio() < b.stored_ratio()
    assert b.stats()["stored_pages"] > 10                      # the worker seals too (in open form: noise)
    assert np.array_equal(a.manager.page_stream, b.manager.page_stream)      # into the same streams
    assert binding > 50                                        # the worker was the tightest rank
    assert cache.stored_ratio() == max(a.stored_ratio(), b.stored_ratio())


# -- on GPUs (NCCL), when a machine of two or more is lent ---------------------------------------
_TWO_GPUS = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")


@pytest.mark.gpu
@_TWO_GPUS
def test_gpu_tp2_matches_tp1_fp32(models):
    prompts = _prompts(TINY4["vocab_size"])
    ref, _, _, _ = _run(models["tiny4"], prompts, dtype="float32", kv_compression=False, device_override="cuda")
    got, _, _, _ = _run(models["tiny4"], prompts, dtype="float32", kv_compression=False, tensor_parallel_size=2,
                        device_override="cuda")
    assert got == ref


@pytest.mark.gpu
@_TWO_GPUS
def test_gpu_tp2_compression_on_off_identical_with_cuda_graphs(models):
    """NCCL all-reduces inside the captured decode graphs, compressed vs uncompressed pages."""
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    kw = dict(kv_memory_gb=0.0003, tensor_parallel_size=2, admission="optimistic", deterministic=True,
              device_override="cuda")
    on, stats, _, eng = _run(models["tiny4"], _prompts(TINY4["vocab_size"]), params, kv_compression=True, **kw)
    off, _, _, _ = _run(models["tiny4"], _prompts(TINY4["vocab_size"]), params, kv_compression=False, **kw)
    assert on == off and stats["stored_pages"] > 0
    assert eng.runner.graphs                                     # decode ran in CUDA graphs


@pytest.mark.parametrize("family", ["mixtral", "gemma2"])
def test_fp32_families_match_tp1(tmp_path, family):
    """TP=2 against TP=1 (fp32): experts split along their intermediate dimension (router
    replicated), and a Gemma 2 with a sliding window and soft-capped scores."""
    from helpers import save_tiny_checkpoint
    spec = {"mixtral": dict(arch="mixtral", num_local_experts=4, num_experts_per_tok=2, intermediate_size=64),
            "gemma2": dict(arch="gemma2", sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                           attn_logit_softcapping=5.0, final_logit_softcapping=3.0)}[family]
    save_tiny_checkpoint(tmp_path, **spec)
    prompts = _prompts(256, 3)
    ref, _, _, _ = _run(str(tmp_path), prompts, dtype="float32", kv_compression=False)
    got, _, _, _ = _run(str(tmp_path), prompts, dtype="float32", kv_compression=False, tensor_parallel_size=2)
    assert got == ref
