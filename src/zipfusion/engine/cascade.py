"""Cascade decode: decode rows behind one shared prefix read its pages once per step, not once
per row.

Prefix-cache hits behind one system prompt hold the same leading pages (a page is shared only
once it is full and sealed). The plain decode kernel restores those pages for every row, and with
compressed pages the restore, not memory, bounds the step. Attention is a weighted sum over keys,
so it splits over any partition of a row's keys and the parts merge exactly by their
log-sum-exps (base 2, as the kernels keep them; FlashInfer's cascade "merge states")::

    o = Σ_j 2^(lse_j - M) · o_j / Σ_j 2^(lse_j - M),      M = max_j lse_j

:func:`plan_cascade` (host, once per step) groups the decode rows by their leading pages: rows
whose block tables start with the same ``shared >= MIN_SHARED_PAGES`` page ids, each row's
shared pages ending before its newest token. Per layer, :meth:`CascadePlan.run`:

1. cuts each group's shared pages into pieces of ``PIECE_PAGES`` and runs every piece as one
   chunk of the paged prefill kernel whose queries are all the group's rows, ended at the piece's
   last key (``kv_end``, ``q_start = kv_end - 1``): the piece's pages are restored once for the
   group, its dots run on tensor cores, pieces run in parallel;
2. runs each grouped row's own remaining pages as one more chunk (its one query);
3. merges the parts per row (fp32, in a fixed order) into bf16;

and rows in no group take the plain decode kernel. The result is not bit-identical to the
plain kernel's (the sums are grouped differently), but compressed and uncompressed runs of one
schedule take the same path and the twin's arithmetic, so they give the same bits; deterministic
mode never cascades (the grouping depends on the batch). A cascade step runs eagerly (its shapes
vary), not as a CUDA graph.

Status: off by default (``cascade_attention=True`` turns it on). Correct and tested on CPU and
on the H200 (fused == twin bits, close to the plain kernel), but its one whole run there
(shared_prefix, compressed, 2026-12-04) was slower: 160 of 512 requests done after 40 s, then no
step finished before the 140 s limit, where the run without it takes 39 s in all. Not yet
profiled; suspects: the eager steps (no CUDA graph), ~20 small torch ops per layer for the merge,
host-to-device copies of the plan each step (now through pinned memory, as the runner's).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..format import PAGE_TOKENS
from ..memory.copy import to_device

MIN_SHARED_PAGES = 16      # a shared prefix of 256 tokens or more is read once per group
PIECE_PAGES = 32           # pages per prefix piece: several programs per group and KV head
# query rows per program of a prefix piece (tokens x padded GQA group: 16 rows of a group of 4
# heads); one size, so that a run compiles one kernel variant, in its warm-up
PREFIX_BLOCK_M = 64


@dataclass
class Chunks:
    """One launch of the paged prefill kernel, planned once per step for every layer: ``rows``
    picks its query rows from the step's q; one block-table row and start per chunk; the
    kernel's plan (work items, key ends)."""
    rows: torch.Tensor
    block_table: torch.Tensor
    q_indptr: torch.Tensor
    q_start: torch.Tensor
    work: object                     # kernels.prefill_attention.PrefillPlan


@dataclass
class CascadePlan:
    plain: torch.Tensor | None       # int64: rows in no group (plain decode kernel)
    plain_table: torch.Tensor | None
    plain_lens: torch.Tensor | None
    grouped: torch.Tensor            # int64 [N]: rows in a group
    prefix: Chunks                   # the groups' prefix pieces
    suffix: Chunks                   # each grouped row's own pages (rows: ``grouped``)
    parts: torch.Tensor              # int64 [N, J]: row j's prefix-piece results (padding: the last row)

    def run(self, backend, layer: int, q: torch.Tensor, trace=None) -> torch.Tensor:
        """Attention of the step's decode rows q [B, Hq, D] -> [B, Hq, D] bf16. ``trace(name)``,
        if given, is called after each part (benchmarks/cascade_probe.py times them)."""
        trace = trace or (lambda name: None)
        out = torch.empty_like(q)
        if self.plain is not None:
            out[self.plain] = backend.decode(layer, q[self.plain], self.plain_table, self.plain_lens)
        trace("plain rows")
        n_pre = self.prefix.rows.numel()
        pre_q = q[self.prefix.rows]
        trace("prefix rows gathered")
        pre_o = q.new_empty((n_pre + 1, *q.shape[1:]), dtype=torch.float32)
        pre_lse = q.new_empty((n_pre + 1, q.shape[1]), dtype=torch.float32)
        pre_o[n_pre], pre_lse[n_pre] = 0.0, float("-inf")       # what padding parts point at
        backend.paged_prefill(layer, pre_q, self.prefix, out=pre_o[:n_pre], lse=pre_lse[:n_pre])
        trace("prefix pieces")
        n = self.grouped.numel()
        suf_o = q.new_empty((n, *q.shape[1:]), dtype=torch.float32)
        suf_lse = q.new_empty((n, q.shape[1]), dtype=torch.float32)
        backend.paged_prefill(layer, q[self.suffix.rows], self.suffix, out=suf_o, lse=suf_lse)
        trace("suffixes")
        lse = torch.cat([pre_lse[self.parts], suf_lse[:, None]], 1)           # [N, J+1, Hq]
        o = torch.cat([pre_o[self.parts], suf_o[:, None]], 1)                 # [N, J+1, Hq, D]
        w = torch.exp2(lse - lse.amax(1, keepdim=True))
        out[self.grouped] = ((w[..., None] * o).sum(1) / w.sum(1)[..., None]).to(q.dtype)
        trace("merge")
        return out


