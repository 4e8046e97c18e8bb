"""The inference engine: config, requests, sampler, scheduler, KV cache view, model runner,
the engine and the offline LLM API."""

from ..config import EngineConfig
from .llm import LLM
from .llm_engine import LLMEngine
from .request import CompletionOutput, RequestOutput
from .sampling import SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput"]
