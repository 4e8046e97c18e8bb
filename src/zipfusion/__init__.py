"""zipfusion: LLM inference with a losslessly compressed BF16 KV cache.

    import zipfusion
    llm = zipfusion.LLM(model="demo", device="cpu")
    out = llm.generate(["In the beginning"], zipfusion.SamplingParams(temperature=0, max_tokens=32))
    print(out[0].text)
"""

__version__ = "0.1.0"

from .engine import LLM, RequestOutput, SamplingParams  # noqa: E402

__all__ = ["LLM", "SamplingParams", "RequestOutput", "__version__"]
