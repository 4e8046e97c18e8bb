"""benchmarks/e2e.py's records, table and figure from the workers' raw results."""

from __future__ import annotations

import json
import math
import os

from e2e_methods import composite_step

NAN = float("nan")
BASE = "uncompressed-flashinfer"


def _row_at(info: dict, batch: int) -> dict | None:
    rows = info.get("rows", []) if info else []
    exact = [r for r in rows if r["batch"] == batch]
    return exact[0] if exact else None


def _synthetic_record(method, info, bw, data_independent=False) -> dict:
    n = info["max_batch"]
    r = _row_at(info, n)
    step = r["step_s"] if r else NAN
    return dict(point=f"{info['fraction']:g}", compressible_fraction=info["compressible_fraction"], max_batch=n,
                decode_tok_s=n / step if r else NAN, total_tok_s=NAN, step_s=step,
                roofline_fraction=(r["weight_bytes"] + r["kv_bytes"]) / bw / step if r else NAN,
                stored_ratio=info.get("stored_ratio"), source="engine, synthetic KV, decode-only steps",
                data_independent=data_independent, kv_gb_for_pages=info.get("kv_gb_for_pages"),
                rows=[dict(batch=x["batch"], tok_s=x["batch"] / x["step_s"]) for x in info.get("rows", [])])


def _burst_record(b: dict, bw: float) -> dict:
    """A public-API burst, the write-up's workload: decode at the peak batch, with its roofline
    fraction (every request holds its whole prompt then). ``total_tok_s`` here is generated tokens /
    wall, as in the committed runs (workloads.py's ``total_tok_s`` counts prompt tokens too)."""
    step = b.get("decode_step_s_at_peak", NAN)
    roof = (b["weight_bytes"] + b["kv_bytes_at_peak"]) / bw / step if step == step and step else NAN
    return dict(point="model", compressible_fraction=b.get("compressible_fraction", NAN),
                max_batch=b["peak_batch"], decode_tok_s=b["decode_tok_s_writeup"],
                total_tok_s=b.get("output_tok_s", b["total_tok_s"]), step_s=step, roofline_fraction=roof,
                stored_ratio=b.get("stored_ratio"), source="engine, model's own KV (public API burst)",
                data_independent=False, requests=b["requests"], preemptions=b["preemptions"],
                ttft_p50_s=b.get("ttft_p50_s"), mean_batch=b.get("mean_batch"), compactions=b.get("compactions"),
                seal_s_per_decode_step=b.get("seal_s_per_decode_step"), wall_s=b.get("wall_s"))


def _composite_records(nv: dict, bw: float, model_fraction: float, weight_bytes: float) -> list[dict]:
    out = []
    timing = nv.get("twin_timing")
    for point, meas in nv["points"].items():
        for method in ("nvcomp-ans", "nvcomp-bitcomp"):
            m = meas.get(method)
            if not m:
                out.append(dict(method=method, point=point, error="no lossless variant measured",
                                tried=meas.get(method + "_tried")))
                continue
            B = m["max_batch"]
            r = _row_at(timing, B)
            step = composite_step(r["step_s"], B, nv["open_bytes_per_request"], m["decode_Bps"]) if r else NAN
            kv_read = B * nv["open_bytes_per_request"] * (1 + m["ratio"])     # compressed in, open out + attend
            out.append(dict(method=method, point=point,
                            compressible_fraction=model_fraction if point == "model" else float(point),
                            max_batch=B, decode_tok_s=B / step if step == step else NAN, total_tok_s=NAN,
                            step_s=step, uncompressed_step_s=r["step_s"] if r else NAN,
                            roofline_fraction=(weight_bytes + kv_read) / bw / step if step == step else NAN,
                            nvcomp_variant=m["variant"], nvcomp_ratio=m["ratio"],
                            nvcomp_decode_GBps=m["decode_Bps"] / 1e9, nvcomp_lossless=m.get("lossless"),
                            source="composite: twin step at this batch + nvCOMP decode of all layers' KV",
                            data_independent=False))
    return out


