"""Command line: ``zipfusion generate``, ``demo``, ``serve`` and ``analyze``.

    zipfusion generate --model demo --prompt "In the beginning" --max-tokens 40 --device cpu
    zipfusion demo
    zipfusion serve --model PATH --port 8000
    zipfusion analyze --model PATH --text corpus.txt --plot kv.png
"""

from __future__ import annotations

import argparse
import sys
import time

from .config import add_cli_args

DEMO_PROMPTS = [
    "In the beginning God created the heaven and the earth.",
    "And the LORD spake unto Moses, saying,",
    "Blessed are the poor in spirit:",
    "The LORD is my shepherd;",
]


def _default_device() -> str:
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def cmd_generate(args) -> int:
    import zipfusion
    from .config import config_from_args
    llm = zipfusion.LLM(**vars(config_from_args(args, skip=("seed",))))
    prompts = list(args.prompt)
    if args.chat:
        if llm.tokenizer is None:
            raise SystemExit("error: --chat needs a model with a tokenizer")
        prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    sp = zipfusion.SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                                  max_tokens=args.max_tokens, stop=args.stop or None, ignore_eos=args.ignore_eos)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp)
    dt = time.perf_counter() - t0
    for prompt, o in zip(args.prompt, outs):
        if len(outs) > 1:
            print(f"--- {prompt!r}")
        print(o.text if llm.tokenizer is not None else " ".join(map(str, o.token_ids)))
    n = sum(len(o.token_ids) for o in outs)
    print(f"[{n} tokens in {dt:.2f} s, kv_compression={args.kv_compression}]", file=sys.stderr)
    return 0


def run_demo(max_tokens: int = 48, prompts: list[str] | None = None, kv_memory_gb: float = 0.02,
             echo=print) -> dict:
    """The model half of ``zipfusion demo``: the embedded model on CPU, compressed and not."""
    import torch

    import zipfusion
    prompts = prompts or DEMO_PROMPTS
    threads = torch.get_num_threads()
    torch.set_num_threads(1)      # a 3-layer model: more threads only add overhead (and contend)
    try:
        return _run_demo(zipfusion, prompts, max_tokens, kv_memory_gb, echo)
    finally:
        torch.set_num_threads(threads)


def _run_demo(zipfusion, prompts, max_tokens, kv_memory_gb, echo) -> dict:
    sp = zipfusion.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    results = {}
    for compress in (True, False):
        llm = zipfusion.LLM("demo", device="cpu", kv_compression=compress, kv_memory_gb=kv_memory_gb)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        results[compress] = (outs, llm.kv_stats(), time.perf_counter() - t0, llm)
    (on, st_on, t_on, llm), (off, _, t_off, _) = results[True], results[False]
    cfg = llm.engine.model_config
    identical = [a.token_ids for a in on] == [b.token_ids for b in off]
    echo(f"\nDemo model ({cfg.num_hidden_layers} layers, {cfg.num_key_value_heads} KV heads x {cfg.head_dim}, "
         f"trained on KJV text), CPU, greedy, {len(prompts)} prompts x {max_tokens} tokens:")
    for p, o in zip(prompts, on):
        echo(f"  {p!r} ->{o.text[:100]!r}")
    echo(f"  compressed ({t_on:.1f} s) and uncompressed ({t_off:.1f} s) outputs identical: "
         f"{'yes' if identical else 'NO'}")
    used, full = st_on["bytes_in_use"], st_on["open_bytes_equivalent"]
    n_req = len(prompts)
    per_req_c, per_req_u = used / n_req, full / n_req
    budget = llm.engine.cache.manager.arena.numel()
    fit_c, fit_u = int(budget // per_req_c), int(budget // per_req_u)
    echo(f"  KV pages at the peak: {st_on['pages_in_use']} ({st_on['stored_pages']} full pages compressed, "
         f"{st_on['open_pages']} open), x {cfg.num_hidden_layers} layers")
    fractions = [layer["compressible_fraction"] for layer in st_on.get("layers", [])
                 if layer["compressible_fraction"] == layer["compressible_fraction"]]   # not NaN
    blocks = f", {sum(fractions) / len(fractions):.1%} of 512-value blocks compressible" if fractions else ""
    echo(f"  compression ratio of full pages: {1 / st_on['stored_ratio']:.3f}x "
         f"({st_on['stored_ratio']:.1%} of their BF16 size{blocks})")
    echo(f"  KV memory: {used / 1024:.0f} KiB instead of {full / 1024:.0f} KiB, "
         f"{1 - used / full:.1%} saved")
    echo(f"  the same {budget / 2**20:.0f} MiB of KV memory admits {fit_c} such requests compressed vs "
         f"{fit_u} uncompressed: {fit_c - fit_u} extra ({fit_c / max(fit_u, 1) - 1:.0%} more)")
    return dict(identical=identical, stats=st_on, extra_requests=fit_c - fit_u, outputs=on)


def cmd_demo(args) -> int:
    from .demo import format_demo
    format_demo()
    res = run_demo(max_tokens=args.max_tokens)
    return 0 if res["identical"] else 1


def cmd_serve(args) -> int:
    from .config import config_from_args
    from .server import serve
    cfg = config_from_args(args)
    serve(cfg.model, host=args.host, port=args.port, **{k: v for k, v in vars(cfg).items() if k != "model"})
    return 0


def cmd_analyze(args) -> int:
    from pathlib import Path

    from .analysis.model_kv import analyze_model
    texts = None
    if args.text:
        texts = []
        for name in args.text:
            path = Path(name)
            if not path.is_file():
                raise FileNotFoundError(f"--text {name}: no such file")
            texts.append(path.read_text(errors="replace"))
    report = analyze_model(args.model, texts, device=args.device or _default_device(),
                           max_tokens=args.max_tokens, load_format=args.load_format)
    print(report.render())
    if args.plot:
        report.plot(args.plot)
        print(f"plot written to {args.plot}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zipfusion", description="LLM inference with a losslessly compressed KV cache")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text for one or more prompts")
    add_cli_args(g, skip=("seed",))
    g.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for several)")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    g.set_defaults(func=cmd_generate)
    d = sub.add_parser("demo", help="compress synthetic KV, then generate with the embedded model on CPU")
    d.add_argument("--max-tokens", type=int, default=48)
    d.set_defaults(func=cmd_demo)
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (needs zipfusion[server])")
    add_cli_args(s)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.set_defaults(func=cmd_serve)
    a = sub.add_parser("analyze", help="how well a model's KV compresses, per layer")
    a.add_argument("--model", default="demo", help="checkpoint folder (with tokenizer) or 'demo'")
    a.add_argument("--text", action="append", help="a text file to run the model on (repeatable); "
                   "default: a built-in sample of prose, a list and code")
    a.add_argument("--max-tokens", type=int, default=4096, help="tokens per text")
    a.add_argument("--device", default=None)
    a.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "random"])
    a.add_argument("--plot", default=None, help="write a PNG of the per-layer numbers here")
    a.set_defaults(func=cmd_analyze)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
