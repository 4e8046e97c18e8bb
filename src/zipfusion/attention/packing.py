"""Packed decode: rows behind one shared prefix restore its pages once per step, in the decode
kernel itself.

Prefix-cache hits behind one system prompt hold the same leading pages (a page is shared only
once it is full and sealed). The plain decode kernel restores those pages for every row, and with
compressed pages the restore, not memory, bounds the step. The kernel's tensor-core tiles have
8 query-head columns per KV head; a GQA group of 4 fills half of them and the rest is padding.
A *packed request* puts R = 8 / G rows' heads in those columns: its block table is the shared
pages, then each row's own pages, and the kernel masks each column to its row's keys
(``spans``; kernels/decode_attention.py, "Packed requests"). Each shared page is then restored
and multiplied once for R rows, at the cost of one row; a row's own pages are read once, as
before. Rows in no group travel alone (one slot used, the rest empty): the plain kernel's work.

:func:`plan_packed` (host, once per step) pairs the rows that :func:`find_groups` finds (block
tables beginning with the same ``>= Tuning.min_shared_pages`` page ids, all before each row's newest
token); :meth:`PackedPlan.run` (per layer) gathers q into the packed layout, runs the kernel
once, and puts each slot's output back in its row.

The sums run in another order than the plain kernel's, so the result is not bit-identical to
it; compressed and uncompressed runs of one schedule take the same path and the fused and
uncompressed kernels' arithmetic is the same, so they give the same bits, and deterministic mode never packs (the pairing depends
on the batch). With CUDA graphs a packed step replays a graph of its own, captured over
:meth:`PackedPlan.empty` buffers (V = the bucket's rows, each table as wide as R requests'
tables) that each step fills (:meth:`PackedPlan.fill`); otherwise it runs eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..config import Tuning
from ..format import PAGE_TOKENS
from ..memory.copy import to_device

# query-head columns of a packed request: one tensor-core n-tile (R = 8 // G rows a request);
# 16 (two n-tiles, R = 16 // G) halves the restores again for twice the MMAs
PACK_HEADS = 8


def find_groups(context_lens: np.ndarray, table: np.ndarray, min_pages: int) -> list[tuple[np.ndarray, int]]:
    """(rows, shared pages) of every group of >= 2 decode rows whose block tables begin with the
    same ``shared >= min_pages`` page ids, all before each row's newest token."""
    lens = np.asarray(context_lens, dtype=np.int64)
    full = (lens - 1) // PAGE_TOKENS                  # pages wholly before a row's newest token
    cand = np.flatnonzero(full >= min_pages)
    if cand.size < 2:
        return []
    first = table[cand, 0]
    order = np.argsort(first, kind="stable")
    _, starts, counts = np.unique(first[order], return_index=True, return_counts=True)
    groups = []
    for s, c in zip(starts, counts):
        if c < 2:
            continue
        rows = cand[order[s:s + c]]
        sub = table[rows, :int(full[rows].min())]
        same = (sub == sub[0]).all(0)
        shared = sub.shape[1] if same.all() else int(np.argmin(same))
        if shared >= min_pages:
            groups.append((rows, shared))
    return groups


