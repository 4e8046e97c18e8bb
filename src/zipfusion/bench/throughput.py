"""``zipfusion bench throughput``: offline, every request of a dataset at once, each mode in its
own process; tokens/s, peak batch, preemptions, the KV's stored ratio and whether the modes
produced the same tokens. Every step's numbers go to OUT_steps.json."""

from __future__ import annotations

import dataclasses
import os
import time

from . import datasets, report
from .offline import (STEP_FIELDS, device_name, log, note, run_modes, run_requests, step_rows, summarize,
                      warm_up, weight_numbers)

RATIO_KEYS = {"total_tok_s": "total tok/s", "output_tok_s": "output tok/s", "requests_s": "req/s",
              "decode_tok_s_at_peak_batch": "decode tok/s at peak", "peak_batch": "peak batch"}
COLUMNS = [("mode", "mode", "{}"), ("requests", "requests", "{}"), ("wall_s", "wall s", "{:.2f}"),
           ("total_tok_s", "total tok/s", "{:,.1f}"), ("output_tok_s", "output tok/s", "{:,.1f}"),
           ("requests_s", "req/s", "{:.2f}"), ("peak_batch", "peak batch", "{}"), ("preemptions", "preempt", "{}"),
           ("weights_stored_gb", "weights GiB", "{:.3g}"), ("kv_memory_gb", "KV GiB", "{:.3g}"),
           ("stored_ratio", "stored ratio", "{:.3f}"), ("compressible_fraction", "compressible", "{:.1%}")]


def engine_options(job: dict) -> dict:
    """The LLM options of a worker: the job's sizes, its mode's options, then ``--engine-args``."""
    from . import MODES
    sizes = {k: job.get(k) for k in ("device", "kv_memory_gb", "max_num_seqs", "max_num_batched_tokens",
                                      "max_model_len")}
    return {**{k: v for k, v in sizes.items() if v is not None}, "deterministic": job.get("deterministic", False),
            **MODES[job["mode"]][0], **job.get("engine", {})}


def build_engine(job: dict):
    """The worker's LLM and the seconds it took."""
    import torch

    from .. import LLM
    from ..config import default_cpu_threads
    if job.get("device", "auto") == "cpu" or not torch.cuda.is_available():
        torch.set_num_threads(job.get("cpu_threads") or default_cpu_threads())
    t0 = time.perf_counter()
    llm = LLM(job["model"], **engine_options(job))
    return llm, time.perf_counter() - t0


def token_prompts(llm, ds: datasets.Dataset) -> list[list[int]]:
    """The dataset's prompts as token ids (text is tokenized and cut to its length)."""
    if not ds.prompts or not isinstance(ds.prompts[0], str):
        return ds.prompts
    if llm.tokenizer is None:
        raise ValueError(f"model {llm.engine.source.name!r} has no tokenizer: --prompt-format text needs one "
                         "(use --prompt-format ids)")
    return [llm.tokenizer.encode(p)[:n] for p, n in zip(ds.prompts, ds.prompt_lens)]


def worker(job: dict) -> dict:
    llm, build_s = build_engine(job)
    eng = llm.engine
    ds = datasets.build(datasets.LengthDist(**job["dist"]), job["dataset"], job["num_prompts"], seed=job["seed"],
                        vocab=eng.model_config.vocab_size, max_len=eng.max_model_len,
                        range_ratio=job["range_ratio"], text=job["text"])
    prompts = token_prompts(llm, ds)
    t0 = time.perf_counter()
    warm_up(eng, eng.max_model_len)
    warm_s = time.perf_counter() - t0
    base = eng.cache.stats()
    turns = ds.turns or [[]] * len(prompts)
    expected = sum(o * (1 + len(t)) for o, t in zip(ds.output_lens, turns))  # every turn's answer
    log(f"  [{job['mode']}] {len(prompts)} requests ({sum(map(len, prompts)):,} prompt tokens, "
        f"{expected:,} to generate) at once")
    trace = (StepTrace(job["profile_steps"], job["trace_path"].format(mode=job["mode"]))
             if job.get("profile_steps") else None)
    reqs, steps, wall = run_requests(eng, prompts, ds.output_lens, label=f"[{job['mode']}]",
                                     progress_s=job.get("progress_s", 20.0), on_step=trace, turns=turns)
    extra = trace.finish() if trace else {}
    return {"mode": job["mode"], **summarize(eng, reqs, steps, wall, base), **extra,
            "step_fields": list(STEP_FIELDS), "step_log": step_rows(steps),
            "finished": sum(r.finish_reason is not None for r in reqs),
            "expected_output_tokens": expected, "dataset": ds.summary(),
            "kv_memory_gb": eng.kv_memory_gb, "kv_memory_gb_asked": job.get("kv_memory_gb"),
            **weight_numbers(eng), "max_model_len": eng.max_model_len,
            "max_num_seqs": eng.config.max_num_seqs, "max_num_batched_tokens": eng.config.max_num_batched_tokens,
            "device_name": device_name(eng), "build_s": build_s, "warm_up_s": warm_s}


def parse_steps(text: str) -> tuple[int, int]:
    """``START:END`` -> (start, end) with 0 <= start < end (ValueError: one line)."""
    try:
        a, b = (int(x) for x in text.split(":"))
    except ValueError:
        a = b = -1
    if not 0 <= a < b:
        raise ValueError(f"--profile-steps takes START:END with 0 <= START < END, got {text!r}")
    return a, b


class StepTrace:
    """torch.profiler over steps [start, end) of a run: a Chrome trace at ``path`` and the top
    operators by device time."""

    def __init__(self, steps: str, path: str):
        import torch
        self.start, self.end = parse_steps(steps)
        self.path, self.step, self.prof, self.done = path, 0, None, None  # done: the finished profile
        self.activities = [torch.profiler.ProfilerActivity.CPU] + (
            [torch.profiler.ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        if self.start == 0:
            self._begin()

    def __call__(self, eng, res) -> None:
        self.step += 1
        if self.step == self.start:
            self._begin()
        elif self.step == self.end and self.prof is not None:
            self._stop()

    def _begin(self) -> None:
        import torch
        self.prof = torch.profiler.profile(activities=self.activities, record_shapes=False)
        self.prof.__enter__()

    def _stop(self) -> None:
        import torch
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.prof.__exit__(None, None, None)
        self.prof.export_chrome_trace(self.path)
        self.done, self.prof = self.prof, None

    def finish(self) -> dict:
        """The trace's summary (its steps, file and top operators), or why there is none."""
        if self.prof is not None:  # the run ended inside the window
            self._stop()
        prof = self.done
        if prof is None:
            return {"profile": {"steps": [self.start, self.end], "note": f"the run had only {self.step} steps"}}
        cuda = self.activities[-1].name == "CUDA"
        key = "device_time_total" if cuda else "cpu_time_total"
        ops = sorted(prof.key_averages(), key=lambda e: getattr(e, key), reverse=True)[:25]
        top = [{"name": e.key, "calls": e.count, "device_ms" if cuda else "cpu_ms": getattr(e, key) / 1e3,
                "self_cpu_ms": e.self_cpu_time_total / 1e3} for e in ops]
        log(f"  traced steps {self.start}..{self.end - 1}: {self.path}")
        return {"profile": {"steps": [self.start, self.end], "trace": self.path, "top_ops": top}}


def identical_outputs(records: list[dict]) -> bool | None:
    """Whether every mode that ran produced the same tokens (None: fewer than two ran)."""
    hashes = [r["outputs_sha256"] for r in records if "outputs_sha256" in r]
    return len(set(hashes)) == 1 if len(hashes) > 1 else None


def plot(result: dict, path: str) -> bool:
    c = result["config"]
    return report.mode_bars([r for r in result["records"] if "output_tok_s" in r],
                            [("total_tok_s", "total tok/s", "{:,.1f}"), ("output_tok_s", "output tok/s", "{:,.1f}"),
                             ("peak_batch", "peak batch", "{}")],
                            f"zipfusion bench throughput: {c['model']} on {result['meta']['device_name']}, "
                            f"{c['dataset']} x {c['num_prompts']}, KV {c['kv_memory_gb'] or 'default'} GiB", path)


# on the CPU: sizes that finish in about a minute
CPU_DEFAULTS = {"num_prompts": 16, "input_len": 64, "output_len": 32}
GPU_NUM_PROMPTS = 200
NOISE_S = 1.0           # a mode's run shorter than this: its ratios are noise


def size_defaults(args, device: str) -> None:
    """Fill the sizes not given (on the CPU: :data:`CPU_DEFAULTS`, said in the log)."""
    if device != "cpu":
        args.num_prompts = args.num_prompts or GPU_NUM_PROMPTS
        return
    filled = {k: v for k, v in CPU_DEFAULTS.items() if getattr(args, k) is None}
    for k, v in filled.items():
        setattr(args, k, v)
    if filled:
        log("on the CPU, sized to finish in about a minute: " + ", ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in filled.items()) + " (give them to change)")


def noise_note(records: list[dict]) -> str | None:
    """A warning when a mode's run was too short for its ratio to mean anything."""
    short = [r["mode"] for r in records if r.get("wall_s") is not None and r["wall_s"] < NOISE_S]
    return (f"{', '.join(short)} ran under {NOISE_S:g} s: the ratios are noise at this size (give more "
            "--num-prompts or --output-len)") if short else None


def run(args, modes: list[str], device: str, engine: dict) -> int:
    """The driver: one worker process per mode, then the table, JSON and PNG."""
    datasets.resolve(args.dataset)
    size_defaults(args, device)
    dist = datasets.resolve(args.dataset, args.input_len, args.output_len, args.shared_prefix, args.prefix_group)
    datasets.build(dist, args.dataset, args.num_prompts, range_ratio=args.range_ratio,
                   text=args.prompt_format == "text")  # bad sizes: now
    job = {"model": args.model, "device": device, "kv_memory_gb": args.kv_memory_gb,
           "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
           "max_model_len": args.max_model_len, "deterministic": args.deterministic, "engine": engine,
           "cpu_threads": args.cpu_threads, "dataset": args.dataset, "dist": dataclasses.asdict(dist),
           "num_prompts": args.num_prompts, "seed": args.seed, "range_ratio": args.range_ratio,
           "text": args.prompt_format == "text"}
    if args.profile_steps:
        parse_steps(args.profile_steps)
        job["profile_steps"] = args.profile_steps
        job["trace_path"] = os.path.abspath(args.out) + "_{mode}.trace.json.gz"
    meta = report.run_meta("throughput", args.argv, device)
    log(f"zipfusion bench throughput: {args.model} on {meta['device_name']}, {args.dataset} x {args.num_prompts}, "
        f"modes {', '.join(modes)}")
    records = run_modes("throughput", modes, job, args.timeout, lambda r: (
        f"wall {r['wall_s']:.2f} s, {r['total_tok_s']:,.1f} tok/s total, {r['output_tok_s']:,.1f} output, "
        f"peak batch {r['peak_batch']}, {r['preemptions']} preemptions"))
    steps = {r["mode"]: {"fields": r.pop("step_fields"), "rows": r.pop("step_log")}
             for r in records if "step_log" in r}  # every step, apart: OUT_steps.json
    ran = {r["mode"]: r for r in records if "output_tok_s" in r}
    result = {"meta": meta, "config": {k: v for k, v in job.items() if k != "dist"} | {"length_dist": job["dist"]},
              "records": records, "ratios": report.ratios(ran, tuple(RATIO_KEYS), modes[0]),
              "identical_outputs": identical_outputs(records), "ratio_note": noise_note(records)}
    written = report.save(result, args.out, plot)
    if steps:
        steps_path = report.out_paths(args.out)[0][:-len(".json")] + "_steps.json"
        report.write_json(steps, steps_path)
        written += f" and {steps_path}"
    rows = [r if "output_tok_s" in r else {"mode": r["mode"], "note": note(r)} for r in records]
    print(written)
    print(report.text_table(rows, COLUMNS))
    if result["ratios"]:
        print(report.ratio_table(result["ratios"], RATIO_KEYS))
        print(f"identical tokens across modes: {result['identical_outputs']}")
        if result["ratio_note"]:
            print(f"NOTE: {result['ratio_note']}")
    return 1 if any("error" in r for r in records) else 0
