"""Engine end to end on CPU: greedy tokens equal transformers', compression on/off identical
(token ids and logits), chunked prefill, preemption by recompute, stop conditions, errors."""

import copy
from collections import Counter

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from zipfusion.engine import LLM, SamplingParams  # noqa: E402
from zipfusion.testing import LateEvent, run_to_completion  # noqa: E402
from helpers import save_tiny_checkpoint, save_word_tokenizer  # noqa: E402

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 32}
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def prompts(seed, lengths):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    out = {}
    for name, kw in {"llama": dict(arch="llama"),
                     "llama-rope-scaled-legacy": dict(arch="llama", legacy_rope=True, rope_scaling=LLAMA3_SCALING,
                                                      rope_theta=500000.0, seed=1),
                     "qwen3-tied": dict(arch="qwen3", tie_word_embeddings=True, seed=2)}.items():
        hf = save_tiny_checkpoint(root / name, **kw)
        save_word_tokenizer(root / name)
        out[name] = (root / name, hf)
    return out


@pytest.mark.parametrize("name", ["llama", "llama-rope-scaled-legacy", "qwen3-tied"])
def test_greedy_tokens_equal_transformers_generate(ckpts, name):
    path, hf = ckpts[name]
    # 40-token prefill budget: the 50-token prompt is prefilled in two chunks
    llm = LLM(str(path), dtype="float32", device="cpu", kv_compression=False, max_num_batched_tokens=40)
    ps = prompts(0, [50, 3, 21])
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], GREEDY, use_tqdm=False)
    for p, o in zip(ps, outs):
        ref = hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(p):].tolist()
        assert o.token_ids == ref
        assert o.outputs[0].finish_reason == "length"


@pytest.mark.parametrize("lengths", [[37], [40, 5, 17, 64]], ids=["batch1", "mixed"])
def test_compression_on_off_identical_tokens_and_logits(ckpts, lengths):
    path, _ = ckpts["llama"]
    ps = prompts(1, lengths)
    res = {}
    for compress in (True, False):
        llm = LLM(str(path), dtype="bfloat16", device="cpu", kv_compression=compress, kv_memory_gb=0.03,
                  max_num_batched_tokens=48)
        reqs = [llm.engine.add_request(p, GREEDY) for p in ps]
        run_to_completion(llm.engine, reqs, keep_logits=True)
        res[compress] = (reqs, llm.kv_stats())
    (on, stats_on), (off, stats_off) = res[True], res[False]
    # compression really happened and decode read compressed pages
    assert stats_on["stored_pages"] > 0 and stats_on["stored_ratio"] < 1.0
    assert stats_off["stored_pages"] == 0
    for a, b in zip(on, off):
        assert a.output_ids == b.output_ids
        assert len(a.logits) == len(b.logits) == GREEDY.max_tokens
        for la, lb in zip(a.logits, b.logits):
            assert torch.equal(la, lb)


def test_preemption_by_recompute_gives_same_tokens(ckpts):
    path, _ = ckpts["llama"]
    ps = prompts(2, [30, 30, 30, 30])
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    big = LLM(str(path), dtype="float32", device="cpu", kv_compression=False)
    ref = big.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
    page_bytes = 2 * 2 * 16 * 2 * 64 * 4                     # layers x K,V x tokens x heads x dim x fp32
    for admission in ("optimistic", "estimate"):
        small = LLM(str(path), dtype="float32", device="cpu", kv_compression=False, admission=admission,
                    kv_memory_gb=10 * page_bytes / 2**30)    # 10 pages: all four fit only while prefilling
        outs = small.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
        preempted = small.engine.scheduler.num_preemptions
        # vLLM-style optimistic admission preempts; the default admits only what will fit
        assert preempted > 0 if admission == "optimistic" else preempted == 0
        assert sum(o.num_preemptions for o in outs) == preempted
        assert [o.token_ids for o in outs] == [o.token_ids for o in ref]


