"""The public offline API (vLLM-shaped): ``zipfusion.LLM`` and ``zipfusion.SamplingParams``.

    import zipfusion
    llm = zipfusion.LLM(model="demo", device="cpu")
    out = llm.generate(["In the beginning"], zipfusion.SamplingParams(temperature=0, max_tokens=32))
    print(out[0].text)
"""

from .engine.llm import LLM, LLMEngine
from .engine.request import CompletionOutput, RequestOutput
from .engine.sampling import SamplingParams

__all__ = ["LLM", "LLMEngine", "SamplingParams", "RequestOutput", "CompletionOutput"]
