"""What every ``zipfusion bench`` run writes: the run's facts (device, versions, git commit, date,
command line), JSON, a PNG (matplotlib, optional: a missing figure must not lose the numbers) and
plain-text tables, the comparison of modes last."""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import re
import shutil
import subprocess
import sys

from .process import zipfusion_variables

PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def versions() -> dict:
    """torch, triton, flashinfer and Python versions (nothing imported), and the git commit
    (``git_dirty``: tracked files changed; None outside a checkout)."""
    from importlib.metadata import PackageNotFoundError, version
    v = {"python": sys.version.split()[0]}
    for pkg, dists in (("torch", ("torch",)), ("triton", ("triton",)),
                       ("flashinfer", ("flashinfer-python", "flashinfer"))):
        v[pkg] = None
        for dist in dists:
            try:
                v[pkg] = version(dist)
                break
            except PackageNotFoundError:
                pass
    if v["torch"] is None and "torch" in sys.modules:
        v["torch"] = sys.modules["torch"].__version__
    git = lambda *a: subprocess.run(["git", *a], cwd=PACKAGE_DIR, capture_output=True, text=True,  # noqa: E731
                                    timeout=10).stdout.strip()
    try:
        v["git_commit"] = git("rev-parse", "--short", "HEAD") or None
        v["git_dirty"] = bool(git("status", "--porcelain", "--untracked-files=no")) if v["git_commit"] else None
    except (OSError, subprocess.SubprocessError):
        v["git_commit"] = v["git_dirty"] = None
    return v


def device_name(device: str | None) -> str:
    """The GPU's name (nvidia-smi, else torch) for a CUDA device, the CPU's model otherwise."""
    if device and str(device).startswith("cuda"):
        index = str(device).partition(":")[2] or "0"
        if shutil.which("nvidia-smi"):
            try:
                names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                                       capture_output=True, text=True, timeout=20).stdout.splitlines()
                if names:
                    return names[min(int(index), len(names) - 1)].strip()
            except (OSError, subprocess.SubprocessError, ValueError):
                pass
        try:
            import torch
            return torch.cuda.get_device_name(int(index))
        except Exception:  # noqa: BLE001 - a name is a nicety
            return "cuda"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def run_meta(kind: str, argv: list[str] | None, device: str | None) -> dict:
    """The facts every result starts with."""
    if argv is None:  # the command line from "bench" on
        argv = sys.argv[sys.argv.index("bench"):] if "bench" in sys.argv else [
            "bench", kind, f"(called from {os.path.basename(sys.argv[0])})"]
    env = zipfusion_variables()
    return {"benchmark": f"zipfusion bench {kind}", "command": " ".join(env + ["zipfusion", *argv]),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
            "device": device, "device_name": device_name(device), "host": platform.node(),
            "cpus": os.cpu_count(), **versions()}


def write_json(obj, path) -> None:
    """JSON with indent 1, each list of plain numbers on one line."""
    text = json.dumps(obj, indent=1, default=float)
    flat = re.sub(r"\[\n\s*([-0-9.eE+, \n\s]*?(?:NaN|Infinity|[-0-9.eE+]+))\n\s*\]",
                  lambda m: "[" + re.sub(r",\n\s*", ", ", m.group(1)) + "]", text)
    with open(path, "w") as f:
        f.write(flat + "\n")


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None (with a note) where it is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no figure (pip install matplotlib)", file=sys.stderr)
        return None
    return plt


def out_paths(out: str) -> tuple[str, str]:
    """``--out PREFIX`` -> (PREFIX.json, PREFIX.png), its folder made."""
    stem = out[:-5] if out.endswith(".json") else out
    folder = os.path.dirname(os.path.abspath(stem))
    os.makedirs(folder, exist_ok=True)
    return stem + ".json", stem + ".png"


def speed_bars(path: str, labels: list[str], series: dict[str, list], title: str, ylabel: str,
               tick_fontsize: int = 7, goal: float | None = None, annotate: bool = True) -> bool:
    """Grouped bars of speed ratios, a line at 1 (and ``goal``); False where nothing is drawn."""
    plt = pyplot()
    if plt is None or not labels:
        return False
    fig, ax = plt.subplots(figsize=(min(24, max(6, 0.9 * len(labels) + 2)), 4))
    width = 0.76 / max(1, len(series))
    for j, (name, values) in enumerate(series.items()):
        xs = [i + (j - (len(series) - 1) / 2) * width for i in range(len(labels))]
        ys = [v or 0 for v in values]
        ax.bar(xs, ys, width=width, label=name)
        for x, y in zip(xs, ys):
            if y and annotate:
                ax.text(x, y, f"{y:.2f}", ha="center", va="bottom", fontsize=7)
    ax.axhline(1.0, color="k", lw=0.8)
    if goal:
        ax.axhline(goal, color="g", lw=0.6, ls="--")
    ax.set_xticks(range(len(labels)), labels, fontsize=tick_fontsize)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def save(result: dict, out: str, plot=None) -> str:
    """JSON, then the figure (``plot(result, path) -> bool``); returns a line saying what was written."""
    json_path, png_path = out_paths(out)
    write_json(result, json_path)
    drawn = False
    if plot is not None:
        try:
            drawn = bool(plot(result, png_path))
        except Exception as exc:                         # noqa: BLE001 - a figure must not lose the numbers
            print(f"no figure: {type(exc).__name__}: {exc}", file=sys.stderr)
    return f"wrote {json_path}" + (f" and {png_path}" if drawn else "")


def fmt(v, spec: str = "{:,.0f}") -> str:
    if v is None or (isinstance(v, float) and (v != v)):
        return "-"
    if isinstance(v, float) and math.isinf(v):
        return "inf"
    try:
        return spec.format(v)
    except (ValueError, TypeError):
        return str(v)


def text_table(rows: list[dict], cols: list[tuple[str, str, str]]) -> str:
    """An aligned plain-text table; ``cols``: (key, header, format); a row's ``note`` replaces its
    numbers."""
    lines = [[h for _, h, _ in cols]]
    for r in rows:
        if r.get("note"):
            lines.append([fmt(r.get(k), f) for k, _, f in cols[:1]] + [r["note"]])
            continue
        lines.append([fmt(r.get(k), f) for k, _, f in cols])
    full = [line for line in lines if len(line) == len(cols)]
    width = [max(len(line[i]) for line in full) for i in range(len(cols))]
    out = []
    for line in lines:
        if len(line) < len(cols):
            out.append(line[0].ljust(width[0]) + "  " + line[1])
        else:
            out.append("  ".join(x.ljust(width[i]) if i == 0 else x.rjust(width[i]) for i, x in enumerate(line)))
    return "\n".join(out)


def ratios(by_mode: dict[str, dict], keys: tuple[str, ...], first: str = "compressed") -> dict:
    """``first`` / each other mode, key by key (NaN where a number is missing or zero)."""
    a = by_mode.get(first)
    out = {}
    if not a:
        return out
    for mode, b in by_mode.items():
        if mode == first or not b:
            continue
        out[f"{first}/{mode}"] = {k: (a[k] / b[k] if isinstance(a.get(k), (int, float)) and isinstance(
            b.get(k), (int, float)) and b[k] else float("nan")) for k in keys}
    return out


def ratio_table(rs: dict, labels: dict[str, str]) -> str:
    """The comparison: one row per ratio, one column per key (``labels``: key -> header)."""
    if not rs:
        return ""
    rows = [{"name": name, **vals} for name, vals in rs.items()]
    return text_table(rows, [("name", "ratio", "{}")] + [(k, h, "{:.3f}x") for k, h in labels.items()])


def mode_bars(recs: list[dict], keys: list[tuple[str, str, str]], title: str, path: str) -> bool:
    """One bar chart per key (key, title, value format), a bar per mode; False without matplotlib or runs."""
    plt = pyplot()
    if plt is None or not recs:
        return False
    fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 3.4))
    for ax, (k, name, spec) in zip(axes, keys):
        vals = [r[k] for r in recs]
        ax.bar([r["mode"] for r in recs], vals, color=[f"C{i}" for i in range(len(recs))])
        for i, v in enumerate(vals):
            ax.text(i, v, fmt(v, spec), ha="center", va="bottom", fontsize=8)
        ax.set_title(name, fontsize=9)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