def find_groups(context_lens: np.ndarray, table: np.ndarray, min_pages: int | None = None) -> list[tuple[np.ndarray, int]]:
    """(rows, shared pages) of every group of >= 2 decode rows whose block tables begin with the
    same ``shared >= min_pages`` (default MIN_SHARED_PAGES) page ids, all before each row's
    newest token."""
    min_pages = min_pages or MIN_SHARED_PAGES
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


def make_chunks(rows, pages, rows_per_chunk, starts, num_q_heads: int, num_kv_heads: int, device, *,
                kv_end=None, block_m: int | None = None) -> Chunks:
    """A launch of the paged prefill kernel from host lists: the step's q ``rows`` it reads, each
    chunk's ``pages`` (the block table, zero-padded), row count, start and optional key end."""
    from ..kernels.prefill_attention import plan_prefill
    table = np.zeros((len(pages), max(len(p) for p in pages)), dtype=np.int32)
    for j, p in enumerate(pages):
        table[j, :len(p)] = p
    indptr = np.concatenate([[0], np.cumsum(rows_per_chunk)]).tolist()
    starts = [int(x) for x in starts]
    work = plan_prefill(indptr, starts, num_q_heads, num_kv_heads, block_m=block_m, device=device, kv_end=kv_end)
    i32 = lambda x: to_device(torch.tensor(x, dtype=torch.int32), device)  # noqa: E731
    return Chunks(to_device(rows, device), to_device(torch.from_numpy(table), device), i32(indptr), i32(starts), work)


def plan_cascade(context_lens: torch.Tensor, block_table: torch.Tensor, num_q_heads: int, num_kv_heads: int,
                 device) -> CascadePlan | None:
    """The step's cascade from its host ``context_lens`` [B] and ``block_table`` [B, W], or None
    when no rows share a long enough prefix."""
    lens, table = context_lens.numpy().astype(np.int64), block_table.numpy()
    groups = find_groups(lens, table)
    if not groups:
        return None
    grouped = np.concatenate([rows for rows, _ in groups])
    # 1. prefix pieces: the group's rows against PIECE_PAGES of its shared pages each
    q_rows, pages, counts, ends, piece_rows = [], [], [], [], []
    at = 0
    for rows, shared in groups:
        mine = []
        for p0 in range(0, shared, PIECE_PAGES):
            p1 = min(p0 + PIECE_PAGES, shared)
            q_rows.append(rows)
            pages.append(table[rows[0], p0:p1])
            counts.append(len(rows))
            ends.append((p1 - p0) * PAGE_TOKENS)
            mine.append(at + np.arange(len(rows)))
            at += len(rows)
        piece_rows.append(np.stack(mine, 1))                               # [rows, pieces]
    J = max(p.shape[1] for p in piece_rows)
    parts = np.full((grouped.size, J), at, dtype=np.int64)                 # padding: row `at`
    r = 0
    for p in piece_rows:
        parts[r:r + p.shape[0], :p.shape[1]] = p
        r += p.shape[0]
    prefix = make_chunks(np.concatenate(q_rows), pages, counts, [e - 1 for e in ends], num_q_heads, num_kv_heads,
                         device, kv_end=ends, block_m=PREFIX_BLOCK_M)
    # 2. each grouped row's own pages after the shared ones (its newest token's page last)
    shared_of = np.concatenate([np.full(len(rows), shared) for rows, shared in groups])
    own = [table[row, s:-(-int(lens[row]) // PAGE_TOKENS)] for row, s in zip(grouped, shared_of)]
    own_end = (lens[grouped] - shared_of * PAGE_TOKENS).tolist()
    suffix = make_chunks(grouped, own, [1] * grouped.size, [e - 1 for e in own_end], num_q_heads, num_kv_heads,
                         device, kv_end=own_end, block_m=16)       # one query: the smallest tile
    plain = np.setdiff1d(np.arange(lens.size), grouped)
    as_dev = lambda x: to_device(torch.as_tensor(x), device)  # noqa: E731
    return CascadePlan(as_dev(plain) if plain.size else None,
                       as_dev(np.ascontiguousarray(table[plain])) if plain.size else None,
                       as_dev(lens[plain].astype(np.int32)) if plain.size else None,
                       as_dev(grouped), prefix, suffix, as_dev(parts))
