"""Sampling parameters and the batched sampler, in vLLM's order and semantics; a seeded request
draws from its own generator, so its tokens do not depend on the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import MAX_LOGIT_BIAS, MAX_PENALTY
from .structured import check_guided, guide_of


@dataclass
class Logprob:
    """A token's log-probability under the raw model distribution and its rank there (vLLM-shaped)."""

    logprob: float
    rank: int


def _number(name: str, v, lo: float, hi: float, lo_open: bool = False) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (lo < v if lo_open else lo <= v) or not v <= hi:
        raise ValueError(f"{name} must be a number in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {v!r}")


@dataclass
class SamplingParams:
    """What to generate for one prompt (vLLM's names, defaults and ranges). Structured output:
    at most one ``guided_*`` field (:mod:`.structured`)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    max_tokens: int | None = 16
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @property
    def fixed_length(self) -> bool:
        """Whether the output is exactly ``max_tokens`` long (no EOS, no stops)."""
        return self.ignore_eos and not self.stop and not self.stop_token_ids

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or a positive int, got {self.top_k!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise TypeError(f"seed must be an int or None, got {type(self.seed).__name__}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be a positive int or None, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an int >= 0, got {self.min_tokens!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        if any(not isinstance(t, int) for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be ints, got {self.stop_token_ids!r}")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or self.logprobs < 0):
            raise ValueError(f"logprobs must be an int >= 0 (number of top tokens) or None, got {self.logprobs!r}")
        check_guided(self)
        _number("presence_penalty", self.presence_penalty, -MAX_PENALTY, MAX_PENALTY)
        _number("frequency_penalty", self.frequency_penalty, -MAX_PENALTY, MAX_PENALTY)
        _number("repetition_penalty", self.repetition_penalty, 0, float("inf"), lo_open=True)
        if self.logit_bias:
            bias = {}
            for k, v in dict(self.logit_bias).items():
                try:
                    tok = int(k)
                except (TypeError, ValueError):
                    raise ValueError(f"logit_bias keys must be token ids, got {k!r}") from None
                _number(f"logit_bias[{k}]", v, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
                bias[tok] = float(v)
            self.logit_bias = bias
        else:
            self.logit_bias = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def guided(self) -> bool:
        return guide_of(self) is not None

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


class Sampler:
    """Samples one token per row; keeps one torch.Generator per seeded request."""

    def __init__(self, device: torch.device, seed: int = 0):
        self.device = torch.device(device)
        self._shared = torch.Generator(device=self.device).manual_seed(seed)

    def make_generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed)

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None],
                 history: list[tuple[list[int], list[int]] | None] | None = None) -> torch.Tensor:
        """logits [B, V] fp32 -> token ids [B] int64; ``history``: per row, (prompt ids, output
        ids), needed by rows with a penalty."""
        B, V = logits.shape
        if len(params) != B or len(generators) != B:
            raise ValueError(f"{B} logits rows but {len(params)} params / {len(generators)} generators")
# decided on the host: no device round trip before sampling
        if any(p.penalized or p.logit_bias for p in params):
            logits = apply_penalties(logits, params, history)
        out = logits.argmax(dim=-1)
        greedy_rows = [p.greedy for p in params]
        if all(greedy_rows):
            return out
        dev = logits.device
        temp = torch.tensor([1.0 if p.greedy else p.temperature for p in params], dtype=torch.float32)
        x = logits.float() / temp.to(dev, non_blocking=True)[:, None]
        top_k = [p.top_k if p.top_k > 0 else V for p in params]
        top_p = [float(p.top_p) for p in params]
        if any(k < V for k in top_k) or any(q < 1 for q in top_p):
            x = _top_k_top_p(x, torch.tensor(top_k).to(dev, non_blocking=True),
                             torch.tensor(top_p).to(dev, non_blocking=True))
        probs = torch.softmax(x, dim=-1)
        noise = torch.empty_like(probs)
        shared_rows = [i for i, g in enumerate(generators) if g is None]
        if shared_rows:
            noise[shared_rows] = torch.empty(len(shared_rows), V, device=probs.device).exponential_(
                generator=self._shared)
        for i, g in enumerate(generators):
            if g is not None:
                noise[i].exponential_(generator=g)
        drawn = (probs / noise).argmax(dim=-1)
        greedy = torch.tensor(greedy_rows).to(dev, non_blocking=True)
        return torch.where(greedy, out, drawn)


def apply_penalties(logits: torch.Tensor, params: list[SamplingParams],
                    history: list[tuple[list[int], list[int]] | None] | None) -> torch.Tensor:
    """The logits with each row's logit bias and penalties applied (only rows that have any)."""
    B, V = logits.shape
    dev = logits.device
    rows = [i for i, p in enumerate(params) if p.penalized or p.logit_bias]
    x = logits.float().clone()
    sub = x[rows]
    bias = [(j, t, b) for j, i in enumerate(rows) for t, b in (params[i].logit_bias or {}).items() if 0 <= t < V]
    if bias:
        r_, t_, b_ = zip(*bias)
        sub.index_put_((torch.tensor(r_, device=dev), torch.tensor(t_, device=dev)),
                       torch.tensor(b_, dtype=sub.dtype, device=dev), accumulate=True)
    pen = [j for j, i in enumerate(rows) if params[i].penalized]
    if pen:
        if history is None or any(history[rows[j]] is None for j in pen):
            raise ValueError("penalties need each penalised row's prompt and output token ids")
        out_r, out_t, pr_r, pr_t = [], [], [], []
        for k, j in enumerate(pen):
            prompt, output = history[rows[j]]
            out_r += [k] * len(output)
            out_t += output
            pr_r += [k] * len(prompt)
            pr_t += prompt
        P = len(pen)
        counts = torch.zeros(P, V, dtype=sub.dtype, device=dev)
        if out_t:
            counts.index_put_((torch.tensor(out_r, device=dev), torch.tensor(out_t, device=dev)),
                              torch.ones(len(out_t), dtype=sub.dtype, device=dev), accumulate=True)
        seen = counts > 0
        if pr_t:
            seen[torch.tensor(pr_r, device=dev), torch.tensor(pr_t, device=dev)] = True
        ps = [params[rows[j]] for j in pen]
        rep = torch.tensor([p.repetition_penalty for p in ps], dtype=sub.dtype).to(dev)[:, None]
        freq = torch.tensor([p.frequency_penalty for p in ps], dtype=sub.dtype).to(dev)[:, None]
        pres = torch.tensor([p.presence_penalty for p in ps], dtype=sub.dtype).to(dev)[:, None]
        y = sub[pen]
        y = torch.where(seen, torch.where(y > 0, y / rep, y * rep), y)
        y = y - freq * counts - pres * (counts > 0).to(y.dtype)
        sub[pen] = y
    x[rows] = sub
    return x


