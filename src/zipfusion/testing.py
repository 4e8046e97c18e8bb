"""Helpers for tests and benchmarks (the engine never calls this module): stepping an engine,
placement from given sizes on the meta device, a counting host tier, and float64 references for
paged attention that read pages exactly as the kernels must."""

from __future__ import annotations

import numpy as np
import torch

from .format.layout import PAGE_TOKENS, PageLayout, loc_is_open, loc_offset
from .format.reference import decode_pages
from .memory import KVCacheManager
from .memory.host_tier import HostTier


def place_with_sizes(m: KVCacheManager, ids, sizes, min_capacity: int = 0, reclaim=None) -> list[int]:
    """Compress the open pages ``ids`` of a meta-device manager as if their encoded sizes were
    ``sizes`` [L, len(ids)]; the ids left open."""
    ids = list(ids)
    if m.device.type != "meta":
        raise ValueError("place_with_sizes: a manager on the meta device (no bytes) only")
    if sizes is None:
        raise ValueError("place_with_sizes needs the pages' encoded sizes (sizes=)")
    sizes = np.asarray(sizes, dtype=np.int64)
    if sizes.shape != (m.num_layers, len(ids)):
        raise ValueError(f"place_with_sizes: sizes must be [num_layers, len(ids)] = {[m.num_layers, len(ids)]}, "
                         f"got {list(sizes.shape)}")
    lo, hi = m.layout.min_page_bytes, m.layout.max_page_bytes
    if ((sizes < lo) | (sizes > hi) | (sizes % 16 != 0)).any():
        raise ValueError(f"place_with_sizes: sizes must be page sizes of the format ({lo}..{hi}, multiples of 16)")
    no_bytes = torch.empty(0, dtype=torch.uint8, device="meta")
    job = m.encoded_pages(ids, no_bytes, np.zeros_like(sizes), sizes)
    return m.place_pages(job, min_capacity=min_capacity, reclaim=reclaim)


class AccountingHostTier(HostTier):
    """A :class:`HostTier` that keeps the books and moves no bytes (meta-device managers)."""

    def _allocate(self) -> None:
        self.buf = torch.empty(self.budget, dtype=torch.uint8, device="meta")

    def _copy_out(self, off, nbytes, records) -> None:
        pass


def run_to_completion(engine, reqs=(), keep_logits: bool = False) -> None:
    """Step ``engine`` until it has no work (``keep_logits``: each request gets its logits rows)."""
    want = {r.request_id: r for r in reqs} if keep_logits else {}
    for r in want.values():
        r.logits = []
    while engine.has_work():
        res = engine.step()
        if want and res.logits is not None:
            rows = res.logits.detach().cpu()
            for r, row in zip(res.sampled, rows):
                if r.request_id in want:
                    want[r.request_id].logits.append(row.clone())


def gather_request_kv(arena: torch.Tensor, page_loc_layer: torch.Tensor, page_ids: torch.Tensor,
                      layout: PageLayout) -> torch.Tensor:
    """The pages ``page_ids`` of one layer as [n, 2, 16, H, D] bf16 (open or decoded)."""
    H, D = layout.num_kv_heads, layout.head_dim
    loc = page_loc_layer[page_ids.to(torch.int64)].cpu()
    pages = torch.empty(len(page_ids), 2, PAGE_TOKENS, H, D, dtype=torch.bfloat16,
                        device=arena.device)
    is_open = loc_is_open(loc)
    n = layout.open_page_bytes
    for i in torch.nonzero(is_open).flatten().tolist():
        start = loc_offset(int(loc[i]))
        pages[i] = arena[start:start + n].view(torch.bfloat16).view(2, PAGE_TOKENS, H, D)
    comp = torch.nonzero(~is_open).flatten()
    if comp.numel():
        pages[comp.to(pages.device)] = decode_pages(arena, loc[comp].to(arena.device), H, D)
    return pages


def reference_decode_attention(q, arena, page_loc_layer, block_table, context_lens, layout,
                               sm_scale, out=None, *, out_dtype=torch.bfloat16, window=None, softcap=None):
    """Decode attention in float64 (``window``, ``softcap``), :func:`decode_attention`'s inputs;
    returns ``out_dtype`` (bf16 by default)."""
    B, Hq, D = q.shape
    H = layout.num_kv_heads
    G = Hq // H
    res = torch.empty(B, Hq, D, dtype=torch.float64, device=q.device)
    lens = context_lens.cpu().tolist()
    for b in range(B):
        L = int(lens[b])
        n = -(-L // PAGE_TOKENS)
        kv = gather_request_kv(arena, page_loc_layer, block_table[b, :n], layout)
        kv = kv.to(torch.float64).transpose(0, 1).reshape(2, n * PAGE_TOKENS, H, D)[:, :L]
        first = 0 if window is None else max(0, L - window)
        k, v = kv[0, first:], kv[1, first:]
        qb = q[b].to(torch.float64).view(H, G, D)
        s = torch.einsum("hgd,lhd->hgl", qb, k) * sm_scale
        if softcap is not None:
            s = torch.tanh(s / softcap) * softcap
        res[b] = torch.einsum("hgl,lhd->hgd", torch.softmax(s, -1), v).reshape(Hq, D)
    if out is not None:
        out.copy_(res)
        return out
    return res.to(out_dtype)


def reference_prefill_attention(q, arena, page_loc_layer, block_table, q_indptr, q_start, layout,
                                sm_scale, *, out_dtype=torch.bfloat16):
    """Causal prefill attention in float64, :func:`paged_prefill_attention`'s inputs (pages read
    as ``page_loc_layer`` says)."""
    T, Hq, D = q.shape
    H = layout.num_kv_heads
    res = torch.empty(T, Hq, D, dtype=torch.float64, device=q.device)
    indptr, start = q_indptr.tolist(), q_start.tolist()
    for c, s in enumerate(start):
        a, b = indptr[c], indptr[c + 1]
        L = s + b - a
        n = -(-L // PAGE_TOKENS)
        kv = gather_request_kv(arena, page_loc_layer, block_table[c, :n], layout)
        kv = kv.to(torch.float64).transpose(0, 1).reshape(2, n * PAGE_TOKENS, H, D)[:, :L]
        k, v = kv[0].repeat_interleave(Hq // H, 1), kv[1].repeat_interleave(Hq // H, 1)
        sc = torch.einsum("thd,lhd->htl", q[a:b].to(torch.float64), k) * sm_scale
        pos = torch.arange(s, L, device=q.device)[:, None]
        sc = sc.masked_fill(torch.arange(L, device=q.device)[None, :] > pos, float("-inf"))
        res[a:b] = torch.einsum("htl,lhd->thd", torch.softmax(sc, -1), v)
    return res.to(out_dtype)


class LateEvent:
    """A chunk release's event as on a device running behind the host, for the CPU (stood in for
    ``ChunkPool._reads_done``): done once ``clock`` (a one-item list the caller moves on, e.g. a
    step count) has gone ``lag`` past its value at the release. ``wait`` is the device's wait
    (later kernels wait, the host goes on), counted in ``waits``; ``synchronize`` would be a host
    wait, which the engine must never need."""

    def __init__(self, clock: list, lag: int, waits: list):
        self.clock, self.at, self.waits = clock, clock[0] + lag, waits

    def query(self) -> bool:
        return self.clock[0] >= self.at

    def wait(self) -> None:
        self.waits[0] += 1

    def synchronize(self) -> None:
        raise AssertionError("the host waited for a released chunk's reads")
