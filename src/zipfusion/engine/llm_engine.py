"""LLMEngine: owns model, KV cache, scheduler, runner and sampler, and advances every request
one step at a time (``add_request``, ``step``, ``abort``). Built from an :class:`EngineConfig`."""

from __future__ import annotations

import itertools
import logging
import weakref

import torch

from ..attention.backend import AttentionBackend
from ..config import DEFAULT_MAX_MODEL_LEN, WATCHDOG_TIMEOUT_S, EngineConfig
from ..format.layout import PAGE_TOKENS
from ..memory.copy import HostArray
from ..memory.kv_cache import ArenaKVCache
from ..models import build_model, load_tokenizer, model_config, resolve_model
from ..kernels import weight_linear
from ..models.compressed_weights import compressed_weights, weight_sizes
from ..models.loader import resolve_tokenizer
from ..models.parallel import TensorParallel, use as use_parallel
from .build import build_kv_cache, free_memory_gb, kv_memory_gb, parse_device, parse_dtype
from .observe import MemoryWatch, PhaseClock, StepResult, StepStats, reuse_stats
from .request import CompletionOutput, Request, RequestOutput, Status
from .runner import ModelRunner
from .sampling import Sampler, SamplingParams, compute_logprobs
from .scheduler import Scheduler, SchedulerOutput
from .structured import GrammarCompiler, apply_bitmask
from .watchdog import Watchdog

log = logging.getLogger("zipfusion")


