"""The ``zipfusion bench`` command line (argparse only: ``--help`` imports neither torch nor httpx);
bad input is a ValueError that ``zipfusion``'s main prints as one line.
"""

from __future__ import annotations

import argparse
import json
import os

from . import DEFAULT_COMPARE, KERNEL_MODES, MODES

DATASET_HELP = ("chat (prompt ~300 / output ~250 tokens), reasoning (decode-heavy: ~200 / ~1,500), long "
                "(~12,000 / ~250), agent (prefill-heavy: ~1,000 / ~120 behind a 2,048-token prefix shared by "
                "groups of 8), random (fixed --input-len / --output-len); lognormal lengths; or the recorded "
                "workloads: burst (8,192 / 256), mix (~1,200 / ~300), long32k (32,768 / 512), long_generation "
                "(1,024 / 8,192), shared_prefix (256 / 256 behind 4,096 shared by 16), multi_turn (8 turns of "
                "256 new / 256 out after a 1,024 first prompt; throughput only) (default: %(default)s)")

EXAMPLES = {
    "serve": """zipfusion bench serve, examples:
  # compressed vs uncompressed serving at the same KV memory, swept from saturation to 2x, with an SLO
  zipfusion bench serve --model llama-3.1-8b-random --device cuda --kv-memory-gb 16 --compare \\
      --dataset reasoning --num-prompts 200 --sweep --goodput ttft:2000 tpot:50 --out serve_8b
  # fixed rates, or a closed loop of 32 clients, against a server that is already running
  zipfusion bench serve --url http://127.0.0.1:8000 --request-rates 1,2,4,inf --dataset chat
  zipfusion bench serve --url http://127.0.0.1:8000 --request-rates inf --max-concurrency 32
  # a server with an API key, its chat route, a ShareGPT-style file of conversations
  zipfusion bench serve --url http://127.0.0.1:8000 --api-key KEY --endpoint chat \\
      --dataset-path sharegpt.json --num-prompts 200 --request-rates 2,4
  # the output rate at saturation in steady state ("steady out tok/s": while requests keep being
  # sent, ramp and tail left out): a closed loop with more in flight than the KV holds, both modes
  zipfusion bench serve --model llama-3.1-8b-random --device cuda --kv-memory-gb 4 --compare \\
      --dataset reasoning --num-prompts 300 --request-rates inf --max-concurrency 64
  # one mode per call (a time limit per call), then one comparison of the two
  zipfusion bench serve ... --mode compressed --out c; zipfusion bench serve ... --mode uncompressed --out u
  zipfusion bench serve --merge c.json u.json --out both
  # the CPU demo model, tiny
  zipfusion bench serve --model demo --device cpu --compare --dataset random --input-len 32 \\
      --output-len 8 --num-prompts 8 --request-rates 4""",
    "throughput": """zipfusion bench throughput, examples:
  zipfusion bench throughput --model llama-3.1-8b-random --device cuda --kv-memory-gb 12 \\
      --compare compressed,uncompressed,flashinfer --dataset chat --num-prompts 600
  # the CPU demo model, tiny (what CI runs)
  zipfusion bench throughput --model demo --device cpu --compare --dataset random --input-len 32 \\
      --output-len 8 --num-prompts 8 --kv-memory-gb 0.002""",
    "latency": """zipfusion bench latency, examples:
  zipfusion bench latency --model llama-3.1-8b-random --device cuda --compare --batch-size 32 \\
      --input-len 8192 --output-len 128
  zipfusion bench latency --model demo --device cpu --compare --batch-size 4 --input-len 64 --output-len 8""",
    "kernel": """zipfusion bench kernel, examples:
  zipfusion bench kernel                                          # batch 32 x 8K, fractions 1/0.92/0.5/0
  zipfusion bench kernel --batches 1,32,64 --contexts 2048,8192,32768 --fractions 1,0.92 --out kernel_h100
  zipfusion bench kernel --device cpu                             # a smoke run (Triton interpreter)
  zipfusion bench kernel --linear --out weights_kernel_h100       # linear layers over compressed weights
  zipfusion bench kernel --linear --models llama-3.1-8b --ms 1,64,2048""",
    "steps": """zipfusion bench steps, examples:
  zipfusion bench throughput --compare --dataset reasoning --out tp   # writes tp_steps.json
  zipfusion bench steps tp_steps.json""",
}


