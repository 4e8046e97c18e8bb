"""``zipfusion bench``: the benchmarks a user runs, as vLLM's ``vllm bench`` (``serve``,
``throughput``, ``latency``, ``kernel``). Each compares :data:`MODES` with ``--compare``, prints a
table last and writes JSON + PNG. Importing this package is cheap (no torch).
"""

from __future__ import annotations

# mode -> (engine options, ``zipfusion serve`` flags); fp8 is the lossy FP8 KV cache
_BF16_WEIGHTS = ({"weight_compression": False}, ["--no-weight-compression"])
MODES = {
    "compressed": ({"kv_compression": True}, []),
    "uncompressed": ({"kv_compression": False}, ["--no-kv-compression"]),
    "flashinfer": ({"kv_compression": False, "attention_backend": "flashinfer"},
                   ["--no-kv-compression", "--attention-backend", "flashinfer"]),
    "fp8": ({"kv_cache_dtype": "fp8"}, ["--kv-cache-dtype", "fp8"]),
# FP8 pages, full ones compressed losslessly on top
    "fp8_lossless": ({"kv_cache_dtype": "fp8_lossless"}, ["--kv-cache-dtype", "fp8_lossless"]),
# FlashInfer's FP8 decode
    "flashinfer_fp8": ({"kv_cache_dtype": "fp8", "attention_backend": "flashinfer"},
                       ["--kv-cache-dtype", "fp8", "--attention-backend", "flashinfer"]),
}
# "weights": weights and KV compressed, its KV given what the weights saved (same total memory)
MODES = {m: ({**opts, **_BF16_WEIGHTS[0]}, flags + _BF16_WEIGHTS[1]) for m, (opts, flags) in MODES.items()}
MODES["weights"] = ({"kv_compression": True, "weight_compression": True, "kv_gets_weight_savings": True},
                    ["--weight-compression", "--kv-gets-weight-savings"])
FLASHINFER_MODES = ("flashinfer", "flashinfer_fp8")
# zipfusion bench kernel's modes
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
