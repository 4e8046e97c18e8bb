"""Paged attention over the KV arena: ``decode_attention`` (open and compressed pages),
``decode_attention_uncompressed`` and ``paged_prefill_attention``; CUDA C++ on the GPU where it
applies, Triton elsewhere (the CPU-checkable reference)."""

from .decode_attention import decode_attention, decode_attention_uncompressed
from .prefill_attention import PrefillPlan, paged_prefill_attention, plan_prefill

__all__ = ["decode_attention", "decode_attention_uncompressed", "paged_prefill_attention", "plan_prefill", "PrefillPlan"]
