"""Tool calling on /v1/chat/completions (server/tools.py) with the demo model's weights under three
chat templates: its own (no tools: the fallback system prompt, hermes calls), a Qwen-style one
(<tool_call> blocks) and a Llama-3-style one (a JSON object with "parameters")."""

import json
import random
import shutil

import pytest

pytest.importorskip("fastapi", reason="server tests need fastapi (pip install -e '.[server]')")
pytest.importorskip("llguidance", reason="tool calling's required mode needs llguidance")
from fastapi.testclient import TestClient  # noqa: E402

from zipfusion.engine import LLMEngine  # noqa: E402
from zipfusion.models.loader import resolve_model  # noqa: E402
from zipfusion.server.openai import create_app  # noqa: E402
from zipfusion.server.tools import HERMES, LLAMA3, ToolStream, parse, tool_format  # noqa: E402

WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}}}
ADD = {"type": "object", "additionalProperties": False, "required": ["a", "b"],
       "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                      "b": {"type": "integer", "minimum": 0, "maximum": 99}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}

QWEN = ("{%- if tools %}<|im_start|>system\n{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n"
        "{% endif %}# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>\nFor each function "
        "call, return a json object within <tool_call></tool_call> XML tags.<|im_end|>\n{%- endif %}"
        "{%- for m in messages %}{% if not (tools and m.role == 'system') %}<|im_start|>{{ m.role }}\n"
        "{{ m.content or '' }}{% for c in m.tool_calls or [] %}\n<tool_call>\n{\"name\": \"{{ c.function.name }}\", "
        "\"arguments\": {{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA = ("{{ bos_token }}{% if tools %}<|start_header_id|>user<|end_header_id|>\n\nGiven the following functions, "
         "respond with a JSON for a function call. Respond in the format {\"name\": function name, \"parameters\": "
         "dictionary of argument name and its value}.\n{% for t in tools %}{{ t | tojson }}\n\n{% endfor %}"
         "<|eot_id|>{% endif %}{% for m in messages %}<|start_header_id|>{{ 'ipython' if m.role == 'tool' else "
         "m.role }}<|end_header_id|>\n\n{% for c in m.tool_calls or [] %}{\"name\": \"{{ c.function.name }}\", "
         "\"parameters\": {{ c.function.arguments | tojson }}}{% endfor %}{{ m.content or '' }}<|eot_id|>"
         "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")


def validate(args: dict, schema: dict):
    try:
        import jsonschema_rs
        jsonschema_rs.validate(schema, args)
    except ImportError:
        assert set(args) == set(schema["required"]), args


@pytest.fixture(scope="module", params=["demo", "qwen", "llama"])
def served(request, tmp_path_factory):
    """(client, format) for the demo weights under one chat template."""
    folder = "demo"
    if request.param != "demo":
        folder = tmp_path_factory.mktemp(request.param)
        src = resolve_model("demo").tokenizer_dir
        for f in src.iterdir():
            shutil.copy(f, folder / f.name)
        cfg = json.loads((folder / "tokenizer_config.json").read_text())
        cfg["chat_template"] = QWEN if request.param == "qwen" else LLAMA
        (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    engine = LLMEngine(str(folder), device="cpu", kv_memory_gb=0.05, max_model_len=1024)
    assert tool_format(engine.tokenizer.chat_template) == (LLAMA3 if request.param == "llama" else HERMES)
    with TestClient(create_app(engine, "m")) as client:
        yield client, request.param


def ask(client, **kw):
    body = {"messages": [{"role": "user", "content": "What is the weather in Paris?"}], "tools": TOOLS,
            "max_tokens": 120, "seed": 0, "temperature": 0.8, **kw}
    return client.post("/v1/chat/completions", json=body)


def check_calls(calls, names=None):
    assert calls
    for c in calls:
        assert c["type"] == "function" and c["id"].startswith("call_")
        name = c["function"]["name"]
        assert name in (names or SCHEMAS)
        validate(json.loads(c["function"]["arguments"]), SCHEMAS[name])


def test_required_and_named_calls_are_schema_valid(served):
    client, kind = served
    r = ask(client, tool_choice="required", n=2)
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None, choice
        check_calls(choice["message"]["tool_calls"])


def test_a_named_call_streamed_comes_as_indexed_deltas(served):
    client, kind = served
    body = {"messages": [{"role": "user", "content": "Add 2 and 3"}], "tools": TOOLS, "max_tokens": 100, "seed": 1,
            "tool_choice": {"type": "function", "function": {"name": "add"}}, "stream": True}
    calls, finish = {}, None
    with client.stream("POST", "/v1/chat/completions", json=body) as s:
        for line in s.iter_lines():
            if not line.startswith("data: {"):
                continue
            c = json.loads(line[6:])["choices"][0]
            assert not c["delta"].get("content"), c
            for d in c["delta"].get("tool_calls", []):
                calls.setdefault(d["index"], d)
            finish = c["finish_reason"] or finish
    assert finish == "stop" and list(calls) == [0]             # a named function: OpenAI's "stop", one call
    check_calls([{k: v for k, v in d.items() if k != "index"} for d in calls.values()], ["add"])


def test_auto_none_and_a_conversation_with_earlier_calls(served):
    client, kind = served
    r = ask(client, tool_choice="auto", max_tokens=8)
    m = r.json()["choices"][0]["message"]
    assert r.status_code == 200 and (m["content"] is not None or m.get("tool_calls"))
    with_tools = r.json()["usage"]["prompt_tokens"]
    r = ask(client, tool_choice="none", max_tokens=2)
    assert "tool_calls" not in r.json()["choices"][0]["message"]
    assert r.json()["usage"]["prompt_tokens"] < with_tools           # "none": the tools not in the prompt
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"}]
    r = client.post("/v1/chat/completions", json={"messages": history, "tools": TOOLS, "max_tokens": 2})
    assert r.status_code == 200, r.text
    for bad, param in [({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
                       ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
                       ({"tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]},
                        "tools[0].function.parameters")]:
        r = ask(client, **bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (bad, r.text)


@pytest.mark.parametrize("fmt, text, content, names", [
    (HERMES, 'Sure.<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n<tool_call>{"name": "g", '
             '"arguments": {}}</tool_call>', "Sure.", ["f", "g"]),
    (HERMES, "no call <tool_call>not json</tool_call> here", "no call <tool_call>not json</tool_call> here", []),
    (HERMES, "<tool_", "<tool_", []),
    (LLAMA3, '<|python_tag|>{"name": "f", "parameters": {"x": [1, 2]}}; {"name": "g", "parameters": {}}', None,
     ["f", "g"]),
    (LLAMA3, '{"name": "f", "arguments": {"x": "}"}}', None, ["f"]),
    (LLAMA3, 'The answer is {"a": 1}', 'The answer is {"a": 1}', []),
    (LLAMA3, '{"name": "f", "parameters": {"x"', '{"name": "f", "parameters": {"x"', []),
])
def test_parse_and_stream_agree_on_any_chunking(fmt, text, content, names):
    got_content, calls = parse(text, fmt)
    assert got_content == content and [c["function"]["name"] for c in calls] == names
    rng = random.Random(0)
    for _ in range(30):
        s, out, streamed, i = ToolStream(fmt), "", [], 0
        while i < len(text):
            k = rng.randint(1, 6)
            piece, got = s.feed(text[i:i + k])
            out, streamed, i = out + piece, streamed + got, i + k
        piece, got = s.finish()
        out, streamed = out + piece, streamed + got
        assert out == (content or "") and [c["function"]["name"] for c in streamed] == names
        assert [c["index"] for c in streamed] == list(range(len(names)))
        assert [c["function"]["arguments"] for c in streamed] == [c["function"]["arguments"] for c in calls]
