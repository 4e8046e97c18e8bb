#!/usr/bin/env python3
"""Structured output's per-token cost: filling the grammar bitmask (llguidance, the engine's
GrammarCompiler, on the host), applying it to the logits (engine/structured.apply_bitmask on the
logits' device: with ``--device cuda`` the pinned mask's copy and the masking on the GPU, timed to
the device's end) and feeding the sampled token back, per step of a batch of guided rows.

Tokens are the argmax of random logits under the mask (a random walk through the grammar; a
finished row starts again), so the numbers are the grammar machinery's own, without a model; one
torch thread. Tokenizers: the demo model's (2,048 tokens), SmolLM2-135M's (49,152; from its GGUF,
downloaded on first use) or a folder holding a tokenizer.json (``--save-tokenizer DIR`` writes
SmolLM2's there, for a machine without network). Result: ``OUT.json``.

    PYTHONPATH=src python benchmarks/structured_output.py
    PYTHONPATH=src python benchmarks/structured_output.py --device cuda --batches 1,16,64 \
        --tokenizers demo,DIR --out OUT       # a GPU machine (DIR: from --save-tokenizer)
"""

from __future__ import annotations

import argparse
import importlib.metadata
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 40},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "maxItems": 4, "items": {"type": "string", "maxLength": 12}}}}
GRAMMARS = {"json_schema": {"guided_json": SCHEMA}, "json_object": {"guided_json": {"type": "object"}},
            "regex": {"guided_regex": r"[A-Z][a-z]{2,12}( [a-z]{1,10}){0,20}\."},
            "choice": {"guided_choice": ["Genesis", "Exodus", "Leviticus", "Numbers", "Deuteronomy"]}}


def percentile(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run(compiler, params, batch: int, steps: int, torch, device: str = "cpu"):
    from zipfusion.engine.structured import apply_bitmask
    g = torch.Generator(device=device).manual_seed(0)
    V = compiler.vocab_size
    cuda = device != "cpu"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    matchers = [compiler.matcher(params) for _ in range(batch)]
    fill, apply, accept = [], [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        mask = compiler.bitmask(matchers, pin=cuda)
        t1 = time.perf_counter()
        logits = torch.randn(batch, V, generator=g, device=device)
        sync()
        t2 = time.perf_counter()
        masked = apply_bitmask(logits, list(range(batch)), mask)
        sync()
        t3 = time.perf_counter()
        tokens = masked.argmax(-1).tolist()
        t4 = time.perf_counter()
        done = [i for i, (m, t) in enumerate(zip(matchers, tokens)) if not compiler.accept(m, t) or m.is_stopped()]
        t5 = time.perf_counter()
        for i in done:                       # a finished row starts again (not timed: a new request's matcher)
            matchers[i] = compiler.matcher(params)
        fill.append(t1 - t0)
        apply.append(t3 - t2)
        accept.append(t5 - t4)

    def ms(xs):
        return {"mean": 1e3 * statistics.fmean(xs), "median": 1e3 * statistics.median(xs),
                "p99": 1e3 * percentile(xs, 0.99)}
    return {"fill_ms": ms(fill), "apply_ms": ms(apply), "accept_ms": ms(accept),
            "fill_per_row_us": 1e6 * statistics.fmean(fill) / batch}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--tokenizers", default="demo,smollm2", help="demo, smollm2 or a folder with a tokenizer.json")
    ap.add_argument("--device", default="cpu", help="where the logits are and the mask is applied (cpu, cuda)")
    ap.add_argument("--save-tokenizer", default=None, help="write SmolLM2's tokenizer into this folder and stop")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "server_hostile_cpu" / "structured_output"))
    args = ap.parse_args(argv)
    import torch

    from zipfusion.engine.structured import GrammarCompiler
    from zipfusion.engine.sampling import SamplingParams
    from zipfusion.models import load_tokenizer, model_config, resolve_model
    torch.set_num_threads(1)
    if args.save_tokenizer:
        from zipfusion.analysis.checkpoints import smollm2_gguf
        load_tokenizer(resolve_model(str(smollm2_gguf())).tokenizer_dir).save(args.save_tokenizer)
        print(f"wrote SmolLM2's tokenizer into {args.save_tokenizer}")
        return 0
    if args.device != "cpu" and not torch.cuda.is_available():
        ap.error(f"--device {args.device}: no CUDA GPU here; use --device cpu")
    rows = []
    for name in args.tokenizers.split(","):
        if Path(name).is_dir():             # a tokenizer alone: its own vocabulary and end-of-sequence ids
            tok = load_tokenizer(name)
            vocab, eos = tok.vocab_size(), set(tok.eos_token_ids)
            name = Path(name).name
        else:
            model = name
            if name == "smollm2":
                from zipfusion.analysis.checkpoints import smollm2_gguf
                model = str(smollm2_gguf())
            source = resolve_model(model)
            tok = load_tokenizer(source.tokenizer_dir)
            mc = model_config(source)
            vocab, eos = mc.vocab_size, set(mc.eos_token_ids) | set(tok.eos_token_ids)
        compiler = GrammarCompiler(tok, vocab, eos)
        compiler.lltokenizer()
        for gname, fields in GRAMMARS.items():
            params = SamplingParams(**fields)
            t0 = time.perf_counter()
            compiler.matcher(params)
            compile_ms = 1e3 * (time.perf_counter() - t0)
            for batch in [int(b) for b in args.batches.split(",")]:
                r = run(compiler, params, batch, args.steps, torch, args.device)
                rows.append({"tokenizer": name, "vocab": vocab, "grammar": gname, "batch": batch,
                             "first_compile_ms": compile_ms, **r})
                print(f"{name:8s} {gname:12s} B={batch:3d}  fill {r['fill_ms']['mean']:7.3f} ms "
                      f"(p99 {r['fill_ms']['p99']:7.3f}, {r['fill_per_row_us']:6.1f} us/row)  apply "
                      f"{r['apply_ms']['mean']:6.3f} ms  accept {r['accept_ms']['mean']:6.3f} ms", flush=True)
    out = {"date": datetime.date.today().isoformat(), "machine": platform.processor() or platform.machine(),
           "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
           "torch": torch.__version__, "llguidance": importlib.metadata.version("llguidance"),
           "torch_threads": 1, "steps": args.steps, "loadavg_1min": os.getloadavg()[0],
           "device": torch.cuda.get_device_name() if args.device != "cpu" else "cpu",
           "command": "PYTHONPATH=src python benchmarks/structured_output.py " + " ".join(argv or sys.argv[1:]),
           "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out + ".json").write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
