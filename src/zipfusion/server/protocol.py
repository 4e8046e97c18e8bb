"""Request bodies of the OpenAI-compatible API, checked at the edge (strict types, finite numbers in
range, valid Unicode; unknown fields ignored with a warning as vLLM does), into SamplingParams.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError
from typing_extensions import Annotated

from ..config import GUIDED_FIELDS, MAX_LOGIT_BIAS, MAX_PENALTY

if TYPE_CHECKING:  # torch: not imported by the body worker
    from ..engine.sampling import SamplingParams

MAX_N = 128
SEED_MIN, SEED_MAX = -2**63, 2**63 - 1  # vLLM's range
Annotated_bias = Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]
Annotated_token = Annotated[int, Field(ge=0)]
SEED_DOC = ("Sample i of the request uses seed + i. A seeded request gives the same tokens again only on a server "
            "started with --deterministic: otherwise its logits can differ slightly with the batch it runs in and "
            "with how many of its prompt tokens the prefix cache holds (usage.prompt_tokens_details.cached_tokens), "
            "as in vLLM without batch invariance.")


class BadRequest(Exception):
    """A request refused (400) before it reaches the engine; ``code``: OpenAI's error name."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


def _invalid(message: str) -> PydanticCustomError:
    return PydanticCustomError("invalid_value", "{message}", {"message": message})


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


NO_SURROGATES = "no_surrogates"  # validation context: the raw body cannot hold a lone surrogate
LARGE_BODY = 2**20  # bytes from which a body is parsed in the body worker process (server/body_worker.py)


def may_hold_surrogates(raw: bytes) -> bool:
    """Whether JSON bytes can decode to a surrogate: a \\uD800-\\uDFFF escape, one encoded raw
    (json.loads decodes with surrogatepass), or any UTF-16/32 body. Fast scans, a regex where they hit."""
    if json.detect_encoding(raw) not in ("utf-8", "utf-8-sig"):
        return True
    if b"\\u" not in raw and b"\xed" not in raw:
        return False
    return re.search(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]", raw) is not None


def bad_text(value, where: str = "") -> str | None:
    """Where in a parsed body a string is not valid Unicode (a lone surrogate): its path, else None."""
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
        return None
    except UnicodeEncodeError:
        pass
    except (TypeError, ValueError):
        pass
    stack = [(where, value)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return path or "body"
        elif isinstance(v, dict):
            stack.extend((f"{path}.{k}" if path else str(k), x) for k, x in v.items())
            bad_key = next((k for k in v if isinstance(k, str) and bad_text(k) is not None), None)
            if bad_key is not None:
                return path or "body"
        elif isinstance(v, list):
            stack.extend((f"{path}[{i}]", x) for i, x in enumerate(v))
    return None


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data, info: ValidationInfo):
        if info.context and info.context.get(NO_SURROGATES):
            return data
        where = bad_text(data)
        if where is not None:
            raise PydanticCustomError(
                "invalid_text", "{where}: the text holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff "
                "escape), which is not valid Unicode; send UTF-8 text", {"where": where})
        return data


class StreamOptions(_Strict):
    include_usage: bool = False


# accepted, no effect (OpenAI bookkeeping, reasoning knobs)
ACCEPTED_NO_EFFECT = ("user", "store", "metadata", "service_tier", "reasoning_effort")
# refused rather than ignored: ignoring them would change what the client gets
REFUSED_EXTRAS = {"functions": "functions (the deprecated function calling) is not supported: send tools",
                  "function_call": "function_call (the deprecated function calling) is not supported: send "
                                   "tool_choice",
                  "audio": "audio output is not supported by this server (text only)"}


