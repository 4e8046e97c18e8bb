"""Paged decode attention over the zipfusion KV arena.

``decode_attention`` (fused: reads open and compressed pages, restores BF16 in registers),
``decode_attention_twin`` (same kernel over open pages only), ``decode_attention_unfused``
(decompress the pages, then the twin) and ``reference_decode_attention`` (torch, float64);
``paged_prefill_attention`` (+ ``plan_prefill``; Triton, ``prefill_attention.py``) and
``reference_prefill_attention`` for prefill chunks.
On the GPU the first two run the CUDA C++ kernel (``cuda/decode_attention.cu``, built on first
use); the Triton kernel in ``triton_attention.py`` is the fallback and the CPU-checkable reference.
"""

from .decode_attention import decode_attention, decode_attention_twin
from .prefill_attention import PrefillPlan, paged_prefill_attention, plan_prefill
from .reference import reference_decode_attention, reference_prefill_attention
from .unfused import decode_attention_unfused, plan_unfused

__all__ = ["decode_attention", "decode_attention_twin", "decode_attention_unfused",
           "plan_unfused", "reference_decode_attention",
           "paged_prefill_attention", "plan_prefill", "PrefillPlan", "reference_prefill_attention"]
