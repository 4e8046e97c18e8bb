"""The offline API: ``LLM(model=...).generate(prompts, SamplingParams(...))``, vLLM-shaped.
``close()`` (or leaving ``with LLM(...) as llm:``) releases the engine, its workers and memory.
"""

from __future__ import annotations

import gc

import torch

from ..config import EngineConfig
from .llm_engine import LLMEngine
from .request import RequestOutput
from .sampling import SamplingParams


class LLM:
    """An LLM with a compressed KV cache. ``model``: a Hub id, a checkpoint folder, a ``.gguf`` file,
    ``"demo"`` or a shipped random-weight config; every other option is an
    :class:`~zipfusion.config.EngineConfig` field."""

    def __init__(self, model: str = "demo", **options):
        self._engine: LLMEngine | None = LLMEngine(EngineConfig.from_kwargs(model, **options))

    @property
    def engine(self) -> LLMEngine:
        if self._engine is None:
            raise RuntimeError("this LLM is closed; build a new one")
        return self._engine

    def close(self) -> None:
        """Release the engine (idempotent): its workers, process group, model, KV cache and GPU
        memory. The LLM cannot generate after."""
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
            for r in reqs:  # all or nothing: queue none of this call's prompts
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
        except BaseException:  # leave no request behind
            for r in reqs:
                eng.abort(r)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [eng.output_of(r, text) for r, (_, text) in zip(reqs, parsed)]

    def kv_stats(self) -> dict:
        """KV memory numbers at the busiest step of the last runs, and the reuse counters now."""
        return self.engine.kv_stats(at_peak=True)

    def reset_prefix_cache(self) -> int:
        """Drop every cached prefix no request holds (vLLM's ``reset_prefix_cache``); pages freed."""
        return self.engine.scheduler.reset_prefix_cache()
