"""Sampling parameters and the batched sampler.

One call samples every row of a ``[B, V]`` logits tensor on its device: greedy rows take the
argmax; the others are divided by their temperature, cut to their top-k and top-p sets and
sampled by the exponential race (argmax of p_i / E_i with E_i ~ Exp(1), which picks i with
probability p_i). A request with a ``seed`` draws its E from its own generator, so its tokens
do not depend on what else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    """What to generate for one prompt (vLLM's names and defaults).

    temperature 0 means greedy. ``top_k`` -1 (or 0) means all tokens, ``top_p`` 1.0 the whole
    distribution. ``stop`` strings end the output (not included in ``.text``); ``stop_token_ids``
    add to the model's end-of-sequence tokens, which ``ignore_eos`` disregards.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    max_tokens: int | None = 16
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: None = field(default=None, repr=False)

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
        if self.logprobs is not None:
            raise ValueError("logprobs are not supported yet")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class Sampler:
    """Samples one token per row; keeps one torch.Generator per seeded request."""

    def __init__(self, device: torch.device, seed: int = 0):
        self.device = torch.device(device)
        self._shared = torch.Generator(device=self.device).manual_seed(seed)

    def make_generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed)

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None]) -> torch.Tensor:
        """logits [B, V] fp32 -> token ids [B] int64 (on the logits' device)."""
        B, V = logits.shape
        if len(params) != B or len(generators) != B:
            raise ValueError(f"{B} logits rows but {len(params)} params / {len(generators)} generators")
        # what to do is decided on the host from the params: no device round trip before sampling
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
        sampled = (probs / noise).argmax(dim=-1)
        greedy = torch.tensor(greedy_rows).to(dev, non_blocking=True)
        return torch.where(greedy, out, sampled)


def _top_k_top_p(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set to -inf every logit outside the row's top-k, then outside its top-p nucleus (the
    smallest set of most likely tokens whose probability reaches top_p; the top token always
    stays)."""
    V = x.shape[-1]
    sorted_x, order = x.sort(dim=-1, descending=True)
    rank = torch.arange(V, device=x.device)[None, :]
    sorted_x = sorted_x.masked_fill(rank >= top_k[:, None], float("-inf"))
    probs = sorted_x.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs                    # mass of the better tokens
    sorted_x = sorted_x.masked_fill((before >= top_p[:, None]) & (rank > 0), float("-inf"))
    return torch.full_like(x, float("-inf")).scatter(-1, order, sorted_x)
