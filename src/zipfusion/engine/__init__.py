"""The inference engine: sampler, requests, scheduler, KV cache view, model runner, LLM API."""

from .llm import LLM, LLMEngine
from .request import CompletionOutput, RequestOutput
from .sampling import SamplingParams

__all__ = ["LLM", "LLMEngine", "SamplingParams", "RequestOutput", "CompletionOutput"]
