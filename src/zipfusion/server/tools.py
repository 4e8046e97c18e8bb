"""Tool calling on /v1/chat/completions as vLLM's parsers (``hermes`` or ``llama3_json``, from the
chat template); ``required`` and a named function hold the output to the calls' grammar.
"""

from __future__ import annotations

import json
import re
import uuid

from .protocol import BadRequest

HERMES, LLAMA3 = "hermes", "llama3_json"
OPEN, CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
COMPACT = {"whitespace_flexible": False}


def tool_format(chat_template: str | None) -> str:
    """The call format a chat template teaches its model (hermes where it names none)."""
    t = chat_template or ""
    if OPEN in t:
        return HERMES
    if PYTHON_TAG in t or "ipython" in t:
        return LLAMA3
    return HERMES


def renders_tools(chat_template: str | None) -> bool:
    return "tools" in (chat_template or "")


def system_prompt(tools: list[dict]) -> str:
    """The tools described for a template that does not render them (after Qwen's wording)."""
    listing = "\n".join(json.dumps(t) for t in tools)
    return (f"You may call these functions:\n<tools>\n{listing}\n</tools>\nTo call one, write {OPEN}\n"
            f'{{"name": <function-name>, "arguments": <args-json-object>}}\n{CLOSE}')


def with_tools_prompt(conversation: list[dict], tools: list[dict]) -> list[dict]:
    """The conversation for a template that does not render tools: :func:`system_prompt` in
    front, earlier calls written in the hermes format."""
    msgs = []
    for m in conversation:
        calls = m.get("tool_calls")
        if calls:
            text = "\n".join(f"{OPEN}\n{json.dumps({'name': c['function']['name'], 'arguments': c['function']['arguments']})}"
                             f"\n{CLOSE}" for c in calls)
            m = {k: v for k, v in m.items() if k != "tool_calls"}
            m["content"] = (m["content"] + "\n" if m["content"] else "") + text
        msgs.append(m)
    head = system_prompt(tools)
    if msgs and msgs[0]["role"] == "system":
        return [{**msgs[0], "content": msgs[0]["content"] + "\n\n" + head}] + msgs[1:]
    return [{"role": "system", "content": head}] + msgs


def check_tools(tools, tool_choice) -> list[dict]:
    """The tools as OpenAI's shape requires (400 naming the place otherwise)."""
    out = []
    for i, t in enumerate(tools or []):
        f = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(f, dict) \
                or not isinstance(f.get("name"), str) or not f["name"]:
            raise BadRequest(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': str, 'description': "
                             "str, 'parameters': {...}}}}}", param=f"tools[{i}]")
        if not isinstance(f.get("parameters", {}), dict):
            raise BadRequest(f"tools[{i}].function.parameters must be a JSON schema (an object)",
                             param=f"tools[{i}].function.parameters")
        out.append(t)
    if tool_choice in (None, "auto", "none"):
        return out
    if not out:
        raise BadRequest(f"tool_choice {tool_choice!r} needs tools", param="tool_choice")
    if tool_choice == "required":
        return out
    name = tool_choice.get("function", {}).get("name") if isinstance(tool_choice, dict) else None
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" or not isinstance(name, str):
        raise BadRequest("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': "
                         "{'name': str}}", param="tool_choice")
    if name not in {t["function"]["name"] for t in out}:
        raise BadRequest(f"tool_choice names function {name!r}, which is not among the tools", param="tool_choice")
    return out


def chosen(tools: list[dict], tool_choice) -> list[dict]:
    """The functions a call may name under ``tool_choice`` (required: any; named: that one)."""
    if isinstance(tool_choice, dict):
        return [t for t in tools if t["function"]["name"] == tool_choice["function"]["name"]]
    return tools


def call_schema(tools: list[dict], fmt: str) -> dict:
    """JSON schema of one call in ``fmt`` to one of ``tools``."""
    key = "parameters" if fmt == LLAMA3 else "arguments"
    alts = [{"type": "object", "additionalProperties": False, "required": ["name", key],
             "properties": {"name": {"const": t["function"]["name"]},
                            key: t["function"].get("parameters") or {"type": "object"}}} for t in tools]
    return {"anyOf": alts, "x-guidance": COMPACT} if len(alts) > 1 else {**alts[0], "x-guidance": COMPACT}


