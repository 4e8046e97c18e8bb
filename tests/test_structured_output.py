"""Structured output (engine/structured.py) on the CPU with the demo model: the bitmask applied
to the logits, JSON schemas / choices / regexes kept offline and through the server, mixed
batches, n > 1, streaming, async scheduling, compression on and off."""

import json
import re

import pytest
import torch

pytest.importorskip("llguidance", reason="structured output needs llguidance (pip install -e '.[server]')")

from zipfusion.engine import LLM, LLMEngine, SamplingParams  # noqa: E402
from zipfusion.engine.structured import apply_bitmask  # noqa: E402

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "ok", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 10},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "ok": {"type": "boolean"},
                         "tags": {"type": "array", "maxItems": 2, "items": {"enum": ["a", "b", "c"]}}}}


def validate(obj, schema):
    """jsonschema (or jsonschema_rs) where installed; else the keys and types of SCHEMA."""
    try:
        import jsonschema
        jsonschema.validate(obj, schema)
        return
    except ImportError:
        pass
    try:
        import jsonschema_rs
        jsonschema_rs.validate(schema, obj)
        return
    except ImportError:
        pass
    assert schema is SCHEMA and isinstance(obj, dict) and set(obj) == set(SCHEMA["required"]), obj
    assert isinstance(obj["name"], str) and len(obj["name"]) <= 10
    assert type(obj["age"]) is int and 0 <= obj["age"] <= 120 and type(obj["ok"]) is bool
    assert len(obj["tags"]) <= 2 and set(obj["tags"]) <= {"a", "b", "c"}


@pytest.fixture(scope="module")
def llm():
    return LLM("demo", device="cpu", kv_memory_gb=0.05, max_model_len=256)


