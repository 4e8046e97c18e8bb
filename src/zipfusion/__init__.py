"""zipfusion: LLM inference with a losslessly compressed BF16 KV cache."""

__version__ = "0.1.0"
