"""The offline API: ``LLM(model=...).generate(prompts, SamplingParams(...))``, vLLM-shaped.

``LLM`` turns prompts into requests of an :class:`~zipfusion.engine.llm_engine.LLMEngine`, runs
it until they are done and returns their outputs in the prompts' order. ``close()`` (or leaving
``with LLM(...) as llm:``) lets go of the engine: its tensor-parallel workers and process group,
its model and KV memory; an LLM dropped without it is released when it is collected.
"""

from __future__ import annotations

import gc

import torch

from ..config import EngineConfig
from .llm_engine import LLMEngine
from .request import RequestOutput
from .sampling import SamplingParams


class LLM:
    """An LLM with a compressed KV cache.

    ``model``: a Hugging Face model id (``"ORG/NAME"``, with ``revision=``), a checkpoint folder,
    a ``.gguf`` file, ``"demo"`` (the embedded tiny model), a compressed checkpoint (``zipfusion
    compress-weights``) or a shipped config with random weights
    (``"llama-3.1-8b-random"``, ... :data:`zipfusion.models.RANDOM_MODELS`).
    Every other option is a field of :class:`~zipfusion.config.EngineConfig`, e.g.
    ``kv_compression`` (keep full KV pages losslessly compressed; needs dtype bfloat16),
    ``weight_compression`` (the same for the weights; default: on for CUDA with bfloat16),
    ``kv_cache_dtype`` ("bf16", or "fp8": E4M3 pages, about 2x the pages, *lossy*),
    ``kv_memory_gb``, ``device`` ("auto" by default), ``deterministic``.
    """

    def __init__(self, model: str = "demo", **options):
        self._engine: LLMEngine | None = LLMEngine(EngineConfig.from_kwargs(model, **options))

    @property
    def engine(self) -> LLMEngine:
        if self._engine is None:
            raise RuntimeError("this LLM is closed; build a new one")
        return self._engine

    def close(self) -> None:
        """Release the engine (idempotent): stop its tensor-parallel workers and leave the process
        group (so that another tensor-parallel LLM can start in this process), drop its model, KV
        cache and CUDA graphs and hand their GPU memory back. The LLM cannot generate after."""
        engine, self._engine = self._engine, None
        if engine is None:
            return
        engine.shutdown()
        del engine
        gc.collect()                          # the engine's parts refer to each other
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

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
                eng.abort(r)
            raise type(exc)(f"prompt {i}: {exc}") from None
        bar = None
        if use_tqdm and len(prompts) > 1:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(prompts), desc="Generating", unit="prompt")
        try:
            while eng.has_work():
                done = eng.step().finished
                if bar is not None and done:
                    bar.update(len(done))
        except BaseException:                    # KeyboardInterrupt, a failed step: leave no request behind
            for r in reqs:
                eng.abort(r)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [eng.output_of(r, text) for r, (_, text) in zip(reqs, parsed)]

    def kv_stats(self) -> dict:
        """KV memory numbers at the busiest step of the last runs (pages, bytes, ratio), and the
        prefix cache's, host tier's and preemptions' counters now (``prefix_cache_*``,
        ``swap*``, ``recomputed_tokens``: ``LLMEngine.reuse_stats``)."""
        return self.engine.kv_stats(at_peak=True)

    def reset_prefix_cache(self) -> int:
        """Drop every cached prefix no request holds (vLLM's ``reset_prefix_cache``); pages freed."""
        return self.engine.scheduler.reset_prefix_cache()
