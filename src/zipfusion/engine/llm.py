"""The offline API: ``LLM(model=...).generate(prompts, SamplingParams(...))``, vLLM-shaped.

``LLMEngine`` owns model, KV cache, scheduler, runner and sampler and advances all requests
one step at a time; ``LLM`` turns prompts into requests and collects outputs in order.
"""

from __future__ import annotations

import itertools

import torch

from ..models import build_model, load_tokenizer, model_config, resolve_model
from .kv_cache import ArenaKVCache, DenseKVCache
from .request import CompletionOutput, Request, RequestOutput, Status
from .runner import ModelRunner
from .sampling import Sampler, SamplingParams
from .scheduler import Scheduler

DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32,
          "fp32": torch.float32, "float": torch.float32, "float16": torch.float16, "fp16": torch.float16,
          "half": torch.float16}


def parse_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    if isinstance(dtype, str) and dtype.lower() in DTYPES:
        return DTYPES[dtype.lower()]
    raise ValueError(f"dtype must be one of {sorted(set(DTYPES))}, got {dtype!r}")


def parse_device(device) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be 'cuda', 'cuda:N' or 'cpu', got {device!r}") from None
    if dev.type not in ("cuda", "cpu"):
        raise ValueError(f"device must be 'cuda' or 'cpu', got {device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but no CUDA GPU is visible; pass device='cpu'")
    return dev


class LLMEngine:
    def __init__(self, model: str = "demo", *, kv_compression: bool = True, kv_memory_gb: float | None = None,
                 dtype="bfloat16", device="cuda", max_model_len: int | None = None, max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 2048, seed: int = 0, load_format: str = "auto",
                 enforce_eager: bool = False, chunk_bytes: int | None = None, prebuilt_model=None,
                 attention_backend: str = "auto", admission: str = "optimistic"):
        self.dtype, self.device = parse_dtype(dtype), parse_device(device)
        if kv_compression and self.dtype != torch.bfloat16:
            raise ValueError(f"kv_compression=True needs dtype='bfloat16' (the page format is BF16), got "
                             f"{self.dtype}; pass kv_compression=False to run in {self.dtype}")
        if kv_memory_gb is not None and (not isinstance(kv_memory_gb, (int, float)) or kv_memory_gb <= 0):
            raise ValueError(f"kv_memory_gb must be a positive number, got {kv_memory_gb!r}")
        self.source = resolve_model(model, load_format)
        self.config = model_config(self.source)
        cfg = self.config
        self.max_model_len = int(max_model_len or min(cfg.max_position_embeddings, 32768))
        if prebuilt_model is not None:        # benchmarks: one set of 8B weights for several engines
            self.model = prebuilt_model
        else:
            self.model = build_model(self.source, dtype=self.dtype, device=self.device, seed=seed)
        self.tokenizer = load_tokenizer(self.source.tokenizer_dir)
        self.eos_token_ids = set(cfg.eos_token_ids) | set(self.tokenizer.eos_token_ids if self.tokenizer else ())
        budget = int((kv_memory_gb if kv_memory_gb is not None else self._default_kv_gb()) * 2**30)
        self.kv_compression = kv_compression
        L, H, D = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
        if self.dtype == torch.bfloat16:
            kw = {"chunk_bytes": chunk_bytes} if chunk_bytes else {}
            self.cache = ArenaKVCache(L, H, D, budget, self.device, compress=kv_compression,
                                      attention_backend=attention_backend, **kw)
        else:
            self.cache = DenseKVCache(L, H, D, DenseKVCache.pages_for(budget, L, H, D, self.dtype),
                                      self.dtype, self.device)
        if admission not in ("optimistic", "conservative", "estimate"):
            raise ValueError(f"admission must be 'optimistic', 'conservative' or 'estimate', got {admission!r}")
        policy = None
        if admission != "optimistic":
            if not isinstance(self.cache, ArenaKVCache):
                raise ValueError(f"admission={admission!r} needs the bfloat16 arena cache")
            from ..memory import Admission
            policy = Admission(self.cache.manager, mode=admission)
        self.scheduler = Scheduler(self.cache, max_num_seqs, max_num_batched_tokens, self.max_model_len,
                                   admission=policy)
        # CUDA graphs need the arena path (the dense cache's torch attention has dynamic shapes)
        self.runner = ModelRunner(self.model, self.cache, self.max_model_len, max_num_seqs,
                                  use_cuda_graphs=not enforce_eager and isinstance(self.cache, ArenaKVCache))
        self.sampler = Sampler(self.device, seed)
        self.graph_buckets = self.runner.capture_cuda_graphs()
        self._ids = itertools.count()
        self.peak_kv_stats: dict | None = None
        self._peak_pages = -1
        self.record_logits = False          # tests: keep every sampled row's logits on the request

    def _default_kv_gb(self) -> float:
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return max(0.5, 0.85 * free / 2**30 - 4.0)      # 4 GiB left for activations and graphs
        return 0.25

    # -- requests ---------------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams) -> Request:
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be zipfusion.SamplingParams, got {type(params).__name__}")
        V = self.config.vocab_size
        if not prompt_ids:
            raise ValueError("empty prompt: give at least one token")
        bad = [t for t in prompt_ids if not isinstance(t, int) or not 0 <= t < V]
        if bad:
            raise ValueError(f"prompt token ids must be ints in 0..{V - 1}, got {bad[:5]}")
        req = Request(next(self._ids), list(prompt_ids), params, arrival=0)
        if params.seed is not None:
            req.generator = self.sampler.make_generator(params.seed)
        self.scheduler.add(req)
        return req

    # -- one step ---------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """Run one scheduled step; returns the requests that finished in it."""
        out = self.scheduler.schedule()
        if out.prefill:
            logits = self.runner.prefill(out.prefill)
            for ch in out.prefill:
                ch.request.num_computed += ch.length
            rows = [i for i, ch in enumerate(out.prefill) if ch.completes]
            reqs = [out.prefill[i].request for i in rows]
            logits = logits[rows] if len(rows) != len(out.prefill) else logits
            stepped = [ch.request for ch in out.prefill]
        else:
            logits = self.runner.decode(out.decode)
            for r in out.decode:
                r.num_computed += 1
            reqs = stepped = out.decode
        finished = []
        if reqs:
            tokens = self.sampler(logits, [r.params for r in reqs], [r.generator for r in reqs]).tolist()
            if self.record_logits:
                for r, row in zip(reqs, logits):
                    r.logits.append(row.detach().cpu().clone())
            for r, t in zip(reqs, tokens):
                r.output_ids.append(int(t))
                reason = self._check_stop(r)
                if reason:
                    finished.append((r, reason))
        sealed = self.scheduler.seal_full_pages(stepped)
        self._note_kv_stats(sealed)
        for r in out.preempted:
            self.runner.forget(r.request_id)
        for r, reason in finished:
            self.scheduler.finish(r, reason)
            self.runner.forget(r.request_id)
        return [r for r, _ in finished]

    def _check_stop(self, r: Request) -> str | None:
        p, t = r.params, r.output_ids[-1]
        n = len(r.output_ids)
        if n >= p.min_tokens:
            if not p.ignore_eos and t in self.eos_token_ids:
                return "stop"
            if t in p.stop_token_ids:
                r.stop_reason = t
                return "stop"
            if p.stop and self.tokenizer is not None:
                text = self.tokenizer.decode(r.output_ids)
                hits = [(text.find(s), s) for s in p.stop if s in text]
                if hits:
                    cut, s = min(hits)
                    r.text, r.stop_reason = text[:cut], s
                    return "stop"
        if p.max_tokens is not None and n >= p.max_tokens:
            return "length"
        if r.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _note_kv_stats(self, sealed: int) -> None:
        """Keep the cache's numbers from the step with the most pages in use, taken again when
        pages were compressed (cheap test first: the manager's stats walk its tables)."""
        pages = sum(len(r.pages) for r in self.scheduler.running)
        if self.peak_kv_stats is None or pages > self._peak_pages or (sealed and pages == self._peak_pages):
            self._peak_pages = pages
            self.peak_kv_stats = self.cache.stats()

    def output_of(self, r: Request, prompt: str | None) -> RequestOutput:
        text = r.text
        if r.stop_reason is None or not isinstance(r.stop_reason, str):
            text = self.tokenizer.decode(r.output_ids) if self.tokenizer is not None else ""
        return RequestOutput(r.request_id, prompt, r.prompt_ids,
                             [CompletionOutput(0, text, list(r.output_ids), r.finish_reason, r.stop_reason)],
                             finished=r.status == Status.FINISHED, num_preemptions=r.num_preemptions)


