"""Prefill of a chunk that starts its request, over its own fresh K/V (cuDNN on the GPU, shapes
bucketed so a run builds few graphs; SDPA elsewhere), and the dense attention both routes run.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

# SDPA kernels for a whole prompt on CUDA, fastest first (docs/benchmarks.md); math last
CUDA_SDPA = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
             SDPBackend.MATH]
# cuDNN pads queries (causal: and keys) to a multiple of this, so a run builds few graphs
CUDNN_BUCKET = 512


class OpenPrefill:
    """Whole prompts (and first chunks) over their own K/V: causal attention, no prefix."""

    def __init__(self, sm_scale: float):
        self.sm_scale = sm_scale

    def plan(self, chunks, device) -> list[slice]:
        """Host work once a step: each chunk's rows in the step's q."""
        return [slice(off, off + ch.length) for off, ch in chunks]

    def run(self, layer: int, q, k, v, out: torch.Tensor, plan: list[slice]) -> None:
        for sl in plan:
            out[sl] = prefill_attention(q[sl], k[sl], v[sl], 0, self.sm_scale)

    def warm_up(self, q: torch.Tensor, kv: torch.Tensor) -> None:
        """Build cuDNN's graph of every causal bucket up to ``q``'s rows (CUDA only)."""
        for n in range(CUDNN_BUCKET, q.shape[0] + 1, CUDNN_BUCKET):
            attend_lse(q[:n], kv[:n], kv[:n], True, self.sm_scale)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float,
                      window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """Causal attention of q [n, Hq, D] at positions start.. over k, v [start+n, H, D] (with
    ``window`` / ``softcap``: :func:`masked_attention`): cuDNN for a whole prompt on CUDA, SDPA's
    bottom-right causal kernels after a prefix, SDPA on the CPU.
    """
    if window is not None or softcap is not None:
        return masked_attention(q, k, v, start, scale, window, softcap)
    if start == 0 and cudnn_takes(q):
        return attend_lse(q, k, v, True, scale)[0]
    n, Hq, _ = q.shape
    H = k.shape[1]
    qb, kb, vb = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
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


MASKED_BLOCK = 256  # query rows a block (bounds its score matrix)


def masked_attention(q, k, v, start: int, scale: float, window: int | None = None, softcap: float | None = None,
                     exact: bool = False) -> torch.Tensor:
    """:func:`prefill_attention` with a sliding window and soft-capped scores, on any device, in
    blocks of MASKED_BLOCK rows (SDPA, or fp32/fp64 torch with soft-capping or ``exact``)."""
    n, Hq, D = q.shape
    H = k.shape[1]
    ftype = torch.float64 if exact else torch.float32
    out = torch.empty_like(q)
    for i in range(0, n, MASKED_BLOCK):
        b = min(MASKED_BLOCK, n - i)
        lo = 0 if window is None else max(0, start + i - window + 1)
        hi = start + i + b
        pos = start + i + torch.arange(b, device=q.device)[:, None]
        keys = torch.arange(lo, hi, device=q.device)[None, :]
        seen = (keys <= pos) if window is None else (keys <= pos) & (keys > pos - window)
        if softcap is None and not exact:
            qh, kh, vh = (t.transpose(0, 1)[None] for t in (q[i:i + b], k[lo:hi], v[lo:hi]))
            out[i:i + b] = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=seen, scale=scale,
                                                          enable_gqa=Hq != H)[0].transpose(0, 1)
            continue
        qb = q[i:i + b].to(ftype).view(b, H, Hq // H, D)
        s = torch.einsum("qhgd,khd->hgqk", qb, k[lo:hi].to(ftype)) * scale
        if softcap is not None:
            s = torch.tanh(s / softcap) * softcap
        p = s.masked_fill(~seen, float("-inf")).softmax(-1)
        out[i:i + b] = torch.einsum("hgqk,khd->qhgd", p, v[lo:hi].to(ftype)).reshape(b, Hq, D).to(q.dtype)
    return out


def attend_lse(q, k, v, causal: bool, scale: float, bucket: int | None = None):
    """(o [n, Hq, D], lse [n, Hq] fp32) of q over k, v, causal top-left: cuDNN on CUDA, fp32 torch
    elsewhere. Queries (and causal keys) are zero-padded to a multiple of ``bucket`` so that cuDNN
    builds a graph per bucket, not per length; padding changes no real row."""
    n, Hq, _ = q.shape
    bucket = bucket or (CUDNN_BUCKET if cudnn_takes(q) else 1)
    if n % bucket:
        pad = lambda t: F.pad(t, (0, 0, 0, 0, 0, bucket - n % bucket))  # noqa: E731 - rows at the end
        q, (k, v) = pad(q), ((pad(k), pad(v)) if causal else (k, v))
        o, lse = attend_lse(q, k, v, causal, scale, bucket)
        return o[:n], lse[:n]
    g, cudnn = Hq // k.shape[1], cudnn_takes(q)
    if cudnn:
        if g > 1 and not cudnn["gqa"]:
            k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        qb, kb, vb = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        o, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(qb, kb, vb, None, True, 0.0, causal, False,
                                                                    scale=scale)[:2]
        return o[0].transpose(0, 1), lse.reshape(Hq, n).transpose(0, 1).float()
    kf, vf = (t.float().repeat_interleave(g, dim=1) for t in (k, v))
    s = torch.einsum("qhd,khd->hqk", q.float(), kf) * scale
    if causal:
        s = s.masked_fill(torch.ones(n, k.shape[0], dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    lse = torch.logsumexp(s, -1)
    return torch.einsum("hqk,khd->qhd", torch.exp(s - lse[..., None]), vf), lse.transpose(0, 1)


def cudnn_takes(q: torch.Tensor) -> dict | None:
    """What cuDNN's SDPA with its log-sum-exp offers for q ({"gqa": bool}), or None."""
    return _cudnn_probe(q.shape[-1]) if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) else None


@functools.cache
def _cudnn_probe(head_dim: int = 128) -> dict | None:
    """Whether cuDNN's SDPA with log-sum-exp (and GQA) runs at ``head_dim`` (asked once)."""
    if not torch.cuda.is_available():
        return None
    op = torch.ops.aten._scaled_dot_product_cudnn_attention
    x = torch.randn(1, 4, 64, head_dim, dtype=torch.bfloat16, device="cuda")
    try:
        op(x, x, x, None, True, 0.0, False, False)
    except Exception:                               # noqa: BLE001 - no cuDNN SDPA here: varlen route
        return None
    try:
        op(x, x[:, :2], x[:, :2], None, True, 0.0, False, False)
        return {"gqa": True}
    except Exception:                               # noqa: BLE001
        return {"gqa": False}