@dataclass
class PackedPlan:
    rows: torch.Tensor          # int64 [V, R]: the step's decode row in each slot (row 0 in empty ones)
    block_table: torch.Tensor   # int32 [V, W]: shared pages, then each slot's own
    context_lens: torch.Tensor  # int32 [V]: the last slot's end (0: a padding request, no keys)
    spans: torch.Tensor         # int32 [V, R, 2]: each slot's own tokens [begin, end)
    slots: torch.Tensor         # int64 [B]: the packed slot (v·R + r) of each decode row

    def run(self, decode, layer: int, q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
        """Attention of the step's decode rows q [B, Hq, D] -> [B, Hq, D] bf16 through the
        ``decode`` route (decode.KernelDecode)."""
        V, R = self.rows.shape
        B, Hq, D = q.shape
        H = num_kv_heads
        G = Hq // H
        packed = q[self.rows].view(V, R, H, G, D).transpose(1, 2).reshape(V, H * R * G, D)
        o = decode(layer, packed, self.block_table, self.context_lens, spans=self.spans, slot_heads=G)
        return o.view(V, H, R, G, D).transpose(1, 2).reshape(V * R, Hq, D)[self.slots]

    @staticmethod
    def empty(V: int, R: int, W: int, B: int, **kw) -> "PackedPlan":
        """A plan of V padding requests (no keys) for B rows: the graph buffers' resting state."""
        z = lambda *shape, dt=torch.int32: torch.zeros(shape, dtype=dt, **kw)  # noqa: E731
        return PackedPlan(z(V, R, dt=torch.int64), z(V, W), z(V), z(V, R, 2), z(B, dt=torch.int64))

    def to(self, device) -> "PackedPlan":
        return PackedPlan(*(to_device(getattr(self, f), device) for f in self.__dataclass_fields__))

    def view(self, bs: int) -> "PackedPlan":
        """The first ``bs`` requests and rows (a graph bucket's share of the buffers)."""
        return PackedPlan(*(getattr(self, f)[:bs] for f in self.__dataclass_fields__))

    def fill(self, other: "PackedPlan") -> None:
        """Copy ``other`` (host tensors, at most as large) into this plan's buffers, the rest
        left as padding: requests without keys, rows reading slot 0 (asynchronous from pinned
        memory on CUDA). All but the block table are small and rewritten whole (a larger step's
        row ids, lengths or spans must not survive); of the block table (bucket x R x max pages)
        only ``other``'s extent: the kernel reads no page past a request's context."""
        for f in self.__dataclass_fields__:
            dst, src = getattr(self, f), getattr(other, f)
            if f == "block_table":
                dst, host = dst[tuple(slice(0, n) for n in src.shape)], src
            else:
                host = torch.zeros(dst.shape, dtype=dst.dtype)
                host[tuple(slice(0, n) for n in src.shape)] = src
            if dst.device.type == "cuda":
                host = host.pin_memory()
            dst.copy_(host, non_blocking=True)


def rows_per_request(num_q_heads: int, num_kv_heads: int, pack_heads: int | None = None) -> int:
    """R, the decode rows a packed request holds: ``pack_heads`` (default PACK_HEADS) columns
    of G query heads each; 0 where the GQA group leaves no room for two rows."""
    R = (pack_heads or PACK_HEADS) // (num_q_heads // num_kv_heads)
    return R if R >= 2 else 0


def plan_packed(context_lens: torch.Tensor, block_table: torch.Tensor, num_q_heads: int, num_kv_heads: int,
                tuning: Tuning = Tuning(), pack_heads: int | None = None) -> PackedPlan | None:
    """The step's packed requests (host tensors) from its host ``context_lens`` [B] and
    ``block_table`` [B, W], or None when the GQA group leaves no room for two rows or packing
    would spare fewer than ``tuning.min_spared_pages`` page reads (rows share at least
    ``tuning.min_shared_pages``)."""
    R = rows_per_request(num_q_heads, num_kv_heads, pack_heads)
    if not R:
        return None
    lens, table = context_lens.numpy().astype(np.int64), block_table.numpy()
    groups = find_groups(lens, table, tuning.min_shared_pages)
    if not groups:
        return None
    members, grouped = [], np.zeros(lens.size, dtype=bool)
    for rows, shared in groups:
        for i in range(0, len(rows) - 1, R):          # runs of R rows (a last one alone travels alone)
            chunk = rows[i:i + R]
            members.append((chunk, shared))
            grouped[chunk] = True
    if sum((len(chunk) - 1) * shared for chunk, shared in members) < tuning.min_spared_pages:
        return None
    members += [([b], 0) for b in np.flatnonzero(~grouped)]
    V = len(members)
    rows = np.zeros((V, R), dtype=np.int64)
    spans = np.zeros((V, R, 2), dtype=np.int32)
    vlens = np.zeros(V, dtype=np.int32)
    slots = np.zeros(lens.size, dtype=np.int64)
    tables = []
    for v, (chunk, shared) in enumerate(members):
        pages = [table[chunk[0], :shared]]
        at = shared
        for r, row in enumerate(chunk):
            n = -(-int(lens[row]) // PAGE_TOKENS)
            pages.append(table[row, shared:n])
            spans[v, r] = (at * PAGE_TOKENS, at * PAGE_TOKENS + int(lens[row]) - shared * PAGE_TOKENS)
            at += n - shared
            rows[v, r] = row
            slots[row] = v * R + r
        vlens[v] = spans[v, len(chunk) - 1, 1]
        tables.append(np.concatenate(pages))
    vtable = np.zeros((V, max(len(t) for t in tables)), dtype=np.int32)
    for v, t in enumerate(tables):
        vtable[v, :len(t)] = t
    return PackedPlan(*(torch.from_numpy(x) for x in (rows, vtable, vlens, spans, slots)))
