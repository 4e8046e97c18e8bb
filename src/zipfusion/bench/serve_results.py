"""What ``zipfusion bench serve`` makes of its request records: per rate a row (vLLM's latency
percentiles, throughputs, goodput, failures), per mode a summary, across modes the comparison,
the table, the plot and the exit status.
"""

from __future__ import annotations

import math
import warnings

from . import report
from .offline import note
from .server_process import FLAT_MIB
from .stats import goodput, summary

RATIO_KEYS = {"max_rate_within_slo": "max rate in SLO", "max_goodput_req_s": "max goodput",
              "max_steady_output_tok_s": "steady output tok/s (while requests arrive)",
              "max_output_tok_s": "output tok/s (whole rate)", "max_requests_s": "req/s (whole rate)",
              "peak_running": "peak batch"}


def rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:.3g}"


def steady_start(n: int, max_concurrency: int | None = None) -> int:
    """Where a run of ``n`` sends starts its steady state (a closed loop: after the first finish)."""
    return max(n // 4, min(max_concurrency or 0, n - 1))


def steady_output_tok_s(recs: list[dict], min_window_s: float = 1.0,
                        max_concurrency: int | None = None) -> float | None:
    """Output tokens/s while requests keep arriving, the ramp and tail left out: what the server
    sustains past saturation. None when arrivals span less than ``min_window_s``."""
    sends = sorted(r["sent"] for r in recs if "sent" in r)
    first = steady_start(len(sends), max_concurrency)
    if len(sends) < 4 or sends[-1] - sends[first] < min_window_s:
        return None
    a, b = sends[first], sends[-1]
    tokens = sum(k for r in recs for t, k in zip(r.get("chunks", ()), r.get("chunk_tokens", ())) if a <= t <= b)
    return tokens / (b - a)


def rate_row(recs: list[dict], duration: float, rate: float, slo: dict[str, float],
             max_concurrency: int | None = None) -> dict:
    """The numbers of one rate from its request records (latencies in ms, as vLLM reports them)."""
    ok = [r for r in recs if r["ok"]]
    failed = [r for r in recs if r.get("error")]
    lost = [r for r in recs if not r["ok"] and not r.get("error")]
    out_tokens = sum(r.get("output_tokens", r.get("tokens", 0)) for r in ok)
    in_tokens = sum(r.get("prompt_tokens", 0) for r in ok)
    ms = lambda xs: {k: (v * 1e3 if v is not None and k != "n" else v)  # noqa: E731
                     for k, v in summary(xs).items()}
    row = {"request_rate": "inf" if math.isinf(rate) else rate, "max_concurrency": max_concurrency,
           "num_requests": len(recs), "completed": len(ok), "failed": len(failed), "lost": len(lost),
           "errors": sorted({str(r["error"])[:300] for r in failed})[:5], "duration_s": duration,
           "requests_s": len(ok) / duration, "output_tok_s": out_tokens / duration,
           "steady_output_tok_s": steady_output_tok_s(recs, max_concurrency=max_concurrency),
           "total_tok_s": (in_tokens + out_tokens) / duration, "input_tokens": in_tokens, "output_tokens": out_tokens,
           "cached_tokens": sum(r.get("cached_tokens", 0) for r in ok),
           "ttft_ms": ms(r["ttft_s"] for r in ok), "tpot_ms": ms(r["tpot_s"] for r in ok if r["tpot_s"] is not None),
           "itl_ms": ms(x for r in ok for x in r["itl_s"]), "e2el_ms": ms(r["e2el_s"] for r in ok)}
    if slo:
        row.update(goodput(recs, slo, duration))
    return row


def within_slo(row: dict, attainment: float) -> bool:
    """Sustained within the SLO: nothing failed or lost, ``attainment`` of requests met the SLO."""
    return row["failed"] == row["lost"] == 0 and row.get("slo_attainment", 0.0) >= attainment


def mode_summary(rows: list[dict], slo: dict, attainment: float) -> dict:
    """What the comparison takes from one mode's rates (``max_rate_within_slo``: the highest
    Poisson rate sustained within the SLO with every lower rate)."""
    best = 0.0
    for r in sorted((r for r in rows if r["request_rate"] != "inf"), key=lambda r: r["request_rate"]):
        if not within_slo(r, attainment):
            break
        best = r["request_rate"]
    return {"max_rate_within_slo": best if slo else None,
            "max_goodput_req_s": max((r["goodput_req_s"] for r in rows), default=None) if slo else None,
            "max_steady_output_tok_s": max((r["steady_output_tok_s"] for r in rows
                                            if r.get("steady_output_tok_s") is not None), default=None),
            "max_output_tok_s": max(r["output_tok_s"] for r in rows),
            "max_requests_s": max(r["requests_s"] for r in rows),
            "peak_running": max((r["server"]["peak_running"] for r in rows if r["server"].get("metric_samples")),
                                default=None),
            "preemptions": sum(r["server"].get("preemptions", 0) for r in rows),
            "failed": sum(r["failed"] for r in rows), "lost": sum(r["lost"] for r in rows)}


def comparison(result: dict, modes: list[str]) -> dict:
    """Per mode its summary (``partial`` for a run cut short), and the first mode's ratios."""
    c = result["config"]
    per = {}
    for m in modes:
        run = result["modes"].get(m, {})
        if "summary" in run:
            per[m] = run["summary"]
        elif run.get("rates"):
            per[m] = {**mode_summary(run["rates"], c.get("goodput") or {}, c.get("slo_attainment", 0.9)),
                      "partial": True}
    return {"per_mode": per, "ratios": report.ratios(per, tuple(RATIO_KEYS), modes[0])}


COLUMNS = [("mode", "mode", "{}"), ("rate", "rate", "{}"), ("completed", "ok", "{}"), ("failed", "fail", "{}"),
           ("lost", "lost", "{}"), ("requests_s", "req/s", "{:.2f}"), ("output_tok_s", "out tok/s", "{:,.1f}"),
           ("steady_output_tok_s", "steady out tok/s", "{:,.1f}"),
           ("ttft_p50", "TTFT p50", "{:,.0f}"), ("ttft_p99", "TTFT p99", "{:,.0f}"), ("tpot_p50", "TPOT p50", "{:.1f}"),
           ("tpot_p99", "TPOT p99", "{:.1f}"), ("itl_p50", "ITL p50", "{:.1f}"), ("itl_p99", "ITL p99", "{:.1f}"),
           ("goodput", "goodput", "{:.2f}"), ("peak_running", "peak batch", "{:.0f}"),
           ("preemptions", "preempt", "{:.0f}"), ("rss_mib", "server RSS MiB", "{:,.0f}")]


def table_rows(result: dict) -> list[dict]:
    rows = []
    for mode, m in result["modes"].items():
        if "rates" not in m:
            rows.append({"mode": mode, "note": note(m)})
            continue
        for r in m["rates"]:
            rows.append({"mode": mode, "rate": rate_label(float(r["request_rate"])), **r,
                         **{f"{k}_{p}": r[f"{k}_ms"][p] for k in ("ttft", "tpot", "itl") for p in ("p50", "p99")},
                         "goodput": r.get("goodput_req_s"),
                         "peak_running": r["server"].get("peak_running") if r["server"].get("metric_samples")
                         else "not sampled",
                         "preemptions": r["server"].get("preemptions"), "rss_mib": r["memory_after"].get("rss_mib")})
    return rows


def vllm_table(row: dict, title: str) -> str:
    """One rate's numbers as ``vllm bench serve`` prints them (ms; Mean / Median / P99)."""
    line = lambda k, v, spec="{:.2f}": f"{k + ':':<40}{report.fmt(v, spec):>10}"  # noqa: E731
    out = [f"{' ' + title + ' ':=^50}", line("Successful requests", row["completed"], "{}"),
           line("Failed or cut short", row["failed"] + row["lost"], "{}"),
           line("Benchmark duration (s)", row["duration_s"]), line("Total input tokens", row["input_tokens"], "{}"),
           line("Total generated tokens", row["output_tokens"], "{}"),
           line("Request throughput (req/s)", row["requests_s"]),
           line("Output token throughput (tok/s)", row["output_tok_s"]),
           line("Total Token throughput (tok/s)", row["total_tok_s"])]
    if row.get("goodput_req_s") is not None:
        out.append(line("Request goodput (req/s)", row["goodput_req_s"]))
    for key, name, head in (("ttft", "TTFT", "Time to First Token"), ("tpot", "TPOT", "Time per Output Token "
                            "(excl. 1st token)"), ("itl", "ITL", "Inter-token Latency"),
                            ("e2el", "E2EL", "End-to-end Latency")):
        d = row[f"{key}_ms"]
        out += [f"{head:-^50}", line(f"Mean {name} (ms)", d["mean"]), line(f"Median {name} (ms)", d["p50"]),
                line(f"P99 {name} (ms)", d["p99"])]
    return "\n".join(out + ["=" * 50])


def plot(result: dict, path: str) -> bool:
    """Latency, throughput and goodput against request rate, every mode on the same axes (the
    all-at-once rate drawn at the rate it achieved, as a star)."""
    plt = report.pyplot()
    modes = {m: v for m, v in result["modes"].items() if v.get("rates")}
    if plt is None or not modes:
        return False
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    slo = result["config"]["goodput"]
    steady = lambda rows: [math.nan if r.get("steady_output_tok_s") is None else r["steady_output_tok_s"]  # noqa: E731
                           for r in rows]
    panels = [(axes[0][0], "ttft_ms", "TTFT (ms)"), (axes[0][1], "tpot_ms", "TPOT (ms)")]
    for i, (mode, m) in enumerate(modes.items()):
        color = f"C{i}"
        rows = sorted(m["rates"], key=lambda r: (r["request_rate"] == "inf", float(r["request_rate"])))
        finite = [r for r in rows if r["request_rate"] != "inf"]
        burst = [r for r in rows if r["request_rate"] == "inf"]
        xs = [r["request_rate"] for r in finite]
        def draw(ax, x, y, style, label=None, **kw):
            if any(v is not None and v == v for v in y):
                ax.plot(x, [math.nan if v is None else v for v in y], style, color=color, label=label, **kw)

        for ax, key, _ in panels:
            for p, style, kw in (("p50", "-o", {"lw": 1.8}), ("p99", ":s", {"lw": 1.2, "mfc": "none"})):
                draw(ax, xs, [r[key][p] for r in finite], style, f"{mode} {p}", ms=4, **kw)
                draw(ax, [r["requests_s"] for r in burst], [r[key][p] for r in burst], "*", ms=9,
                     mfc=color if p == "p50" else "none")
        draw(axes[1][0], xs, [r["output_tok_s"] for r in finite], "-o", mode, ms=4)
        draw(axes[1][0], xs, steady(finite), "--", f"{mode}, while arrivals last", lw=1)
        draw(axes[1][0], [r["requests_s"] for r in burst], [r["output_tok_s"] for r in burst], "*", ms=9)
        draw(axes[1][0], [r["requests_s"] for r in burst], steady(burst), "*", f"{mode}, while requests are sent",
             ms=11, mfc="none")
        key, name = ("goodput_req_s", "goodput (req/s in SLO)") if slo else ("requests_s", "requests/s completed")
        draw(axes[1][1], xs, [r[key] for r in finite], "-o", mode, ms=4)
        draw(axes[1][1], [r["requests_s"] for r in burst], [r[key] for r in burst], "*", ms=9)
        axes[1][1].set_ylabel(name)
    for ax, key, name in panels:
        ax.set_ylabel(name)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            ax.set_yscale("log")
        if key[:4] in slo:
            ax.axhline(slo[key[:4]], color="gray", ls=":", lw=1, label="SLO")
        lo, hi = ax.get_ylim()
        if 0 < lo and hi / lo < 10:  # at least a decade: noise is not magnified
            mid = math.sqrt(lo * hi)
            ax.set_ylim(mid / math.sqrt(10), mid * math.sqrt(10))
    for ax in (axes[1][0], axes[1][1]):
        ax.set_ylim(bottom=0)
    axes[1][0].set_ylabel("output tokens/s")
    loop = result["config"].get("max_concurrency")
    star = f"closed loop of {loop}" if loop else "all at once"
    for ax in (a for row in axes for a in row):
        ax.set_xlabel(f"request rate (req/s, Poisson; *: {star}, as achieved)")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    c, m = result["config"], result["meta"]
    fig.suptitle(f"zipfusion bench serve: {c['model']} on {m['device_name']}, {c['dataset']} x {c['num_prompts']} "
                 f"per rate, KV {c['kv_memory_gb'] or 'default'} GiB"
                 + (", SLO " + " ".join(f"{k}:{v:g}" for k, v in slo.items()) + " ms" if slo else ""),
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def finish(result: dict, out: str) -> int:
    """The comparison, JSON + PNG, the tables; 1 when a request failed or was lost."""
    slo, attainment = result["config"]["goodput"], result["config"]["slo_attainment"]
    result["comparison"] = comparison(result, result["config"]["modes"])
    failed = sum(m["summary"]["failed"] + m["summary"]["lost"] for m in result["modes"].values() if "summary" in m)
    print(report.save(result, out, plot))
    for mode, m in result["modes"].items():
        for r in m.get("rates", []):
            print(vllm_table(r, f"{mode}, rate {rate_label(float(r['request_rate']))}"))
    print(report.text_table(table_rows(result), COLUMNS))
    for mode, m in result["modes"].items():
        if "memory" in m:
            mem = m["memory"]
            later = mem["growth_after_first_rate_mib"]
            print(f"{mode}: server memory from after the warm-up to the end: "
                  + (", ".join(f"{k} {v:+,.0f}" for k, v in mem["growth_mib"].items()) or "not measured")
                  + (" MiB; after the first rate: " + ", ".join(f"{k} {v:+,.0f}" for k, v in later.items())
                     if later else "") + f" MiB ({'flat' if mem['flat'] else 'NOT FLAT' if mem['flat'] is False else '?'}"
                  + f", tolerance {FLAT_MIB:.0f} MiB)")
    per = result["comparison"]["per_mode"]
    if slo:
        print(f"SLO {' '.join(f'{k}:{v:g}' for k, v in slo.items())} ms, >= {attainment:.0%} of requests: "
              + "; ".join(f"{m} sustains {report.fmt(s['max_rate_within_slo'], '{:.3g}')} req/s" for m, s in per.items()))
    if result["comparison"]["ratios"]:
        print(report.ratio_table(result["comparison"]["ratios"],
                                 RATIO_KEYS if slo else {k: v for k, v in RATIO_KEYS.items() if "slo" not in k
                                                         and "goodput" not in k}))
    if failed:
        print(f"{failed} request(s) failed or were lost")
    return 1 if failed or any("error" in m for m in result["modes"].values()) else 0
