"""Packed decode (docs/design.md): rows behind one shared prefix travel as one request whose query-head
columns are R rows', so the kernel restores shared pages once for R rows. Another sum order than
the plain kernel's, so deterministic mode never packs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..config import Tuning
from ..format import PAGE_TOKENS
from ..memory.copy import to_device

# query-head columns of a packed request: one tensor-core n-tile (R = 8 // G rows a request)
PACK_HEADS = 8


def find_groups(context_lens: np.ndarray, table: np.ndarray, min_pages: int) -> list[tuple[np.ndarray, int]]:
    """(rows, shared pages) of every group of >= 2 decode rows whose block tables begin with the
    same ``>= min_pages`` full page ids."""
    lens = np.asarray(context_lens, dtype=np.int64)
    full = (lens - 1) // PAGE_TOKENS
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
    rows: torch.Tensor  # the step's decode row in each slot
    block_table: torch.Tensor   # int32 [V, W]: shared pages, then each slot's own
    context_lens: torch.Tensor  # 0: a padding request, no keys
    spans: torch.Tensor         # int32 [V, R, 2]: each slot's own tokens [begin, end)
    slots: torch.Tensor  # the packed slot of each decode row

    def run(self, decode, layer: int, q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
        """Attention of the step's decode rows q [B, Hq, D] through the ``decode`` route."""
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
        return PackedPlan(*(getattr(self, f)[:bs] for f in self.__dataclass_fields__))

    def fill(self, other: "PackedPlan") -> None:
        """Copy ``other`` into this plan's buffers, the rest left as padding; of the block table
        only ``other``'s extent (the kernel reads no page past a request's context)."""
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
    """R, the decode rows a packed request holds (0 where the GQA group leaves no room for two)."""
    R = (pack_heads or PACK_HEADS) // (num_q_heads // num_kv_heads)
    return R if R >= 2 else 0


def plan_packed(context_lens: torch.Tensor, block_table: torch.Tensor, num_q_heads: int, num_kv_heads: int,
                tuning: Tuning = Tuning(), pack_heads: int | None = None) -> PackedPlan | None:
    """The step's packed requests (host tensors), or None when packing is impossible or would
    spare fewer than ``tuning.min_spared_pages`` page reads."""
    R = rows_per_request(num_q_heads, num_kv_heads, pack_heads)
    if not R:
        return None
    lens, table = context_lens.numpy().astype(np.int64), block_table.numpy()
    groups = find_groups(lens, table, tuning.min_shared_pages)
    if not groups:
        return None
    members, grouped = [], np.zeros(lens.size, dtype=bool)
    for rows, shared in groups:
        for i in range(0, len(rows) - 1, R):
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
