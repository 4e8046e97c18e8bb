"""zipfusion: LLM inference with a losslessly compressed BF16 KV cache."""

__version__ = "0.1.0"

from .api import LLM, RequestOutput, SamplingParams  # noqa: E402

__all__ = ["LLM", "SamplingParams", "RequestOutput", "__version__"]