def guided_fields(tools: list[dict], tool_choice, fmt: str, parallel: bool) -> dict:
    """SamplingParams' guided field that makes the output calls (``required`` / a named function)."""
    schema = call_schema(chosen(tools, tool_choice), fmt)
    if fmt == LLAMA3:
        return {"guided_json": schema}
    more = "+" if parallel and not isinstance(tool_choice, dict) else ""
    lark = (f'start: call{more}\ncall: {json.dumps(OPEN + chr(10))} body {json.dumps(chr(10) + CLOSE)}\n'
            f"body: %json {json.dumps(schema)}")
    return {"guided_grammar": lark}


def _call(obj, fmt: str) -> dict | None:
    """An OpenAI tool call from one parsed object, or None when it is not a call."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("parameters", obj.get("arguments")) if fmt == LLAMA3 else obj.get("arguments")
    if args is None:
        args = {}
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"], "arguments": args if isinstance(args, str) else json.dumps(args)}}


def parse(text: str, fmt: str) -> tuple[str | None, list[dict]]:
    """(content, tool calls) of a finished output; content None when only calls were written."""
    if fmt == LLAMA3:
        body = text.strip()
        body = body[len(PYTHON_TAG):].strip() if body.startswith(PYTHON_TAG) else body
        calls = _split_calls(body, fmt) if body.startswith("{") else []
        return (None, calls) if calls and all(calls) else (text, [])
    calls, rest, pos = [], [], 0
    for m in re.finditer(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), text, re.DOTALL):
        try:
            call = _call(json.loads(m.group(1)), fmt)
        except ValueError:
            call = None
        if call is None:
            continue
        rest.append(text[pos:m.start()])
        pos = m.end()
        calls.append(call)
    rest.append(text[pos:])
    content = "".join(rest).strip()
    return (content or None) if calls else text, calls


def _split_calls(body: str, fmt: str) -> list:
    """Calls separated by ``;`` (Llama 3's parallel form), decoded one JSON value at a time."""
    dec, calls, i = json.JSONDecoder(), [], 0
    while i < len(body):
        try:
            obj, i = dec.raw_decode(body, i)
        except ValueError:
            return []
        calls.append(_call(obj, fmt))
        while i < len(body) and body[i] in " \n\t;":
            i += 1
    return calls


class ToolStream:
    """The streamed form of :func:`parse` for one choice; content that could still start a call
    is held back."""

    def __init__(self, fmt: str):
        self.fmt, self.buf, self.count, self.json_mode = fmt, "", 0, None
        self.blank = ""

    def _number(self, calls: list[dict]) -> list[dict]:
        """The calls as streamed deltas."""
        out = [{"index": self.count + k, **c} for k, c in enumerate(calls)]
        self.count += len(calls)
        return out

    def feed(self, text: str) -> tuple[str, list[dict]]:
        out, calls = self._feed(text)
        calls = self._number(calls)
        if not out.strip():
            self.blank += out
            return "", calls
        out, self.blank = self.blank + out, ""
        return out, calls

    def _feed(self, text: str) -> tuple[str, list[dict]]:
        self.buf += text
        if self.fmt == LLAMA3:
            if self.json_mode is None and self.buf.strip():
                self.json_mode = self.buf.lstrip().startswith(("{", PYTHON_TAG[:len(self.buf.lstrip())]))
            if self.json_mode is False:
                out, self.buf = self.buf, ""
                return out, []
            return "", []  # a JSON call (or not yet known): parsed at the end
        out, calls = "", []
        while True:
            start = self.buf.find(OPEN)
            if start < 0:
                keep = next((k for k in range(len(OPEN) - 1, 0, -1) if self.buf.endswith(OPEN[:k])), 0)
                out += self.buf[:len(self.buf) - keep]
                self.buf = self.buf[len(self.buf) - keep:]
                return out, calls
            end = self.buf.find(CLOSE, start)
            if end < 0:
                out += self.buf[:start]
                self.buf = self.buf[start:]
                return out, calls
            content, found = parse(self.buf[start:end + len(CLOSE)], self.fmt)
            out += self.buf[:start] + (content or "" if not found else "")
            calls += found
            self.buf = self.buf[end + len(CLOSE):]

    def finish(self) -> tuple[str, list[dict]]:
        rest, self.buf = self.buf, ""
        content, calls = parse(rest, self.fmt) if rest else ("", [])
        content = self.blank + (content or "") if (content or "").strip() or not self.count and not calls else ""
        self.blank = ""
        return content, self._number(calls)