def test_the_runner_hears_of_every_request_that_ended_in_the_steps_output(ckpts):
    """Preempted and finished requests reach the runner with a forward (``SchedulerOutput.ended``): a
    preemption with the step that schedules without it, each end once; the runner drops their staged rows."""
    path, _ = ckpts["llama"]
    page_bytes = 2 * 2 * 16 * 2 * 64 * 4
    llm = LLM(str(path), dtype="float32", device="cpu", kv_compression=False, admission="optimistic",
              kv_memory_gb=10 * page_bytes / 2**30)
    eng, ended = llm.engine, []
    run = eng.runner.run

    def spy(out):
        assert {r.request_id for r in out.preempted} <= set(out.ended)
        eng.runner._row_owner = [(rid, 1, 0, 0) for rid in out.ended] + [(-1, 1, 0, 0)]
        logits = run(out)
        assert eng.runner._row_owner == [None] * len(out.ended) + [(-1, 1, 0, 0)]
        ended.extend(out.ended)
        return logits
    eng.runner.run = spy
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts(2, [30, 30, 30, 30])],
                        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    assert eng.scheduler.num_preemptions > 0
    ended += eng.scheduler.take_ended()                 # those that finished behind the last forward
    assert Counter(ended) == {o.request_id: o.num_preemptions + 1 for o in outs}


def test_arena_preemption_completes(ckpts):
    path, _ = ckpts["llama"]
    ps = prompts(3, [20, 20, 20, 20])
    open_page = 2 * 16 * 2 * 64 * 2
    chunk = 2 * open_page
    # 2 layers x (1 open chunk + 2 compression reserve) + 3 chunks to share
    llm = LLM(str(path), dtype="bfloat16", device="cpu", kv_compression=True, admission="optimistic",
              kv_memory_gb=(2 * 3 + 3) * chunk / 2**30, chunk_bytes=chunk)
    outs = llm.generate([{"prompt_token_ids": p} for p in ps],
                        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert all(len(o.token_ids) == 16 for o in outs)
    cached = llm.kv_stats()["prefix_cache_evictable_pages"]      # full pages kept for later hits
    llm.reset_prefix_cache()
    assert llm.engine.cache.stats()["pages_in_use"] == 0 and cached > 0      # everything freed at the end


def test_lookahead_admission_keeps_a_larger_compression_reserve(ckpts):
    """Lookahead runs the arena near full: the engine keeps config.LOOKAHEAD_RESERVE_CHUNKS chunks a
    layer for the seal (the manager's 2 otherwise), and the tokens are the same."""
    from zipfusion.config import LOOKAHEAD_RESERVE_CHUNKS
    path, _ = ckpts["llama"]
    ps = prompts(5, [30, 12, 41, 7])
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = {}
    for admission, reserve in (("estimate", 2), ("lookahead", LOOKAHEAD_RESERVE_CHUNKS)):
        llm = LLM(str(path), dtype="bfloat16", device="cpu", kv_compression=True, admission=admission,
                  kv_memory_gb=0.002)
        assert llm.engine.cache.manager.reserve == reserve
        outs[admission] = [o.token_ids for o in llm.generate([{"prompt_token_ids": p} for p in ps], sp,
                                                             use_tqdm=False)]
    assert outs["estimate"] == outs["lookahead"]


def test_conservative_admission_avoids_preemption(ckpts):
    path, _ = ckpts["llama"]
    ps = prompts(3, [20, 20, 20, 20])
    open_page = 2 * 16 * 2 * 64 * 2
    chunk = 2 * open_page
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outs = {}
    for admission in ("optimistic", "conservative", "estimate"):
        llm = LLM(str(path), dtype="bfloat16", device="cpu", kv_compression=True, admission=admission,
                  kv_memory_gb=(2 * 3 + 3) * chunk / 2**30, chunk_bytes=chunk)
        outs[admission] = [o.token_ids for o in llm.generate([{"prompt_token_ids": p} for p in ps], sp,
                                                             use_tqdm=False)]
        preempted = llm.engine.scheduler.num_preemptions
        assert (preempted > 0) if admission == "optimistic" else (preempted == 0)
    assert outs["optimistic"] == outs["conservative"] == outs["estimate"]


def test_stop_conditions(ckpts):
    path, _ = ckpts["llama"]
    llm = LLM(str(path), dtype="float32", device="cpu", kv_compression=False)
    p = "w5 w9 w13 w200"
    full = llm.generate(p, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)[0]
    ids = full.token_ids
    assert full.text == " ".join("</s>" if t == 2 else f"w{t}" for t in ids if t != 2)
    k = next(i for i in range(3, 10) if ids[i] not in ids[:i])   # a token first seen at step k
    # stop token id: output ends with it
    o = llm.generate(p, SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[ids[k]]), use_tqdm=False)[0]
    assert o.token_ids == ids[:k + 1] and o.outputs[0].finish_reason == "stop" and o.outputs[0].stop_reason == ids[k]
    # stop string: text ends before it
    word = f"w{ids[k]}"
    o = llm.generate(p, SamplingParams(temperature=0, max_tokens=10, stop=[" " + word]), use_tqdm=False)[0]
    assert o.outputs[0].finish_reason == "stop" and o.text == " ".join(f"w{t}" for t in ids[:k])
    # eos (made to be that token) stops unless ignore_eos
    llm.engine.eos_token_ids = {ids[k]}
    o = llm.generate(p, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0]
    assert o.token_ids == ids[:k + 1] and o.outputs[0].finish_reason == "stop"
    o = llm.generate(p, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)[0]
    assert o.token_ids == ids and o.outputs[0].finish_reason == "length"


