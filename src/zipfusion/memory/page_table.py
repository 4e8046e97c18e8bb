"""The page table: page id -> where the page lives in every layer. Host arrays are the truth;
``page_loc`` is the kernels' copy, mirrored on CUDA per change or, ``deferred``, at :meth:`flush`.
"""

from __future__ import annotations

import numpy as np
import torch

from .copy import to_device

FREE, OPEN, STORED = 0, 1, 2
STATE_NAMES = ("free", "open", "stored")


class PageTable:
    def __init__(self, num_layers: int, max_pages: int, device: torch.device, mirrored: bool | None = None):
        L = num_layers
        self.num_layers, self.max_pages, self.device = L, max_pages, torch.device(device)
        self.loc = np.full((L, max_pages), -1, dtype=np.int64)
        self.size = np.zeros((L, max_pages), dtype=np.int64)  # stored bytes (STORED pages)
        self.state = np.zeros(max_pages, dtype=np.int8)
        self.group = np.zeros(max_pages, dtype=np.int64)  # open pages: group and slot
        self.slot = np.zeros(max_pages, dtype=np.int64)
        self._free_ids = list(range(max_pages - 1, -1, -1))
        self.mirrored = self.device.type not in ("cpu", "meta") if mirrored is None else mirrored
        self.page_loc = torch.from_numpy(self.loc.copy()).to(self.device) if self.mirrored else torch.from_numpy(self.loc)
        self.deferred = False  # sync() only notes the columns; flush() copies them
        self._dirty: list[np.ndarray] = []
        self._dirty_layers: set[int] = set()

    @property
    def num_free_ids(self) -> int:
        return len(self._free_ids)

    def take_ids(self, n: int) -> np.ndarray:
        return np.array([self._free_ids.pop() for _ in range(n)], dtype=np.int64)

    def release_ids(self, ids: np.ndarray) -> None:
        self.state[ids] = FREE
        self.loc[:, ids] = -1
        self.size[:, ids] = 0
        self._free_ids.extend(ids.tolist())
        self.sync(ids)

    def sync(self, ids: np.ndarray) -> None:
        """Mirror the host columns ``ids`` to the device table (deferred: at the next flush)."""
        if not self.mirrored or ids.size == 0:
            return
        if self.deferred:
            self._dirty.append(np.array(ids, dtype=np.int64))
            return
        # pinned staging + non_blocking: no host stall behind queued kernels
        self.page_loc[:, to_device(ids, self.device)] = to_device(torch.from_numpy(self.loc[:, ids]), self.device)

    def sync_layer(self, layer: int) -> None:
        """Mirror the host row of ``layer`` (deferred: at the next flush)."""
        if not self.mirrored:
            return
        if self.deferred:
            self._dirty_layers.add(layer)
            return
        self.page_loc[layer].copy_(to_device(torch.from_numpy(self.loc[layer]), self.device))

    def flush(self) -> None:
        """The deferred changes to the device table, in one copy."""
        rows, cols = sorted(self._dirty_layers), self._dirty
        self._dirty, self._dirty_layers = [], set()
        if rows:
            at = to_device(np.array(rows), self.device)
            self.page_loc[at] = to_device(torch.from_numpy(self.loc[rows]), self.device)
        if cols:
            ids = np.unique(np.concatenate(cols))
            self.page_loc[:, to_device(ids, self.device)] = to_device(torch.from_numpy(self.loc[:, ids]), self.device)

    def check(self, ids, want_state: int | None, what: str) -> np.ndarray:
        """``ids`` as an int64 array of distinct allocated page ids (ValueError/TypeError if not)."""
        if isinstance(ids, torch.Tensor):
            ids = ids.detach().cpu().tolist()
        if isinstance(ids, (int, np.integer)):
            ids = [ids]
        try:
            arr = np.asarray(list(ids), dtype=np.int64)
        except (TypeError, ValueError, OverflowError):
            raise TypeError(f"{what}: page ids must be a list of ints, got {ids!r}") from None
        if arr.ndim != 1:
            raise ValueError(f"{what}: page ids must be a flat list of ints")
        if arr.size == 0:
            return arr
        bad = arr[(arr < 0) | (arr >= self.max_pages)]
        if bad.size:
            raise ValueError(f"{what}: page id {int(bad[0])} does not exist (valid ids: 0..{self.max_pages - 1})")
        if np.unique(arr).size != arr.size:
            raise ValueError(f"{what}: page ids repeat in {arr.tolist()}; pass each page once")
        state = self.state[arr]
        dead = arr[state == FREE]
        if dead.size:
            raise ValueError(f"{what}: page {int(dead[0])} is not allocated (never allocated or already "
                             "freed: a double free?)")
        if want_state is not None:
            wrong = arr[state != want_state]
            if wrong.size:
                raise ValueError(f"{what}: page {int(wrong[0])} is already compressed; only open pages "
                                 "can be compressed")
        return arr
