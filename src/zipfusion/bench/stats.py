"""Percentiles and goodput (vLLM's ``--goodput ttft:MS tpot:MS e2el:MS``), on plain lists."""

from __future__ import annotations

import math

PERCENTILES = (50, 90, 99)
# --goodput key -> the per-request field it bounds (seconds in the records, milliseconds on the command line)
GOODPUT_KEYS = {"ttft": "ttft_s", "tpot": "tpot_s", "e2el": "e2el_s"}


def percentile(xs, q: float) -> float:
    """The ``q``-th percentile (0..100) of ``xs`` with linear interpolation between closest ranks
    (numpy's default); NaN for no data."""
    s = sorted(xs)
    if not s:
        return float("nan")
    if not 0 <= q <= 100:
        raise ValueError(f"a percentile is in [0, 100], got {q}")
    at = (len(s) - 1) * q / 100
    lo = math.floor(at)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (at - lo)


def summary(xs) -> dict:
    """mean, p50 / p90 / p99, max and the count of ``xs`` (None for each number without data)."""
    xs = list(xs)
    if not xs:
        return {"mean": None, **{f"p{q}": None for q in PERCENTILES}, "max": None, "n": 0}
    return {"mean": sum(xs) / len(xs), **{f"p{q}": percentile(xs, q) for q in PERCENTILES}, "max": max(xs),
            "n": len(xs)}


def parse_goodput(items) -> dict[str, float]:
    """``["ttft:2000", "tpot:50"]`` (also one string, space- or comma-separated) -> {"ttft": 2000.0,
    "tpot": 50.0}, milliseconds; ValueError in one line for anything else."""
    if isinstance(items, str):
        items = [items]
    out = {}
    for item in (part for it in items or () for part in it.replace(",", " ").split()):
        key, sep, value = item.partition(":")
        try:
            ms = float(value)
        except ValueError:
            ms = float("nan")
        if not sep or key not in GOODPUT_KEYS or not ms > 0 or math.isinf(ms):
            raise ValueError(f"--goodput takes KEY:MS pairs with KEY one of {', '.join(GOODPUT_KEYS)} and MS > 0 "
                             f"(e.g. --goodput ttft:2000 tpot:50), got {item!r}")
        if key in out:
            raise ValueError(f"--goodput names {key} twice")
        out[key] = ms
    return out


def meets_slo(rec: dict, slo: dict[str, float]) -> bool:
    """Whether a finished request meets every bound of ``slo`` (ms). A request with one output
    token has no TPOT: that bound holds for it (as in vLLM)."""
    if not rec.get("ok"):
        return False
    for key, ms in slo.items():
        v = rec.get(GOODPUT_KEYS[key])
        if v is not None and v * 1e3 > ms:
            return False
    return True


def goodput(recs: list[dict], slo: dict[str, float], duration_s: float) -> dict:
    """Requests/s that met the SLO, and the share of all requests (sent) that did."""
    good = sum(meets_slo(r, slo) for r in recs)
    return {"good_requests": good, "goodput_req_s": good / duration_s if duration_s > 0 else float("nan"),
            "slo_attainment": good / len(recs) if recs else float("nan")}
