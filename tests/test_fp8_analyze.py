"""``zipfusion analyze --kv-dtype fp8``: the FP8 + lossless sizes, checked against the codec."""

import pytest
import torch

from zipfusion.analysis.fp8_stats import SCALES, analyze_fp8
from zipfusion.analysis.synthetic import realistic_pages
from zipfusion.format.fp8 import head_scales, quantize_e4m3
from zipfusion.format.fp8_blocks import DESIGNS, encode_fp8_page


def as_layer(pages):  # [P, 2, 16, H, D] -> K, V as [tokens, H, D]
    P, _, T, H, D = pages.shape
    kv = pages.transpose(0, 1).reshape(2, P * T, H, D)
    return kv[0], kv[1]


def test_sizes_are_the_encoded_pages_bytes():
    layers = [as_layer(realistic_pages(3, 2, 64, seed=s)) for s in range(2)]
    report = analyze_fp8([(k[:40], v[:40]) for k, v in layers])          # a partial page is left out
    for stats, (k, v) in zip(report.layers, layers):
        k, v = k[:32], v[:32]
        for scale in SCALES:
            qk = quantize_e4m3(k, head_scales(k) if scale == "head" else 1.0)
            qv = quantize_e4m3(v, head_scales(v) if scale == "head" else 1.0)
            pages = torch.stack([qk, qv]).view(2, 2, 16, 2, 64).transpose(0, 1)
            for design in DESIGNS:
                encoded = sum(encode_fp8_page(p.contiguous(), design).numel() for p in pages)
                assert sum(stats.stored[scale, design]) == encoded, (scale, design)
                assert stats.ratio(scale, design) == encoded / (2 * 2 * 16 * 2 * 64)
    d = report.as_dict()
    for scale in SCALES:
        ratios = {name: x["ratio"] for name, x in d["scales"][scale]["designs"].items()}
        assert all(0.75 < r < 1.01 for r in ratios.values())
        assert ratios["adaptive"] <= min(ratios.values())
        assert sum(d["scales"][scale]["adaptive_blocks_by_mode"].values()) == pytest.approx(1.0)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="one full page"):
        analyze_fp8([(torch.zeros(8, 1, 64), torch.zeros(8, 1, 64))])
    with pytest.raises(ValueError, match="tokens, num_kv_heads, head_dim"):
        analyze_fp8([(torch.zeros(16, 64), torch.zeros(16, 64))])
    from zipfusion.analysis.model_kv import analyze_model
    with pytest.raises(ValueError, match="kv_dtype"):
        analyze_model("demo", kv_dtype="fp16")


def test_cli_analyze_fp8_on_the_demo_model(tmp_path, capsys):
    from zipfusion.cli import main
    text = tmp_path / "t.txt"
    text.write_text("And the earth was without form, and void; and darkness was upon the face of the deep. " * 6)
    args = ["analyze", "--model", "demo", "--device", "cpu", "--text", str(text)]
    assert main(args + ["--kv-dtype", "fp8", "--plot", str(tmp_path / "kv.png")]) == 0
    out = capsys.readouterr().out
    assert "compressible blocks" in out                                   # the BF16 report stays
    assert "FP8 E4M3 + lossless blocks" in out and "all   scale tensor: blk3" in out and "all   scale head:" in out
    assert (tmp_path / "kv.png").is_file() and (tmp_path / "kv_fp8.png").stat().st_size > 1000
    assert main(args) == 0
    assert "FP8" not in capsys.readouterr().out                           # default: bf16 only, as before
    with pytest.raises(SystemExit):
        main(args + ["--kv-dtype", "int8"])
