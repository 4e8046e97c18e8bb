"""The KV side of one forward step: what the model's layers store and attend to.

A step's tokens are flattened as ``[decode rows | prefill chunk 1 | prefill chunk 2 ...]``:
each decode row is one request's newest token, each chunk a run of one request's prompt (or
recomputed) tokens. :class:`StepKV` is the model's :class:`~zipfusion.models.llama.KVCacheStep`
for that batch:

* ``store``: rope and K/V of every token written into its page slot (one call per layer);
* ``attend``: decode rows run the paged decode kernel over their pages (compressed or open);
  each prefill chunk attends causally over its request's earlier tokens (read back from the
  pages, decoded if compressed) followed by its own, through :func:`prefill_attention`.

Deterministic mode (``cache.deterministic``): a prefill token attends exactly as it would as a
decode row -- the decode kernel over the request's pages with its own context length (its K/V
were stored first) -- so a token's attention sums in the same order whether it was computed
in a prompt chunk of any size, a recompute after preemption, or a decode step.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from ..format import PAGE_TOKENS
from .kv_cache import KVCache

# SDPA kernels for a whole prompt on CUDA, fastest first (cuDNN: 0.90 ms per Llama-8B layer at
# 8192 tokens on an H200, FlashAttention 1.71 ms; docs/benchmarks.md); math only as a last resort
CUDA_SDPA = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
             SDPBackend.MATH]


@dataclass
class ChunkView:
    """A prefill chunk as attention sees it: ``length`` tokens at positions ``start..``, the
    request's pages (its first ``start`` tokens are already in them)."""
    start: int
    length: int
    pages: list[int]


class StepKV:
    def __init__(self, cache: KVCache, sm_scale: float, page_ids: torch.Tensor, slots: torch.Tensor,
                 num_decode: int = 0, block_table: torch.Tensor | None = None,
                 context_lens: torch.Tensor | None = None, chunks: list[ChunkView] = ()):
        self.cache, self.sm_scale = cache, sm_scale
        self.page_ids, self.slots = page_ids, slots
        self.num_decode, self.block_table, self.context_lens = num_decode, block_table, context_lens
        self.chunks = list(chunks)
        # deterministic mode: every prefill token as a decode row (its request's pages, its length)
        self._as_decode = [self._decode_rows(ch, page_ids.device) for ch in self.chunks] \
            if cache.deterministic else None

    @staticmethod
    def _decode_rows(ch: ChunkView, device) -> tuple[torch.Tensor, torch.Tensor]:
        pages = ch.pages[:-(-(ch.start + ch.length) // PAGE_TOKENS)]
        table = torch.tensor(pages, dtype=torch.int32, device=device).expand(ch.length, len(pages))
        lens = torch.arange(ch.start + 1, ch.start + ch.length + 1, dtype=torch.int32, device=device)
        return table, lens

    def store(self, layer, q, k, v, cos, sin):
        return self.cache.store(layer, q, k, v, cos, sin, self.page_ids, self.slots, want_kv=bool(self.chunks))

    def attend(self, layer, q, k, v):
        n = self.num_decode
        outs = []
        if n:
            outs.append(self.cache.decode_attention(layer, q[:n], self.block_table, self.context_lens,
                                                    self.sm_scale))
        off = n
        for i, ch in enumerate(self.chunks):
            qi, ki, vi = q[off:off + ch.length], k[off:off + ch.length], v[off:off + ch.length]
            if self._as_decode is not None:
                outs.append(self.cache.decode_attention(layer, qi, *self._as_decode[i], self.sm_scale))
                off += ch.length
                continue
            if ch.start:
                kp, vp = self.cache.read_tokens(layer, ch.pages, ch.start)
                ki, vi = torch.cat([kp.to(ki.dtype), ki]), torch.cat([vp.to(vi.dtype), vi])
            outs.append(prefill_attention(qi, ki, vi, ch.start, self.sm_scale))
            off += ch.length
        return outs[0] if len(outs) == 1 else torch.cat(outs)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """Causal attention of q [n, Hq, D] (positions start..start+n-1) over k, v [start+n, H, D]:
    query i sees keys j <= start + i. Memory linear in n (no score matrix) on CUDA.

    CUDA: torch's fused SDPA kernels in bf16 -- cuDNN or FlashAttention for a whole prompt
    (top-left causal, GQA native); with a prefix, the bottom-right causal variant
    (``causal_lower_right``, FlashAttention/memory-efficient kernels), K/V heads repeated for GQA.
    CPU: SDPA with an explicit mask.
    """
    n, Hq, _ = q.shape
    H = k.shape[1]
    qb, kb, vb = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))        # [1, heads, len, D]
    if start == 0:
        with sdpa_kernel(CUDA_SDPA, set_priority=True) if q.is_cuda else contextlib.nullcontext():
            o = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale, enable_gqa=Hq != H)
    elif q.is_cuda:
        if Hq != H:
            kb, vb = kb.repeat_interleave(Hq // H, dim=1), vb.repeat_interleave(Hq // H, dim=1)
        o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=causal_lower_right(n, start + n), scale=scale)
    else:
        pos = torch.arange(start + n, device=q.device)
        mask = pos[None, :] <= (start + torch.arange(n, device=q.device))[:, None]
        o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=scale, enable_gqa=Hq != H)
    return o[0].transpose(0, 1)
