"""Command line: ``zipfusion generate``, ``demo``, ``serve``, ``analyze``, ``compress-weights`` and
``bench``. Nothing heavy is imported before the arguments are parsed; a user error prints one
``error: ...`` line and exits with status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from . import __version__
from .config import LOAD_FORMATS, add_cli_args
from .extras import require


class CLIError(Exception):
    """A user error the CLI reports in one line (exit status 2)."""


def _token_ids(text: str) -> list[int]:
    """``--prompt-token-ids 1,2,3`` (commas and/or spaces)."""
    parts = text.replace(",", " ").split()
    try:
        ids = [int(p) for p in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected token ids like 1,2,3, got {text!r}") from None
    if not ids or any(i < 0 for i in ids):
        raise argparse.ArgumentTypeError(f"expected one or more token ids >= 0, got {text!r}")
    return ids


def set_cpu_threads(threads: int | None) -> int:
    """torch's CPU threads: ``threads``, or :func:`~zipfusion.config.default_cpu_threads`."""
    import torch

    from .config import default_cpu_threads
    n = default_cpu_threads() if threads is None else threads
    if n < 1:
        raise CLIError(f"--cpu-threads must be >= 1, got {n}")
    torch.set_num_threads(n)
    return n


def _show_build_progress() -> None:
    """A model build that takes long logs its progress on stderr."""
    import logging

    from .server import configure_logging
    configure_logging("warning")
    logging.getLogger("zipfusion.models").setLevel(logging.INFO)

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
    texts, id_prompts = list(args.prompt or []), list(args.prompt_token_ids or [])
    if not texts and not id_prompts:
        raise CLIError("give a prompt: --prompt TEXT or --prompt-token-ids 1,2,3 (repeatable)")
    if args.chat and id_prompts:
        raise CLIError("--chat wraps text prompts in the chat template; it does not take --prompt-token-ids")
    from .models import resolve_model
    source = resolve_model(args.model, args.load_format, args.revision)    # before any weight is built
    if source.tokenizer_dir is None and args.tokenizer is None and (texts or args.chat):
        raise CLIError(f"model {args.model!r} has no tokenizer, so it cannot take text: pass "
                       "--prompt-token-ids 1,2,3 instead of --prompt (output is printed as token ids), or a "
                       "checkpoint with tokenizer files")
    set_cpu_threads(args.cpu_threads)
    _show_build_progress()
    import zipfusion
    from .config import options_from_args
    llm = zipfusion.LLM(**options_from_args(args, skip=("seed",)))
    prompts = list(texts)
    if args.chat:
        if llm.tokenizer is None:
            raise CLIError("--chat needs a model with a tokenizer")
        prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    prompts += id_prompts
    sp = zipfusion.SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                                  max_tokens=args.max_tokens, stop=args.stop or None, ignore_eos=args.ignore_eos,
                                  presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                                  repetition_penalty=args.repetition_penalty)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp)
    dt = time.perf_counter() - t0
    for prompt, o in zip(texts + [",".join(map(str, ids)) for ids in id_prompts], outs):
        if len(outs) > 1:
            print(f"--- {prompt!r}")
        print(o.text if llm.tokenizer is not None else " ".join(map(str, o.token_ids)))
    n = sum(len(o.token_ids) for o in outs)
    config = llm.engine.config
    kv = f"kv_cache_dtype={config.kv_cache_dtype}{' (lossy)' if config.kv_lossy else ''}"
    print(f"[{n} tokens in {dt:.2f} s, kv_compression={config.kv_compression}, {kv}]", file=sys.stderr)
    return 0


def run_demo(max_tokens: int = 48, prompts: list[str] | None = None, kv_memory_gb: float = 0.02,
             echo=print) -> dict:
    """The model half of ``zipfusion demo``: the embedded model on CPU, compressed and not."""
    import torch

    import zipfusion
    prompts = prompts or DEMO_PROMPTS
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a 3-layer model: more threads only add overhead
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
                 if layer["compressible_fraction"] == layer["compressible_fraction"]]
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
    require(("fastapi", "uvicorn", "prometheus_client"), "server", "zipfusion serve")
    from .config import config_from_args, serving_max_num_batched_tokens
    from .server import bind_socket, serve
    from .server.limits import limits_from_args
    limits = limits_from_args(args)
    if args.max_num_batched_tokens is None:      # sized for interactivity on this device
        args.max_num_batched_tokens = serving_max_num_batched_tokens(args.device)
    cfg = config_from_args(args)
    if args.default_max_tokens < 1:
        raise CLIError(f"--default-max-tokens must be >= 1, got {args.default_max_tokens}")
    set_cpu_threads(args.cpu_threads)
    sock = bind_socket(args.host, args.port)      # a busy port fails here, before the model loads
    api_key = args.api_key or os.environ.get("ZIPFUSION_API_KEY") or None
    serve(cfg, sock=sock, api_key=api_key, served_model_name=args.served_model_name, log_level=args.log_level,
          default_max_tokens=args.default_max_tokens, limits=limits, metrics_prefix=args.metrics_prefix)
    return 0


