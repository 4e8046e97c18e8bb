"""Helpers shared by the benchmarks (imported as ``common`` by scripts in this folder): engines on
weights built once (and a model of either mode on them), the copy bandwidth that achieved
bandwidths are compared with, CUDA-graph replay timing, and pyplot."""

from __future__ import annotations

import torch

# shared with ``zipfusion bench`` (the package's benchmarks): JSON, figures, the copy ceiling
from zipfusion.bench.kernel import copy_bandwidth  # noqa: F401
from zipfusion.bench.report import pyplot, write_json  # noqa: F401


def on_weights_of(model, deterministic: bool):
    """A model built with ``deterministic`` (a construction argument, never set later) that holds
    ``model``'s weight tensors themselves, no copy: built on the meta device, then given them."""
    from zipfusion.models import CausalLM
    with torch.device("meta"):
        view = CausalLM(model.config, deterministic=deterministic)
    view.load_state_dict(model.state_dict(keep_vars=True), strict=True, assign=True)
    for name, buf in model.named_buffers():             # also those outside the state dict (rope)
        owner, _, attr = name.rpartition(".")
        setattr(view.get_submodule(owner), attr, buf)
    return view.eval()


def engine_on(model_name: str, model=None, **options):
    """An LLMEngine for ``model_name`` (options: EngineConfig fields) that runs on ``model``'s
    weights, built once by the benchmark and shared between several engines, instead of building
    its own (``model=None``: the engine builds them); the engine's ``deterministic`` option holds
    (:func:`on_weights_of`). Through LLMEngine's public seam,
    :meth:`~zipfusion.engine.llm_engine.LLMEngine.build_model`."""
    from zipfusion import LLMEngine
    if model is None:
        return LLMEngine(model_name, **options)
    if options.get("tensor_parallel_size", 1) > 1:
        raise ValueError("weights built in this process cannot be split over ranks")

    class SharedWeightsEngine(LLMEngine):
        def build_model(self):
            return on_weights_of(model, self.config.deterministic)
    return SharedWeightsEngine(model_name, **options)


def replay_seconds(graph: "torch.cuda.CUDAGraph", reps: int) -> list[float]:
    """Seconds of each of ``reps`` replays of a captured CUDA graph (CUDA events, synced)."""
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / 1e3)
    return ts
