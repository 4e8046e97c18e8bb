"""The host tier: full pages kept in (pinned) host memory, as stored, instead of thrown away.

When the prefix cache evicts a page nobody holds (memory is needed: often the pages of a
preempted request), the page's bytes go here as they lie in the arena -- compressed pages
compressed, so fewer bytes cross PCIe -- and the page id is freed. A later request whose tokens
match the page takes it back: a new open page is allocated, the bytes come back to the device
and are decoded into it (bit for bit), and the page is sealed again with the next seal. Nothing
is recomputed. When the tier is full its least recently stored pages are dropped (then they are
recomputed, as without a tier).

Transfers (``put`` / ``take``) run on the current CUDA stream without a host sync: the D2H copy
of a batch is queued after the kernels that wrote the pages and before any that reuse their
memory, and the H2D copy before the decode that reads it, so stream order alone keeps a page in
flight from being read or overwritten early. (They do not overlap the step's compute yet: a side
stream would.) On the CPU the same code copies between tensors.

Layout: one host tensor per ``put`` batch, each page a slice of it: its layers' byte ranges one
after another (``Record``). The budget counts the pages' bytes; a batch tensor is freed when its
last page is dropped or taken.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..format.layout import loc_is_open, loc_offset
from . import codec
from .copy import copy_ranges
from .page_table import OPEN, STORED


@dataclass
class Record:
    """One page on the host: ``data`` (uint8, its layers' bytes in order), per layer the byte
    count and whether the bytes are the page's open form."""
    data: torch.Tensor
    nbytes: np.ndarray            # [L] int64
    open_form: np.ndarray         # [L] bool

    @property
    def size(self) -> int:
        return int(self.nbytes.sum())


@dataclass
class HostTierStats:
    pages_out: int = 0
    pages_in: int = 0
    bytes_out: int = 0
    bytes_in: int = 0
    dropped: int = 0


class HostTier:
    def __init__(self, manager, budget_bytes: int):
        self.m, self.budget = manager, int(budget_bytes)
        self.used = 0
        self.pin = manager.device.type == "cuda"
        self.stats = HostTierStats()

    def fits(self, nbytes: int) -> bool:
        return self.used + nbytes <= self.budget

    def page_bytes(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Offsets, byte counts and open-form flags [L, n] of the pages ``ids`` in the arena."""
        t = self.m.table
        loc = t.loc[:, ids]
        stored = (t.state[ids] == STORED)[None, :]
        nbytes = np.where(stored, t.size[:, ids], self.m.layout.open_page_bytes)
        return loc_offset(loc), nbytes, loc_is_open(loc) | ~stored

    def put(self, ids: list[int]) -> list[Record]:
        """Copy pages (open or stored) to the host as they lie; the caller then frees them."""
        ids = np.asarray(ids, dtype=np.int64)
        off, nbytes, open_form = self.page_bytes(ids)
        per_page = nbytes.T.reshape(-1)                              # page-major: a page's layers together
        staged = torch.empty(int(per_page.sum()), dtype=torch.uint8, device=self.m.device)
        dst = np.concatenate([[0], np.cumsum(per_page)[:-1]])
        copy_ranges(self.m.arena, staged, off.T.reshape(-1), dst, per_page)
        host = torch.empty(staged.numel(), dtype=torch.uint8, pin_memory=self.pin)
        host.copy_(staged, non_blocking=self.pin)
        out, start = [], 0
        for i in range(ids.size):
            n = int(nbytes[:, i].sum())
            out.append(Record(host[start:start + n], nbytes[:, i].copy(), open_form[:, i].copy()))
            start += n
        self.used += start
        self.stats.pages_out += ids.size
        self.stats.bytes_out += start
        return out

    def take(self, records: list[Record], ids: list[int]) -> None:
        """Restore ``records`` into the open pages ``ids`` (just allocated), bit for bit."""
        m, ids = self.m, np.asarray(ids, dtype=np.int64)
        if not ids.size:
            return
        if (m.table.state[ids] != OPEN).any():
            raise ValueError("HostTier.take: the destination pages must be open")
        host = torch.empty(sum(r.size for r in records), dtype=torch.uint8, pin_memory=self.pin)
        torch.cat([r.data for r in records], out=host)
        staged = host.to(m.device, non_blocking=self.pin) if self.pin else host
        nbytes = np.stack([r.nbytes for r in records], axis=1)      # [L, n]
        open_form = np.stack([r.open_form for r in records], axis=1)
        start = np.concatenate([[0], np.cumsum(nbytes.T.reshape(-1))[:-1]]).reshape(ids.size, -1).T   # [L, n]
        dst = loc_offset(m.table.loc[:, ids])
        page = m.layout.open_page_bytes
        for layer in range(m.num_layers):
            comp = ~open_form[layer]
            if comp.any():
                pages = codec.decode(staged, torch.from_numpy(start[layer, comp]),
                                     torch.from_numpy(nbytes[layer, comp]), m.layout)
                flat = pages.contiguous().view(torch.uint8).reshape(-1)
                copy_ranges(flat, m.arena, np.arange(int(comp.sum())) * page, dst[layer, comp],
                            np.full(int(comp.sum()), page))
            if (~comp).any():
                copy_ranges(staged, m.arena, start[layer, ~comp], dst[layer, ~comp], np.full(int((~comp).sum()), page))
        self.drop(records)
        self.stats.pages_in += ids.size
        self.stats.bytes_in += int(nbytes.sum())

    def drop(self, records: list[Record]) -> None:
        """Let go of pages on the host (taken back, or dropped for room)."""
        self.used -= sum(r.size for r in records)