def assemble(raw: dict, args) -> list[dict]:
    """One record per (method, compressibility point)."""
    recs = []
    model_fraction = raw.get("fused", {}).get("burst", {}).get("compressible_fraction", NAN)
    fractions = [f"{float(f):g}" for f in args.fractions.split(",")]
    for method, out in raw.items():
        if "error" in out:
            recs.append(dict(method=method, error=out["error"]))
            continue
        bw = out["copy_bandwidth_Bps"]
        mine = []
        if "burst" in out:
            mine.append(_burst_record(out["burst"], bw))
            mine[-1]["compressible_fraction"] = model_fraction
        indep = method.startswith("uncompressed")
        for info in out["synthetic"] if "synthetic" in args.points else []:
            rec = _synthetic_record(method, info, bw, indep)
            if indep:               # the same speed and capacity at every fraction: one row per point
                for f in fractions:
                    mine.append({**rec, "point": f, "compressible_fraction": float(f), "rows": rec["rows"]})
            else:
                mine.append(rec)
        for r in mine:
            recs.append({"method": method, **r})
        if "nvcomp" in out:
            wb = out.get("burst", {}).get("weight_bytes", NAN)
            recs += _composite_records(out["nvcomp"], bw, model_fraction, wb)
    base = {r["point"]: r["decode_tok_s"] for r in recs if r.get("method") == BASE and "decode_tok_s" in r}
    for r in recs:
        r.setdefault("model", args.model)
        r.setdefault("kv_budget_gb", args.kv_gb)
        b = base.get(r.get("point"))
        r["speedup_vs_uncompressed_flashinfer"] = (r["decode_tok_s"] / b if b and "decode_tok_s" in r
                                                   and r["decode_tok_s"] == r["decode_tok_s"] else NAN)
    return recs


def _fmt(v, f="{:.0f}"):
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return f.format(v)


def table(records: list[dict]) -> str:
    lines = ["| method | point | compressible | max batch | decode tok/s | total tok/s | vs FlashInfer | "
             "roofline | source |", "|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        if "error" in r:
            lines.append(f"| {r['method']} | {r.get('point', '')} | error: {r['error'][:80]} ||||||")
            continue
        lines.append(f"| {r['method']} | {r['point']} | {_fmt(r['compressible_fraction'], '{:.1%}')} | "
                     f"{r['max_batch']} | {_fmt(r['decode_tok_s'])} | {_fmt(r['total_tok_s'])} | "
                     f"{_fmt(r['speedup_vs_uncompressed_flashinfer'], '{:.3f}x')} | "
                     f"{_fmt(r['roofline_fraction'], '{:.1%}')} | {r['source']} |")
    return "\n".join(lines)


def plot(records: list[dict], path: str) -> None:
    from common import pyplot
    plt = pyplot()
    if plt is None:
        return
    ok = [r for r in records if "error" not in r]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    seen = set()
    for r in ok:
        if r.get("rows") and r["method"] not in seen and len(r["rows"]) > 1:
            seen.add(r["method"])
            a1.plot([x["batch"] for x in r["rows"]], [x["tok_s"] for x in r["rows"]], "o-",
                    label=f"{r['method']} ({r['compressible_fraction']:.0%} compressible)")
    a1.set_xlabel("batch (requests of the prompt length)")
    a1.set_ylabel("decode tok/s")
    a1.set_title("decode throughput vs batch")
    a1.legend(fontsize=7)
    for method in sorted({r["method"] for r in ok} - {BASE}):
        pts = sorted((r["compressible_fraction"], r["speedup_vs_uncompressed_flashinfer"]) for r in ok
                     if r["method"] == method and r["point"] != "model"
                     and r["speedup_vs_uncompressed_flashinfer"] == r["speedup_vs_uncompressed_flashinfer"])
        if pts:
            a2.plot([100 * p[0] for p in pts], [p[1] for p in pts], "o-", label=method)
        mdl = [r for r in ok if r["method"] == method and r["point"] == "model"]
        if mdl and mdl[0]["compressible_fraction"] == mdl[0]["compressible_fraction"]:
            a2.plot([100 * mdl[0]["compressible_fraction"]], [mdl[0]["speedup_vs_uncompressed_flashinfer"]], "k*")
    a2.axhline(1.0, color="gray", lw=1, ls="--")
    a2.set_xlabel("compressible blocks (%)  (* = the model's own KV)")
    a2.set_ylabel("decode tok/s / uncompressed FlashInfer")
    a2.set_title("gain vs compressible fraction (max batch each)")
    a2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write_outputs(result: dict, out: str) -> str:
    with open(os.path.join(out, "e2e.json"), "w") as f:
        json.dump(result, f, indent=1, default=float)
    m = result["meta"]
    work = f"{m['prompt']} + {m['max_tokens']} tokens"
    md = (f"## End to end ({m['model']}, KV budget {m['kv_budget_gb']} GiB, {m['requests']} requests of {work}; "
          f"{m['device']}, {m['date']})\n\nCommand: `{m['command']}`\n\n" + table(result["records"]) + "\n")
    with open(os.path.join(out, "e2e.md"), "w") as f:
        f.write(md)
    try:
        plot(result["records"], os.path.join(out, "e2e.png"))
    except Exception as exc:                 # a figure must not lose the numbers
        md += f"\n(no figure: {exc})\n"
    return md