class Formatter(argparse.RawDescriptionHelpFormatter):
    """Examples kept as written; defaults said in the option help where it has %(default)s."""


def _common(p: argparse.ArgumentParser, kind: str, compare_default: str = DEFAULT_COMPARE) -> None:
    p.add_argument("--compare", nargs="?", const=compare_default, default=None, metavar="MODES",
                   help=f"run these modes one after the other, each in its own process, and print their ratios: "
                        f"comma-separated of {', '.join(KERNEL_MODES if kind == 'kernel' else MODES)} "
                        f"(bare --compare: {compare_default})")
    if kind == "kernel":
        p.add_argument("--mode", default=None, help="one mode alone (default: the first three, as --compare); "
                       "fp8 and flashinfer_fp8 time the lossy E4M3 pages, fp8_lossless our kernel over them "
                       "encoded in the lossless FP8 block format")
    else:
        p.add_argument("--mode", default="compressed", help="the one mode to run without --compare "
                       "(default: %(default)s)")
    p.set_defaults(default_modes=compare_default if kind == "kernel" else "compressed")
    p.add_argument("--out", default=f"zipfusion-bench-{kind}",
                   help="writes OUT.json and OUT.png (default: %(default)s, in this folder)")
    if kind == "kernel":
        return
    p.add_argument("--model", default="demo", help="as zipfusion serve's --model (default: %(default)s)")
    p.add_argument("--kv-memory-gb", type=float, default=None,
                   help="GiB of KV memory, the same in every mode (default: the engine's: what the GPU has free; "
                        "0.25 on the CPU)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="most requests running at once (default: the "
                   "engine's, 256" + ("; latency: the batch size)" if kind == "latency" else ")"))
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="most tokens in one step (default: the engine's" + (", serving-sized)" if kind == "serve" else ")"))
    p.add_argument("--max-model-len", type=int, default=None, help="(default: the model's, at most 32768)")
    p.add_argument("--seed", type=int, default=0, help="seed of the dataset's lengths and tokens (default: %(default)s)")


def _offline(p: argparse.ArgumentParser) -> None:
    p.add_argument("--deterministic", action="store_true",
                   help="batch-invariant kernels: the modes' tokens must then be identical")
    p.add_argument("--engine-args", default="{}", help="other LLM options as JSON, e.g. '{\"enforce_eager\": true}'")
    p.add_argument("--cpu-threads", type=int, default=None, help="torch threads of a CPU worker (default: half the cores)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per mode's process (default: %(default)s)")


def _dataset(p: argparse.ArgumentParser, num_prompts: int | None, default_help: str = "%(default)s") -> None:
    p.add_argument("--dataset", default="chat", help=DATASET_HELP)
    p.add_argument("--num-prompts", type=int, default=num_prompts, help=f"requests (default: {default_help})")
    p.add_argument("--input-len", type=int, default=None,
                   help="median prompt tokens (random: every prompt's); the dataset's caps (and multi_turn's "
                        "tokens a turn) scale along")
    p.add_argument("--output-len", type=int, default=None, help="median output tokens (random: every request's)")
    p.add_argument("--range-ratio", type=float, default=0.0,
                   help="random: lengths uniform in [len x (1 - r), len x (1 + r)] (default: %(default)s)")
    p.add_argument("--shared-prefix", type=int, default=None,
                   help="tokens of a prefix each group of requests shares (default: the dataset's; agent 2048)")
    p.add_argument("--prefix-group", type=int, default=None, help="requests per shared prefix (default: the dataset's)")
    p.add_argument("--prompt-format", default="ids", choices=("ids", "text"),
                   help="random token ids, or random words (needs a model with a tokenizer) (default: %(default)s)")


def add_bench_parser(sub) -> argparse.ArgumentParser:
    """``zipfusion bench`` and its four subcommands, on the ``zipfusion`` parser's subparsers."""
    b = sub.add_parser("bench", help="benchmarks: serve, throughput, latency, kernel (as vllm bench); steps",
                       formatter_class=Formatter,
                       description="Benchmarks a user runs, each printing a table and writing JSON + PNG; "
                                   "--compare compressed,uncompressed[,flashinfer] on each.",
                       epilog="\n\n".join(EXAMPLES.values()))
    bsub = b.add_subparsers(dest="bench_command", required=True, metavar="{serve,throughput,latency,kernel,steps}")

    s = _subcommand(bsub, "serve", "the serving benchmark: rates, TTFT/TPOT/ITL, goodput, compressed vs uncompressed",
                    "Requests to zipfusion serve (one started per mode on 127.0.0.1, or --url) at a sweep of Poisson "
                    "request rates or a closed loop; per rate TTFT / TPOT / ITL p50 / p99, output tok/s, requests/s "
                    "and goodput; with --compare, the highest rate each mode sustains within the SLO and their "
                    "ratio.", device_help="the server's device: cuda, cpu or auto (default: %(default)s)")
    s.add_argument("--url", default=None, help="a running zipfusion serve to use instead of starting one (one mode; "
                   "the results are labeled with the model, KV memory and mode it reports)")
    s.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="the server's API key, sent as a bearer token (default: $OPENAI_API_KEY; given to the "
                        "servers this benchmark starts too)")
    s.add_argument("--endpoint", default="completions", choices=("completions", "chat"),
                   help="/v1/completions, or /v1/chat/completions (vLLM's openai-chat: text prompts as one user "
                        "message) (default: %(default)s)")
    s.add_argument("--dataset-path", default=None, metavar="JSON",
                   help="a ShareGPT-style file (a list of {'conversations': [{'from': 'human', 'value': ...}, "
                        "{'from': 'gpt', 'value': ...}]}): the first turn is the prompt, the reply's length (counted "
                        "by the server's /tokenize) the output length; replaces --dataset")
    _dataset(s, 100)
    s.add_argument("--request-rates", default="inf",
                   help="requests/s, comma-separated; inf: every request at once (default: %(default)s)")
    s.add_argument("--sweep", action="store_true",
                   help="instead of --request-rates: find the saturation (every request at once), then run "
                        "--sweep-points fractions of it")
    s.add_argument("--sweep-points", default="0.5,1,1.5,2",
                   help="fractions of the saturation rate that --sweep runs (default: %(default)s)")
    s.add_argument("--max-concurrency", type=int, default=None,
                   help="at most this many requests in flight (with rate inf: a closed loop of N clients)")
    s.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="the SLO, as vLLM's: ttft, tpot and/or e2el bounds in ms, e.g. --goodput ttft:2000 tpot:50")
    s.add_argument("--slo-attainment", type=float, default=0.9,
                   help="share of a rate's requests that must meet the SLO for the rate to count as sustained "
                        "(default: %(default)s)")
    s.add_argument("--warmup", type=int, default=4, help="requests before the first rate, not measured "
                   "(default: %(default)s)")
    s.add_argument("--vocab-size", type=int, default=2048,
                   help="prompt token ids are drawn from [10, VOCAB - 10) (default: %(default)s, the demo model's)")
    s.add_argument("--server-args", default="", help="more zipfusion serve options, e.g. '--max-num-seqs 128 "
                   "--no-enable-prefix-caching' (quoted)")
    s.add_argument("--timeout", type=float, default=900.0, help="seconds per request (default: %(default)s)")
    s.add_argument("--startup-timeout", type=float, default=900.0,
                   help="seconds for a server to load its model (default: %(default)s)")
    s.add_argument("--metrics-interval", type=float, default=2.0,
                   help="seconds between /metrics samples while a rate runs (default: %(default)s)")
    s.add_argument("--progress-s", type=float, default=10.0, help="seconds between progress lines (default: %(default)s)")
    s.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                   help="runs nothing: combine earlier runs' OUT.json (e.g. one mode per call where a call has a "
                        "time limit; same workload, KV memory and SLO) into one comparison at --out")

    t = _subcommand(bsub, "throughput", "offline LLM.generate over a dataset, every request at once",
                    "Offline: every request of a dataset at once (LLM.generate's loop, after a warm-up), each mode "
                    "in its own process; total and output tok/s, requests/s, peak batch, preemptions, the KV's "
                    "stored ratio.")
    _dataset(t, None, "200; on the CPU 16, with --input-len 64 --output-len 32 unless given: about a minute")
    _offline(t)
    t.add_argument("--profile-steps", default=None, metavar="START:END",
                   help="trace steps START..END-1 of each mode's run with torch.profiler: a Chrome trace "
                        "(OUT_<mode>.trace.json.gz, for Perfetto) and the top operators by device time in the JSON "
                        "(as vLLM's --profile); the traced steps run slower, so their mode's numbers are not timings")

    lat = _subcommand(bsub, "latency", "one batch: prefill time, then per-token decode time",
                      "One batch of --batch-size requests with --input-len prompts: the time until each has its "
                      "first token (prefill), then per output token (decode), over --num-iters batches, each mode "
                      "in its own process.")
    lat.add_argument("--batch-size", type=int, default=8, help="requests in the batch (default: %(default)s)")
    lat.add_argument("--input-len", type=int, default=1024, help="prompt tokens (default: %(default)s)")
    lat.add_argument("--output-len", type=int, default=128, help="output tokens (default: %(default)s)")
    lat.add_argument("--num-iters", type=int, default=5, help="measured batches (default: %(default)s)")
    lat.add_argument("--num-iters-warmup", type=int, default=1, help="batches before them (default: %(default)s)")
    _offline(lat)

    k = _subcommand(bsub, "kernel", "decode attention: compressed vs uncompressed kernel vs FlashInfer (CUDA)",
                    "Decode attention of Llama-3.1-8B's shape over paged KV with a given share of compressible "
                    "blocks: the fused kernel over compressed pages (compressed), the same kernel over open pages "
                    "(uncompressed) and FlashInfer's (flashinfer, skipped with a note when it is not installed). "
                    "Needs a CUDA GPU.", device_help="cuda, or cpu for a tiny smoke run (default: %(default)s)",
                    compare_default="compressed,uncompressed,flashinfer")
    k.add_argument("--fractions", default="1,0.92,0.5,0", help="compressible fractions of the KV; 0.92: the real "
                   "model's statistics (default: %(default)s)")
    k.add_argument("--batches", default="32", help="batch sizes, comma-separated (default: %(default)s)")
    k.add_argument("--contexts", default="8192", help="context lengths, comma-separated (default: %(default)s)")
    k.add_argument("--head-dim", type=int, default=None, choices=(64, 128, 256),
                   help="head size: 64 (Llama-3.2-1B's), 128 (Llama-3.1-8B's), 256 (Gemma 3's) (default: 128; "
                        "the CPU smoke run: 64)")
    k.add_argument("--heads", default="32,8", help="query heads,KV heads (default: %(default)s, Llama-3.1-8B's; "
                   "Gemma 3 12B's: 16,8)")
    k.add_argument("--linear", action="store_true", help="linear layers instead: the fused decompress-GEMM over "
                   "the lossless weight format vs torch.nn.functional.linear (cuBLAS) on Llama-3.1-8B and Qwen3-32B "
                   "shapes")
    k.add_argument("--models", default="llama-3.1-8b,qwen3-32b", help="--linear: model shapes (default: %(default)s)")
    k.add_argument("--ms", default="1,8,32,64,128,256,2048,8192", help="--linear: rows of x (default: %(default)s)")

    st = bsub.add_parser("steps", formatter_class=Formatter, epilog=EXAMPLES["steps"],
                         help="decode steps at equal rows, by mode, from a throughput run's step log",
                         description="Per mode and decode-row count, the steps without prefill: wall time p50 / "
                                     "p90 / p99 (ms), the seal's mean host time and the rows' mean context.")
    st.add_argument("path", metavar="STEPS_JSON", help="bench throughput's OUT_steps.json")
    st.set_defaults(func=cmd_bench)
    return b


def _subcommand(bsub, name: str, help: str, description: str, device_help: str = "cuda, cpu or auto (default: "
                "%(default)s)", compare_default: str = DEFAULT_COMPARE) -> argparse.ArgumentParser:
    """A ``zipfusion bench`` subcommand with its example, the options every one has and --device."""
    p = bsub.add_parser(name, formatter_class=Formatter, epilog=EXAMPLES[name], help=help, description=description)
    _common(p, name, compare_default)
    p.add_argument("--device", default="auto", help=device_help)
    p.set_defaults(func=cmd_bench)
    return p


def _resolve_device(device: str) -> str:
    if device in (None, "auto"):
        import torch
        return "cuda" if torch.cuda.is_available() else "cpu"
    if not (device == "cpu" or device == "cuda" or device.startswith("cuda:")):
        raise ValueError(f"--device must be cuda, cuda:N, cpu or auto, got {device!r}")
    return device


def _engine_args(text: str) -> dict:
    try:
        extra = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--engine-args is not JSON ({exc}); e.g. '{{\"enforce_eager\": true}}'") from None
    if not isinstance(extra, dict):
        raise ValueError(f"--engine-args must be a JSON object of LLM options, got {text}")
    ours = {"kv_compression", "attention_backend", "device", "kv_memory_gb", "max_num_seqs", "max_num_batched_tokens",
            "max_model_len", "deterministic", "model", "weight_compression", "kv_gets_weight_savings"}
    taken = sorted(set(extra) & ours)
    if taken:
        raise ValueError(f"--engine-args sets {taken}, which the benchmark sets itself (--compare/--mode or "
                         "its own option); use those instead")
    return extra


def _terminate(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def cmd_bench(args) -> int:
    """SIGTERM (e.g. timeout(1)) ends a run as Ctrl-C does: the servers and workers it started are stopped."""
    import signal
    import threading
    if threading.current_thread() is not threading.main_thread():
        return _cmd_bench(args)
    before = signal.signal(signal.SIGTERM, _terminate)
    try:
        return _cmd_bench(args)
    finally:
        signal.signal(signal.SIGTERM, before)


def _cmd_bench(args) -> int:
    from . import KERNEL_MODES, parse_modes
    kind = args.bench_command
    if kind == "steps":
        from .steps import run
        return run(args.path)
    modes = parse_modes(args.compare if args.compare is not None else args.mode or args.default_modes,
                        **({"known": KERNEL_MODES} if kind == "kernel" else {}))
    args.argv = getattr(args, "argv", None)
    if kind != "kernel":
        for flag in ("kv_memory_gb", "max_num_seqs", "max_num_batched_tokens", "max_model_len", "num_prompts"):
            v = getattr(args, flag, None)
            if v is not None and not v > 0:
                raise ValueError(f"--{flag.replace('_', '-')} must be > 0, got {v}")
    if kind == "serve":
        from .stats import parse_goodput
        slo = parse_goodput(args.goodput)       # before anything starts: a typo costs nothing
        device = args.device if args.url or args.merge else _resolve_device(args.device)
        from .serve import run
        return run(args, modes, device, slo)
    device = _resolve_device(args.device)
    if kind == "kernel" and args.linear:
        from .weight_kernel import run
        return run(args, device)
    if kind == "kernel":
        from .kernel import run
        return run(args, modes, device)
    engine = _engine_args(args.engine_args)
    if kind == "throughput":
        from .throughput import run
    else:
        from .latency import run
    return run(args, modes, device, engine)
