"""Per-request state and the finished output."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from ..format.layout import PAGE_TOKENS
from .sampling import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    """A prompt being served. ``tokens`` = prompt + generated so far; the K/V of the first
    ``num_computed`` of them is in the request's pages (page ``i`` = tokens 16i..16i+15)."""

    request_id: int
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_sealed_pages: int = 0          # full pages already handed to the memory manager to compress
    prefix_node: int = 0               # prefix-cache node naming pages[:num_sealed_pages] (0: none)
    dropped_pages: int = 0             # leading pages given back (behind every window): the null page
    num_cached_tokens: int | None = None   # prompt tokens found in the prefix cache at admission
    status: Status = Status.WAITING
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    generator: torch.Generator | None = None
    num_preemptions: int = 0
    computed_before: int = 0           # tokens whose K/V was computed before its last preemption
    text: str = ""
    arrival_time: float = field(default_factory=time.perf_counter)
    token_times: list[float] = field(default_factory=list, repr=False)   # when each output token came
    logprobs: list = field(default_factory=list, repr=False)   # per output token {id: Logprob}, when asked
    matcher: object = field(default=None, repr=False)   # structured output: its llguidance matcher

    @property
    def max_total_tokens(self) -> int | None:
        """Prompt + max_tokens (None: no max_tokens; the engine's max_model_len caps it)."""
        mt = self.params.max_tokens
        return None if mt is None else len(self.prompt_ids) + mt

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def in_prefill(self) -> bool:
        """Tokens before the last one still lack K/V (a prompt, or everything after a preemption);
        otherwise the next step is a decode step feeding the last token."""
        return self.num_computed < self.num_tokens - 1

    def token_block(self, i: int) -> list[int]:
        """The 16 tokens of page ``i`` (it must be full)."""
        a, b, n = i * PAGE_TOKENS, (i + 1) * PAGE_TOKENS, len(self.prompt_ids)
        if b <= n:
            return self.prompt_ids[a:b]
        return self.prompt_ids[a:] + self.output_ids[max(0, a - n):b - n]

    def pages_needed(self, upto_tokens: int) -> int:
        """New pages needed to hold K/V of the first ``upto_tokens`` tokens."""
        return max(0, -(-upto_tokens // PAGE_TOKENS) - len(self.pages))


@dataclass
class CompletionOutput:
    """One prompt's result: generated ``text`` and ``token_ids``; ``finish_reason`` is
    "stop" (end-of-sequence token or stop string) or "length" (max_tokens / context limit)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: str | int | None = None
    logprobs: list | None = None      # per token {token id: Logprob} when SamplingParams.logprobs is set


@dataclass
class RequestOutput:
    """vLLM-shaped output: ``outputs[0]`` is the completion; ``.text`` and ``.token_ids`` are
    shortcuts to it."""

    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    num_preemptions: int = 0
    num_cached_tokens: int = 0         # prompt tokens read from the prefix cache instead of computed

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids
