"""EngineConfig: every engine option, its default and its help, in one place; the CLI options are
generated from its fields. Imports no torch, so ``--help`` is fast. Also the one reader of the
environment (:func:`environment`).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
from dataclasses import dataclass, field
from pathlib import Path

CPU_KV_MEMORY_GB = 0.25          # KV arena on the CPU when kv_memory_gb is not given
GPU_MEMORY_UTILIZATION = 0.90    # share of the GPU's free memory (after the weights) the engine may use
ACTIVATION_RESERVE_GB = 4.0      # of that share, kept for activations, CUDA graphs and the allocator
DEFAULT_MAX_MODEL_LEN = 32768
# Prefill chunk budget when none is given: offline steps may be long; a server's step is every
# stream's inter-token gap, so ``zipfusion serve`` sizes it by device.
OFFLINE_MAX_NUM_BATCHED_TOKENS = 8192
SERVING_MAX_NUM_BATCHED_TOKENS = {"big_gpu": 8192, "gpu": 2048, "cpu": 128}
WATCHDOG_TIMEOUT_S = 300.0   # on CUDA: longest one engine step may run (engine/watchdog.py)
ADMISSION_POLICIES = ("estimate", "lookahead", "conservative", "optimistic")
# Lookahead admission runs the arena near full, so its seal keeps 3 chunks a layer to pack into.
LOOKAHEAD_RESERVE_CHUNKS = 3


def dtype_is_bf16(dtype) -> bool:
    return str(dtype).lower().removeprefix("torch.") in ("bfloat16", "bf16")


def memory_options(admission: str) -> dict:
    return {"reserve_chunks": LOOKAHEAD_RESERVE_CHUNKS} if admission == "lookahead" else {}


# Prefill over stored pages on CUDA: chunks all at least this long run split_prefill (cuDNN),
# the prefix rounded down to the grain so cuDNN builds few graphs.
PREFILL_SPLIT_MIN_TOKENS = 1024
PREFILL_SPLIT_GRAIN = 2048
TP_START_METHODS = ("spawn", "forkserver")
TP_TIMEOUT_S = 600.0             # how long a tensor-parallel collective waits for a peer
LOAD_FORMATS = ("auto", "safetensors", "gguf", "random")
# kv_cache_dtype names accepted and the canonical name each stands for
KV_CACHE_DTYPE_NAMES = ("auto", "bf16", "fp8", "fp8_e4m3", "fp8_lossless")
KV_CACHE_DTYPE_CANONICAL = {"auto": "bf16", "bf16": "bf16", "fp8": "fp8", "fp8_e4m3": "fp8", "fp8_lossless": "fp8"}
# A request's value ranges (SamplingParams checks them; the server's torch-free parser too)
MAX_PENALTY = 2.0
MAX_LOGIT_BIAS = 100.0
GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def _check_number(owner: str, name: str, value, kind: type, low: float, *, above: bool = False,
                  none_ok: bool = False, hint: str = "") -> None:
    """``value`` is a ``kind`` (never a bool) >= ``low`` (> with ``above``), or None where
    ``none_ok``; else a one-line ValueError."""
    if value is None and none_ok:
        return
    kinds = (int, float) if kind is float else (int,)
    if isinstance(value, bool) or not isinstance(value, kinds) or not (value > low if above else value >= low):
        what = "a number" if kind is float else "an int"
        bound = f"> {low:g}" if above else f">= {low:g}"
        raise ValueError(f"{owner}{name} must be {what} {bound}{hint}, got {value!r}")


@dataclass(frozen=True)
class Tuning:
    """Performance knobs: how work is batched and laid out, never a token."""

    # pages of requests expected to finish in the same window share a fill stream's chunks
    fill_streams: int = 16
    fill_window: int = 128
    # packed decode: rows pack behind a shared prefix of this many pages, sparing this many reads
    min_shared_pages: int = 16
    min_spared_pages: int = 4096
    # host tier: staging buffer sizes, and the open pages decoded per launch
    stage_out_bytes: int = 64 << 20
    stage_in_bytes: int = 256 << 20
    decode_batch_bytes: int = 256 << 20

    def __post_init__(self):
        for f in dataclasses.fields(self):
            _check_number("tuning.", f.name, getattr(self, f.name), int, 0 if f.name == "min_spared_pages" else 1)


def _opt(default, help: str, **kw):
    return field(default=default, metadata={"help": help, **kw})


_NUMBER_OPTIONS = (
    ("max_num_seqs", int, 1, {}), ("max_num_batched_tokens", int, 1, {}), ("tensor_parallel_size", int, 1, {}),
    ("max_logprobs", int, 0, {}), ("prefill_split_min_tokens", int, 1, {}), ("prefill_split_grain", int, 1, {}),
    ("tp_timeout_s", float, 0, {"above": True}), ("max_model_len", int, 2, {"none_ok": True}),
    ("kv_memory_gb", float, 0, {"above": True, "none_ok": True}),
    ("watchdog_timeout_s", float, 0, {"none_ok": True, "hint": " (0: off)"}), ("kv_host_memory_gb", float, 0, {"none_ok": True}),
)


@dataclass
class EngineConfig:

    model: str = _opt("demo", "Hugging Face model id (ORG/NAME: downloaded with huggingface_hub into its cache; "
                              "HF_TOKEN, HF_HOME, HF_HUB_CACHE and HF_HUB_OFFLINE=1 honoured), checkpoint folder, "
                              ".gguf file, 'demo' (embedded tiny model), or a shipped config with random weights "
                              "(NAME-random, NAME one of llama-3.1-8b, qwen3-8b, qwen3-32b, qwen2.5-7b, mistral-7b, phi-3-mini, gemma-3-12b, "
                              "qwen3-30b-a3b, mixtral-8x7b (93 GB in bf16: 2 GPUs with --tensor-parallel-size 2), "
                              "mixtral-8x7b-16l (its first 16 layers: one 80 GB GPU))")
    revision: str | None = _opt(None, "Hub branch, tag or commit of --model (default: main)")
    tokenizer: str | None = _opt(None, "tokenizer from another Hub id (its main branch) or folder (default: the model's)")
    chat_template: str | None = _opt(None, "file holding a Jinja chat template to use instead of the tokenizer's (default: the tokenizer's)")
    device: str = _opt("auto", "cuda, cuda:N, cpu, or auto (cuda when a GPU is visible)")
    dtype: str = _opt("bfloat16", "bfloat16, or float32 (needs --no-kv-compression)")
    kv_compression: bool = _opt(True, "keep full KV pages losslessly compressed (bfloat16 pages; fp8 ones with "
                                      "--kv-cache-dtype fp8_lossless)",
                                off_help="keep KV pages uncompressed (default: full pages are kept losslessly "
                                         "compressed; needed for --dtype float32; always off with "
                                         "--kv-cache-dtype fp8)")
    weight_compression: bool = _opt(
        False, "keep the linear layers' and embeddings' BF16 weights losslessly compressed in memory (about 0.75 "
               "of their size; the memory saved goes to the KV cache when --kv-memory-gb is not given), read by "
               "fused kernels: more requests fit, each step is slower (off by default: docs/benchmarks.md; "
               "needs --dtype bfloat16)",
        off_help="keep the weights uncompressed", both_flags=True)
    kv_cache_dtype: str = _opt(
        "bf16", "how K/V values are stored: bf16 (exact; losslessly compressed unless --no-kv-compression) or "
                "fp8 (E4M3, one byte a value: about 2x the KV pages in the same memory. LOSSY: each K/V value "
                "is rounded to 3 mantissa bits and |x| > 448 saturates (per-tensor scale 1.0, as vLLM's "
                "default); outputs differ from bf16. FP8 pages are not compressed), or fp8_lossless (the same E4M3 "
                "values, full pages compressed losslessly on top: the same outputs as fp8; EXPERIMENTAL, "
                "slower than fp8 today). Also accepted: auto (= bf16), fp8_e4m3 (= fp8)", choices=KV_CACHE_DTYPE_NAMES)
    kv_memory_gb: float | None = _opt(None, "GiB for the KV cache (default: what the GPU has free after "
                                            f"the weights x {GPU_MEMORY_UTILIZATION} - "
                                            f"{ACTIVATION_RESERVE_GB} GiB; {CPU_KV_MEMORY_GB} on CPU)")
    max_model_len: int | None = _opt(None, "longest prompt + output in tokens (default: the model's, "
                                           f"at most {DEFAULT_MAX_MODEL_LEN})")
    max_num_seqs: int = _opt(256, "most requests running at once")
    max_num_batched_tokens: int | None = _opt(
        None, "most tokens in one step (decode tokens + prefill chunks); a long prompt is prefilled in "
              f"chunks of this size (default: {OFFLINE_MAX_NUM_BATCHED_TOKENS} offline; zipfusion serve: "
              f"{SERVING_MAX_NUM_BATCHED_TOKENS['big_gpu']} on a GPU with >= 70 GiB, "
              f"{SERVING_MAX_NUM_BATCHED_TOKENS['gpu']} on a smaller one, {SERVING_MAX_NUM_BATCHED_TOKENS['cpu']} "
              "on the CPU, so running streams keep a short inter-token gap)")
    seed: int = _opt(0, "seed for random weights and for requests sampled without a seed (a seeded request "
                        "repeats its tokens exactly only with --deterministic; see there)")
    load_format: str = _opt("auto", "auto, safetensors, gguf, or random (ignore the weights)",
                            choices=LOAD_FORMATS)
    enforce_eager: bool = _opt(False, "no CUDA graphs")
    attention_backend: str = _opt("auto", "decode attention: auto, kernel (our kernels, also on CPU), torch, "
                                          "or flashinfer (FlashInfer's paged decode: uncompressed BF16 or FP8 KV on CUDA, "
                                          "pip install flashinfer-python)",
                                  choices=("auto", "kernel", "torch", "flashinfer"))
    admission: str = _opt("estimate", "estimate: admit what fits at the observed compression ratio, "
                                      "keeping room for running requests; lookahead: the same, with requests "
                                      "of known length reserved at their busiest future step (more running "
                                      "at once; measured once on a GPU); conservative: at open size; "
                                      "optimistic: whatever fits now (preempt later)",
                          choices=ADMISSION_POLICIES)
    enable_prefix_caching: bool = _opt(True, "share the KV pages of prompts' common beginnings between requests "
                                             "(full pages, compressed as they are; evicted least recently "
                                             "used when memory is needed)",
                                       off_help="compute every prompt in full (default: requests share the KV "
                                                "pages of their prompts' common beginnings, as in vLLM)")
    packed_decode: bool = _opt(False, "experimental: decode rows behind one shared prefix travel in pairs through "
                                      "the decode kernel, which restores each shared page once for both "
                                      "(GQA groups of up to 4 heads; not with deterministic=True)")
    kv_host_memory_gb: float | None = _opt(
        None, "GiB of pinned host memory for KV pages the prefix cache evicts (kept as stored, brought back "
              "on a hit instead of recomputed; a preempted request's pages too); 0: off (default: on one GPU, "
              "min(2 x kv_memory_gb, a quarter of the host's free memory); 0 on the CPU and with tensor "
              "parallelism)")
    async_scheduling: bool = _opt(True, "schedule the next step while the GPU computes this one (vLLM's async "
                                        "scheduling, SGLang's overlap; CUDA, one GPU): the host's scheduling "
                                        "leaves the gap between steps, tokens unchanged",
                                  off_help="schedule each step after the previous one's tokens are back "
                                           "(default: the next step is scheduled while the GPU computes)")
    watchdog_timeout_s: float | None = _opt(
        None, "seconds one engine step may run before the process is ended with every thread's stack "
              f"(a stalled GPU; SGLang's --watchdog-timeout); 0: off (default: {WATCHDOG_TIMEOUT_S:g} on "
              "CUDA, off on the CPU)")
    deterministic: bool = _opt(False, "a request's tokens depend only on its prompt, sampling parameters and seed "
                                      "(batch-invariant kernels; slower). Without it the logits can differ slightly "
                                      "(rounding) with the batch a request runs in and with how much of its "
                                      "prompt the prefix cache held, so a seeded request sampled at temperature "
                                      "> 0 can give other tokens (as in vLLM without batch invariance)")
    chunk_bytes: int | None = _opt(None, "arena chunk size in bytes (default: from the KV memory)")
    tensor_parallel_size: int = _opt(1, "split the model over this many GPUs (processes; gloo on the CPU): "
                                        "Megatron tensor parallelism, one worker process per rank "
                                        "started by the engine (or by torchrun); must divide the KV heads")
    max_logprobs: int = _opt(20, "most top log-probabilities a request may ask for (SamplingParams.logprobs)")
    tp_timeout_s: float = _opt(TP_TIMEOUT_S, "seconds a tensor-parallel collective (or a worker's start) may wait "
                                             "for a peer before the engine gives up")
    tp_start_method: str = _opt("spawn", "how the engine starts its tensor-parallel workers: spawn, or "
                                         "forkserver (forked from a server process that has imported torch and "
                                         "zipfusion once: faster to start; the tests use it)",
                                choices=TP_START_METHODS, expert=True)
    kv_gets_weight_savings: bool = _opt(False, "with --kv-memory-gb given: the KV cache also gets the bytes weight "
                                               "compression saved (benchmarks compare modes at the same weights + "
                                               "KV memory; without --kv-memory-gb the default budget has them anyway)",
                                        expert=True)
    check_pages: bool = _opt(False, "debugging aid: every decode attention call first asserts its block table, "
                                    "context lengths and page locations on the device (a bad location stops "
                                    "the process with a device-side assert instead of a kernel reading garbage "
                                    "or spinning; a few small kernels a layer)", expert=True)
    prefill_split_min_tokens: int = _opt(
        PREFILL_SPLIT_MIN_TOKENS, "CUDA: a step whose continuation chunks are all at least this long attends "
                                  "each with cuDNN over its prefix and over the rest, merged (split_prefill), "
                                  "instead of one varlen FlashAttention call; a huge value turns that off",
        expert=True)
    prefill_split_grain: int = _opt(
        PREFILL_SPLIT_GRAIN, "split_prefill's prefix part covers the prefix rounded down to a multiple of this "
                             "many keys, so that cuDNN builds graphs for few prefix lengths (1: the whole "
                             "prefix, a graph per prefix length)", expert=True)
    tuning: Tuning = field(default=Tuning(), metadata={"cli": False})     # API only

    def __post_init__(self):
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = OFFLINE_MAX_NUM_BATCHED_TOKENS
        for name, kind, low, kw in _NUMBER_OPTIONS:
            _check_number("", name, getattr(self, name), kind, low, **kw)
        if not isinstance(self.tuning, Tuning):
            raise ValueError(f"tuning must be a zipfusion.config.Tuning, got {type(self.tuning).__name__}")
        if not isinstance(self.weight_compression, bool):
            raise ValueError(f"weight_compression must be True or False, "
                             f"got {self.weight_compression!r}")
        if self.weight_compression and not dtype_is_bf16(self.dtype):
            raise ValueError(f"weight_compression=True needs dtype='bfloat16' (the weight format is BF16), got "
                             f"dtype={self.dtype!r}; pass weight_compression=False (--no-weight-compression)")
        for f in dataclasses.fields(self):
            if isinstance(f.default, bool) and not isinstance(getattr(self, f.name), bool):
                raise ValueError(f"{f.name} must be True or False, got {getattr(self, f.name)!r}")
            choices = f.metadata.get("choices")
            if choices and getattr(self, f.name) not in choices:
                raise ValueError(f"{f.name} must be one of {list(choices)}, got {getattr(self, f.name)!r}")

        lossless_fp8 = self.kv_cache_dtype == "fp8_lossless"
        if lossless_fp8 and not self.kv_compression:
            raise ValueError("kv_cache_dtype='fp8_lossless' compresses full FP8 pages; drop kv_compression=False "
                             "(--no-kv-compression), or take kv_cache_dtype='fp8' for uncompressed FP8 pages")
        self.kv_cache_dtype = KV_CACHE_DTYPE_CANONICAL[self.kv_cache_dtype]
        if self.kv_cache_dtype == "fp8":
            self._check_fp8(lossless_fp8)
        if self.chat_template is not None and not Path(self.chat_template).expanduser().is_file():
            raise ValueError(f"chat_template: no such file {self.chat_template!r}; pass a file holding a Jinja template")
        if self.attention_backend == "flashinfer":
            if self.kv_compression:
                raise ValueError("attention_backend='flashinfer' reads uncompressed pages only; pass kv_compression=False")
            if self.deterministic:
                raise ValueError("attention_backend='flashinfer' is not batch-invariant; drop deterministic=True")

    def _check_fp8(self, lossless: bool) -> None:
        """kv_cache_dtype='fp8': FP8 pages, lossy; 'fp8_lossless' is kept as 'fp8' with
        kv_compression on (full pages compressed in the FP8 block format)."""
        self.kv_compression = lossless
        if not dtype_is_bf16(self.dtype):
            raise ValueError(f"kv_cache_dtype='fp8' runs with dtype='bfloat16' activations, got dtype={self.dtype!r}")
        if self.packed_decode:
            raise ValueError("packed_decode does not read FP8 pages; drop packed_decode or kv_cache_dtype='fp8'")

    @property
    def kv_lossy(self) -> bool:
        return self.kv_cache_dtype != "bf16"

    @classmethod
    def from_kwargs(cls, model: str | None = None, **options) -> "EngineConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - names)
        if unknown:
            raise TypeError(f"unknown engine option(s) {unknown}; valid: {sorted(names)}")
        return cls(**({"model": model} if model is not None else {}), **options)


def serving_max_num_batched_tokens(device: str = "auto") -> int:
    """The chunk budget ``zipfusion serve`` uses on ``device`` when none is given. Imports torch."""
    import torch
    if device in (None, "auto"):
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if not str(device).startswith("cuda") or not torch.cuda.is_available():
        return SERVING_MAX_NUM_BATCHED_TOKENS["cpu"]
    index = torch.device(device).index or 0
    big = torch.cuda.get_device_properties(index).total_memory >= 70 * 2**30
    return SERVING_MAX_NUM_BATCHED_TOKENS["big_gpu" if big else "gpu"]


def default_cpu_threads() -> int:
    """torch CPU threads when --cpu-threads is not given: half the usable cores, 1 to 8 (every
    core's spinning threads lose to one thread on a busy box: docs/tuning.md)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):          # pragma: no cover - non-Linux
        cores = os.cpu_count() or 1
    return max(1, min(8, cores // 2))


def add_cli_args(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """One ``--option`` per field (``--no-X`` for a bool defaulting to True, with ``off_help``)."""
    for f in dataclasses.fields(EngineConfig):
        if f.name in skip or f.metadata.get("cli") is False:
            continue
        flag = "--" + f.name.replace("_", "-")
        help = argparse.SUPPRESS if f.metadata.get("expert") else f.metadata["help"]
        if f.metadata.get("both_flags"):               # the flag and its --no- twin
            parser.add_argument(flag, dest=f.name, action="store_true", default=f.default, help=help)
            parser.add_argument("--no-" + f.name.replace("_", "-"), dest=f.name, action="store_false",
                                default=f.default, help=f.metadata["off_help"])
        elif f.default is True:
            parser.add_argument("--no-" + f.name.replace("_", "-"), dest=f.name, action="store_false",
                                help=f.metadata["off_help"])
        elif f.default is False:
            parser.add_argument(flag, dest=f.name, action="store_true", help=help)
        else:
            kind = float if "float" in f.type else int if "int" in f.type else str   # annotations are strings
            shown = "" if "(default:" in help or help == argparse.SUPPRESS else f" (default: {f.default})"
            parser.add_argument(flag, dest=f.name, type=kind, default=f.default,
                                choices=f.metadata.get("choices"), help=help + shown)


def options_from_args(args: argparse.Namespace, skip: tuple[str, ...] = ()) -> dict:
    """The options :func:`add_cli_args`' flags give, as typed: what ``LLM(**options)`` takes."""
    names = {f.name for f in dataclasses.fields(EngineConfig) if f.metadata.get("cli") is not False} - set(skip)
    return {k: v for k, v in vars(args).items() if k in names}


def config_from_args(args: argparse.Namespace, skip: tuple[str, ...] = ()) -> EngineConfig:
    return EngineConfig(**options_from_args(args, skip))


@dataclass(frozen=True)
class Environment:
    """The environment variables zipfusion reads, read here once (but for ``ZIPFUSION_API_KEY``,
    read by ``zipfusion serve``)."""
    kernel_cache: Path                # ZIPFUSION_KERNEL_CACHE: the built CUDA kernel libraries
    checkpoint_cache: Path            # ZIPFUSION_CHECKPOINT_CACHE: downloaded checkpoint wheels (analysis/)
    decode_kernel: str                # ZIPFUSION_DECODE_KERNEL: "auto", "cuda" or "triton"
    cuda_producer: bool | None        # ZIPFUSION_CUDA_PRODUCER=0/1 (None: the default)
    nvcc: str | None                  # NVCC, CUDA_HOME: where nvcc is
    cuda_home: str
    pip_index_url: str | None         # PIP_INDEX_URL
    hf_cache: Path                    # HF_HUB_CACHE, else HF_HOME/hub: the Hugging Face Hub cache
    hf_offline: bool                  # HF_HUB_OFFLINE=1: only what the Hub cache holds
    torchrun: tuple[int, int, int] | None   # RANK, WORLD_SIZE, LOCAL_RANK: started by torchrun


@functools.cache
def environment() -> Environment:
    env = os.environ
    cache = Path.home() / ".cache" / "zipfusion"
    torchrun = None
    if "RANK" in env and "WORLD_SIZE" in env:
        torchrun = int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", env["RANK"]))
    return Environment(
        kernel_cache=Path(env.get("ZIPFUSION_KERNEL_CACHE") or cache / "kernels").expanduser(),
        checkpoint_cache=Path(env.get("ZIPFUSION_CHECKPOINT_CACHE") or cache / "wheels").expanduser(),
        decode_kernel=env.get("ZIPFUSION_DECODE_KERNEL", "auto"),
        cuda_producer={"0": False, "1": True}.get(env.get("ZIPFUSION_CUDA_PRODUCER", "")),
        nvcc=env.get("NVCC"), cuda_home=env.get("CUDA_HOME", "/usr/local/cuda"),
        pip_index_url=env.get("PIP_INDEX_URL"), torchrun=torchrun,
        hf_cache=Path(env.get("HF_HUB_CACHE") or Path(env.get("HF_HOME") or Path.home() / ".cache" / "huggingface")
                      / "hub").expanduser(),
        hf_offline=env.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"))

