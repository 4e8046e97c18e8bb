"""FlashInfer's paged decode over the uncompressed arena (``attention_backend="flashinfer"``), the
baseline SGLang users run, reading our open pages in place: one plan a step, each layer writing
its own page indices into a buffer the wrapper reads (CUDA-graph mode).
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

from ..format.layout import PAGE_TOKENS, PageLayout

WORKSPACE_BYTES = 256 << 20  # FlashInfer's float workspace, shared
EAGER_WRAPPERS = 8
TENSOR_CORE_MIN_GROUP = 4  # as SGLang
INSTALL_HINT = "attention_backend='flashinfer' needs FlashInfer: pip install flashinfer-python"


def import_flashinfer():
    try:
        import flashinfer
    except ImportError as exc:
        raise ImportError(INSTALL_HINT) from exc
    return flashinfer


def paged_plan(context_lens, block_table) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """FlashInfer's CSR page table from ours (host arrays): (indptr, page ids, last_page_len)."""
    lens = np.asarray(context_lens, dtype=np.int64)
    table = np.asarray(block_table)
    if table.ndim != 2 or lens.shape != (table.shape[0],):
        raise ValueError(f"block_table must be [B, W] and context_lens [B], got {table.shape} and {lens.shape}")
    if lens.size and (lens.min() < 1 or lens.max() > PAGE_TOKENS * table.shape[1]):
        raise ValueError(f"context_lens must be in 1..{PAGE_TOKENS * table.shape[1]}, got "
                         f"{lens.min()}..{lens.max()}")
    pages = (lens + PAGE_TOKENS - 1) // PAGE_TOKENS
    indptr = np.zeros(lens.size + 1, dtype=np.int32)
    np.cumsum(pages, out=indptr[1:])
    used = np.arange(table.shape[1])[None, :] < pages[:, None]
    return indptr, table[used].astype(np.int64), (lens - PAGE_TOKENS * (pages - 1)).astype(np.int32)


def page_indices(page_loc_layer: torch.Tensor, page_ids: torch.Tensor, open_page_bytes: int) -> torch.Tensor:
    """FlashInfer page index of each open page: its byte offset / open_page_bytes (the open tag,
    bit 0, drops out of the division)."""
    return torch.div(page_loc_layer[page_ids], open_page_bytes, rounding_mode="floor").to(torch.int32)


class _Slot:
    """One wrapper in CUDA-graph mode for a fixed batch size, and the buffers it reads."""

    def __init__(self, fi, workspace, bs: int, width: int, tensor_cores: bool):
        dev = workspace.device
        self.width = width
        self.ids = torch.zeros(bs * width, dtype=torch.int64, device=dev)  # our page ids, CSR order
        self.indices = torch.zeros(bs * width, dtype=torch.int32, device=dev)  # FlashInfer's, one layer
        self.wrapper = fi.BatchDecodeWithPagedKVCacheWrapper(
            workspace, "NHD", use_cuda_graph=True, use_tensor_cores=tensor_cores,
            paged_kv_indptr_buffer=torch.zeros(bs + 1, dtype=torch.int32, device=dev),
            paged_kv_indices_buffer=self.indices,
            paged_kv_last_page_len_buffer=torch.zeros(bs, dtype=torch.int32, device=dev),
            backend="fa2")


class FlashInferDecode:
    """Paged decode attention with FlashInfer over the open pages of an uncompressed arena."""

    def __init__(self, arena: torch.Tensor, layout: PageLayout, num_qo_heads: int, chunk_bytes: int,
                 fp8_scales: tuple[float, float] | None = None):
        """``fp8_scales``: (k_scale, v_scale) of E4M3 pages; None: BF16."""
        ob = layout.open_page_bytes
        if chunk_bytes % ob:
            raise ValueError(f"attention_backend='flashinfer' needs chunk_bytes a multiple of the open page "
                             f"size ({ob} bytes), got {chunk_bytes}")
        if not isinstance(num_qo_heads, int) or num_qo_heads % layout.num_kv_heads:
            raise ValueError(f"num_qo_heads must be a multiple of num_kv_heads={layout.num_kv_heads}, "
                             f"got {num_qo_heads!r}")
        self.fi = import_flashinfer()
        self.layout, self.num_qo_heads, self.open_page_bytes = layout, num_qo_heads, ob
        n = arena.numel() // ob
        self.kv_dtype = torch.bfloat16 if fp8_scales is None else torch.float8_e4m3fn
        self.scales = {} if fp8_scales is None else {"k_scale": float(fp8_scales[0]), "v_scale": float(fp8_scales[1])}
        self.pages = arena[:n * ob].view(self.kv_dtype).view(n, 2, PAGE_TOKENS, layout.num_kv_heads,
                                                              layout.head_dim)
        self.workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=arena.device)
        self.tensor_cores = num_qo_heads // layout.num_kv_heads >= TENSOR_CORE_MIN_GROUP
        self._graph_slots: dict[int, _Slot] = {}
        self._eager_slots: OrderedDict[tuple[int, int], _Slot] = OrderedDict()
        self._current: _Slot | None = None
        self._current_bs = -1

    def _slot(self, bs: int, width: int, graph: bool) -> _Slot:
        if graph:
            slot = self._graph_slots.get(bs)
            if slot is None or slot.width < width:
                if slot is not None:
                    raise ValueError(f"block table width grew from {slot.width} to {width} after capture")
                slot = self._graph_slots[bs] = _Slot(self.fi, self.workspace, bs, width, self.tensor_cores)
            return slot
        key = (bs, width)
        slot = self._eager_slots.pop(key, None)
        if slot is None:
            if len(self._eager_slots) >= EAGER_WRAPPERS:  # its buffers may still be read: wait
                torch.cuda.current_stream().synchronize()
                self._eager_slots.popitem(last=False)
            slot = _Slot(self.fi, self.workspace, bs, width, self.tensor_cores)
        self._eager_slots[key] = slot
        return slot

    def prepare(self, context_lens: torch.Tensor, block_table: torch.Tensor, sm_scale: float,
                graph: bool = False) -> None:
        """Plan the step's decode on the host (never inside a graph capture); ``graph``: B is a
        CUDA-graph bucket."""
        bs, width = block_table.shape
        indptr, ids, last = paged_plan(context_lens, block_table)
        slot = self._slot(bs, width, graph)
        nnz = ids.size
        padded = np.full(bs * width, ids[0] if nnz else 0, dtype=np.int64)
        padded[:nnz] = ids
        slot.ids.copy_(torch.from_numpy(padded))
        L = self.layout
        slot.wrapper.plan(torch.from_numpy(indptr), slot.ids[:nnz], torch.from_numpy(last),
                          self.num_qo_heads, L.num_kv_heads, L.head_dim, PAGE_TOKENS,
                          q_data_type=torch.bfloat16, kv_data_type=self.kv_dtype, sm_scale=float(sm_scale))
        self._current, self._current_bs = slot, bs

    def run(self, q: torch.Tensor, page_loc_layer: torch.Tensor) -> torch.Tensor:
        """Decode attention of q [B, Hq, D] for one layer, as planned."""
        slot = self._current
        if slot is None or q.shape[0] != self._current_bs:
            raise RuntimeError(f"FlashInfer decode of {q.shape[0]} rows without a plan for them: call "
                               "prepare() (the runner's cache.prepare_decode) before the forward")
        slot.indices.copy_(page_indices(page_loc_layer, slot.ids, self.open_page_bytes))
        return slot.wrapper.run(q.contiguous(), self.pages, **self.scales)
