"""The CUDA C++ decode-attention kernel (``cuda/decode_attention.cu``): built with nvcc on first use,
cached (one library per head dim: 64, 128 or 256), called through ctypes on torch's current
stream; groups up to 16, sm_80+.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import re
import shutil
import subprocess
import warnings
from pathlib import Path

import torch

from ..config import environment
from .splits import plan_splits

log = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("cuda") / "decode_attention.cu"
HEAD_DIMS = (64, 128, 256)
MAX_GROUP = 16


def default_stages(compressed: bool, group: int, head_dim: int = 128) -> int:
    """Half pages in flight per warp (docs/tuning.md): fused 4, uncompressed 3; groups over 8: 4;
    head_dim 256: 3 (two CTAs an SM)."""
    if head_dim == 256:
        return 3
    return 3 if not compressed and group <= 8 else 4


PRODUCER_STAGES = 4  # the producer kernel's fixed depth


def default_producer(compressed: bool, hopper: bool) -> bool:
    """Whether the producer-warp kernel is the default: for compressed pages on Hopper
    (``ZIPFUSION_CUDA_PRODUCER`` overrides)."""
    override = environment().cuda_producer
    return hopper and (compressed if override is None else override)


class CudaKernelUnavailable(RuntimeError):
    """The CUDA C++ kernel cannot run here (no nvcc, old GPU, unsupported shape)."""


def choose_copy(compressed: bool, hopper: bool, group: int, stages: int | None,
                tma: bool | None, producer: bool | None, head_dim: int = 128) -> tuple[int, int]:
    """(stages, copy) for the kernel library: copy 0 = per-warp cp.async, 1 = per-warp bulk
    copies, 2 = a producer warp with bulk copies; unset knobs take the defaults."""
    if producer is None:
        producer = (default_producer(compressed, hopper) and tma is not False
                    and stages in (None, PRODUCER_STAGES))
    if producer and stages not in (None, PRODUCER_STAGES):
        raise ValueError(f"stages={stages} with producer=True: the producer kernel keeps "
                         f"{PRODUCER_STAGES} half pages a warp in flight; leave stages unset")
    if producer and tma is False:
        raise ValueError("producer=True with tma=False: the producer warp stages pages with bulk "
                         "copies (TMA); leave tma unset")
    if tma is None:
        tma = compressed and hopper
    if (tma or producer) and not hopper:
        raise CudaKernelUnavailable("tma=True / producer=True need an sm_90+ GPU (Hopper)")
    if producer:
        return PRODUCER_STAGES, 2
    return int(stages or default_stages(compressed, group, head_dim)), int(bool(tma))


def _nvcc() -> str:
    env = environment()
    for cand in (env.nvcc, shutil.which("nvcc"), os.path.join(env.cuda_home, "bin", "nvcc")):
        if cand and os.path.exists(cand):
            return cand
    raise CudaKernelUnavailable("nvcc was not found (set NVCC or CUDA_HOME, or use "
                                "backend='triton')")


_BUILT: dict[str, "ctypes.CDLL | CudaKernelUnavailable"] = {}  # arch, head dim, flags -> library or why not
_FLAGS: list[str] = []


def set_build_defines(*defines: str) -> None:
    """Add preprocessor defines to every later build in this process (benchmarks, tests)."""
    for d in defines:
        if not re.fullmatch(r"[A-Za-z_]\w*(=\w+)?", d):
            raise ValueError(f"a build define is NAME or NAME=VALUE, got {d!r}")
    _FLAGS[:] = [f"-D{d}" for d in defines]


def _library(arch: str, head_dim: int = 128) -> ctypes.CDLL:
    """The kernel library for ``arch`` and ``head_dim``, built once; a failure is remembered and
    warned once."""
    flags = [f"-DZF_HEAD_DIM={head_dim}", *_FLAGS]
    key = arch + " " + " ".join(flags)
    got = _BUILT.get(key)
    if got is None:
        try:
            got = _build(arch, flags)
        except CudaKernelUnavailable as e:
            warnings.warn(f"zipfusion: the CUDA attention kernel is unavailable ({e}); decode "
                          "attention falls back to the slower Triton kernel", stacklevel=3)
            got = e
        _BUILT[key] = got
    if isinstance(got, CudaKernelUnavailable):
        raise got
    return got


def nvcc_command(arch: str, flags: list[str], out: Path) -> list[str]:
    """The nvcc command line that builds the kernel library for ``arch`` into ``out``."""
    return [_nvcc(), "-O3", "--use_fast_math", "-std=c++17", "-shared", "-Xcompiler", "-fPIC",
            f"-gencode=arch=compute_{arch},code=sm_{arch}", *flags, "-o", str(out), str(SOURCE)]


def _build(arch: str, flags: list[str]) -> ctypes.CDLL:
    src = SOURCE.read_bytes()
    key = hashlib.sha256(src + arch.encode() + " ".join(flags).encode()).hexdigest()[:16]
    cache = environment().kernel_cache
    cache.mkdir(parents=True, exist_ok=True)
    lib = cache / f"decode_attention_{arch}_{key}.so"
    if not lib.exists():
        log.info("building the CUDA attention kernel for sm_%s (once, 10-20 s) into %s",
                 arch, cache)
        tmp = lib.with_suffix(f".{os.getpid()}.tmp")
        res = subprocess.run(nvcc_command(arch, flags, tmp), capture_output=True, text=True)
        if res.returncode != 0:
            raise CudaKernelUnavailable(f"building {SOURCE.name} failed:\n{res.stderr[-4000:]}")
        os.replace(tmp, lib)
    return load_library(lib)


def load_library(lib: Path) -> ctypes.CDLL:
    dll = ctypes.CDLL(str(lib))
    dll.zf_decode_attention.restype = ctypes.c_int
    dll.zf_decode_attention.argtypes = (
        [ctypes.c_int] * 4 + [ctypes.c_void_p] * 8
        + [ctypes.c_float] + [ctypes.c_int] * 6 + [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p])
    dll.zf_error_string.restype = ctypes.c_char_p
    dll.zf_error_string.argtypes = [ctypes.c_int]
    return dll


def _arch(device: torch.device) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    if major < 8:
        raise CudaKernelUnavailable(f"the CUDA kernel needs bf16 tensor cores (sm_80+), this GPU "
                                    f"is sm_{major}{minor}")
    return f"{major}{minor}"


def unsupported_reason(device: torch.device, head_dim: int, group: int) -> str | None:
    """Why the CUDA kernel cannot serve this call, or None if it can."""
    if device.type != "cuda":
        return "tensors are not on a CUDA device"
    if head_dim not in HEAD_DIMS:
        return f"head_dim {head_dim} (the CUDA kernel is built for {', '.join(map(str, HEAD_DIMS))})"
    if group > MAX_GROUP:
        return f"GQA group of {group} query heads (the CUDA kernel serves up to {MAX_GROUP})"
    try:
        _library(_arch(device), head_dim)
    except CudaKernelUnavailable as e:
        return str(e)
    return None


def ctas_per_sm(stages: int, head_dim: int = 128) -> int:
    """CTAs of the kernel that fit on one SM at this copy depth (the .cu's ``ctas_per_sm``)."""
    if head_dim == 256:
        return 3 if stages <= 2 else 2 if stages <= 3 else 1
    return 4 if stages <= 3 else 3 if stages <= 4 else 2 if stages <= 6 else 1


def head_passes(group: int, head_dim: int) -> int:
    """CTAs per (split, KV head): head_dim 256 serves 8 query heads a CTA (the .cu's ``cta_heads``)."""
    return -(-group // 8) if head_dim == 256 else 1


PAGES_PER_CTA_OVERHEAD = 2.5  # a CTA's fixed cost, in pages (docs/tuning.md)


def default_num_splits(batch: int, num_kv_heads: int, max_pages: int, device: torch.device,
                       head_dim: int = 128, group: int = 1) -> int:
    """Split-KV factor from a wave model of the launch: the fewest splits within 3 % of the
    cheapest, >= 16 pages a split. The uncompressed kernel uses the fused kernel's slots, as
    the split count fixes the order of the sums and both must give the same bits.
    """
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    slots = ctas_per_sm(default_stages(True, 1, head_dim), head_dim) * sms
    work = max(1, batch * num_kv_heads * head_passes(group, head_dim))

    def cost(S: int) -> float:
        return -(-work * S // slots) * (-(-max_pages // S) + PAGES_PER_CTA_OVERHEAD)

    candidates = range(1, int(max(1, min(max_pages // 16, 64))) + 1)
    best = min(cost(S) for S in candidates)
    return next(S for S in candidates if cost(S) <= 1.03 * best)


def decode_attention_cuda(q: torch.Tensor, arena: torch.Tensor, page_loc_layer: torch.Tensor,
                          block_table: torch.Tensor, context_lens: torch.Tensor, num_kv_heads: int,
                          qk_scale: float, out: torch.Tensor, *, compressed: bool,
                          num_splits: int | None = None, split_pages: int | None = None,
                          stages: int | None = None, tma: bool | None = None,
                          producer: bool | None = None, spans: torch.Tensor | None = None,
                          slot_heads: int = 0) -> torch.Tensor:
    """Launch the kernel (and the merge for several splits); inputs checked by the caller.
    ``stages``, ``tma``, ``producer`` pick the copy scheme (every variant gives the same bits);
    ``spans`` and ``slot_heads``: packed requests."""
    B, Hq, D = q.shape
    G = Hq // num_kv_heads
    if B == 0:
        return out
    arch = _arch(q.device)
    lib = _library(arch, D)
    hopper = int(arch) >= 90
    stages, copy = choose_copy(compressed, hopper, G, stages, tma, producer, D)
    max_pages = block_table.shape[1]
    plan = plan_splits(out, max_pages, num_splits, split_pages,
                       lambda: default_num_splits(B, num_kv_heads, max_pages, q.device, D, G))
    stream = torch.cuda.current_stream(q.device).cuda_stream
    with torch.cuda.device(q.device):
        err = lib.zf_decode_attention(
            D, int(compressed), stages, copy,
            q.data_ptr(), arena.data_ptr(), page_loc_layer.data_ptr(), block_table.data_ptr(),
            context_lens.data_ptr(), out.data_ptr(), plan.part_o.data_ptr(),
            plan.part_lse.data_ptr(), float(qk_scale), block_table.stride(0), plan.pages,
            plan.count, B, num_kv_heads, G, None if spans is None else spans.data_ptr(),
            int(slot_heads), stream)
    if err:
        raise RuntimeError(f"CUDA decode attention failed: {lib.zf_error_string(err).decode()}")
    return out