def cmd_analyze(args) -> int:
    from pathlib import Path

    if args.plot:
        require(("matplotlib",), "bench", "analyze --plot")
    if args.weights:
        return _analyze_weights(args)
    if args.layers is not None:
        raise CLIError("--layers samples the layers of --weights MODEL; pass --weights too")
    from .analysis.model_kv import analyze_model
    texts = None
    if args.text:
        texts = []
        for name in args.text:
            path = Path(name)
            if not path.is_file():
                raise FileNotFoundError(f"--text {name}: no such file")
            texts.append(path.read_text(errors="replace"))
    _show_build_progress()
    report = analyze_model(args.model, texts, device=args.device or _default_device(),
                           max_tokens=args.max_tokens, load_format=args.load_format, kv_dtype=args.kv_dtype)
    print(report.render())
    if args.plot:
        report.plot(args.plot)
        print(f"plot written to {args.plot}")
        if report.fp8 is not None:
            path = Path(args.plot)
            fp8_plot = str(path.with_name(f"{path.stem}_fp8{path.suffix or '.png'}"))
            report.fp8.plot(fp8_plot, title=f"{report.model}: FP8 E4M3 + lossless blocks, stored / FP8 bytes")
            print(f"FP8 plot written to {fp8_plot}")
    return 0


