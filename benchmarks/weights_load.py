"""Load time with compressed weights: a model built as BF16, built and compressed at load, and
loaded from the compressed checkpoint ``zipfusion compress-weights`` writes (best of --repeat,
each in this one process after a first untimed round: imports and first calls left out).

    PYTHONPATH=src python benchmarks/weights_load.py --models demo,smollm2 --out benchmarks/results/real_model_kv_cpu/weights
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import torch

from zipfusion.models import build_model, load_tokenizer, resolve_model
from zipfusion.models.compressed_weights import save_compressed, weight_sizes


def best(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def measure(name: str, device: str, repeat: int) -> dict:
    if name == "smollm2":
        from zipfusion.analysis.checkpoints import smollm2_gguf
        name = str(smollm2_gguf())
    src = resolve_model(name)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "z"
        model = build_model(src, device=device, weight_compression=True)
        t = time.perf_counter()
        save_compressed(model, src, out, load_tokenizer(src.tokenizer_dir))
        write_s = time.perf_counter() - t
        sizes = weight_sizes(model)
        disk = sum(f.stat().st_size for f in out.glob("*.safetensors"))
        build_model(resolve_model(str(out)), device=device)            # the untimed first round
        rec = {"model": Path(name).name, "device": device, "weights_bytes": sizes.original_bytes,
               "stored_bytes": sizes.stored_bytes, "ratio": sizes.ratio, "checkpoint_bytes": disk,
               "write_s": write_s,
               "bf16_load_s": best(lambda: build_model(src, device=device), repeat),
               "compress_at_load_s": best(lambda: build_model(src, device=device, weight_compression=True), repeat),
               "load_compressed_s": best(lambda: build_model(resolve_model(str(out)), device=device), repeat)}
    print(json.dumps(rec), flush=True)
    return rec


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="demo,smollm2")
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="weights_load")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    records = [measure(m, a.device, a.repeat) for m in a.models.split(",")]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
            "python": platform.python_version(), "machine": platform.machine(), "threads": a.threads,
            "command": "PYTHONPATH=src python benchmarks/weights_load.py " + " ".join(
                f"--{k} {v}" for k, v in vars(a).items())}
    (out / "weights_load.json").write_text(json.dumps({"meta": meta, "records": records}, indent=1))
    print(f"{'model':<36}{'BF16 load':>11}{'compress at load':>18}{'load compressed':>17}{'ratio':>8}")
    for r in records:
        print(f"{r['model']:<36}{r['bf16_load_s']:>10.2f}s{r['compress_at_load_s']:>17.2f}s"
              f"{r['load_compressed_s']:>16.2f}s{r['ratio']:>8.3f}")


if __name__ == "__main__":
    main()
