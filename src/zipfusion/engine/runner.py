"""The model runner: a scheduled step (``[decode rows | prefill chunks]``) -> one forward -> logits.
A pure decode step on CUDA replays the batch-size bucket's captured CUDA graph (padding rows use one
scratch page); a step with prefill chunks runs eagerly."""

from __future__ import annotations

import bisect

import numpy as np
import torch

from ..kernels import weight_linear
from ..memory.copy import to_device
from ..models import CausalLM
from ..attention.backend import AttentionBackend
from ..models.compressed_weights import compressed_weights
from .request import PAGE_TOKENS, Request
from .scheduler import SchedulerOutput

# decode batch sizes with a CUDA graph (n rows replay the smallest >= n); every 8: a split count fixed at capture
GRAPH_BUCKETS = (1, 2, 4) + tuple(range(8, 513, 8))


class ModelRunner:
    def __init__(self, model: CausalLM, attention: AttentionBackend, max_model_len: int, max_num_seqs: int,
                 use_cuda_graphs: bool = True):
        self.model = model
        self.attention, self.cache = attention, attention.cache
        self.device = next(model.parameters()).device
        self.max_pages_per_req = -(-max_model_len // PAGE_TOKENS)
        self.max_num_seqs = max_num_seqs
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.packed_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._buckets: list[int] = []
        self.use_cuda_graphs = use_cuda_graphs and self.device.type == "cuda"
        self._scratch: list[int] = []
        self._row_owner: list = []                    # staged table row i: (request id, pages, last, dropped)

    @torch.inference_mode()
    def run(self, out: SchedulerOutput) -> torch.Tensor:
        """Logits [n, V] fp32."""
        if out.ended:                                 # their staged table rows are not to be trusted
            gone = set(out.ended)
            self._row_owner = [None if isinstance(o, tuple) and o[0] in gone else o for o in self._row_owner]
        if not out.prefill:
            return self.decode(out.decode)
        self.cache.flush_table()                      # the step's page-table changes, one copy
        n = len(out.decode)
        dec = self.decode_inputs(out.decode, n) if n else None
        if dec is not None:
            self.attention.prepare_decode(dec["context_lens"], dec["block_table"])
        ids, pos, pages, slots, last = [], [], [], [], []
        off = n
        for ch in out.prefill:
            r = ch.request
            p = np.arange(ch.start, ch.start + ch.length)
            ids.append(np.asarray(r.tokens[ch.start:ch.start + ch.length], dtype=np.int64))
            pos.append(p)
            pages.append(np.asarray(r.pages, dtype=np.int64)[p // PAGE_TOKENS])
            slots.append(p % PAGE_TOKENS)
            off += ch.length
            if ch.completes:
                last.append(off - 1)
        vec = np.stack([np.concatenate(x) for x in (ids, pos, pages, slots)])
        if dec is not None:
            vec = np.concatenate([dec["vec"].numpy(), vec], axis=1)
        # inputs through pinned memory: no host wait, so the host seals while the forward runs
        vec = to_device(vec, self.device)
        kv = self.attention.plan(vec[2], vec[3], num_decode=n,
                                 block_table=dec and to_device(dec["block_table"], self.device),
                                 context_lens=dec and to_device(dec["context_lens"], self.device),
                                 chunks=[ch.view() for ch in out.prefill])
        hidden = self.model(vec[0], vec[1], kv)
        rows = to_device(np.array(list(range(n)) + last, dtype=np.int64), self.device)
        return self.model.compute_logits(hidden[rows])

    # decode inputs: four [bs] vectors and the block table [bs, W], in pinned buffers under CUDA graphs
    VECTORS = ("input_ids", "positions", "page_ids", "slots")

    def decode_inputs(self, reqs: list[Request], bs: int, host: dict | None = None) -> dict:
        """Host decode inputs padded to ``bs`` rows with the scratch page (into ``host`` when given)."""
        W = self.max_pages_per_req
        scratch = self._scratch[0] if self._scratch else 0
        if host is None:
            host, owners = self._new_buffers(bs), [None] * bs
        else:
            owners = self._row_owner
        vec, table = host["vec"].numpy(), host["block_table"].numpy()
        n = len(reqs)
        for i, r in enumerate(reqs):
            key = (r.request_id, len(r.pages), r.pages[-1] if r.pages else -1, r.dropped_pages)
            if owners[i] != key:
                if key[1] > W:
                    raise ValueError(f"request {r.request_id} has {key[1]} pages > max_model_len allows ({W})")
                table[i, :key[1]] = r.pages
                table[i, key[1]:] = scratch
                owners[i] = key
        for i in range(n, bs):
            if owners[i] != "pad":
                table[i] = scratch
                owners[i] = "pad"
        pos = np.fromiter((r.num_computed for r in reqs), dtype=np.int64, count=n)
        vec[:, n:bs] = 0
        vec[0, :n] = [r.output_ids[-1] if r.output_ids else r.prompt_ids[-1] for r in reqs]
        vec[1, :n] = pos
        vec[2, :n] = table[np.arange(n), pos // PAGE_TOKENS]
        vec[2, n:bs] = scratch
        vec[3, :n] = pos % PAGE_TOKENS
        lens = host["context_lens"].numpy()
        lens[:n] = pos + 1
        lens[n:bs] = 1
        return self._named(host, bs)

    def _new_buffers(self, bs: int) -> dict:
        return {"vec": torch.zeros(len(self.VECTORS), bs, dtype=torch.int64),
                "block_table": torch.zeros(bs, self.max_pages_per_req, dtype=torch.int32),
                "context_lens": torch.ones(bs, dtype=torch.int32)}

    def _named(self, bufs: dict, bs: int) -> dict:
        """The decode inputs by name, as views of the first ``bs`` rows of ``bufs``."""
        b = {k: bufs["vec"][j, :bs] for j, k in enumerate(self.VECTORS)}
        b.update(vec=bufs["vec"][:, :bs], block_table=bufs["block_table"][:bs],
                 context_lens=bufs["context_lens"][:bs])
        return b

    def _decode_forward(self, b: dict) -> torch.Tensor:
        kv = self.attention.plan(b["page_ids"], b["slots"], num_decode=b["input_ids"].shape[0],
                                 block_table=b["block_table"], context_lens=b["context_lens"])
        hidden = self.model(b["input_ids"], b["positions"], kv)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def decode(self, reqs: list[Request]) -> torch.Tensor:
        """One decode step for ``reqs``."""
        self.cache.flush_table()
        n = len(reqs)
        i = bisect.bisect_left(self._buckets, n)
        if i == len(self._buckets):
            host = self.decode_inputs(reqs, n)
            self.attention.prepare_decode(host["context_lens"], host["block_table"])
            return self._decode_forward({k: v.to(self.device, non_blocking=True) for k, v in host.items()})
        bucket = self._buckets[i]
        self._staged.synchronize()                 # the last step's copies have left the staging buffers
        self.decode_inputs(reqs, bucket, self._host)
        how = self.attention.prepare_decode(self._host["context_lens"][:bucket], self._host["block_table"][:bucket],
                                            graph=True)
        if how == "eager":                         # packed requests larger than the graph buffers
            dev = {k: v.to(self.device, non_blocking=True) for k, v in self._named(self._host, bucket).items()}
            self._staged.record()
            return self._decode_forward(dev)[:n]
        self._static["vec"].copy_(self._host["vec"], non_blocking=True)
        for k in ("block_table", "context_lens"):
            self._static[k][:bucket].copy_(self._host[k][:bucket], non_blocking=True)
        self._staged.record()
        (self.packed_graphs if how == "packed" else self.graphs)[bucket].replay()
        return self._logits[:n]

    def reserve_scratch_page(self) -> int:
        """The page that a graph's padding rows write into and read from (allocated once)."""
        if not self._scratch:
            self._scratch = self.cache.alloc(1)
        return self._scratch[0]

    @torch.inference_mode()
    def capture_cuda_graphs(self, max_batch: int | None = None, sizes: list[int] | None = None) -> list[int]:
        """Capture the decode step for every bucket up to ``max_batch`` (or exactly ``sizes``)."""
        if not self.use_cuda_graphs:
            return []
        max_batch = min(max_batch or self.max_num_seqs, self.max_num_seqs)
        buckets = sorted(set(sizes)) if sizes else [b for b in GRAPH_BUCKETS if b <= max_batch]
        if not buckets:
            return []
        self.reserve_scratch_page()
        self.cache.flush_table()
        top = buckets[-1]
        weight_linear.warmup(compressed_weights(self.model), top)
        self._row_owner = [None] * top
        self._host = {k: v.pin_memory() for k, v in self._new_buffers(top).items()}
        self.decode_inputs([], top, self._host)
        self._static = {k: v.to(self.device) for k, v in self._host.items()}
        self._staged = torch.cuda.Event()
        self._logits = torch.empty(top, self.model.config.vocab_size, dtype=torch.float32, device=self.device)
        packed = self.attention.packed_graph_buffers(top, self.max_pages_per_req)
        pool = None
        for bs in reversed(buckets):
            b = self._named(self._static, bs)
            for graphs in (self.graphs, self.packed_graphs) if packed else (self.graphs,):
                def prepare():
                    if graphs is self.packed_graphs:
                        self.attention.use_packed_buffers(bs)
                    else:
                        self.attention.prepare_decode(self._host["context_lens"][:bs],
                                                      self._host["block_table"][:bs], graph=True)
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    for _ in range(2):
                        prepare()
                        self._decode_forward(b)
                torch.cuda.current_stream().wait_stream(stream)
                g = torch.cuda.CUDAGraph()
                prepare()
                with torch.cuda.graph(g, pool=pool):
                    self._logits[:bs].copy_(self._decode_forward(b))
                pool = g.pool()
                graphs[bs] = g
        self._buckets = sorted(self.graphs)
        torch.cuda.synchronize()
        return buckets
