"""The accuracy cost of the FP8 KV cache (issue 47 item 2), measured on the CPU.

Four KV modes of one engine, the same model weights (BF16) and the same fixed prompts:

  bf16           BF16 pages, uncompressed: the reference
  bf16_lossless  BF16 pages, losslessly compressed (kv_compression=True): 0 by construction, measured
  fp8            E4M3 pages (kv_cache_dtype="fp8", per-tensor scale 1.0)
  fp8_lossless   the same E4M3 pages, full ones losslessly compressed on top (kv_cache_dtype="fp8_lossless":
                 fp8's tokens by construction)

Per mode and model:

* greedy decoding (temperature 0, up to ``--max-tokens`` tokens, stopping at EOS) of every prompt:
  the share of prompts whose whole output equals the reference's, and for the others the first
  position where the outputs differ (0 = the first generated token);
* teacher forcing on the reference's tokens: each prompt followed by the reference's output, the
  mode's next-token distribution at every generated position, and the mean over all positions of
  KL(p_ref || p_mode) = Σ_v p_ref(v) (log p_ref(v) - log p_mode(v)) (nats), with the reference's
  distributions those of its own greedy run (the same contexts); also the share of positions where
  the mode's argmax is the reference's token.

Models: SmolLM2-135M-Instruct (the Q4_1 GGUF that ``python -m zipfusion.analysis.checkpoints``
fetches once, dequantized to BF16; prompts through its chat template) and the embedded ``demo``
model (KJV-trained, plain text prompts). ``deterministic=True`` in every mode, so that a
request's logits do not depend on its batch: the only difference between modes is the KV cache.

    PYTHONPATH=src python benchmarks/fp8_accuracy.py            # both models, 32 prompts x 64 tokens
    PYTHONPATH=src python benchmarks/fp8_accuracy.py --models demo --prompts 4 --max-tokens 8   # a smoke run

Writes benchmarks/results/fp8_accuracy_cpu/fp8_accuracy.{json,png} (``--out``) and prints a table
(``--replot``: the PNG again from the JSON).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import time
from pathlib import Path

import torch

from zipfusion.engine import LLM, SamplingParams

RESULTS = Path(__file__).resolve().parent / "results" / "fp8_accuracy_cpu"
MODES = {"bf16": dict(kv_compression=False), "bf16_lossless": dict(kv_compression=True),
         "fp8": dict(kv_cache_dtype="fp8"), "fp8_lossless": dict(kv_cache_dtype="fp8_lossless")}
CHAT_PROMPTS = [
    "What is the capital of France?", "Explain photosynthesis in two sentences.",
    "Write a haiku about the sea.", "How do I reverse a list in Python?",
    "What causes the seasons on Earth?", "Give me three tips for better sleep.",
    "Translate 'good morning' into Spanish and German.", "What is 17 times 23?",
    "Summarize the plot of Romeo and Juliet.", "Why is the sky blue?",
    "Write a short story about a robot who learns to paint.", "What is the difference between a virus and a bacterium?",
    "List the planets of the solar system in order.", "How does a binary search work?",
    "What are the main causes of inflation?", "Describe the water cycle.",
    "Write a limerick about a cat.", "What is machine learning?",
    "How do vaccines work?", "Give a recipe for pancakes.",
    "What is the Pythagorean theorem?", "Explain what a black hole is to a child.",
    "Write a SQL query that counts rows in a table named users.", "What were the causes of World War I?",
    "How can I improve my public speaking?", "What is the boiling point of water at sea level?",
    "Write an email asking for a day off.", "What is the meaning of the word 'ephemeral'?",
    "Compare cats and dogs as pets.", "How does the internet work?",
    "What is a prime number? Give examples.", "Suggest a name for a coffee shop.",
]
DEMO_PROMPTS = [
    "In the beginning", "And God said", "The LORD is my shepherd", "Blessed are the",
    "And it came to pass", "Now the serpent was", "And the children of Israel", "For God so loved",
    "Then said Jesus unto", "And Moses spake", "Praise ye the LORD", "In my Father's house",
    "And the angel of the LORD", "Hear, O Israel", "And David said", "The heavens declare",
    "And he opened his mouth", "Thus saith the LORD", "And there was a man", "Behold, I send",
    "And when they were come", "My son, forget not", "And the word of the LORD", "Woe unto you",
    "And Abraham said", "The fear of the LORD", "And the king said", "And Jesus answered",
    "Let not your heart", "And after these things", "Make a joyful noise", "And Samuel said",
]


def prompt_ids(llm, texts: list[str], chat: bool) -> list[list[int]]:
    tok = llm.tokenizer
    if chat:
        texts = [tok.apply_chat_template([{"role": "user", "content": t}]) for t in texts]
    return [tok.encode(t) for t in texts]


def run_mode(model: str, mode: str, texts: list[str], chat: bool, max_tokens: int, force=None, ref_logp=None,
             max_model_len: int = 512):
    """Greedy outputs (``force`` None) with their log-softmax rows, or teacher-forced on ``force``
    (each request's output replaced by the reference's token after every step) with, per request,
    KL(ref || mode) and whether the argmax is the reference token at every position."""
    with LLM(model, device="cpu", deterministic=True, max_model_len=max_model_len, **MODES[mode]) as llm:
        eng = llm.engine
        ids = prompt_ids(llm, texts, chat)
        reqs = []
        for i, p in enumerate(ids):
            sp = (SamplingParams(temperature=0, max_tokens=max_tokens) if force is None else
                  SamplingParams(temperature=0, max_tokens=len(force[i]), ignore_eos=True))
            reqs.append(eng.add_request(p, sp))
        index = {r.request_id: i for i, r in enumerate(reqs)}
        rows = [[] for _ in reqs]
        t0 = time.perf_counter()
        while eng.has_work():
            res = eng.step()
            if res.logits is None:
                continue
            logp = torch.log_softmax(res.logits.double(), -1).cpu()
            for r, row in zip(res.sampled, logp):
                i = index[r.request_id]
                pos = len(r.output_ids) - 1
                if force is None:
                    rows[i].append(row.float())
                else:
                    ref, row = ref_logp[i][pos].double(), row.float().double()    # both rounded as stored
                    kl = float((ref.exp() * (ref - row)).sum())
                    rows[i].append((kl, int(row.argmax()) == force[i][pos]))
                    r.output_ids[-1] = force[i][pos]          # the next step reads the reference's token
        secs = time.perf_counter() - t0
        return [list(r.output_ids) for r in reqs], rows, secs, [len(p) for p in ids]


def first_divergence(out: list[int], ref: list[int]) -> int | None:
    for i, (a, b) in enumerate(zip(out, ref)):
        if a != b:
            return i
    return None if len(out) == len(ref) else min(len(out), len(ref))


def measure(model: str, texts: list[str], chat: bool, max_tokens: int) -> dict:
    ref_out, ref_logp, ref_secs, plens = run_mode(model, "bf16", texts, chat, max_tokens)
    rows = {}
    for mode in MODES:
        if mode == "bf16":
            out, secs = ref_out, ref_secs
        else:
            out, _, secs, _ = run_mode(model, mode, texts, chat, max_tokens)
        _, forced, fsecs, _ = run_mode(model, mode, texts, chat, max_tokens, force=ref_out, ref_logp=ref_logp)
        div = [first_divergence(o, r) for o, r in zip(out, ref_out)]
        kls = [kl for per in forced for kl, _ in per]
        agree = [a for per in forced for _, a in per]
        rows[mode] = {
            "prompts": len(texts), "identical_outputs": sum(d is None for d in div),
            "identical_share": sum(d is None for d in div) / len(texts),
            "first_divergence": div,
            "median_first_divergence": (sorted(d for d in div if d is not None)[len([d for d in div if d is not None]) // 2]
                                        if any(d is not None for d in div) else None),
            "generated_tokens": sum(len(o) for o in out), "reference_tokens": sum(len(r) for r in ref_out),
            "forced_positions": len(kls), "mean_kl_nats": sum(kls) / len(kls), "max_kl_nats": max(kls),
            "forced_argmax_agreement": sum(agree) / len(agree),
            "greedy_seconds": secs, "forced_seconds": fsecs,
            "outputs": out,
        }
        print(f"  {model} {mode}: {rows[mode]['identical_outputs']}/{len(texts)} identical, "
              f"mean KL {rows[mode]['mean_kl_nats']:.3g}, argmax agreement {rows[mode]['forced_argmax_agreement']:.4f}",
              flush=True)
    kv = kv_value_stats(model, texts, chat, ref_out)
    print(f"  {model} K/V under E4M3: " + "; ".join(
        f"{r} max |x| {s['max_abs']:.4g}, saturated {s['saturated_share']:.2e}, rel. RMS error "
        f"{s['relative_rms_error']:.4f}" for r, s in kv.items()), flush=True)
    return {"chat_template": chat, "prompt_tokens": plens, "reference_outputs": ref_out, "modes": rows,
            "kv_values_under_e4m3": kv}


def kv_value_stats(model: str, texts: list[str], chat: bool, outputs: list[list[int]]) -> dict:
    """What E4M3 does to this model's K/V over the reference's sequences (prompt + output; one
    causal BF16 forward each, analysis.model_kv.capture_kv: rotated K and V as the cache stores
    them): largest magnitudes, the share that saturates (|x| > 448), that lands in E4M3's
    subnormal range (0 < |x| < 2^-6: fewer than 3 mantissa bits kept) or becomes 0 (|x| < 2^-10,
    ties to 0 at 2^-10), and the relative RMS rounding error ||x' - x|| / ||x||."""
    from zipfusion.analysis.model_kv import capture_kv, load_for_analysis
    from zipfusion.format.fp8 import E4M3_MAX, dequantize_e4m3, quantize_e4m3
    net, tok = load_for_analysis(model)
    acc = {r: dict(n=0, sat=0, sub=0, zero=0, err2=0.0, norm2=0.0, absmax=0.0) for r in ("k", "v")}
    for text, out in zip(texts, outputs):
        if chat:
            text = tok.apply_chat_template([{"role": "user", "content": text}])
        ids = torch.tensor(tok.encode(text) + out)
        for k, v in capture_kv(net, ids):
            for role, x in (("k", k), ("v", v)):
                x = x.float()
                a, q = x.abs(), dequantize_e4m3(quantize_e4m3(x), dtype=torch.float32)
                s = acc[role]
                s["n"] += x.numel()
                s["sat"] += int((a > E4M3_MAX).sum())
                s["sub"] += int(((a > 0) & (a < 2.0 ** -6)).sum())
                s["zero"] += int(((a > 0) & (q == 0)).sum())
                s["err2"] += float(((q - x) ** 2).sum())
                s["norm2"] += float((x ** 2).sum())
                s["absmax"] = max(s["absmax"], float(a.max()))
    return {role: {"values": s["n"], "max_abs": s["absmax"], "saturated_share": s["sat"] / s["n"],
                   "subnormal_share": s["sub"] / s["n"], "flushed_to_zero_share": s["zero"] / s["n"],
                   "relative_rms_error": (s["err2"] / s["norm2"]) ** 0.5} for role, s in acc.items()}


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    models = list(results)
    modes = [mode for mode in MODES if mode in results[models[0]]["modes"]]      # an older JSON: three
    colors = {"bf16": "#4c72b0", "bf16_lossless": "#55a868", "fp8": "#c44e52", "fp8_lossless": "#dd8452"}
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.4))
    w = 0.8 / len(modes)
    for j, mode in enumerate(modes):
        xs = [i + (j - (len(modes) - 1) / 2) * w for i in range(len(models))]
        share = [100 * results[m]["modes"][mode]["identical_share"] for m in models]
        kl = [results[m]["modes"][mode]["mean_kl_nats"] for m in models]
        b = axes[0].bar(xs, share, w, color=colors[mode], label=mode)
        axes[0].bar_label(b, fmt="%.0f%%", fontsize=8)
        b = axes[1].bar(xs, kl, w, color=colors[mode], label=mode)
        axes[1].bar_label(b, labels=[f"{v:.3g}" for v in kl], fontsize=8)
    for ax, title in ((axes[0], "greedy outputs identical to bf16 (% of prompts)"),
                      (axes[1], "mean KL(bf16 || mode) of next-token distributions (nats)")):
        ax.set_xticks(range(len(models)), models)
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
    for m, marker in zip(models, "os^"):
        div = [d for d in results[m]["modes"]["fp8"]["first_divergence"] if d is not None]
        axes[2].hist(div, bins=range(0, 66, 4), alpha=0.6, label=f"{m} ({len(div)} prompts diverge)")
    axes[2].set_title("fp8: first position where greedy output differs from bf16", fontsize=10)
    axes[2].set_xlabel("generated token index")
    axes[2].legend(fontsize=8)
    fig.suptitle("FP8 (E4M3) KV cache vs BF16 on the CPU: bf16_lossless is the compressed BF16 cache", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="smollm2,demo", help="comma-separated: smollm2, demo, or a model path")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--replot", action="store_true", help="redraw the PNG from the JSON in --out, run nothing")
    args = ap.parse_args()
    if args.replot:
        plot(json.loads((args.out / "fp8_accuracy.json").read_text())["results"], args.out / "fp8_accuracy.png")
        return
    torch.set_num_threads(args.threads)
    results = {}
    t0 = time.perf_counter()
    for name in args.models.split(","):
        if name == "smollm2":
            from zipfusion.analysis.checkpoints import smollm2_gguf
            model, texts, chat = str(smollm2_gguf()), CHAT_PROMPTS, True
        elif name == "demo":
            model, texts, chat = "demo", DEMO_PROMPTS, False
        else:
            model, texts, chat = name, CHAT_PROMPTS, True
        print(f"{name}: {model}", flush=True)
        results[name] = {"model": model, **measure(model, texts[:args.prompts], chat, args.max_tokens)}
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "machine": platform.platform(),
            "processor": platform.processor() or platform.machine(), "python": platform.python_version(),
            "torch": torch.__version__, "threads": args.threads, "prompts": args.prompts,
            "max_tokens": args.max_tokens, "deterministic": True, "seconds": time.perf_counter() - t0}
    (args.out / "fp8_accuracy.json").write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
    plot(results, args.out / "fp8_accuracy.png")
    print(f"\n{'model':<10} {'mode':<14} {'identical':>10} {'median 1st div':>15} {'mean KL (nats)':>15} "
          f"{'max KL':>9} {'argmax agree':>13}")
    for name, r in results.items():
        for mode, row in r["modes"].items():
            print(f"{name:<10} {mode:<14} {row['identical_outputs']:>4}/{row['prompts']:<5} "
                  f"{str(row['median_first_divergence']):>15} {row['mean_kl_nats']:>15.3g} {row['max_kl_nats']:>9.3g} "
                  f"{row['forced_argmax_agreement']:>13.4f}")


if __name__ == "__main__":
    main()