def compute_logprobs(logits: torch.Tensor, tokens: torch.Tensor, num_top: list[int]) -> list[dict[int, Logprob]]:
    """Per row: {token id: Logprob} for the sampled token and the ``num_top`` most likely, from
    the raw logits; one transfer to the host."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(-1, tokens.view(-1, 1).to(lp.device))
    rank = (lp > chosen).sum(-1) + 1
    k = max(num_top)
    if k > 0:
        top_lp, top_ids = lp.topk(min(k, lp.shape[-1]), dim=-1)
        top_lp, top_ids = top_lp.cpu().tolist(), top_ids.cpu().tolist()
    chosen, rank, tok = chosen[:, 0].cpu().tolist(), rank.cpu().tolist(), tokens.cpu().tolist()
    out = []
    for i, n in enumerate(num_top):
        d = {int(tok[i]): Logprob(chosen[i], int(rank[i]))}
        for j in range(n):
            d.setdefault(top_ids[i][j], Logprob(top_lp[i][j], j + 1))
        out.append(d)
    return out


def _top_k_top_p(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """-inf for every logit outside the row's top-k, then its top-p nucleus (the top token stays)."""
    V = x.shape[-1]
    sorted_x, order = x.sort(dim=-1, descending=True)
    rank = torch.arange(V, device=x.device)[None, :]
    sorted_x = sorted_x.masked_fill(rank >= top_k[:, None], float("-inf"))
    probs = sorted_x.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs
    sorted_x = sorted_x.masked_fill((before >= top_p[:, None]) & (rank > 0), float("-inf"))
    return torch.full_like(x, float("-inf")).scatter(-1, order, sorted_x)