class _Body(_Strict):
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Union[str, list[str], None] = None
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX, description=SEED_DOC)
    presence_penalty: float = Field(default=0.0, ge=-MAX_PENALTY, le=MAX_PENALTY)
    frequency_penalty: float = Field(default=0.0, ge=-MAX_PENALTY, le=MAX_PENALTY)
    logit_bias: dict[str, Annotated_bias] | None = None
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    reasoning_effort: str | None = None
    # vLLM / SGLang extras
    top_k: int = Field(default=-1, ge=-1)
    min_tokens: int = Field(default=0, ge=0)
    repetition_penalty: float = Field(default=1.0, gt=0)
    stop_token_ids: list[Annotated_token] | None = None
    ignore_eos: bool = False
    # structured output (OpenAI's response_format, vLLM's guided_*): at most one
    response_format: dict[str, Any] | None = None
    guided_json: Union[dict[str, Any], str, None] = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_shape(cls, stop):
        if stop is None or isinstance(stop, str) or isinstance(stop, list) and all(isinstance(x, str) for x in stop):
            return stop
        raise _invalid("expected a string, a list of strings, or null")

    def stop_strings(self) -> list[str]:
        return [s for s in ([self.stop] if isinstance(self.stop, str) else self.stop or []) if s]

    def unknown_fields(self) -> list[str]:
        return sorted(self.model_extra or ())

    def check_common(self) -> None:
        extra = self.model_extra or {}
        for name in sorted(extra):
            if name in REFUSED_EXTRAS:
                raise BadRequest(REFUSED_EXTRAS[name], param=name)
        self.guided()
# the chat route's refusals
        if extra.get("tools") or extra.get("tool_choice") not in (None, "none"):
            raise BadRequest("tools are taken on /v1/chat/completions only", param="tools")
        if self.stream_options is not None and not self.stream:
            raise BadRequest("stream_options is only allowed with stream=true", param="stream_options")
        asked = self.requested_max_tokens()
        if asked is not None and self.min_tokens > asked:
            raise BadRequest(f"min_tokens={self.min_tokens} is more than max_tokens={asked}; lower min_tokens",
                             param="min_tokens")
        if self.seed is not None and self.seed + self.n - 1 > SEED_MAX:
            raise BadRequest(f"seed + n - 1 must be <= {SEED_MAX} (sample i uses seed + i); pick a smaller seed",
                             param="seed")

    def check_limits(self, limits, prompts: int = 1) -> None:
        if prompts * self.n > limits.max_sequences:
            raise BadRequest(f"{prompts} prompt(s) x n={self.n} = {prompts * self.n} sequences; this server takes "
                             f"at most {limits.max_sequences} per request (--max-sequences-per-request): "
                             "split the request", param="n" if prompts == 1 else "prompt")
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > limits.max_stop:
            raise BadRequest(f"{len(stops)} stop strings; at most {limits.max_stop} are allowed", param="stop")
        long = [s for s in stops if len(s) > limits.max_stop_chars]
        if long:
            raise BadRequest(f"a stop string of {len(long[0])} characters; at most {limits.max_stop_chars} are "
                             "allowed", param="stop")
        if len(self.stop_token_ids or ()) > limits.max_stop_token_ids:
            raise BadRequest(f"{len(self.stop_token_ids)} stop_token_ids; at most {limits.max_stop_token_ids} "
                             "are allowed", param="stop_token_ids")

    def guided(self) -> dict:
        """The guided_* fields this body asks for (400 for a malformed one or more than one)."""
        given = {k: v for k in GUIDED_FIELDS if (v := getattr(self, k)) is not None}
        fmt = self.response_format
        if fmt is not None:
            kind = fmt.get("type")
            if kind == "json_object":
                given["response_format"] = {"type": "object"}
            elif kind == "json_schema":
                spec = fmt.get("json_schema")
                if not isinstance(spec, dict) or not isinstance(spec.get("name"), str) \
                        or not isinstance(spec.get("schema", {}), dict):
                    raise BadRequest("response_format json_schema must be {'type': 'json_schema', 'json_schema': "
                                     "{'name': str, 'schema': {...}, 'strict': bool}}", param="response_format")
                given["response_format"] = spec.get("schema", {"type": "object"})
            elif kind != "text" or set(fmt) != {"type"}:
                raise BadRequest(f"response_format type {kind!r} is not supported: give 'text', 'json_object' or "
                                 "'json_schema'", param="response_format")
        if len(given) > 1:
            raise BadRequest(f"give one of response_format, {', '.join(GUIDED_FIELDS)} (got "
                             f"{', '.join(given)})", param=sorted(given)[1])
        if not given:
            return {}
        (name, value), = given.items()
        key = "guided_json" if name == "response_format" else name
        return {key: value}

    def guided_param(self) -> str | None:
        return next((k for k in ("response_format",) + GUIDED_FIELDS if getattr(self, k) is not None), None)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def num_logprobs(self) -> int | None:
        return None

    def sampling_params(self, sample: int, max_tokens: int) -> SamplingParams:
        from ..engine.sampling import SamplingParams
        try:
            return SamplingParams(
                temperature=1.0 if self.temperature is None else self.temperature, top_p=self.top_p,
                top_k=self.top_k, seed=None if self.seed is None else self.seed + sample, max_tokens=max_tokens,
                stop=self.stop_strings(), stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
                min_tokens=self.min_tokens, logprobs=self.num_logprobs(), presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
                logit_bias=self.logit_bias, **self.guided())
        except (ValueError, TypeError) as exc:
            raise BadRequest(str(exc)) from None

    def engine_requests(self, prompts: list[list[int]], default_max_tokens: int,
                        max_model_len: int) -> list[tuple[list[int], SamplingParams]]:
        """One (prompt ids, params) per sample, prompt-major."""
        out = []
        for ids in prompts:
            mt = self.max_tokens_for(ids, default_max_tokens, max_model_len)
            if self.min_tokens > mt:
                raise BadRequest(f"min_tokens={self.min_tokens} is more than the {mt} tokens this request may "
                                 "generate (max_tokens, or what max_model_len leaves after the prompt, at most the "
                                 "server's default); lower min_tokens or give max_tokens", param="min_tokens")
            out += [(ids, self.sampling_params(j, mt)) for j in range(self.n)]
        return out

    def check_engine(self, prompts: list[list[int]], vocab: int, max_logprobs: int, max_model_len: int,
                     prompt_param: str = "prompt") -> None:
        for i, ids in enumerate(prompts):
            if not ids:
                raise BadRequest("the prompt is empty (no tokens); give some text or token ids", param=prompt_param)
            bad = next((t for t in ids if t >= vocab), None)
            if bad is not None:
                raise BadRequest(f"prompt token id {bad} is not a token of this model (ids are 0..{vocab - 1})",
                                 param=prompt_param)
            asked = self.requested_max_tokens()
            if len(ids) >= max_model_len or asked is not None and len(ids) + asked > max_model_len:
                too_long = len(ids) >= max_model_len
                raise BadRequest(f"this model's maximum context length (max_model_len) is {max_model_len} tokens, "
                                 f"but {len(ids) + (asked or 0)} were requested ({len(ids)} in the prompt, {asked} "
                                 "in the completion); shorten the prompt or lower max_tokens",
                                 param=prompt_param if too_long else self.max_tokens_param())
        bad = [t for t in self.stop_token_ids or () if t >= vocab]
        if bad:
            raise BadRequest(f"stop_token_ids must be token ids in 0..{vocab - 1}, got {bad[:5]}",
                             param="stop_token_ids")
        bad = [k for k in (self.logit_bias or {}) if not k.lstrip("-").isdigit() or not 0 <= int(k) < vocab]
        if bad:
            raise BadRequest(f"logit_bias keys must be token ids in 0..{vocab - 1}, got {bad[:5]}", param="logit_bias")
        k = self.num_logprobs()
        if k is not None and k > max_logprobs:
            raise BadRequest(f"{self.logprobs_param()}={k} is more than this server's max_logprobs={max_logprobs}",
                             param=self.logprobs_param())

    def max_tokens_param(self) -> str:
        return "max_tokens"

    def logprobs_param(self) -> str:
        return "logprobs"

    def max_tokens_for(self, prompt_ids: list[int], default_max_tokens: int, max_model_len: int) -> int:
        """max_tokens, else what max_model_len leaves after the prompt, at most the default."""
        asked = self.requested_max_tokens()
        if asked is not None:
            return asked
        return max(1, min(default_max_tokens, max_model_len - len(prompt_ids)))


