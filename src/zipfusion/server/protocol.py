"""Request bodies of the OpenAI-compatible API and their translation into SamplingParams.

Every field OpenAI defines is either implemented or refused with a 400 that names it; a field
neither OpenAI nor vLLM defines is refused the same way (``extra="forbid"``), so nothing a
client asks for is silently ignored. vLLM's extras ``top_k``, ``min_tokens``,
``repetition_penalty``, ``stop_token_ids`` and ``ignore_eos`` are accepted too.
"""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from ..engine.sampling import SamplingParams

MAX_N = 128          # most samples one request may ask for


class BadRequest(Exception):
    """A request the server refuses (400) before it reaches the engine."""

    def __init__(self, message: str, status: int = 400, param: str | None = None):
        super().__init__(message)
        self.status, self.param = status, param


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float = 1.0
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Union[str, list[str], None] = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None                      # an end-user id: logged by OpenAI, no effect on output
    # vLLM / SGLang extras
    top_k: int = -1
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False

    def check_common(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise BadRequest("stream_options is only allowed with stream=true", param="stream_options")

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def num_logprobs(self) -> int | None:
        return None

    def sampling_params(self, sample: int, max_tokens: int) -> SamplingParams:
        """The params of sample ``sample`` (0..n-1); with a seed, sample i uses seed + i."""
        try:
            return SamplingParams(
                temperature=1.0 if self.temperature is None else self.temperature, top_p=self.top_p,
                top_k=self.top_k, seed=None if self.seed is None else self.seed + sample, max_tokens=max_tokens,
                stop=self.stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
                min_tokens=self.min_tokens, logprobs=self.num_logprobs(), presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
                logit_bias=self.logit_bias)
        except (ValueError, TypeError) as exc:
            raise BadRequest(str(exc)) from None

    def engine_requests(self, prompts: list[list[int]], default_max_tokens: int,
                        max_model_len: int) -> list[tuple[list[int], SamplingParams]]:
        """One (prompt ids, params) per sample, prompt-major: choice ``i * n + j`` is prompt i, sample j."""
        return [(ids, self.sampling_params(j, self.max_tokens_for(ids, default_max_tokens, max_model_len)))
                for ids in prompts for j in range(self.n)]

    def max_tokens_for(self, prompt_ids: list[int], default_max_tokens: int, max_model_len: int) -> int:
        """What was asked; else what max_model_len leaves after the prompt, at most the server's default."""
        asked = self.requested_max_tokens()
        if asked is not None:
            return asked
        return max(1, min(default_max_tokens, max_model_len - len(prompt_ids)))


class CompletionRequest(_Body):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0)
    best_of: int | None = None
    suffix: str | None = None
    return_token_ids: bool = False        # vLLM's: each choice (and each streamed chunk) carries its token ids

    def check(self) -> None:
        self.check_common()
        if self.suffix:
            raise BadRequest("suffix is not supported", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise BadRequest(f"best_of={self.best_of} is not supported (only best_of == n)", param="best_of")
        if self.echo and self.logprobs is not None:
            raise BadRequest("echo with logprobs is not supported (it needs the prompt's logprobs)", param="echo")
        if isinstance(self.prompt, list) and not self.prompt:
            raise BadRequest("prompt is empty", param="prompt")

    def num_logprobs(self) -> int | None:
        return self.logprobs


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Union[str, list[dict[str, Any]], None] = None
    name: str | None = None

    def text(self, where: str) -> str:
        """The content as one string: text parts joined by newlines; any other part: 400."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        texts = []
        for j, part in enumerate(self.content):
            kind = part.get("type")
            if kind != "text":
                raise BadRequest(f"{where}.content[{j}]: content parts of type {kind!r} are not supported "
                                 "(this server takes text only)", param=f"{where}.content")
            if not isinstance(part.get("text"), str) or set(part) - {"type", "text"}:
                raise BadRequest(f"{where}.content[{j}]: a text part is {{'type': 'text', 'text': str}}",
                                 param=f"{where}.content")
            texts.append(part["text"])
        return "\n".join(texts)


class ChatCompletionRequest(_Body):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0)
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None

    def check(self) -> None:
        self.check_common()
        if self.response_format is not None and self.response_format != {"type": "text"}:
            raise BadRequest(f"response_format {self.response_format!r} is not supported (only {{'type': 'text'}}: "
                             "no JSON mode or structured output)", param="response_format")
        if self.tools:
            raise BadRequest("tools are not supported by this server (no function calling)", param="tools")
        if self.tool_choice not in (None, "none"):
            raise BadRequest("tool_choice is not supported by this server (no function calling)",
                             param="tool_choice")
        if self.top_logprobs is not None and not self.logprobs:
            raise BadRequest("top_logprobs needs logprobs=true", param="top_logprobs")

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def conversation(self) -> list[dict]:
        return [{"role": m.role, "content": m.text(f"messages[{i}]"), **({"name": m.name} if m.name else {})}
                for i, m in enumerate(self.messages)]
