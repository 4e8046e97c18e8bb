"""Schemathesis (``st run --checks all``) against the demo server's /openapi.json: every status,
content type and body the server sends is the one the document describes, no input gives a 5xx,
the API key is enforced. Bounded: deterministic generation, 25 examples per operation, small
outputs (--default-max-tokens 4, max_model_len 128), a 120 s cap (about 20 s on a 2-core CPU).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="server tests need fastapi (pip install -e '.[server]')")
pytest.importorskip("schemathesis", reason="needs schemathesis (in the test extra: pip install -e '.[test]')")

from helpers import live_server  # noqa: E402

from zipfusion.engine import LLMEngine  # noqa: E402
from zipfusion.server.openai import create_app  # noqa: E402

CONFIG = Path(__file__).with_name("schemathesis.toml")


def test_schemathesis_all_checks_pass(tmp_path):
    engine = LLMEngine("demo", device="cpu", kv_memory_gb=0.01, max_model_len=128)
    app = create_app(engine, default_max_tokens=4, api_key="st-key")
    with live_server(app) as url:
        cmd = [sys.executable, "-m", "schemathesis.cli", "--config-file", str(CONFIG), "run", url + "/openapi.json",
               "--checks", "all", "--max-examples", "25", "--generation-deterministic", "--workers", "1",
               "-H", "Authorization: Bearer st-key", "--request-timeout", "30"]
        env = {**os.environ, "SCHEMATHESIS_HOOKS": "", "NO_COLOR": "1"}
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    tail = "\n".join(r.stdout.splitlines()[-60:])
    assert r.returncode == 0, tail + r.stderr[-2000:]
    assert "No issues found" in r.stdout, tail