Prompt = Union[str, list[str], list[Annotated_token], list[list[Annotated_token]]]


class CompletionRequest(_Body):
    prompt: Prompt
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0)
    best_of: int | None = Field(default=None, ge=1)
    suffix: str | None = None
    return_token_ids: bool = False  # vLLM's: each choice carries its token ids

    @field_validator("prompt", mode="plain", json_schema_input_type=Prompt)
    @classmethod
    def _prompt_shape(cls, p):
        """The prompt's whole check, in Python: the event loop's thread can take the GIL between two
        ids (the core validator would hold it for the whole list); one clear complaint for a prompt
        of none of its four shapes."""
        if isinstance(p, str) or isinstance(p, list) and all(isinstance(x, str) for x in p):
            return p
        nested = isinstance(p, list) and bool(p) and all(isinstance(row, list) for row in p)
        rows = p if nested else [p]
        if not all(isinstance(row, list) and all(_is_int(x) for x in row) for row in rows):
            raise _invalid("expected a string, a list of strings, a list of token ids, or a list of lists of "
                           "token ids")
        for i, row in enumerate(rows):
            for j, x in enumerate(row):
                if x < 0:
                    where = f"prompt[{i}][{j}]" if nested else f"prompt[{j}]"
                    raise _invalid(f"token ids must be >= 0 ({where} is {x})")
        return p

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


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Union[str, list[dict[str, Any]], None] = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None       # an assistant's earlier calls
    tool_call_id: str | None = None                      # a tool message: the call it answers

    @field_validator("content", mode="before")
    @classmethod
    def _content_shape(cls, content):
        if content is None or isinstance(content, str) or isinstance(content, list) and all(
                isinstance(part, dict) for part in content):
            return content
        raise _invalid("expected a string, a list of content parts ({'type': 'text', 'text': ...}), or null")

    def text(self, where: str) -> str:
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
    top_logprobs: int | None = Field(default=None, ge=0, description="> 0 needs logprobs: true")
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    _tool_guided: dict = PrivateAttr(default_factory=dict)

    def check(self) -> None:
        self.check_common()
        self.tool_list()
        if self.top_logprobs and not self.logprobs:
            raise BadRequest("top_logprobs > 0 needs logprobs=true", param="top_logprobs")

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens else "max_tokens"

    def logprobs_param(self) -> str:
        return "top_logprobs"

    def tool_list(self) -> list[dict]:
        from .tools import check_tools
        tools = check_tools(self.tools, self.tool_choice)
        return [] if self.tool_choice == "none" else tools

    def force_tool_calls(self, fields: dict) -> None:
        if super().guided():
            raise BadRequest("tool_choice 'required' or a named function cannot be combined with response_format "
                             "or guided_*", param="tool_choice")
        self._tool_guided = fields

    def guided(self) -> dict:
        return self._tool_guided or super().guided()

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def conversation(self) -> list[dict]:
        out = []
        for i, m in enumerate(self.messages):
            msg = {"role": m.role, "content": m.text(f"messages[{i}]"), **({"name": m.name} if m.name else {})}
            if m.tool_calls is not None:
                if m.role != "assistant":
                    raise BadRequest(f"messages[{i}]: only assistant messages carry tool_calls",
                                     param=f"messages[{i}].tool_calls")
                msg["tool_calls"] = [_template_call(c, f"messages[{i}].tool_calls[{j}]")
                                     for j, c in enumerate(m.tool_calls)]
            if m.tool_call_id is not None:
                msg["tool_call_id"] = m.tool_call_id
            out.append(msg)
        return out