def test_seeded_sampling_independent_of_batch(ckpts):
    path, _ = ckpts["qwen3-tied"]
    llm = LLM(str(path), dtype="float32", device="cpu", kv_compression=False)
    ps = prompts(4, [9, 14, 20])
    sp = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=123, max_tokens=10, ignore_eos=True)
    alone = llm.generate({"prompt_token_ids": ps[0]}, sp, use_tqdm=False)[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)
    batch = llm.generate([{"prompt_token_ids": p} for p in ps], [sp, others, others], use_tqdm=False)
    assert batch[0].token_ids == alone
    other_seed = llm.generate({"prompt_token_ids": ps[0]}, SamplingParams(
        temperature=0.8, top_p=0.9, top_k=50, seed=124, max_tokens=10, ignore_eos=True), use_tqdm=False)[0]
    assert other_seed.token_ids != alone


def test_bad_input_is_named(ckpts, tmp_path):
    path, _ = ckpts["llama"]
    with pytest.raises(ValueError, match="bfloat16"):
        LLM(str(path), dtype="float32", device="cpu", kv_compression=True)
    with pytest.raises(ValueError, match="dtype"):
        LLM(str(path), dtype="int8", device="cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device='cpu'"):
            LLM(str(path), device="cuda")
    llm = LLM(str(path), dtype="float32", device="cpu", kv_compression=False)
    with pytest.raises(ValueError, match="token ids"):
        llm.generate({"prompt_token_ids": [1, 999]}, use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate({"prompt_token_ids": []}, use_tqdm=False)
    with pytest.raises(ValueError, match="2 sampling params"):
        llm.generate(["w1", "w2", "w3"], [GREEDY, GREEDY], use_tqdm=False)
    with pytest.raises(TypeError, match="prompt"):
        llm.generate([3.5], use_tqdm=False)
    tiny = LLM(str(path), dtype="float32", device="cpu", kv_compression=False, kv_memory_gb=2 * 2 * 16 * 2 * 64 * 4 * 2 / 2**30)
    with pytest.raises(ValueError, match="max_model_len=32 .*give more kv_memory_gb"):
        tiny.generate({"prompt_token_ids": list(range(3, 60))}, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="more than the model's 512 positions"):
        LLM(str(path), dtype="float32", device="cpu", kv_compression=False, max_model_len=600)
    with pytest.raises(ValueError, match="holds 32 tokens, fewer than max_model_len=64"):
        LLM(str(path), dtype="float32", device="cpu", kv_compression=False, max_model_len=64,
            kv_memory_gb=2 * 2 * 16 * 2 * 64 * 4 * 2 / 2**30)
    with pytest.raises(ValueError, match="kv_memory_gb=1e.06 is more than"):
        LLM(str(path), dtype="float32", device="cpu", kv_compression=False, kv_memory_gb=1e6)
    with pytest.raises(TypeError, match="unknown engine option"):
        LLM(str(path), kv_compresion=False)
    with pytest.raises(ValueError, match="enable_prefix_caching must be True or False, got 'yes'"):
        LLM(str(path), enable_prefix_caching="yes")
    with pytest.raises(ValueError, match="kv_host_memory_gb must be a number >= 0"):
        LLM(str(path), kv_host_memory_gb=-1)
    with pytest.raises(ValueError, match="kv_host_memory_gb=1e.06 is more than the host's free memory"):
        LLM(str(path), dtype="bfloat16", device="cpu", kv_host_memory_gb=1e6)
    save_tiny_checkpoint(tmp_path)                                  # no tokenizer
    with pytest.raises(ValueError, match="no tokenizer"):
        LLM(str(tmp_path), dtype="float32", device="cpu", kv_compression=False).generate("hello", use_tqdm=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("model", ["demo", "llama"])
def test_gpu_compression_on_off_identical_with_cuda_graphs(ckpts, model):
    path = "demo" if model == "demo" else str(ckpts["llama"][0])
    ps = prompts(5, [300, 7, 45, 129])
    res = {}
    for compress in (True, False):
        llm = LLM(path, dtype="bfloat16", device="cuda", kv_compression=compress, kv_memory_gb=0.2,
                  max_num_seqs=8, max_num_batched_tokens=128, max_model_len=512)
        assert llm.engine.graph_buckets                            # decode runs as CUDA graphs
        reqs = [llm.engine.add_request(p, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)) for p in ps]
        run_to_completion(llm.engine, reqs, keep_logits=True)
        res[compress] = (reqs, llm.kv_stats())
    assert res[True][1]["stored_pages"] > 0
    for a, b in zip(res[True][0], res[False][0]):
        assert a.output_ids == b.output_ids
        assert all(torch.equal(x, y) for x, y in zip(a.logits, b.logits))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_engine_against_transformers_and_through_preemption(ckpts):
    """On the GPU (bf16, CUDA graphs, fused kernels, mixed steps): logits close to transformers'
    fp32 forward of the same tokens (an independent reference), and the same tokens when memory
    is so small that requests are preempted and recomputed (the same logits bits too, but only
    in deterministic mode: tests/test_deterministic.py; a recompute prefills what was decoded)."""
    path, hf = ckpts["llama"]
    ps = prompts(6, [50, 9, 33, 40])
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    runs = {}
    open_page = 2 * 16 * 2 * 64 * 2
    for name, kw in (("big", dict(kv_memory_gb=0.2)),                 # 10 chunks of 2 pages: 5 pages fit with
                     ("small", dict(kv_memory_gb=10 * 2 * open_page / 2**30, chunk_bytes=2 * open_page,
                                    admission="optimistic"))):      # the reserve and the graphs' scratch page
        llm = LLM(str(path), dtype="bfloat16", device="cuda", max_num_batched_tokens=64, max_model_len=80, **kw)
        reqs = [llm.engine.add_request(p, sp) for p in ps]
        run_to_completion(llm.engine, reqs, keep_logits=True)
        runs[name] = (reqs, llm.engine.scheduler.num_preemptions)
    assert runs["small"][1] > 0 and runs["big"][1] == 0
    for a, b in zip(runs["big"][0], runs["small"][0]):
        assert a.output_ids == b.output_ids
        got, ref = torch.stack(b.logits), torch.stack(a.logits)
        assert float((got - ref).norm() / ref.norm()) < 1e-2
    # the fp32 reference, and transformers' own bf16 forward as the yardstick of bf16 rounding:
    # ours may be off from fp32 by about as much as transformers' bf16 is, not more
    hf32, hf16 = hf.float().cuda(), copy.deepcopy(hf).to("cuda", torch.bfloat16)
    for p, r in zip(ps, runs["big"][0]):
        ids = torch.tensor([p + r.output_ids[:-1]], device="cuda")
        ref = hf32(ids).logits[0, len(p) - 1:].float().cpu()
        bf16 = hf16(ids).logits[0, len(p) - 1:].float().cpu()
        got = torch.stack(r.logits)
        err = float((got - ref).norm() / ref.norm())
        assert err < max(2 * float((bf16 - ref).norm() / ref.norm()), 1e-2), err


def test_a_bad_prompt_in_a_batch_queues_nothing_and_the_engine_goes_on():
    llm = LLM("demo", device="cpu", max_model_len=64, kv_memory_gb=0.01)
    sp = SamplingParams(max_tokens=4, temperature=0)
    with pytest.raises(ValueError, match=r"prompt 1: .*max_model_len=64; shorten the prompt"):
        llm.generate(["In the beginning", "word " * 200], sp)
    assert not llm.engine.scheduler.has_work()
    good = llm.generate(["In the beginning"], sp)
    assert len(good) == 1 and len(good[0].token_ids) == 4


def test_memory_watch_names_the_step_that_grew_reserved_memory(caplog):
    """The engine's MemoryWatch (on CUDA) warns once per 64 MiB of growth past the high-water mark,
    naming the step and what the memory system did in it; CPU: the allocator's counters injected."""
    from zipfusion.engine.observe import MemoryWatch
    llm = LLM("demo", device="cpu", max_model_len=64, kv_memory_gb=0.01)
    import itertools
    reserved = itertools.chain([100 << 20, 120 << 20, 400 << 20, 420 << 20], itertools.repeat(300 << 20))
    watch = MemoryWatch(llm.engine, reserved=lambda d: next(reserved), peak=lambda d: 380 << 20)
    llm.engine._memory_watch = watch
    with caplog.at_level("WARNING", logger="zipfusion"):
        llm.generate(["In the beginning God"] * 2, SamplingParams(max_tokens=3, temperature=0))
    grew = [r.getMessage() for r in caplog.records if "GPU memory reserved by torch grew" in r.getMessage()]
    assert len(grew) == 1 and "100 -> 400 MiB (allocated peak 380 MiB) at step 2" in grew[0], grew
    assert "compressed +" in grew[0] and watch.high == 400 << 20


def test_warm_up_runs_a_whole_step_budget_and_leaves_the_engine_as_new():
    """``warm_up`` (the server's, on CUDA) prefills a prompt of the whole step budget, then leaves
    nothing behind: every page free again, counters and request ids afresh, and later runs give
    the tokens of an engine that never warmed up."""
    sp = SamplingParams(max_tokens=6, temperature=0)
    prompts = ["In the beginning God", "And the earth was"]
    kw = dict(device="cpu", max_model_len=256, kv_memory_gb=0.01, max_num_batched_tokens=128)
    cold = LLM("demo", **kw)
    warm = LLM("demo", **kw)
    eng = warm.engine
    free = eng.cache.capacity_new_pages()
    steps = []
    eng.add_observer(lambda res, stats: steps.append(res.prefill_tokens))
    eng.warm_up()
    assert steps[0] == 128 and not eng.has_work()           # the largest step: the whole budget
    assert eng.cache.capacity_new_pages() == free and eng.scheduler.prefix.num_cached_pages == 0
    assert eng.scheduler.prefix.stats.queried_tokens == 0 and eng.scheduler.num_preemptions == 0
    outs = warm.generate(prompts, sp)
    assert [o.request_id for o in outs] == [o.request_id for o in cold.generate(prompts, sp)]
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in cold.generate(prompts, sp)]
    eng.add_request([5, 6, 7], sp)
    with pytest.raises(RuntimeError, match="idle engine"):
        eng.warm_up()


