"""The analyzer's numbers agree with the codec's."""

import pytest
import torch
from pathlib import Path

from zipfusion.analysis.kv_stats import analyze_kv
from zipfusion.analysis.synthetic import model_like_pages, pages_with_fraction, realistic_pages
from zipfusion.format import RAW_MARK, analyze_pages, page_sizes


def as_layer(pages):  # [P, 2, 16, H, D] -> K, V as [tokens, H, D]
    P, _, T, H, D = pages.shape
    kv = pages.transpose(0, 1).reshape(2, P * T, H, D)
    return kv[0], kv[1]


def test_report_matches_codec(tmp_path):
    layers = [realistic_pages(20, 2, 128, seed=s) for s in range(3)] + [pages_with_fraction(20, 2, 128, 0.5)]
    report = analyze_kv([as_layer(p) for p in layers])
    for stats, pages in zip(report.layers, layers):
        base = analyze_pages(pages)
        assert stats.key_fraction == pytest.approx(float((base[:, :, 0] != RAW_MARK).float().mean()))
        assert stats.value_fraction == pytest.approx(float((base[:, :, 1] != RAW_MARK).float().mean()))
        assert stats.compressed_bytes == int(page_sizes(pages).sum())
    assert report.layers[3].key_fraction + report.layers[3].value_fraction == pytest.approx(1.0)
    assert 0.75 < report.size_ratio < 1.0
    assert "compressible blocks" in report.render()
    report.plot(str(tmp_path / "kv.png"))
    assert (tmp_path / "kv.png").stat().st_size > 1000
    report.model = "some-model"                            # issue 48: the plot names the model and the totals
    v1 = report.v1["size_ratio"]
    assert report.headline().startswith(f"some-model: stored at {report.size_ratio:.1%} of BF16 with format v2, "
                                        f"{v1:.1%} with v1")


def test_v1_and_v2_side_by_side():
    """Model-like KV (blocks failing v1 because of 1-4 values): v2 compresses every block,
    v1 leaves those raw; the outlier histogram and the below-window share are what was put in."""
    counts = {"K": (0.2, 0.05, 0.02, 0.01), "V": (0.1, 0.05, 0.0, 0.0)}
    pages = model_like_pages(200, 2, 64, seed=3, counts=counts, below={"K": 1.0, "V": 0.5})
    report = analyze_kv([as_layer(pages)])
    assert report.compressible_fraction == 1.0
    v1 = report.v1
    assert v1["key_fraction"] == pytest.approx(1 - 0.28, abs=0.03)
    assert v1["value_fraction"] == pytest.approx(1 - 0.15, abs=0.03)
    assert v1["size_ratio"] > report.size_ratio > 0.75
    out = report.outliers()
    assert out["key"]["below_window"] == 1.0 and 0.3 < out["value"]["below_window"] < 0.7
    hist = out["key"]["blocks_by_outliers"]
    assert hist[0] == pytest.approx(v1["key_fraction"]) and hist[-1] == 0.0
    assert hist[1] == pytest.approx(0.2, abs=0.03)
    assert "v1" in report.render()


def test_partial_page_is_left_out_and_bad_input_named():
    k, v = as_layer(realistic_pages(2, 1, 64))
    report = analyze_kv([(k[:40], v[:40])])
    assert report.pages == 2
    with pytest.raises(ValueError, match="one full page"):
        analyze_kv([(k[:10], v[:10])])
    with pytest.raises(TypeError, match="bfloat16"):
        analyze_kv([(k.float(), v.float())])


def test_analyze_the_demo_model(tmp_path):
    from zipfusion.analysis.model_kv import analyze_model, capture_kv
    from zipfusion.models import build_model
    report = analyze_model("demo", progress=False)
    cfg = build_model("demo").config
    assert report.model == "demo"
    assert len(report.layers) == cfg.num_hidden_layers
    assert report.num_kv_heads == cfg.num_key_value_heads and report.head_dim == cfg.head_dim
    assert report.pages >= 4
    assert 0.75 <= report.size_ratio <= 1.01
    # the captured K matches the model's own projection for layer 0 at position 0 (no rope there)
    net = build_model("demo")
    ids = torch.tensor([5, 6, 7])
    k0, _ = capture_kv(net, ids)[0]
    x = net.model.layers[0].input_layernorm(net.model.embed_tokens(ids))
    qkv = net.model.layers[0].self_attn.qkv_proj(x)
    q_size = cfg.num_attention_heads * cfg.head_dim
    k_ref = qkv[:, q_size:q_size + cfg.num_key_value_heads * cfg.head_dim].reshape(3, -1, cfg.head_dim)
    assert torch.equal(k0[0].view(torch.int16), k_ref[0].to(torch.bfloat16).view(torch.int16))


def test_cli_analyze(tmp_path, capsys, caplog):
    from zipfusion.cli import main
    caplog.set_level("INFO", logger="zipfusion.models")
    text = tmp_path / "t.txt"
    text.write_text("And the earth was without form, and void; and darkness was upon the face of the deep. " * 6)
    assert main(["analyze", "--model", "demo", "--device", "cpu", "--text", str(text),
                 "--plot", str(tmp_path / "kv.png")]) == 0
    out = capsys.readouterr()
    assert "compressible blocks" in out.out and (tmp_path / "kv.png").is_file()
    # issue 48: each stage says so on stderr (the model's loading, a bar per layer, the measuring)
    assert any(r.getMessage().startswith("loading model demo (safetensors, bfloat16, on cpu)") for r in caplog.records)
    assert "Running the model over 1 text(s)" in out.err and "layer" in out.err and "Measuring" in out.err
    assert main(["analyze", "--model", "demo", "--text", str(tmp_path / "missing.txt")]) == 2


def test_report_as_json_and_plot_needs_matplotlib(tmp_path, monkeypatch):
    import json
    import sys

    from zipfusion.analysis.kv_stats import PlotUnavailable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from real_model import report_dict
    layers = [as_layer(realistic_pages(4, 2, 64, seed=s)) for s in range(2)]
    report = analyze_kv(layers)
    d = json.loads(json.dumps(report_dict(report)))
    assert d["compressible_fraction"] == pytest.approx((d["key_fraction"] + d["value_fraction"]) / 2)
    assert [x["layer"] for x in d["layers"]] == [0, 1] and sum(d["key_spans"]) == 2 * 4 * 2 * 2      # layers x pages x heads x blocks
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(PlotUnavailable, match="pip install matplotlib"):
        report.plot(str(tmp_path / "kv.png"))
    assert isinstance(PlotUnavailable("x"), ValueError)      # the CLI prints it as one line