def _template_call(call: dict, where: str) -> dict:
    f = call.get("function")
    if not isinstance(f, dict) or not isinstance(f.get("name"), str):
        raise BadRequest(f"{where} must be {{'id': str, 'type': 'function', 'function': {{'name': str, 'arguments': "
                         "str}}}}", param=where)
    args = f.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            raise BadRequest(f"{where}.function.arguments is not JSON text", param=where) from None
    return {**call, "function": {"name": f["name"], "arguments": args}}


class TokenizeRequest(_Strict):
    """vLLM's /tokenize body: ``prompt`` text, or ``messages`` rendered by the chat template."""
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    def conversation(self) -> list[dict]:
        return ChatCompletionRequest.model_construct(messages=self.messages).conversation()


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[Annotated_token]


class BodyErrors(Exception):
    """pydantic's complaints about a body (located in it, without the input): FastAPI's
    RequestValidationError once back in the server process."""

    @property
    def errors(self) -> list[dict]:
        return self.args[0]


def load_body(model: type[BaseModel], raw: bytes) -> BaseModel:
    """``raw`` parsed and validated as ``model``; a BadRequest or BodyErrors otherwise."""
    from pydantic import ValidationError
    try:
        data = json.loads(raw)
    except UnicodeDecodeError:
        raise BadRequest("the body could not be read as JSON text (it must be UTF-8 encoded JSON)") from None
    except json.JSONDecodeError as exc:
        raise BodyErrors([{"type": "json_invalid", "loc": ("body", exc.pos), "msg": "JSON decode error",
                           "ctx": {"error": exc.msg}}]) from None
    try:
        return model.model_validate(data, context={NO_SURROGATES: not may_hold_surrogates(raw)})
    except ValidationError as exc:
        raise BodyErrors([{**e, "loc": ("body", *e["loc"])} for e in exc.errors(include_input=False)]) from None