class LLMEngine:
    def __init__(self, config: EngineConfig | str | None = None, **options):
        """``LLMEngine(EngineConfig(...))`` or ``LLMEngine("model", **options)``."""
        if not isinstance(config, EngineConfig):
            config = EngineConfig.from_kwargs(config, **options)
        elif options:
            raise TypeError(f"pass options in the EngineConfig, not beside it: {sorted(options)}")
        cfg = self.config = config
        self.dtype, self.device = parse_dtype(cfg.dtype), parse_device(cfg.device)
        if cfg.kv_compression and self.dtype != torch.bfloat16:
            raise ValueError(f"kv_compression=True needs dtype='bfloat16' (the page format is BF16), got "
                             f"{self.dtype}; pass kv_compression=False to run in {self.dtype}")
        AttentionBackend.check_kind(cfg.attention_backend, self.device, self.dtype)
        self.source = resolve_model(cfg.model, cfg.load_format, cfg.revision)
        self.model_config = mc = model_config(self.source)
        if self.source.compressed:                   # a compressed checkpoint holds compressed weights
            cfg.weight_compression = True
        self.max_model_len = self._max_model_len(cfg.max_model_len, mc.max_position_embeddings)
        self.tp = None
        if cfg.tensor_parallel_size > 1:
            from ..distributed.driver import start
            from .tp_runner import serve
            self.tp = start(cfg, self.device, mc, serve)
        with use_parallel(self.tp.parallel if self.tp else TensorParallel()):
            self.model = self.build_model()
        self.weights = weight_sizes(self.model)     # before the KV budget: what compression freed is free
        if self.weights.compressed and self.device.type == "cuda":
            weight_linear.warmup(compressed_weights(self.model),
                                 max(cfg.max_num_seqs, cfg.max_num_batched_tokens))
        self.tokenizer = load_tokenizer(resolve_tokenizer(cfg.tokenizer) or self.source.tokenizer_dir,
                                        chat_template=cfg.chat_template)
        eos = set(mc.eos_token_ids) | set(self.tokenizer.eos_token_ids if self.tokenizer else ())
        self.grammars = GrammarCompiler(self.tokenizer, mc.vocab_size, eos)
        self.cache = self._build_cache()
        self._len_note = ""
        self._check_one_request_fits(cfg.max_model_len is not None)
        sched_cache = self.tp.lockstep(self.cache) if self.tp else self.cache
        self.host_tier = self._build_host_tier()
        self.scheduler = Scheduler(sched_cache, cfg.max_num_seqs, cfg.max_num_batched_tokens, self.max_model_len,
                                   admission=cfg.admission, prefix_caching=cfg.enable_prefix_caching,
                                   host_tier=self.host_tier, tuning=cfg.tuning, window=self._kv_window(),
                                   eos_token_ids=eos, tokenizer=self.tokenizer, grammars=self.grammars)
        self.attention = AttentionBackend.from_config(cfg, self.cache, mc, self.tp.size if self.tp else 1)
        self.runner = ModelRunner(self.model, self.attention, self.max_model_len, cfg.max_num_seqs,
                                  use_cuda_graphs=not cfg.enforce_eager and self.attention.graph_safe
                                  and not self._moe_loops(mc))
        if self.tp:
            from .tp_runner import TPRunner
            self.runner = TPRunner(self.runner, self.tp, self.max_model_len)
        self.sampler = Sampler(self.device, cfg.seed)
        self.graph_buckets = self.runner.capture_cuda_graphs()
        self.attention.warm_up_prefill(cfg.max_num_batched_tokens)
        if self.host_tier is not None:
            self.host_tier.start()
        # the next step scheduled while this one runs on the GPU (tests set it on the CPU too)
        self.async_scheduling = cfg.async_scheduling and self.device.type == "cuda" and not self.tp
        self.watchdog = self._build_watchdog(cfg.watchdog_timeout_s)
        self._memory_watch = MemoryWatch(self) if self.device.type == "cuda" else None
        self._ahead: SchedulerOutput | None = None
        self._ids = itertools.count()
        self.peak_kv_stats: dict | None = None
        self._peak_pages = -1
        self.recomputed_tokens = 0
        self._observers: list = []
        w = self.weights
        log.info("zipfusion engine: model %s (%d layers, %d KV heads x %d), %s on %s, weights %.2f GiB -> %.2f GiB "
                 "(%s, %.3f), KV memory %.2f GiB (%s), max_model_len %d, max_num_seqs %d", self.source.name,
                 mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim, str(self.dtype).replace("torch.", ""),
                 self.device, w.original_bytes / 2**30, w.stored_bytes / 2**30,
                 "compressed" if w.compressed else "uncompressed", w.ratio, self.kv_memory_gb,
                 ("fp8 (E4M3, lossy), " if cfg.kv_cache_dtype == "fp8" else "")
                 + ("compressed" if cfg.kv_compression else "uncompressed"), self.max_model_len, cfg.max_num_seqs)

    def build_model(self):
        """The model from ``self.source`` (a subclass may return one on weights it already holds)."""
        return build_model(self.source, dtype=self.dtype, device=self.device, seed=self.config.seed,
                           deterministic=self.config.deterministic, weight_compression=self.config.weight_compression)

    def _moe_loops(self, mc) -> bool:
        """Whether the experts run as a loop over groups, whose host reads a CUDA graph cannot capture."""
        return mc.num_experts > 0 and (self.config.deterministic or self.dtype != torch.bfloat16)

    @staticmethod
    def _max_model_len(asked: int | None, positions: int) -> int:
        if asked is None:
            return min(positions, DEFAULT_MAX_MODEL_LEN)
        if asked > positions:
            raise ValueError(f"max_model_len={asked} is more than the model's {positions} positions; "
                             f"pass max_model_len <= {positions}")
        return asked

    def _build_cache(self):
        """The KV cache (engine/build.py; a tensor-parallel worker builds its own there too)."""
        gb = kv_memory_gb(self.config, self.device, self.weights.saved_bytes)
        if self.tp:                         # every rank the same budget: page ids agree (distributed/lockstep.py)
            gb = self.tp.agree_budget(gb)
        self.kv_memory_gb = gb
        return build_kv_cache(self.config, self.model_config, self.dtype, self.device, gb,
                              self.tp.size if self.tp else 1)

    def _build_host_tier(self):
        """The KV host tier (memory/host_tier.py), or None."""
        cfg = self.config
        gb = cfg.kv_host_memory_gb
        if gb is None:
            default_on = self.device.type == "cuda" and not self.tp
            gb = min(2 * self.kv_memory_gb, free_memory_gb(torch.device("cpu")) / 4) if default_on else 0.0
        if not gb or not cfg.enable_prefix_caching or not isinstance(self.cache, ArenaKVCache):
            return None
        if self.tp:
            raise ValueError("kv_host_memory_gb is not supported with tensor_parallel_size > 1 yet; pass 0")
        if gb > free_memory_gb(torch.device("cpu")):
            raise ValueError(f"kv_host_memory_gb={gb:g} is more than the host's free memory; pass a smaller one")
        from ..memory.host_tier import HostTier
        return HostTier(self.cache.manager, int(gb * 2**30), cfg.tuning)

    def _kv_window(self) -> int | None:
        """The largest sliding window when every layer has one (pages behind it are given back), else None."""
        ws = self.model_config.sliding_windows
        if not ws or None in ws or self.tp or max(ws) + PAGE_TOKENS > self.max_model_len:
            return None
        return max(ws)

    def _check_one_request_fits(self, asked: bool) -> None:
        """vLLM's start-up rule."""
        graphs = self.device.type == "cuda" and not self.config.enforce_eager and isinstance(self.cache, ArenaKVCache)
        fits = (self.cache.capacity_new_pages() - graphs) * PAGE_TOKENS          # CUDA graphs take a scratch page
        if fits >= self.max_model_len:
            return
        if asked or fits < PAGE_TOKENS:
            raise ValueError(f"the KV memory ({self.kv_memory_gb:g} GiB) holds {max(fits, 0)} tokens, fewer than "
                             f"max_model_len={self.max_model_len}; give more kv_memory_gb or a smaller max_model_len")
        log.warning("max_model_len lowered from %d to %d: what %.3g GiB of KV memory holds",
                    self.max_model_len, fits, self.kv_memory_gb)
        self.max_model_len = fits
        self._len_note = f" (what kv_memory_gb={self.kv_memory_gb:g} holds; give more kv_memory_gb)"

    def _build_watchdog(self, timeout_s: float | None):
        """The step watchdog (engine/watchdog.py), or None."""
        if timeout_s is None:
            timeout_s = WATCHDOG_TIMEOUT_S if self.device.type == "cuda" else 0
        if not timeout_s:
            return None
        watchdog = Watchdog(timeout_s)
        weakref.finalize(self, watchdog.close)
        return watchdog

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers and the watchdog (idempotent)."""
        if self.watchdog is not None:
            self.watchdog.close()
        if self.tp:
            self.tp.shutdown()

    @property
    def eos_token_ids(self) -> set:
        """The token ids that end a request (the scheduler's stop rule)."""
        return self.scheduler.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids) -> None:
        self.scheduler.eos_token_ids = set(ids)

    @property
    def pages(self):
        """The page store."""
        return self.scheduler.pages

    def add_request(self, prompt_ids: list[int], params: SamplingParams, matcher=None) -> Request:
        """Queue a request."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be zipfusion.SamplingParams, got {type(params).__name__}")
        V = self.model_config.vocab_size
        if not prompt_ids:
            raise ValueError("empty prompt: give at least one token")
        bad = [t for t in prompt_ids if not isinstance(t, int) or not 0 <= t < V]
        if bad:
            raise ValueError(f"prompt token ids must be ints in 0..{V - 1}, got {bad[:5]}")
        if params.logprobs is not None and params.logprobs > self.config.max_logprobs:
            raise ValueError(f"logprobs={params.logprobs} is more than this engine's max_logprobs="
                             f"{self.config.max_logprobs}")
        bad = [t for t in (params.logit_bias or {}) if not 0 <= t < V]
        if bad:
            raise ValueError(f"logit_bias token ids must be in 0..{V - 1}, got {bad[:5]}")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(f"a prompt of {len(prompt_ids)} tokens does not fit max_model_len="
                             f"{self.max_model_len}{self._len_note}; shorten the prompt or raise max_model_len")
        req = Request(next(self._ids), list(prompt_ids), params)
        req.matcher = matcher if matcher is not None or not params.guided else self.grammars.matcher(params)
        if params.seed is not None:
            req.generator = self.sampler.make_generator(params.seed)
        elif self.config.deterministic and not params.greedy:
            req.generator = self.sampler.make_generator(self.config.seed)
        self.scheduler.add(req)
        return req

    def abort(self, req: Request) -> None:
        """Stop a request wherever it is (waiting or running)."""
        if req.status != Status.FINISHED:
            self.scheduler.finish(req, "abort")

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def add_observer(self, fn) -> None:
        """Call ``fn(result: StepResult, stats: StepStats)`` at the end of every step."""
        self._observers.append(fn)

    def remove_observer(self, fn) -> None:
        self._observers.remove(fn)

    def step(self) -> StepResult:
        """Run one step: schedule, forward (the seal behind it), postprocess; returns what it did."""
        if self.watchdog is None:
            return self._step()
        self.watchdog.begin()
        try:
            return self._step()
        finally:
            self.watchdog.end()

    def _step(self) -> StepResult:
        clock = PhaseClock()
        out = self._take_ahead() or self.scheduler.schedule()
        out.ended = self.scheduler.take_ended()
        running = len(self.scheduler.running)
        clock.mark("schedule")
        logits = self.runner.run(out)
        recomputed = self.scheduler.computed(out)
        self.recomputed_tokens += recomputed
        sampled = out.decode + [ch.request for ch in out.prefill if ch.completes]
        tokens = self._launch_sample(sampled, logits) if sampled else None
        clock.mark("forward")
        # the pages this step fills hold K/V of tokens known already (a step writes its inputs')
        placed = self.scheduler.after_forward(out.decode + [ch.request for ch in out.prefill])
        clock.mark("seal")
        if self.async_scheduling:
            self._ahead = self.scheduler.schedule_ahead(sampled)
            clock.mark("ahead")
        finished = self._postprocess(sampled, logits, tokens, placed)
        clock.mark("finish")
        res = StepResult(finished, sampled, logits if sampled else None, len(out.decode),
                         sum(ch.length for ch in out.prefill), running, len(out.preempted))
        if self._observers:
            stats = StepStats(placed, recomputed, sum(r.num_computed for r in out.decode), **clock.times())
            for fn in self._observers:
                fn(res, stats)
        if self._memory_watch is not None:
            self._memory_watch.check(res, placed)
        return res

    def _postprocess(self, sampled: list[Request], logits, tokens, placed: int) -> list[Request]:
        """The sampled tokens back (the step's one wait) and into the scheduler's postprocess."""
        self._note_kv_stats(placed)
        return self._finish_sample(sampled, logits, tokens) if sampled else []

    def _take_ahead(self) -> SchedulerOutput | None:
        """The schedule made ahead, without the requests that finished (or were aborted) since."""
        out, self._ahead = self._ahead, None
        if out is None:
            return None
        out.decode = [r for r in out.decode if r.status == Status.RUNNING]
        out.prefill = [ch for ch in out.prefill if ch.request.status == Status.RUNNING]
        return None if out.empty else out

    def _launch_sample(self, reqs: list[Request], logits: torch.Tensor):
        """One token per request from its logits row, launched."""
        params = [r.params for r in reqs]
        history = ([(r.prompt_ids, r.output_ids) if p.penalized else None for r, p in zip(reqs, params)]
                   if any(p.penalized for p in params) else None)
        guided = [i for i, r in enumerate(reqs) if r.matcher is not None]
        if guided:
            mask = self.grammars.bitmask([reqs[i].matcher for i in guided], pin=logits.is_cuda)
            logits = apply_bitmask(logits, guided, mask)
        new_tokens = self.sampler(logits, params, [r.generator for r in reqs], history)
        return HostArray(new_tokens), new_tokens

    def _finish_sample(self, reqs: list[Request], logits: torch.Tensor, tokens) -> list[Request]:
        """Wait for the sampled tokens."""
        host, new_tokens = tokens
        logprobs = self._logprobs(reqs, logits, new_tokens)
        return self.scheduler.postprocess(reqs, host.get().tolist(), logprobs)

    def _logprobs(self, reqs: list[Request], logits: torch.Tensor, new_tokens: torch.Tensor) -> dict:
        """{row: logprobs of its sampled token and top alternatives}, for the rows that asked."""
        rows = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
        if not rows:
            return {}
        idx = torch.tensor(rows, device=logits.device)
        return dict(zip(rows, compute_logprobs(logits[idx], new_tokens[idx], [reqs[i].params.logprobs for i in rows])))

    def _note_kv_stats(self, placed: int) -> None:
        """Keep the cache's numbers from the step with the most pages in use."""
        pages = sum(len(r.pages) - r.dropped_pages for r in self.scheduler.running)
        if self.peak_kv_stats is None or pages > self._peak_pages or (placed and pages == self._peak_pages):
            self._peak_pages = pages
            self.peak_kv_stats = self.cache.stats()

    def warm_up(self) -> None:
        """Run one request filling a step's token budget, then reset the counters, prefix cache and request
        ids, so that the largest prefill's activations are cached before the first request."""
        if self.has_work():
            raise RuntimeError("warm_up() is for an idle engine: requests are in it")
        room = (self.cache.capacity_new_pages() - 2) * PAGE_TOKENS
        n = min(self.config.max_num_batched_tokens, self.max_model_len - 2, room)
        if n < 1:
            return
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(10, max(11, self.model_config.vocab_size - 10), (n,), generator=g).tolist()
        self.add_request(ids, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
        while self.has_work():
            self.step()
        self.reset_stats()
        self._ids = itertools.count()
        if self._memory_watch is not None:
            self._memory_watch = MemoryWatch(self)

    def reset_stats(self) -> None:
        """Start the counters afresh and the prefix cache cold (a benchmark's run after its warm-up)."""
        self.scheduler.num_preemptions = 0
        self.recomputed_tokens = 0
        self.scheduler.reset_prefix_cache()
        self.scheduler.prefix.stats = type(self.scheduler.prefix.stats)()
        self.peak_kv_stats, self._peak_pages = None, -1

    def kv_stats(self, at_peak: bool = False) -> dict:
        """The cache's numbers (pages, bytes, ratio: now, or ``at_peak`` at the busiest step since
        ``peak_kv_stats`` was last cleared) with ``reuse_stats``'s counters now."""
        return {**((at_peak and self.peak_kv_stats) or self.cache.stats()), **self.reuse_stats()}

    def reuse_stats(self) -> dict:
        """What K/V was reused, moved or thrown away, now (:func:`~.observe.reuse_stats`)."""
        return reuse_stats(self.scheduler, self.recomputed_tokens)

    def output_of(self, r: Request, prompt: str | None) -> RequestOutput:
        text = r.text
        if r.stop_reason is None or not isinstance(r.stop_reason, str):
            text = self.tokenizer.decode(r.output_ids) if self.tokenizer is not None else ""
        return RequestOutput(r.request_id, prompt, r.prompt_ids,
                             [CompletionOutput(0, text, list(r.output_ids), r.finish_reason, r.stop_reason,
                                               list(r.logprobs) if r.params.logprobs is not None else None)],
                             finished=r.status == Status.FINISHED, num_preemptions=r.num_preemptions,
                             num_cached_tokens=r.num_cached_tokens or 0)
