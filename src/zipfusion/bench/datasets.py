"""Synthetic datasets: prompt and output lengths drawn from a named distribution (:data:`DATASETS`,
lognormal around a median, capped), prompts as random token ids or random words, every draw a
function of the seed alone. No torch here: the serving client imports this module.
"""

from __future__ import annotations

import dataclasses
import math
import random

SIGMA = 0.8
ID_RANGE_LOW = 10  # clear of special tokens at either end


@dataclasses.dataclass(frozen=True)
class LengthDist:
    prompt: int  # fixed when ``prompt_cap`` is 0
    output: int
    prompt_cap: int = 0
    output_cap: int = 0
    shared_prefix: int = 0  # > 0: requests in groups of ``group`` share one such prefix
    group: int = 1
    turns: int = 1  # > 1: conversations; turn t + 1's prompt = turn t's prompt + answer + ``turn_prompt`` new
    turn_prompt: int = 0
    about: str = ""


DATASETS = {
    "chat": LengthDist(300, 250, 4096, 1024, about="ShareGPT-like conversation turns"),
    "reasoning": LengthDist(200, 1500, 2048, 6000, about="decode-heavy: short question, long answer"),
    "long": LengthDist(12000, 250, 30000, 1000, about="long context"),
    "agent": LengthDist(1000, 120, 8000, 500, shared_prefix=2048, group=8,
                        about="prefill-heavy, a shared system prompt + tools per group of 8"),
    "random": LengthDist(1024, 128, about="fixed lengths (--input-len, --output-len, --range-ratio)"),
    # benchmarks/workloads.py's scenarios, the same lengths and sharing (docs/benchmarks.md maps them)
    "burst": LengthDist(8192, 256, about="fixed 8,192-token prompts, 256 out"),
    "mix": LengthDist(1200, 300, 7000, 2000, about="mixed lengths, prompts up to 7,000 tokens"),
    "long32k": LengthDist(32768, 512, about="fixed 32,768-token prompts, 512 out (--max-model-len 33792)"),
    "long_generation": LengthDist(1024, 8192, about="fixed 1,024-token prompts, 8,192 out"),
    "shared_prefix": LengthDist(256, 256, shared_prefix=4096, group=16,
                                about="256-token questions behind a 4,096-token prompt shared by groups of 16"),
    "multi_turn": LengthDist(1024, 256, turns=8, turn_prompt=256,
                             about="conversations of 8 turns, 256 new tokens and 256 out a turn"),
}

# common words: text prompts are random sequences of them (about one token each)
TEXT_TOKENS_PER_WORD = 1.5
WORDS = list(dict.fromkeys("""the of and to in is was that for on with as by at from his he it an be are this which or
had not but were all have one their they been has there who more when so if will would no its
into out up some time than them only other new then what about two first after these also any
may such people made over can could years most like should where between through well much
before three world great must same year back because down while those state under during last
long each work being even many life day used both high part place against small old take found
here without water way off later called every another large might never often city number still
point public house light early little children form power young given until order today family
market little system country group land music history line name water story level war side
river field sound fire road paper table voice stone ship horse window garden letter""".split()))


def lognormal(median: int, cap: int, n: int, rng: random.Random) -> list[int]:
    """``n`` lengths: ``median`` each when ``cap`` is 0, else lognormal(ln median, SIGMA) in [1, cap]."""
    if not cap:
        return [median] * n
    return [max(1, min(cap, round(math.exp(math.log(median) + SIGMA * rng.gauss(0.0, 1.0))))) for _ in range(n)]