def _analyze_weights(args) -> int:
    import json

    from .analysis.weights import analyze_weights
    _show_build_progress()
    report = analyze_weights(args.weights, device=args.device or _default_device(), load_format=args.load_format,
                             layers=args.layers)
    print(report.render())
    if args.plot:
        report.plot(args.plot)
        print(f"plot written to {args.plot}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report.to_dict(), f, indent=1)
        print(f"numbers written to {args.json}")
    return 0


def cmd_compress_weights(args) -> int:
    from .engine.build import parse_device
    from .models import build_model, load_tokenizer, resolve_model
    from .models.compressed_weights import save_compressed
    source = resolve_model(args.model, args.load_format)
    if source.compressed:
        raise CLIError(f"--model {args.model} is a compressed checkpoint already")
    _show_build_progress()
    t0 = time.perf_counter()
    model = build_model(source, device=parse_device(args.device), seed=args.seed, weight_compression=True)
    m = save_compressed(model, source, args.out, load_tokenizer(source.tokenizer_dir))
    print(f"wrote {args.out}: {len(m['compressed'])} compressed tensors, weights {m['original_bytes'] / 2**30:.3f} GiB "
          f"-> {m['stored_bytes'] / 2**30:.3f} GiB ({m['stored_bytes'] / m['original_bytes']:.3f}) in "
          f"{time.perf_counter() - t0:.1f} s; serve it with --model {args.out}")
    return 0


GENERATE_SAMPLING = """sampling defaults of this command: --temperature 0 (greedy, so a run is
reproducible), --top-p 1, --top-k -1 (off), --max-tokens 64, no penalties. Note: the Python API's
zipfusion.SamplingParams() defaults to temperature 1.0 (vLLM's default); pass --temperature 1 here
for the same distribution."""


def _add_cpu_threads(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cpu-threads", type=int, default=None,
                        help="torch threads for CPU work (default: half the cores this process may use, 1 to 8; "
                             "torch's every-core default ran up to 55x slower on a shared 2-core box)")


def build_parser() -> argparse.ArgumentParser:
    from .server.limits import add_limit_args
    parser = argparse.ArgumentParser(prog="zipfusion", description="LLM inference with a losslessly compressed KV cache")
    parser.add_argument("--version", action="version", version=f"zipfusion {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text for one or more prompts",
                       description="Generate text for one or more prompts and print it.", epilog=GENERATE_SAMPLING)
    add_cli_args(g, skip=("seed",))
    _add_cpu_threads(g)
    g.add_argument("--prompt", action="append", help="a prompt (repeat for several)")
    g.add_argument("--prompt-token-ids", action="append", type=_token_ids, metavar="IDS",
                   help="a prompt as token ids, e.g. 1,2,3 (repeatable; for a model without a tokenizer)")
    g.add_argument("--max-tokens", type=int, default=64, help="tokens to generate per prompt (default: 64)")
    g.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy (default: 0; note SamplingParams() defaults to 1.0)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1.0 = off)")
    g.add_argument("--top-k", type=int, default=-1, help="sample among the k most likely tokens (default: -1 = off)")
    g.add_argument("--presence-penalty", type=float, default=0.0, help="in [-2, 2] (default: 0 = off)")
    g.add_argument("--frequency-penalty", type=float, default=0.0, help="in [-2, 2] (default: 0 = off)")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="> 0 (default: 1.0 = off)")
    g.add_argument("--seed", type=int, default=None,
                   help="sampling seed (default: none); a prompt's tokens repeat whatever else runs beside it "
                        "only with --deterministic")
    g.add_argument("--stop", action="append", help="stop string (repeatable; default: none)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating after an end-of-sequence token")
    g.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    g.set_defaults(func=cmd_generate)
    d = sub.add_parser("demo", help="compress synthetic KV, then generate with the embedded model on CPU")
    d.add_argument("--max-tokens", type=int, default=48, help="tokens per prompt (default: 48)")
    d.set_defaults(func=cmd_demo)
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (needs the server extra: "
                                     "pip install -e '.[server]')",
                       description="OpenAI-compatible server: /v1/completions, /v1/chat/completions, /v1/models, "
                                   "/tokenize, /detokenize, /version, /health, /metrics (prometheus).")
    add_cli_args(s)
    _add_cpu_threads(s)
    add_limit_args(s)
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    s.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    s.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every /v1 route (default: $ZIPFUSION_API_KEY, "
                        "else no key)")
    s.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) the API answers to; the first is reported (default: the model's name: "
                        "a checkpoint folder's name or a .gguf file's stem, never its path)")
    s.add_argument("--default-max-tokens", type=int, default=256,
                   help="max_tokens of a request that gives none, capped by what is left of max_model_len "
                        "(default: 256)")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="log level of the server and the engine (default: info)")
    s.add_argument("--metrics-prefix", default="zipfusion", choices=["zipfusion", "vllm"],
                   help="prefix of the /metrics names: vllm gives vLLM's own names, for its dashboards "
                        "(default: zipfusion)")
    s.set_defaults(func=cmd_serve)
    a = sub.add_parser("analyze", help="how well a model's KV compresses, per layer")
    a.add_argument("--model", default="demo", help="checkpoint folder (with tokenizer files), .gguf file (with "
                                                   "tokenizer metadata), or 'demo' (default: demo)")
    a.add_argument("--text", action="append", help="a text file to run the model on (repeatable); "
                   "default: a built-in sample of prose, a list and code")
    a.add_argument("--max-tokens", type=int, default=4096, help="tokens per text (default: 4096)")
    a.add_argument("--device", default=None, help="cuda or cpu (default: cuda when a GPU is visible)")
    a.add_argument("--load-format", default="auto", choices=LOAD_FORMATS,
                   help="auto (from the files), safetensors, gguf, or random (ignore the weights) (default: auto)")
    a.add_argument("--plot", default=None, help="write a PNG of the per-layer numbers here (needs matplotlib); "
                   "with --kv-dtype fp8 also NAME_fp8.png")
    a.add_argument("--kv-dtype", default="bf16", choices=["bf16", "fp8"],
                   help="bf16: the BF16 page format (v2, v1 beside); fp8: also quantize the KV to FP8 E4M3 as vLLM's "
                        "fp8 KV cache does (scale 1.0, and amax/448 per KV head) and size it in the lossless FP8 "
                        "block format, per design (default: bf16)")
    a.add_argument("--weights", default=None, metavar="MODEL",
                   help="instead of the KV: how well MODEL's weights compress in the weight format, per tensor "
                        "kind and layer (a checkpoint folder, .gguf file, 'demo' or a random model)")
    a.add_argument("--layers", type=int, default=None, metavar="N",
                   help="--weights: N layers spread evenly (the model's total estimated from them; default: all)")
    a.add_argument("--json", default=None, help="--weights: write the numbers here as JSON")
    a.set_defaults(func=cmd_analyze)
    c = sub.add_parser("compress-weights", help="write a model's weights compressed once; load it with --model DIR",
                       description="Compress a model's weight matrices (the format the engine serves them in) and "
                                   "write them, its config and tokenizer to a new folder with a manifest of "
                                   "checksums; --model DIR then loads it without compressing again.")
    c.add_argument("--model", required=True, help="checkpoint folder, .gguf file, 'demo' or a random model")
    c.add_argument("--out", required=True, help="a new folder to write")
    c.add_argument("--device", default="auto", help="where to compress: cuda, cpu or auto (default: auto)")
    c.add_argument("--load-format", default="auto", choices=LOAD_FORMATS, help="(default: auto)")
    c.add_argument("--seed", type=int, default=0, help="random models: the seed of their weights (default: 0)")
    c.set_defaults(func=cmd_compress_weights)
    from .bench.cli import add_bench_parser
    add_bench_parser(sub)
    return parser


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (CLIError, ValueError, TypeError, FileNotFoundError, ImportError) as e:
        print(f"error: {_one_line(e)}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        if type(e).__name__ != "KVCacheTooSmall":       # the engine's "one request does not fit"
            raise
        print(f"error: {_one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
