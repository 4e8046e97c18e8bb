"""Paged decode attention over the zipfusion KV arena.

``decode_attention`` (fused: reads open and compressed pages, restores BF16 in registers) and
``decode_attention_uncompressed`` (same kernel over open pages only); ``paged_prefill_attention`` (+
``plan_prefill``; Triton, ``prefill_attention.py``) for prefill chunks. Torch references live in
``zipfusion.testing``, the decompress-then-attend baseline in ``benchmarks/unfused.py``.
On the GPU the first two run the CUDA C++ kernel (``cuda/decode_attention.cu``, built on first
use); the Triton kernel in ``triton_attention.py`` is the fallback and the CPU-checkable reference.
"""

from .decode_attention import decode_attention, decode_attention_uncompressed
from .prefill_attention import PrefillPlan, paged_prefill_attention, plan_prefill

__all__ = ["decode_attention", "decode_attention_uncompressed", "paged_prefill_attention", "plan_prefill", "PrefillPlan"]