def uniform(length: int, range_ratio: float, n: int, rng: random.Random) -> list[int]:
    lo, hi = max(1, round(length * (1 - range_ratio))), max(1, round(length * (1 + range_ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


def random_prompts(lens: list[int], vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    ids = range(ID_RANGE_LOW, max(ID_RANGE_LOW + 1, vocab - ID_RANGE_LOW))
    return [rng.choices(ids, k=n) for n in lens]


def random_text(lens: list[int], seed: int) -> list[str]:
    """Prompts of random common words, about one token a word (the server counts the tokens)."""
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=n)).capitalize() + "." for n in lens]


@dataclasses.dataclass
class Dataset:
    name: str
    prompts: list                 # token id lists, or str (text)
    prompt_lens: list[int]  # tokens asked for (text: words)
    output_lens: list[int]
    clipped: int
    turns: list = dataclasses.field(default_factory=list)  # per request, its later turns' new tokens

    def __len__(self) -> int:
        return len(self.prompts)

    def summary(self) -> dict:
        def stats(xs):
            s = sorted(xs)
            return {"mean": sum(s) / len(s), "median": s[len(s) // 2], "min": s[0], "max": s[-1],
                    "total": sum(s)} if s else {}
        return {"dataset": self.name, "requests": len(self), "prompt_tokens": stats(self.prompt_lens),
                "output_tokens": stats(self.output_lens), "clipped_to_max_len": self.clipped}


def resolve(name: str, input_len: int | None = None, output_len: int | None = None,
            shared_prefix: int | None = None, group: int | None = None) -> LengthDist:
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; pick from {', '.join(DATASETS)}")
    d = DATASETS[name]
    for flag, v in (("--input-len", input_len), ("--output-len", output_len)):
        if v is not None and v < 1:
            raise ValueError(f"{flag} must be >= 1, got {v}")
    for flag, v in (("--shared-prefix", shared_prefix), ("--prefix-group", group)):
        if v is not None and v < (0 if flag == "--shared-prefix" else 1):
            raise ValueError(f"{flag} must be >= {0 if flag == '--shared-prefix' else 1}, got {v}")
    scale = lambda cap, new, old: max(new, round(cap * new / old)) if cap else 0  # noqa: E731
    p, o = input_len or d.prompt, output_len or d.output
    return dataclasses.replace(d, prompt=p, output=o, prompt_cap=scale(d.prompt_cap, p, d.prompt),
                               output_cap=scale(d.output_cap, o, d.output),
                               turn_prompt=max(1, round(d.turn_prompt * p / d.prompt)) if d.turn_prompt else 0,
                               shared_prefix=d.shared_prefix if shared_prefix is None else shared_prefix,
                               group=group or d.group)


def fit(prompt: int, output: int, max_len: int) -> tuple[int, int]:
    """Lengths cut to fit ``max_len`` (prompt shortened first, down to half, then the output)."""
    if prompt + output < max_len:
        return prompt, output
    output = min(output, max(1, max_len - 1 - min(prompt, max_len // 2)))
    return max(1, min(prompt, max_len - 1 - output)), output


def lengths(dist: LengthDist, n: int, *, seed: int = 0, max_len: int | None = None,
            range_ratio: float = 0.0) -> tuple[list[int], list[int], int]:
    """``n`` (prompt, output) lengths of ``dist``, cut to fit ``max_len``, and how many were cut."""
    if n < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {n}")
    if not 0 <= range_ratio < 1:
        raise ValueError(f"--range-ratio must be in [0, 1), got {range_ratio}")
    rng = random.Random(seed)
    if dist.prompt_cap or dist.output_cap:
        plens = lognormal(dist.prompt, dist.prompt_cap, n, rng)
        olens = lognormal(dist.output, dist.output_cap, n, rng)
    else:
        plens, olens = uniform(dist.prompt, range_ratio, n, rng), uniform(dist.output, range_ratio, n, rng)
    if max_len is None:
        return plens, olens, 0
    if dist.shared_prefix >= max_len // 2:
        raise ValueError(f"a shared prefix of {dist.shared_prefix} tokens leaves too little of max_model_len={max_len}: "
                         f"pass --shared-prefix below {max_len // 2} (or a model with a longer context)")
    later = (dist.turns - 1) * (dist.turn_prompt + max(olens))  # what a conversation's later turns add
    if dist.shared_prefix + later >= max_len // 2:
        raise ValueError(f"{dist.turns} turns of {dist.turn_prompt} + {max(olens)} tokens leave too little of "
                         f"max_model_len={max_len}: pass a smaller --output-len or --input-len, or --max-model-len")
    fitted = [fit(p, o, max_len - dist.shared_prefix - later) for p, o in zip(plens, olens)]
    clipped = sum(f != po for f, po in zip(fitted, zip(plens, olens)))
    return [p for p, _ in fitted], [o for _, o in fitted], clipped


def build(dist: LengthDist, name: str, n: int, *, seed: int = 0, id_seed: int | None = None, vocab: int = 2048,
          max_len: int | None = None, range_ratio: float = 0.0, text: bool = False) -> Dataset:
    """``n`` requests of ``dist``: ``seed`` draws the lengths, ``id_seed`` (default ``seed``) the
    tokens, so one set of lengths can be sent with fresh tokens."""
    if text and dist.turns > 1:
        raise ValueError(f"dataset {name!r} is conversations of token ids: pass --prompt-format ids")
    if text and max_len is not None:
        max_len = int(max_len / TEXT_TOKENS_PER_WORD)
    plens, olens, clipped = lengths(dist, n, seed=seed, max_len=max_len, range_ratio=range_ratio)
    prefix = dist.shared_prefix
    id_seed = seed if id_seed is None else id_seed
    groups = -(-n // dist.group)
    if text:
        prompts = random_text(plens, id_seed)
        if prefix:
            system = random_text([prefix] * groups, id_seed + 1)
            prompts = [system[i // dist.group] + " " + p for i, p in enumerate(prompts)]
    else:
        prompts = random_prompts(plens, vocab, id_seed)
        if prefix:
            system = random_prompts([prefix] * groups, vocab, id_seed + 1)
            prompts = [system[i // dist.group] + p for i, p in enumerate(prompts)]
    later = random_prompts([dist.turn_prompt] * (n * (dist.turns - 1)), vocab, id_seed + 2)
    return Dataset(name, prompts, [p + prefix for p in plens], olens, clipped, [later[i::n] for i in range(n)])


def sharegpt(path: str, n: int, *, seed: int = 0, count=None, max_len: int | None = None) -> Dataset:
    """``n`` conversations of a ShareGPT-style JSON file in a seeded order (vLLM's
    ``sharegpt``): the first human turn is the prompt, the reply's tokens its output length."""
    import json
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"--dataset-path {path}: {exc}") from None
    pairs = []
    for item in data if isinstance(data, list) else []:
        turns = item.get("conversations") if isinstance(item, dict) else None
        if isinstance(turns, list) and len(turns) >= 2 and all(isinstance(t, dict) for t in turns[:2]):
            pairs.append((str(turns[0].get("value", "")), str(turns[1].get("value", ""))))
    if not pairs:
        raise ValueError(f"--dataset-path {path}: no conversations of two turns (ShareGPT's shape: a list of "
                         "{'conversations': [{'from': 'human', 'value': ...}, {'from': 'gpt', 'value': ...}]})")
    random.Random(seed).shuffle(pairs)
    count = count or (lambda text: max(1, round(len(text.split()) * 1.3)))
    prompts, plens, olens = [], [], []
    for prompt, reply in pairs:
        p, o = count(prompt), count(reply)
        if p < 4 or o < 4 or max_len is not None and p + o >= max_len:
            continue
        prompts.append(prompt)
        plens.append(p)
        olens.append(o)
        if len(prompts) == n:
            break
    if len(prompts) < n:
        raise ValueError(f"--dataset-path {path}: {len(prompts)} usable conversations, fewer than --num-prompts {n}")
    return Dataset("sharegpt", prompts, plens, olens, 0)
