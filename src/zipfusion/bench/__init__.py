"""``zipfusion bench``: the benchmarks a user runs, as vLLM's ``vllm bench``.

- ``serve``: a serving benchmark against ``zipfusion serve`` (one it starts per mode, or ``--url``):
  Poisson arrivals at a sweep of rates or a closed loop, TTFT / TPOT / ITL, goodput (:mod:`.serve`);
- ``throughput``: offline, every request at once, each mode in its own process (:mod:`.throughput`);
- ``latency``: one batch of B prompts of L tokens: prefill time, then per-token decode (:mod:`.latency`);
- ``kernel``: decode attention, compressed vs uncompressed kernel vs FlashInfer (:mod:`.kernel`).

Each takes ``--compare compressed,uncompressed[,weights][,flashinfer][,fp8][,fp8_lossless][,flashinfer_fp8]``
(:data:`MODES`; weights: the weights compressed too, the KV given what they saved; fp8, the lossy FP8 KV cache, read by our kernel or FlashInfer's, fp8_lossless the
same pages compressed losslessly on top; :data:`KERNEL_MODES` for the kernel
bench), prints a table last and writes JSON + PNG (:mod:`.report`). Datasets are length distributions with random token
ids or text (:mod:`.datasets`). Importing this package is cheap (no torch): the CLI builds its
parser from :mod:`.cli`.
"""

from __future__ import annotations

# mode -> (engine options, ``zipfusion serve`` flags): what a user compares. fp8 is the lossy
# FP8 (E4M3) KV cache (vLLM's --kv-cache-dtype fp8), the comparison a zero-tolerance team weighs.
_BF16_WEIGHTS = ({"weight_compression": False}, ["--no-weight-compression"])
MODES = {
    "compressed": ({"kv_compression": True}, []),
    "uncompressed": ({"kv_compression": False}, ["--no-kv-compression"]),
    "flashinfer": ({"kv_compression": False, "attention_backend": "flashinfer"},
                   ["--no-kv-compression", "--attention-backend", "flashinfer"]),
    "fp8": ({"kv_cache_dtype": "fp8"}, ["--kv-cache-dtype", "fp8"]),
    # FP8 pages, full ones compressed losslessly on top (the E4M3 bytes kept bit for bit)
    "fp8_lossless": ({"kv_cache_dtype": "fp8_lossless"}, ["--kv-cache-dtype", "fp8_lossless"]),
    # the FP8 KV cache decoded by FlashInfer's FP8 kernel (CUDA; vLLM's FP8 decode)
    "flashinfer_fp8": ({"kv_cache_dtype": "fp8", "attention_backend": "flashinfer"},
                       ["--kv-cache-dtype", "fp8", "--attention-backend", "flashinfer"]),
}
# every mode above serves BF16 weights; "weights" compresses the weights and the KV, and its KV gets
# what the weights saved on top of --kv-memory-gb: the same weights + KV memory as the others
MODES = {m: ({**opts, **_BF16_WEIGHTS[0]}, flags + _BF16_WEIGHTS[1]) for m, (opts, flags) in MODES.items()}
MODES["weights"] = ({"kv_compression": True, "weight_compression": True, "kv_gets_weight_savings": True},
                    ["--weight-compression", "--kv-gets-weight-savings"])
FLASHINFER_MODES = ("flashinfer", "flashinfer_fp8")                # need FlashInfer and CUDA
# zipfusion bench kernel's: BF16 pages (compressed, open, FlashInfer's) and E4M3 pages (ours, FlashInfer's;
# fp8_lossless: ours over the same E4M3 pages in the lossless FP8 block format, a kernel mode only)
KERNEL_MODES = ("compressed", "uncompressed", "flashinfer", "fp8", "fp8_lossless", "flashinfer_fp8")
DEFAULT_COMPARE = "compressed,uncompressed"


def parse_modes(text: str, known=MODES) -> list[str]:
    """``compressed,uncompressed`` -> a list of known, distinct modes (ValueError: one line)."""
    modes = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in modes if m not in known]
    if not modes or bad:
        raise ValueError(f"unknown mode(s) {bad or [text]}; pick from {', '.join(known)} (comma-separated)")
    if len(set(modes)) != len(modes):
        raise ValueError(f"a mode is named twice in {text!r}")
    return modes


def flashinfer_skip_reason(device: str, deterministic: bool = False) -> str | None:
    """Why the flashinfer mode cannot run here, or None."""
    import importlib.util
    if not str(device).startswith("cuda"):
        return f"FlashInfer runs on CUDA only; the device is {device}"
    if deterministic:
        return "FlashInfer's decode is not batch-invariant (the engine refuses deterministic=True with it)"
    if importlib.util.find_spec("flashinfer") is None:
        return "flashinfer is not installed (pip install flashinfer-python, or scripts/gpu/carry_wheels.sh)"
    return None