def test_bitmask_masks_exactly_the_zero_bits_of_the_guided_rows():
    g = torch.Generator().manual_seed(0)
    B, V = 5, 70                                       # V not a multiple of 32: the last word is cut
    logits = torch.randn(B, V, generator=g)
    rows = [1, 3, 4]
    mask = torch.randint(-2**31, 2**31 - 1, (3, 3), generator=g, dtype=torch.int64).to(torch.int32)
    mask[0, 0] = -2**31                                # only bit 31 (the sign bit) of the first word
    out = apply_bitmask(logits, rows, mask)
    for k, i in enumerate(rows):
        for t in range(V):
            bit = (int(mask[k, t // 32]) >> (t % 32)) & 1
            assert out[i, t] == (logits[i, t] if bit else float("-inf")), (i, t)
    for i in (0, 2):
        assert torch.equal(out[i], logits[i])
    assert torch.isfinite(logits).all()                # the raw logits untouched (logprobs read them)


def test_json_schema_choice_and_regex_are_kept(llm):
    params = [SamplingParams(max_tokens=120, temperature=0.9, seed=s, guided_json=SCHEMA) for s in range(3)]
    params += [SamplingParams(max_tokens=20, temperature=1.0, seed=3, guided_choice=["yes", "no", "maybe so"]),
               SamplingParams(max_tokens=30, temperature=1.0, seed=4, guided_regex=r"[0-9]{3}-[a-z]{2,4}"),
               SamplingParams(max_tokens=60, temperature=0.9, seed=5, guided_json={"type": "object"}),
               SamplingParams(max_tokens=60, temperature=0, guided_json=json.dumps({"type": "array",
                                                                                   "items": {"type": "integer", "minimum": -9, "maximum": 99},
                                                                                   "maxItems": 3}))]
    outs = llm.generate(["In the beginning"] * len(params), params, use_tqdm=False)
    for o in outs[:3]:
        assert o.outputs[0].finish_reason == "stop", o.text
        validate(json.loads(o.text), SCHEMA)
    assert outs[3].text in ("yes", "no", "maybe so")
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", outs[4].text), outs[4].text
    if outs[5].outputs[0].finish_reason == "stop":     # a free object may run past max_tokens
        assert isinstance(json.loads(outs[5].text), dict)
    assert outs[5].text.startswith("{")
    arr = json.loads(outs[6].text)
    assert isinstance(arr, list) and len(arr) <= 3 and all(type(x) is int for x in arr)


def test_a_bad_grammar_is_a_clear_error(llm):
    with pytest.raises(ValueError, match="at most one"):
        SamplingParams(guided_regex="a", guided_choice=["a"])
    with pytest.raises(ValueError, match="guided_choice"):
        SamplingParams(guided_choice=[])
    with pytest.raises(ValueError, match="guided_json is not valid JSON"):
        SamplingParams(guided_json="{nope")
    with pytest.raises(ValueError, match="guided_regex"):
        llm.generate(["x"], SamplingParams(guided_regex="(unclosed"), use_tqdm=False)


def run_batch(engine, items):
    reqs = [engine.add_request(engine.tokenizer.encode(p), sp) for p, sp in items]
    while engine.has_work():
        engine.step()
    return reqs


@pytest.mark.parametrize("compression", [True, False])
def test_unconstrained_rows_keep_their_tokens_beside_guided_ones(compression):
    """A batch of guided and free rows: the free rows' tokens are those of the same batch with
    no grammar anywhere (deterministic mode: a row's tokens depend on it alone), with async
    scheduling and with the KV cache compressed or not; the guided rows keep their grammar."""
    free = [("And God said", SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)),
            ("In the beginning", SamplingParams(max_tokens=24, temperature=1.0, seed=7, ignore_eos=True))]
    guided = [("The LORD", SamplingParams(max_tokens=80, temperature=0.9, seed=1, guided_json=SCHEMA)),
              ("Behold", SamplingParams(max_tokens=24, temperature=0.9, seed=2, guided_regex=r"[a-z ]{1,40}\."))]
    eng = LLMEngine("demo", device="cpu", kv_memory_gb=0.05, max_model_len=256, deterministic=True,
                    kv_compression=compression, dtype="bfloat16" if compression else "float32")
    eng.async_scheduling = True                 # the GPU's default, run on the CPU (see LLMEngine)
    mixed = run_batch(eng, [free[0], guided[0], free[1], guided[1]])
    plain = run_batch(eng, [free[0], (guided[0][0], SamplingParams(max_tokens=8)), free[1],
                            (guided[1][0], SamplingParams(max_tokens=8))])
    assert mixed[0].output_ids == plain[0].output_ids and mixed[2].output_ids == plain[2].output_ids
    validate(json.loads(eng.output_of(mixed[1], None).outputs[0].text), SCHEMA)
    assert re.fullmatch(r"[a-z ]{1,40}\.", eng.output_of(mixed[3], None).outputs[0].text)


def test_through_the_server_streamed_and_not_with_n(llm):
    pytest.importorskip("fastapi", reason="server tests need fastapi")
    from fastapi.testclient import TestClient
    from zipfusion.server.openai import create_app

    eng = LLMEngine("demo", device="cpu", kv_memory_gb=0.05, max_model_len=256)
    with TestClient(create_app(eng)) as client:
        fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Who?"}], "n": 2,
                                                      "max_tokens": 120, "seed": 3, "response_format": fmt})
        assert r.status_code == 200, r.text
        for c in r.json()["choices"]:
            validate(json.loads(c["message"]["content"]), SCHEMA)
        with client.stream("POST", "/v1/completions", json={"prompt": "In the beginning", "stream": True, "n": 2,
                                                             "max_tokens": 40, "seed": 1,
                                                             "guided_choice": ["light", "darkness"]}) as s:
            texts = ["", ""]
            for line in s.iter_lines():
                if line.startswith("data: {"):
                    for c in json.loads(line[6:])["choices"]:
                        texts[c["index"]] += c["text"]
        assert all(t in ("light", "darkness") for t in texts), texts
        r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 30, "guided_regex": "[0-9]{4}"})
        assert re.fullmatch("[0-9]{4}", r.json()["choices"][0]["text"])
        r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 60, "temperature": 0,
                                                 "response_format": {"type": "json_object"}})
        assert r.json()["choices"][0]["text"].startswith("{")
        for body, param in [({"response_format": {"type": "json_schema"}}, "response_format"),
                            ({"response_format": {"type": "xml"}}, "response_format"),
                            ({"guided_regex": "(", "max_tokens": 2}, "guided_regex"),
                            ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex")]:
            r = client.post("/v1/completions", json={"prompt": "x", **body})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
        assert not eng.scheduler.has_work()


@pytest.mark.parametrize("one_eos_only", [False, True])
def test_several_eos_ids_compile_with_any_llguidance(llm, monkeypatch, one_eos_only):
    """A model with several EOS ids (Llama 3, SmolLM2): llguidance 1.9+ takes them all; an older
    llguidance, whose LLTokenizer takes one int, gets the first instead of a TypeError."""
    import llguidance
    from zipfusion.engine.structured import GrammarCompiler
    real, seen = llguidance.LLTokenizer, []

    def older(tok, n_vocab=None, eos_token=None):
        seen.append(eos_token)
        if one_eos_only and isinstance(eos_token, list):
            raise TypeError("argument 'eos_token': 'list' object cannot be interpreted as an integer")
        return real(tok, n_vocab=n_vocab, eos_token=eos_token)
    monkeypatch.setattr(llguidance, "LLTokenizer", older)
    tok = llm.engine.tokenizer
    compiler = GrammarCompiler(tok, llm.engine.model_config.vocab_size, {2, 1})
    m = compiler.matcher(SamplingParams(max_tokens=8, guided_choice=["yes", "no"]))
    assert m is not None and not m.is_error()
    assert seen[0] == [1, 2] and (seen[-1] == 1 if one_eos_only else len(seen) == 1)