class LLM:
    """An LLM with a compressed KV cache.

    ``model``: a Hugging Face checkpoint folder, ``"demo"`` (the embedded tiny model) or a
    shipped config with random weights (``"llama-3.1-8b-random"``, ``"qwen3-8b-random"``).
    ``kv_compression``: keep full KV pages losslessly compressed (needs dtype bfloat16).
    ``kv_memory_gb``: bytes for the KV arena (default: 85% of free GPU memory, 0.25 GB on CPU).
    """

    def __init__(self, model: str = "demo", *, kv_compression: bool = True, kv_memory_gb: float | None = None,
                 dtype="bfloat16", device="cuda", **engine_kwargs):
        self.engine = LLMEngine(model, kv_compression=kv_compression, kv_memory_gb=kv_memory_gb, dtype=dtype,
                                device=device, **engine_kwargs)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def _prompt_ids(self, prompt) -> tuple[list[int], str | None]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"model {self.engine.source.name!r} has no tokenizer; pass token ids "
                                 "({'prompt_token_ids': [...]}) instead of text")
            return self.tokenizer.encode(prompt), prompt
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return list(prompt["prompt_token_ids"]), prompt.get("prompt")
            if "prompt" in prompt:
                return self._prompt_ids(prompt["prompt"])
            raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return list(prompt), None
        raise TypeError(f"a prompt is a str, a list of token ids or a dict, got {type(prompt).__name__}")

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """One :class:`RequestOutput` per prompt, in the prompts' order."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple)) and prompts
                                                 and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = sampling_params if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        parsed = [self._prompt_ids(p) for p in prompts]
        eng = self.engine
        reqs = []
        try:
            for i, ((ids, _), sp) in enumerate(zip(parsed, params)):
                reqs.append(eng.add_request(ids, sp))
        except (ValueError, TypeError) as exc:
            for r in reqs:                       # all or nothing: queue none of this call's prompts
                eng.scheduler.waiting.remove(r)
            raise type(exc)(f"prompt {i}: {exc}") from None
        bar = None
        if use_tqdm and len(prompts) > 1:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(prompts), desc="Generating", unit="prompt")
        try:
            while eng.scheduler.has_work():
                done = eng.step()
                if bar is not None and done:
                    bar.update(len(done))
        finally:
            if bar is not None:
                bar.close()
        return [eng.output_of(r, text) for r, (_, text) in zip(reqs, parsed)]

    def kv_stats(self) -> dict:
        """KV memory numbers at the busiest step of the last runs (pages, bytes, ratio)."""
        return dict(self.engine.peak_kv_stats or self.engine.cache.stats())
