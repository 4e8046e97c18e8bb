"""What every rank of an engine builds alike from its EngineConfig: the dtype and device, the KV
memory budget and the KV cache in it. ``LLMEngine`` builds its cache here, and so does each
tensor-parallel worker (tp_runner.py), after every rank agreed on the smallest budget."""

from __future__ import annotations

import os

import torch

from ..config import ACTIVATION_RESERVE_GB, CPU_KV_MEMORY_GB, GPU_MEMORY_UTILIZATION, EngineConfig, memory_options
from ..memory import BudgetTooSmall
from ..memory.fp8_kv_cache import Fp8KVCache
from ..memory.kv_cache import ArenaKVCache, DenseKVCache

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32,
          "fp32": torch.float32, "float": torch.float32, "float16": torch.float16, "fp16": torch.float16,
          "half": torch.float16}


def parse_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype.lower() in DTYPES:
        return DTYPES[dtype.lower()]
    raise ValueError(f"dtype must be one of {sorted(set(DTYPES))}, got {dtype!r}")


def parse_device(device) -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be 'auto', 'cuda', 'cuda:N' or 'cpu', got {device!r}") from None
    if dev.type not in ("cuda", "cpu"):
        raise ValueError(f"device must be 'auto', 'cuda' or 'cpu', got {device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but no CUDA GPU is visible; pass device='cpu' (or 'auto')")
    return dev


def free_memory_gb(device: torch.device) -> float:
    """What the device has free now: GPU memory, or the host's available memory."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0] / 2**30
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**30
    except (ValueError, OSError, AttributeError):          # pragma: no cover - non-POSIX hosts
        return float("inf")


def kv_memory_gb(config: EngineConfig, device: torch.device, weights_saved_bytes: int = 0) -> float:
    """The GiB this process can give the KV cache: ``config.kv_memory_gb`` (checked), else what
    the device has free once the weights are in place, x GPU_MEMORY_UTILIZATION less
    ACTIVATION_RESERVE_GB (CPU: CPU_KV_MEMORY_GB); plus weight compression's saving if asked."""
    free = free_memory_gb(device)
    if config.kv_memory_gb is None:
        return (max(0.5, GPU_MEMORY_UTILIZATION * free - ACTIVATION_RESERVE_GB) if device.type == "cuda"
                else min(CPU_KV_MEMORY_GB, 0.5 * free))
    gb = config.kv_memory_gb + (weights_saved_bytes / 2**30 if config.kv_gets_weight_savings else 0.0)
    if gb > free:
        raise ValueError(f"kv_memory_gb={gb:g} is more than the {free:.1f} GiB free on {device}; "
                         f"pass a smaller kv_memory_gb, or leave it out to size it from what is free")
    return gb


def build_kv_cache(config: EngineConfig, model_config, dtype: torch.dtype, device: torch.device, gb: float,
                   tp_size: int = 1):
    """The KV cache of ``gb`` GiB for this rank's KV heads: an arena (BF16 or FP8 pages) or dense
    pages."""
    mc, budget = model_config, int(gb * 2**30)
    L, H, D = mc.num_hidden_layers, mc.num_key_value_heads // tp_size, mc.head_dim
    if dtype != torch.bfloat16:
        return DenseKVCache(L, H, D, DenseKVCache.pages_for(budget, L, H, D, dtype), dtype, device)
    kw = {"chunk_bytes": config.chunk_bytes} if config.chunk_bytes else {}
    try:
        if config.kv_cache_dtype == "fp8":
            return Fp8KVCache(L, H, D, budget, device, kv_compression=config.kv_compression,
                              defer_table_sync=True, **kw, **memory_options(config.admission))
        return ArenaKVCache(L, H, D, budget, device, kv_compression=config.kv_compression,
                            defer_table_sync=True, **kw, **memory_options(config.admission))
    except BudgetTooSmall as exc:
        raise ValueError(f"kv_memory_gb={gb:g} is too small for this model: {exc}") from None
