"""FP8 + lossless on real KV (issue 47 item 3): stored / FP8 bytes of the FP8 E4M3 block format.

Runs what ``zipfusion analyze --kv-dtype fp8`` runs (:mod:`zipfusion.analysis.fp8_stats`) on

* SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to BF16): the analyzer's default text
  (``model_kv.SAMPLE_TEXT``) and the three 4,096-token texts of ``benchmarks/real_model.py``
  (legal, technical, python; each alone and merged);
* the embedded demo model, on the analyzer's default text;

each under both FP8 scales (1.0, and amax/448 per layer, KV head and K/V) and every block design,
beside the BF16 format's v2/v1 stored ratios of the same KV. No GPU.

    PYTHONPATH=src python benchmarks/fp8_lossless.py     # writes benchmarks/results/fp8_lossless_cpu/
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_model import builtin_texts  # noqa: E402

from zipfusion.analysis.checkpoints import smollm2_gguf  # noqa: E402
from zipfusion.analysis.fp8_stats import analyze_fp8  # noqa: E402
from zipfusion.analysis.kv_stats import analyze_kv, require_matplotlib  # noqa: E402
from zipfusion.analysis.model_kv import SAMPLE_TEXT, capture_kv, load_for_analysis, merge_full_pages, text_ids  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "fp8_lossless_cpu"


def measure(layers_kv, tokens: int) -> tuple[dict, object]:
    """BF16 v2/v1 and FP8-lossless numbers of one set of layers' KV."""
    bf16 = analyze_kv(layers_kv)
    fp8 = analyze_fp8(layers_kv)
    return {"tokens": tokens, "pages_per_layer": bf16.pages,
            "bf16": {"v2_stored_over_bf16": bf16.size_ratio, "v1_stored_over_bf16": bf16.v1["size_ratio"]},
            "fp8": fp8.as_dict()}, fp8


def line(name: str, d: dict) -> str:
    t, h = d["fp8"]["scales"]["tensor"], d["fp8"]["scales"]["head"]
    designs = "  ".join(f"{k} {v['ratio']:.4f}" for k, v in t["designs"].items())
    return (f"{name:>22}: {d['tokens']:>5} tokens; BF16 v2 {d['bf16']['v2_stored_over_bf16']:.4f}; FP8 scale 1.0: "
            f"{designs}; per-head adaptive {h['designs']['adaptive']['ratio']:.4f}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per long text")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)
    require_matplotlib()
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gguf = smollm2_gguf()
    runs = {}
    t0 = time.perf_counter()
    net, tok = load_for_analysis(str(gguf))
    texts = {"sample": SAMPLE_TEXT, **builtin_texts(gguf)}
    captured = {}
    for name, text in texts.items():
        ids = text_ids(tok, text, args.tokens)
        captured[name] = (len(ids), capture_kv(net, torch.tensor(ids)))
        runs[f"smollm2/{name}"], fp8 = measure(merge_full_pages([captured[name][1]]), len(ids))
        print(line(f"smollm2/{name}", runs[f"smollm2/{name}"]), flush=True)
        if name == "sample":
            fp8.plot(str(out / "smollm2_sample_fp8.png"), title=f"{gguf.name}, analyzer's default text "
                     f"({len(ids)} tokens): FP8 E4M3 + lossless, stored / FP8 bytes")
    long = [n for n in texts if n != "sample"]
    runs["smollm2/long3"], fp8 = measure(merge_full_pages([captured[n][1] for n in long]),
                                         sum(captured[n][0] for n in long))
    print(line("smollm2/long3", runs["smollm2/long3"]), flush=True)
    fp8.plot(str(out / "smollm2_long3_fp8.png"), title=f"{gguf.name}, legal + technical + python "
             f"(3 x {args.tokens} tokens): FP8 E4M3 + lossless, stored / FP8 bytes")
    net, tok = load_for_analysis("demo")
    ids = text_ids(tok, SAMPLE_TEXT, args.tokens)
    runs["demo/sample"], _ = measure(merge_full_pages([capture_kv(net, torch.tensor(ids))]), len(ids))
    print(line("demo/sample", runs["demo/sample"]), flush=True)
    doc = {
        "what": "stored bytes / FP8 bytes of full 16-token KV pages quantized to FP8 E4M3 (vLLM's fp8 KV: "
                "x/scale, saturating RNE; scale 'tensor' = 1.0, 'head' = amax/448 per layer, KV head, K/V) "
                "in the lossless FP8 block format (zipfusion.format.fp8_blocks), per design; records included. "
                "bf16: the BF16 page format's stored / BF16 bytes of the same KV.",
        "date": dt.date.today().isoformat(), "device": "cpu", "cpu": platform.processor() or platform.machine(),
        "python": platform.python_version(), "torch": torch.__version__,
        "seconds": round(time.perf_counter() - t0, 1),
        "command": " ".join(["PYTHONPATH=src python benchmarks/fp8_lossless.py", *(argv or sys.argv[1:])]),
        "runs": runs,
    }
    (out / "fp8_lossless.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(f"-> {out / 'fp8_lossless.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