def test_step_stats_count_the_decode_rows_context():
    """StepStats.context_tokens: the decode rows' context lengths summed (what decode attention
    reads), as the requests' lengths say; each phase counted once: their seconds add up to the
    step's."""
    eng = LLM("demo", device="cpu", kv_memory_gb=0.01, max_num_batched_tokens=64).engine
    seen = []

    def observe(res, stats):
        seen.append((res.decode_rows, stats.context_tokens))
        phases = stats.schedule_s + stats.forward_s + stats.seal_s + stats.ahead_s + stats.finish_s
        assert phases == pytest.approx(stats.seconds) and stats.forward_s > 0 and stats.finish_s > 0
    eng.add_observer(observe)
    a = eng.add_request([5] * 20, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    b = eng.add_request([6] * 7, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    while eng.has_work():
        eng.step()
    decode = [c for n, c in seen if n == 2]
    assert decode == [20 + 7 + 2 * k for k in (1, 2, 3)]      # the k-th decode step: rows of 20 + k and 7 + k
    assert a.output_ids and b.output_ids


def test_pages_left_open_under_pressure_are_retried(ckpts, monkeypatch):
    """The seal contract (issue 20): a seal that finds no room it may take leaves pages open,
    and the scheduler hands exactly those pages back at its next seal, where they compress. The
    run under pressure gives the tokens of a run with room to spare (deterministic mode: the two
    batch differently), without preemption."""
    path, _ = ckpts["llama"]
    chunk = 4 * (2 * 16 * 2 * 64 * 2)
    ps = prompts(0, [40, 33, 70, 25, 50, 61])
    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    tight = LLM(str(path), dtype="bfloat16", device="cpu", kv_compression=True, admission="conservative",
                kv_memory_gb=12 * chunk / 2**30, chunk_bytes=chunk, max_num_batched_tokens=64, deterministic=True)
    calls, place = [], tight.engine.cache.manager.place_pages

    def logged(job, min_capacity=0, reclaim=None, keep=None):    # the page store's placements
        left = place(job, min_capacity, reclaim, keep)
        calls.append((set(job.ids.tolist()) if keep is None else set(keep), set(left)))
        return left
    monkeypatch.setattr(tight.engine.cache.manager, "place_pages", logged)
    got = [o.token_ids for o in tight.generate([{"prompt_token_ids": p} for p in ps], sp, use_tqdm=False)]
    left_open = [(i, left) for i, (_, left) in enumerate(calls) if left]
    assert left_open, "no seal left a page open: the test needs more pressure"
    for i, left in left_open:
        assert i + 1 < len(calls) and left <= calls[i + 1][0]          # offered again at the next seal
    assert any(left - calls[i + 1][1] for i, left in left_open)        # ... and compressed there
    assert tight.engine.scheduler.num_preemptions == 0
    roomy = LLM(str(path), dtype="bfloat16", device="cpu", kv_compression=True, kv_memory_gb=0.03,
                max_num_batched_tokens=64, deterministic=True)
    assert got == [o.token_ids for o in roomy.generate([{"prompt_token_ids": p} for p in ps], sp, use_tqdm=False)]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
def test_async_scheduling_gives_the_same_tokens_through_stops_preemption_and_abort(ckpts, device):
    """Async scheduling (the next step scheduled before this one's tokens are back: the GPU
    default, forced on here) against the plain order, deterministic mode, memory tight enough to
    preempt: requests that stop at a token nobody could predict are dropped from the schedule made
    ahead, those at max_tokens let go of their pages early (a last token that is also a stop token
    still gives "stop"), a request aborted between steps never runs again; every other request
    gets the plain order's tokens. On the GPU (CUDA graphs, the host tier on) the schedule made
    ahead also queues its seals, moves and copies behind a forward still running."""
    path, _ = ckpts["llama"]
    ps = prompts(5, [30, 12, 41, 25, 33, 18, 27, 9, 22, 35, 14, 28])
    probe = LLM(str(path), dtype="bfloat16", device=device, kv_compression=True, deterministic=True,
                kv_memory_gb=0.05)
    free = [o.token_ids for o in probe.generate([{"prompt_token_ids": p} for p in ps],
                                                 SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                                                 use_tqdm=False)]
    params = []
    for i, ids in enumerate(free):
        k = next(j for j in range(4, 20) if ids[j] not in ids[:j])       # a token first seen at step k
        if i % 4 == 0:      # stops at a token no schedule can foresee
            params.append(SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[ids[k]]))
        elif i % 4 == 1:    # its last allowed token is also its stop token: "stop", not "length"
            params.append(SamplingParams(temperature=0, max_tokens=k + 1, stop_token_ids=[ids[k]]))
        else:
            params.append(SamplingParams(temperature=0.8, seed=i, max_tokens=24, ignore_eos=True))
    chunk = 2 * (2 * 16 * 2 * 64 * 2)

    def run(async_scheduling: bool):
        llm = LLM(str(path), dtype="bfloat16", device=device, kv_compression=True, admission="optimistic",
                  kv_memory_gb=(2 * 3 + 4) * chunk / 2**30, chunk_bytes=chunk, deterministic=True,
                  max_num_batched_tokens=32)
        eng = llm.engine
        eng.async_scheduling = async_scheduling
        reqs = [eng.add_request(p, sp) for p, sp in zip(ps, params)]
        taken, take = [], eng._take_ahead
        eng._take_ahead = lambda: taken.append(take()) or taken[-1]
        steps = 0
        while eng.has_work():
            eng.step()
            steps += 1
            if steps == 6:
                eng.abort(reqs[-1])
        scratch = len(eng.runner._scratch)                  # CUDA graphs' padding page
        assert eng.cache.stats()["pages_in_use"] == eng.scheduler.prefix.num_cached_pages + scratch
        return reqs, eng.scheduler.num_preemptions, sum(t is not None for t in taken)

    plain, _, _ = run(False)
    ahead, preempted_ahead, used = run(True)
    assert preempted_ahead > 0 and used > 10          # preempted ahead of a forward, and schedules used
    for i, (a, b) in enumerate(zip(plain[:-1], ahead[:-1])):
        assert (b.output_ids, b.finish_reason) == (a.output_ids, a.finish_reason), i
    assert [r.finish_reason for r in ahead[:-1:4] + ahead[1:-1:4]] == ["stop"] * 6
    assert ahead[-1].finish_reason == "abort" and len(ahead[-1].output_ids) <= 7
    assert ahead[-1].output_ids == free[-1][:len(ahead[-1].output_ids)]


@pytest.mark.parametrize("lag", [1, 4])
def test_chunks_returning_late_and_scheduling_ahead_give_the_plain_runs_bits(ckpts, monkeypatch, lag):
    """The GPU's order of events on the CPU: released chunks stay pending until their event
    completes (``lag`` steps later, or waited for, as ``ChunkPool._reads_done`` is on CUDA), the
    next step is scheduled ahead, the kernels read a page table kept apart (brought up to date
    before each forward), the host tier and the prefix cache on, memory tight enough to preempt
    and compact. Which chunks serve which pages then differs from the plain run; the tokens and
    logits must not (the H200 hung on async scheduling in a 32K run: docs/benchmarks.md)."""
    from zipfusion.memory import chunks, page_table
    from zipfusion.engine import llm_engine
    path, _ = ckpts["llama"]
    rng = torch.Generator().manual_seed(7)
    shared = torch.randint(3, 250, (40,), generator=rng).tolist()
    ps = [(shared if i % 3 == 0 else []) + torch.randint(3, 250, (int(n),), generator=rng).tolist()
          for i, n in enumerate(torch.randint(10, 90, (24,), generator=rng))]
    outs = torch.randint(4, 40, (24,), generator=rng).tolist()
    page = 2 * 16 * 2 * 64 * 2                                   # one open page of one layer
    init, step = page_table.PageTable.__init__, llm_engine.LLMEngine.step
    clock, waits = [0], [0]

    def run(late: bool):
        if late:
            monkeypatch.setattr(chunks.ChunkPool, "_reads_done", lambda self: LateEvent(clock, lag, waits))
            monkeypatch.setattr(page_table.PageTable, "__init__",
                                lambda self, L, P, device, mirrored=None: init(self, L, P, device, True))
            monkeypatch.setattr(llm_engine.LLMEngine, "step",
                                lambda self: clock.__setitem__(0, clock[0] + 1) or step(self))
        llm = LLM(str(path), dtype="bfloat16", device="cpu", deterministic=True, kv_memory_gb=48 * page / 2**30,
                  chunk_bytes=4 * page, max_num_batched_tokens=64, max_model_len=160, admission="optimistic",
                  kv_host_memory_gb=0.002)
        eng = llm.engine
        eng.async_scheduling = late
        reqs = [eng.add_request(p, SamplingParams(temperature=0, max_tokens=o, ignore_eos=True))
                for p, o in zip(ps, outs)]
        run_to_completion(eng, reqs, keep_logits=True)
        stats = eng.cache.stats()
        assert eng.scheduler.num_preemptions > 0 and stats["compactions"] > 0, stats
        return reqs

    plain = run(False)
    late = run(True)
    assert waits[0] > 0                              # some take's chunk was still pending
    for a, b in zip(plain, late):
        assert a.output_ids == b.output_ids
        assert all(torch.equal(x, y) for x, y in zip(a.logits, b.logits))


STEP_SYNC_CASES = {   # (engine options, prompt lengths): short tails after 96-token chunks; 1024+
    # chunks over compressed prefixes taking split_prefill's cuDNN calls (its thresholds scaled to
    # the demo model's 1024 positions)
    "short": (dict(kv_memory_gb=0.004, max_num_batched_tokens=96, max_model_len=400), [200, 37, 90, 150, 120, 64]),
    "split": (dict(kv_memory_gb=0.02, max_num_batched_tokens=256, max_model_len=1024, prefill_split_min_tokens=128,
                   prefill_split_grain=128), [900, 700, 500, 40]),
}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("ahead", [False, True], ids=["plain", "async"])
@pytest.mark.parametrize("case", sorted(STEP_SYNC_CASES))
def test_gpu_steps_never_wait_for_the_device_but_for_their_tokens(case, ahead):
    """Issue 44: compression costs the decode path no device-to-host sync. Every synchronizing
    CUDA call torch knows of (torch.cuda.set_sync_debug_mode: stream syncs, blocking copies,
    .item(), ...) made during steps with mixed prefill chunks (short tails, long continuation
    chunks), seals, with and without async scheduling, is recorded with its stack; none may
    come from anywhere but the step's one wait for its sampled tokens."""
    import traceback
    import warnings
    options, lengths = STEP_SYNC_CASES[case]
    llm = LLM("demo", device="cuda", max_num_seqs=16, async_scheduling=ahead, **options)
    sp = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)

    def batch(seed):
        for p in prompts(seed, lengths):
            llm.engine.add_request(p, sp)
    batch(0)                                      # warm-up: kernels compiled, pinned buffers cached
    while llm.engine.has_work():
        llm.engine.step()
    syncs = []

    def note(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            syncs.append("".join(traceback.format_stack(limit=14)))
    batch(1)
    torch.cuda.set_sync_debug_mode("warn")        # (setting it warns once itself: before recording)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = note
            steps = 0
            while llm.engine.has_work():
                llm.engine.step()
                steps += 1
    finally:
        torch.cuda.set_sync_debug_mode("default")
    stats = llm.kv_stats()
    assert stats["stored_pages"] > 0 and steps > 60 and llm.engine.async_scheduling == ahead
    bad = [s for s in syncs if "_finish_sample" not in s]
    assert not bad, f"{len(bad)} device syncs outside the token wait; first:\n{bad[0]}"
