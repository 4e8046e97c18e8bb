"""Train zipfusion's embedded demo model: a tiny Llama on the King James Bible, on the CPU.

The result (src/zipfusion/models/demo/) is a standard Hugging Face checkpoint -- config.json,
bf16 model.safetensors, a byte-level BPE tokenizer.json -- small enough (< 4 MB) to ship inside
the package, so `zipfusion demo` and `LLM(model="demo")` run with no download. Its attention
has head_dim 64 and 2 KV heads, a geometry the KV page format (docs/format.md) supports.

Data: the Authorized (King James) Version, public domain, from the Debian package
bible-kjv-text (read with its `bible` program):

    apt-get install -y bible-kjv-text
    pip install torch transformers tokenizers safetensors
    PYTHONPATH=src python scripts/train_demo_model.py     # ~15-20 min on one CPU core

Everything is seeded and the run is a fixed number of steps, so the same torch version on the
same kind of CPU gives the same weights. The script logs losses and writes train_log.json
next to the weights.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import shutil
import subprocess
import time
from pathlib import Path

import torch

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "src" / "zipfusion" / "models" / "demo"
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] | capitalize }}: {{ m['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}"
)

# Model geometry: hidden 256 = 4 query heads x 64, 2 KV heads (GQA), 3 layers, tied embeddings.
# 1.85 M parameters = 3.7 MB in bf16.
MODEL = dict(vocab_size=2048, hidden_size=256, intermediate_size=320, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, head_dim=64,
             max_position_embeddings=1024, rope_theta=10000.0, rms_norm_eps=1e-5)


# --------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------

VERSE = re.compile(r"^(\d?[A-Za-z]+)(\d+):(\d+) (.*)$")


def kjv_verses(text_file: str | None) -> list[str]:
    """The KJV as lines 'Ge1:1 In the beginning ...' (from `bible -f`, or a saved copy)."""
    if text_file:
        raw = Path(text_file).read_text(encoding="utf-8")
    else:
        if shutil.which("bible") is None:
            raise SystemExit("the `bible` program is missing: apt-get install -y bible-kjv-text "
                             "(or pass --text FILE with lines like 'Ge1:1 In the beginning ...')")
        raw = subprocess.run(["bible", "-f", "gen1:1-rev22:21"], check=True,
                             capture_output=True, text=True).stdout
    return [line for line in raw.splitlines() if line.strip()]


def kjv_chapters(lines: list[str]) -> list[str]:
    """Group verses by chapter, drop the references: one string per chapter, a verse a line."""
    chapters: list[list[str]] = []
    last = None
    for line in lines:
        m = VERSE.match(line)
        if m is None:
            raise ValueError(f"unexpected line in the KJV text: {line[:80]!r}")
        book_chapter = (m.group(1), m.group(2))
        if book_chapter != last:
            chapters.append([])
            last = book_chapter
        chapters[-1].append(m.group(4).strip())
    return ["\n".join(c) for c in chapters]


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------

def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE (every string round-trips exactly); BOS is prepended on encode."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[BOS, EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))])
    return tok


def save_tokenizer(tok, out: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS,
                                   pad_token=EOS, model_max_length=MODEL["max_position_embeddings"])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(out))


# --------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------

def build_model(bos_id: int, eos_id: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**MODEL, tie_word_embeddings=True, bos_token_id=bos_id,
                         eos_token_id=eos_id, pad_token_id=eos_id, attention_bias=False,
                         mlp_bias=False, hidden_act="silu", initializer_range=0.02)
    return LlamaForCausalLM(config)


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warmup, then cosine decay to 10 % of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


@torch.no_grad()
def evaluate(model, stream: torch.Tensor, seq: int, batches: int = 8, batch: int = 16) -> float:
    model.eval()
    g = torch.Generator().manual_seed(1234)
    losses = []
    for _ in range(batches):
        x = windows(stream, seq, batch, g)
        losses.append(model(input_ids=x, labels=x).loss.item())
    model.train()
    return sum(losses) / len(losses)


def windows(stream: torch.Tensor, seq: int, batch: int, g: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, stream.numel() - seq, (batch,), generator=g)
    return torch.stack([stream[s:s + seq] for s in starts.tolist()])


def greedy(model, tok, prompt: str, n: int = 40) -> str:
    ids = torch.tensor([tok.encode(prompt).ids])
    model.eval()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, do_sample=False)
    model.train()
    return tok.decode(out[0].tolist(), skip_special_tokens=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--text", help="KJV text with 'Ge1:1 ...' lines (default: run `bible`)")
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--checkpoint", type=Path, default=Path("/tmp/zipfusion_demo_fp32.pt"),
                    help="fp32 weights are also saved here (for --resave)")
    ap.add_argument("--resave", action="store_true",
                    help="skip training: rewrite --out from --checkpoint")
    args = ap.parse_args()

    random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    chapters = kjv_chapters(kjv_verses(args.text))
    held_out = set(range(7, len(chapters), 100))          # ~1 % of chapters for validation
    train_ch = [c for i, c in enumerate(chapters) if i not in held_out]
    val_ch = [c for i, c in enumerate(chapters) if i in held_out]
    print(f"{len(chapters)} chapters ({len(train_ch)} train, {len(val_ch)} validation)")

    tok = train_tokenizer(train_ch, MODEL["vocab_size"])
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)

    def stream(chs: list[str]) -> torch.Tensor:   # BOS chapter EOS BOS chapter EOS ...
        ids: list[int] = []
        for enc in tok.encode_batch(chs):
            ids += enc.ids + [eos]                 # enc.ids already starts with BOS
        return torch.tensor(ids, dtype=torch.long)

    train_stream, val_stream = stream(train_ch), stream(val_ch)
    n_chars = sum(map(len, train_ch))
    print(f"train tokens {train_stream.numel():,} ({n_chars / train_stream.numel():.2f} chars/token), "
          f"validation tokens {val_stream.numel():,}")

    model = build_model(bos, eos)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params:,} parameters, {n_params * 2 / 1e6:.2f} MB in bf16")
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    summary_base = {"steps": args.steps, "batch": args.batch, "seq": args.seq, "lr": args.lr,
                    "warmup": args.warmup, "seed": args.seed, "threads": args.threads,
                    "parameters": n_params, "train_tokens": train_stream.numel(),
                    "val_tokens": val_stream.numel(),
                    "tokens_seen": args.steps * args.batch * args.seq, "torch": str(torch.__version__)}
    if args.resave:   # write the HF files again from the fp32 checkpoint of an earlier run
        ck = torch.load(args.checkpoint)
        model.load_state_dict(ck["state_dict"])
        old = json.loads((args.out / "train_log.json").read_text()) if (args.out / "train_log.json").exists() else {}
        save_checkpoint(model, tok, dict(ck["summary"], **{k: v for k, v in old.items() if k not in ck["summary"]}), args.out)
        return
    g = torch.Generator().manual_seed(args.seed)
    log = []
    t0 = time.time()
    running = None
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        x = windows(train_stream, args.seq, args.batch, g)
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        running = loss.item() if running is None else 0.95 * running + 0.05 * loss.item()
        if (step + 1) % args.log_every == 0 or step + 1 == args.steps:
            entry = {"step": step + 1, "train_loss": round(loss.item(), 4),
                     "train_loss_ema": round(running, 4), "seconds": round(time.time() - t0, 1)}
            if (step + 1) % (5 * args.log_every) == 0 or step + 1 == args.steps:
                entry["val_loss"] = round(evaluate(model, val_stream, args.seq), 4)
            log.append(entry)
            print(json.dumps(entry), flush=True)

    final_val = evaluate(model, val_stream, args.seq)
    sample = greedy(model, tok, "In the beginning")
    print(f"final train loss (EMA) {running:.4f}, validation loss {final_val:.4f}")
    print("greedy:", repr(sample))

    torch.save({"state_dict": model.state_dict(), "summary": summary_base}, args.checkpoint)
    summary = dict(summary_base, final_train_loss_ema=round(running, 4),
                   final_val_loss=round(final_val, 4), wall_seconds=round(time.time() - t0, 1),
                   greedy_in_the_beginning=sample, log=log)
    save_checkpoint(model, tok, summary, args.out)


def save_checkpoint(model, tok, summary: dict, out: Path) -> None:
    """Write the Hugging Face files: bf16 safetensors, config, tokenizer, training log.

    config.json also gets the transformers-4 keys (torch_dtype, rope_theta) next to the
    transformers-5 ones, so older readers and hand-written config parsers find them.
    """
    out.mkdir(parents=True, exist_ok=True)
    model = model.to(torch.bfloat16)
    model.save_pretrained(str(out), safe_serialization=True)
    save_tokenizer(tok, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["torch_dtype"] = "bfloat16"
    cfg["rope_theta"] = MODEL["rope_theta"]
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    tc = json.loads((out / "tokenizer_config.json").read_text())
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"      # the name transformers 4 and 5 know
    tc["chat_template"] = CHAT_TEMPLATE
    (out / "tokenizer_config.json").write_text(json.dumps(tc, indent=2, sort_keys=True) + "\n")
    (out / "chat_template.jinja").unlink(missing_ok=True)   # now in tokenizer_config.json
    (out / "train_log.json").write_text(json.dumps(summary, indent=1) + "\n")
    total = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    print(f"wrote {out} ({total / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()
