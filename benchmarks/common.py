"""Helpers shared by the benchmarks (imported as ``common`` by scripts in this folder): engines on
weights built once (and a model of either mode on them), the copy bandwidth that achieved
bandwidths are compared with, CUDA-graph replay timing, and pyplot."""

from __future__ import annotations

import json
import re
import statistics

import torch


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


def write_json(obj, path) -> None:
    """JSON with indent 1, but each list of plain numbers on one line (a step log stays one row
    per step instead of one line per number)."""
    text = json.dumps(obj, indent=1, default=float)
    flat = re.sub(r"\[\n\s*([-0-9.eE+, \n\s]*?(?:NaN|Infinity|[-0-9.eE+]+))\n\s*\]",
                  lambda m: "[" + re.sub(r",\n\s*", ", ", m.group(1)) + "]", text)
    with open(path, "w") as f:
        f.write(flat + "\n")


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None (with a note) where matplotlib is missing:
    a missing figure must not lose the numbers."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no figure (pip install matplotlib)")
        return None
    return plt


def copy_bandwidth(device="cuda", nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth, bytes read + written per second (median of 20 copies);
    NaN off the GPU. This is the ceiling that achieved bandwidths are compared with."""
    device = torch.device(device)
    if device.type != "cuda":
        return float("nan")
    x = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    ts = []
    for _ in range(20):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        y.copy_(x)
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / 1e3)
    del x, y
    return 2 * nbytes / statistics.median(ts)


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
