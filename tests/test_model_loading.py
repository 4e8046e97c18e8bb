"""Loading as users do: a Hub id through huggingface_hub's cache (offline, a file-based cache laid
out as the Hub client lays it out), --revision, --tokenizer, --chat-template, remote code refused."""

import json
import shutil

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("huggingface_hub")

from zipfusion.config import environment  # noqa: E402
from zipfusion.models import config_from_dict, resolve_model  # noqa: E402
from helpers import save_tiny_checkpoint, save_word_tokenizer  # noqa: E402

REV_MAIN, REV_V1 = "a" * 40, "b" * 40


def add_snapshot(cache, repo, sha, src, refs=()):
    """Put folder ``src`` into the Hub cache as ``repo``'s snapshot ``sha`` (files as symlinks to
    blobs, as huggingface_hub stores them) and point ``refs`` (branch or tag names) at it."""
    root = cache / ("models--" + repo.replace("/", "--"))
    snap = root / "snapshots" / sha
    snap.mkdir(parents=True)
    (root / "blobs").mkdir(exist_ok=True)
    for i, f in enumerate(sorted(p for p in src.iterdir() if p.is_file())):
        blob = root / "blobs" / f"{sha[:8]}{i:032x}"
        shutil.copy(f, blob)
        (snap / f.name).symlink_to(blob)
    (root / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (root / "refs" / ref).write_text(sha)


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """An offline Hub cache under tmp_path: org/tiny at main (seed 0) and tag v1 (seed 1)."""
    cache = tmp_path / "hf" / "hub"
    for seed, sha, refs in ((0, REV_MAIN, ["main"]), (1, REV_V1, ["v1"])):
        src = tmp_path / f"src{seed}"
        save_tiny_checkpoint(src, seed=seed)
        save_word_tokenizer(src)
        add_snapshot(cache, "org/tiny", sha, src, refs)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    environment.cache_clear()
    yield cache
    environment.cache_clear()


def test_hub_id_from_the_offline_cache(hub):
    from zipfusion.models import build_model
    src = resolve_model("org/tiny")
    assert src.weights_dir.name == REV_MAIN and src.tokenizer_dir == src.weights_dir
    assert resolve_model("org/tiny", revision="v1").weights_dir.name == REV_V1
    assert resolve_model("org/tiny", revision=REV_V1).weights_dir.name == REV_V1
    w0 = build_model(src, dtype=torch.float32).model.embed_tokens.weight
    w1 = build_model(resolve_model("org/tiny", revision="v1"), dtype=torch.float32).model.embed_tokens.weight
    assert not torch.equal(w0, w1)                 # the tag's snapshot, not main's
    with pytest.raises(FileNotFoundError, match=r"'org/nope': not found in the Hub cache .*HF_HUB_OFFLINE"):
        resolve_model("org/nope")
    with pytest.raises(FileNotFoundError, match="revision 'v9'"):
        resolve_model("org/tiny", revision="v9")


def test_llm_from_hub_with_tokenizer_and_chat_template(hub, tmp_path):
    from zipfusion import LLM, SamplingParams
    (tmp_path / "tok").mkdir()
    save_word_tokenizer(tmp_path / "tok")
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}w7 {{ m['content'] }} {% endfor %}w9")
    llm = LLM("org/tiny", revision="v1", tokenizer=str(tmp_path / "tok"), chat_template=str(template),
              device="cpu", kv_memory_gb=0.01)
    text = llm.tokenizer.apply_chat_template([{"role": "user", "content": "w5 w6"}])
    assert text == "w7 w5 w6 w9" and llm.tokenizer.encode(text) == [7, 5, 6, 9]
    out = llm.generate([text], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].token_ids) == 3
    with pytest.raises(ValueError, match="chat_template: no such file"):
        LLM("org/tiny", chat_template=str(tmp_path / "none.jinja"), device="cpu")


def test_cli_flags_reach_the_engine_config():
    import argparse
    from zipfusion.config import add_cli_args, config_from_args
    p = argparse.ArgumentParser()
    add_cli_args(p)
    cfg = config_from_args(p.parse_args(["--model", "org/x", "--revision", "v1", "--tokenizer", "org/t"]))
    assert (cfg.model, cfg.revision, cfg.tokenizer, cfg.chat_template) == ("org/x", "v1", "org/t", None)


def test_remote_code_and_unknown_architectures_say_what():
    base = dict(vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2)
    with pytest.raises(ValueError, match=r"'?\['DeepseekV9ForCausalLM'\]'? needs remote code .*modeling_ds\.DS.*"
                                          r"it runs \[.*'LlamaForCausalLM'"):
        config_from_dict({**base, "architectures": ["DeepseekV9ForCausalLM"],
                          "auto_map": {"AutoModelForCausalLM": "modeling_ds.DS"}})
    with pytest.raises(ValueError, match=r"'GPT2LMHeadModel'.* is not supported; zipfusion runs \["):
        config_from_dict({**base, "architectures": ["GPT2LMHeadModel"]})
