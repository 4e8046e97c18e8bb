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
    """A prompt being served."""

    request_id: int
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    num_computed: int = 0
    num_sealed_pages: int = 0          # full pages already handed to the memory manager to compress
    prefix_node: int = 0               # prefix-cache node naming pages[:num_sealed_pages] (0: none)
    dropped_pages: int = 0             # leading pages given back (behind every window): the null page
    num_cached_tokens: int | None = None
    status: Status = Status.WAITING
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    generator: torch.Generator | None = None
    num_preemptions: int = 0
    computed_before: int = 0
    text: str = ""
    arrival_time: float = field(default_factory=time.perf_counter)
    token_times: list[float] = field(default_factory=list, repr=False)
    logprobs: list = field(default_factory=list, repr=False)
    matcher: object = field(default=None, repr=False)

    @property
    def max_total_tokens(self) -> int | None:
        """Prompt + max_tokens (None: no max_tokens)."""
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
        """Tokens before the last one still lack K/V (a prompt, or everything after a preemption)."""
        return self.num_computed < self.num_tokens - 1

    def token_block(self, i: int) -> list[int]:
        """The 16 tokens of page ``i`` (it must be full)."""
        a, b, n = i * PAGE_TOKENS, (i + 1) * PAGE_TOKENS, len(self.prompt_ids)
        if b <= n:
            return self.prompt_ids[a:b]
        return self.prompt_ids[a:] + self.output_ids[max(0, a - n):b - n]

    def pages_needed(self, upto_tokens: int) -> int:
        return max(0, -(-upto_tokens // PAGE_TOKENS) - len(self.pages))


@dataclass
class CompletionOutput:
    """One prompt's result."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: str | int | None = None
    logprobs: list | None = None


@dataclass
class RequestOutput:

    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    num_preemptions: int = 0
    num_cached_tokens: int = 0

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids
