"""The weight format's 4-bit exponent code against 3-bit fixed-length codes (ZipServ-like), in
size and escape rate, on Gaussian weights and trained checkpoints (CPU, a few seconds).

* ``ours``: the format as stored (format/weights.py): 8-bit low byte + 4-bit code (sign, d in 1..7
  covering 14 exponents b+2..b+15 with the exponent's lowest bit in the low byte, d=0 for ±0),
  one base byte per 128 values, escapes as a list (10 bytes each: value, row, column).
* ``3bit_top7``: sign + 7 fraction bits (8 bits) + a 3-bit code naming one of the block's 7 most
  frequent exponents, code 0 an escape; a 7-byte table per block; each escape's exponent byte in an
  ordered side array (8 bits, position implicit: the cheapest escapes a 3-bit code can have).
* ``3bit_window``: the same with 7 consecutive exponents (one base byte per block), the window
  that leaves the fewest values out.
±0 counts as an escape for the 3-bit codes (no code left for it) unless the block's table holds
exponent 0. Blocks are 128 values along K for all three.

    PYTHONPATH=src python3 benchmarks/weight_codes.py [--minilm PATH.safetensors] [--out DIR]
"""

import argparse
import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file

from zipfusion.format.weights import WEIGHT_BLOCK, compress_weight

DEMO = Path(__file__).resolve().parents[1] / "src/zipfusion/models/demo/model.safetensors"


def three_bit(w: torch.Tensor) -> dict:
    """Bits a value and escape rates of the two 3-bit codes for bf16 [N, K] (K padded to 128)."""
    N, K = w.shape
    kp = -(-K // WEIGHT_BLOCK) * WEIGHT_BLOCK
    e = ((w.contiguous().view(torch.int16).to(torch.int32) >> 7) & 0xFF)
    e = torch.nn.functional.pad(e, (0, kp - K), value=-1).view(-1, WEIGHT_BLOCK)    # -1: padding
    real = e >= 0
    hist = torch.zeros(e.shape[0], 257, dtype=torch.int32)
    hist.scatter_add_(1, (e + 1).clamp_min(0), real.to(torch.int32))
    hist = hist[:, 1:]                                                        # [blocks, 256]
    n = real.sum().item()
    top7 = hist.topk(7, dim=1).values.sum().item()
    win = torch.nn.functional.conv1d(hist[:, None].float(), torch.ones(1, 1, 7)).squeeze(1)
    window = win.max(1).values.sum().item()
    blocks = e.shape[0]
    out = {}
    for name, inside, table in (("3bit_top7", top7, 7), ("3bit_window", window, 1)):
        esc = n - inside
        bits = 11 * blocks * WEIGHT_BLOCK + 8 * esc + 8 * table * blocks
        out[name] = {"bits_per_value": bits / n, "escape_rate": esc / n, "ratio": bits / (16 * n)}
    return out


def ours(w: torch.Tensor) -> dict:
    cw = compress_weight(w)
    n = w.numel()
    return {"ours": {"bits_per_value": 8 * cw.nbytes / n, "escape_rate": cw.num_escapes / n,
                     "ratio": cw.nbytes / cw.original_nbytes}}


def tensors(minilm: str | None):
    g = torch.Generator().manual_seed(0)
    yield "gaussian std 0.02 [4096x4096]", "gaussian", (torch.randn(4096, 4096, generator=g) * 0.02).bfloat16()
    for label, path in (("demo", str(DEMO)), ("minilm", minilm)):
        if not path or not os.path.exists(path):
            continue
        for name, t in load_file(path).items():
            if t.dim() == 2 and t.numel() >= 4096:
                yield f"{label}: {name} {list(t.shape)}", label, t.bfloat16()    # MiniLM is fp32: rounded


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minilm", default=None, help="all-MiniLM-L6-v2's model.safetensors (fp32, rounded to bf16)")
    ap.add_argument("--out", default=None, help="write DIR/weight_codes.json")
    args = ap.parse_args()
    rows, totals = [], {}
    for name, group, w in tensors(args.minilm):
        zeros = (w == 0).sum().item()
        r = {"tensor": name, "group": group, "values": w.numel(), "zeros": zeros, **ours(w), **three_bit(w)}
        rows.append(r)
        t = totals.setdefault(group, {"values": 0, "zeros": 0})
        t["values"] += w.numel()
        t["zeros"] += zeros
        for code in ("ours", "3bit_top7", "3bit_window"):
            c = t.setdefault(code, {"bits": 0.0, "escapes": 0.0})
            c["bits"] += r[code]["bits_per_value"] * w.numel()
            c["escapes"] += r[code]["escape_rate"] * w.numel()
    print(f"{'set':10s} {'values':>10s}  " + "  ".join(f"{c:>26s}" for c in ("ours", "3bit_top7", "3bit_window"))
          + "  exact zeros")
    summary = {}
    for group, t in totals.items():
        summary[group] = {code: {"ratio": t[code]["bits"] / t["values"] / 16,
                                 "escape_rate": t[code]["escapes"] / t["values"]}
                          for code in ("ours", "3bit_top7", "3bit_window")}
        summary[group]["zero_share"] = t["zeros"] / t["values"]
        print(f"{group:10s} {t['values']:10d}  " + "  ".join(
            f"ratio {s['ratio']:.4f} esc {100 * s['escape_rate']:7.3f} %" for c, s in summary[group].items()
            if c != "zero_share") + f"  zeros {100 * summary[group]['zero_share']:.5f} %")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "weight_codes.json").write_text(json.dumps({"summary": summary, "tensors": rows}, indent=1))


if __name__ == "__main__":
    main()
