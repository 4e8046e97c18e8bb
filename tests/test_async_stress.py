"""benchmarks/async_stress.py on the CPU (--smoke: the demo model): short runs with async
scheduling, chunks returning late and the page table kept apart, each checked against the plain
order; and the harness's own faults (a step that never ends, a wrong token) caught as a hang with
every thread's stack and a replay line, and as a mismatch."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "async_stress.py")


def stress(tmp_path, *args, timeout=150):
    env = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "src")}
    p = subprocess.run([sys.executable, SCRIPT, "--smoke", "--out", str(tmp_path), *args], capture_output=True,
                       text=True, env=env, timeout=timeout)
    return p, json.loads((tmp_path / "async_stress.json").read_text())


def test_stressed_runs_give_the_plain_orders_tokens(tmp_path):
    p, r = stress(tmp_path, "--cases", "1", "--variants", "2", "--modes", "fast,det")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert r["passed"] and r["runs"] == 4 and r["reference_runs"] == 2
    assert not (r["hangs"] or r["mismatches"] or r["errors"] or r["diverged"])
    stressed = [x for x in r["records"] if x["variant"]]
    assert {x["verdict"] for x in stressed} == {"ok"} and all(x["leak"] == 0 for x in r["records"])
    # the stress was there: chunks released late and taken while others were pending, pages
    # compacted, requests preempted; det mode's requests aborted and stopped mid-run
    assert all(x["delays"].get("chunk_release", 0) > 0 and x["delays"].get("take_with_pending", 0) > 0
               for x in stressed)
    assert sum(x["compactions"] for x in stressed) > 0 and sum(x["preemptions"] for x in r["records"]) > 0
    det = [x for x in stressed if x["mode"] == "det"]
    assert sum(x["aborted"] for x in det) > 0 and sum(x["stopped"] for x in det) > 0
    assert p.stdout.splitlines()[-1].startswith("| all | 4 | 2 | 0 | 0 | 0 |")      # the table comes last


def test_a_stalled_run_is_a_hang_with_its_stacks_and_a_replay(tmp_path):
    p, r = stress(tmp_path, "--cases", "1", "--variants", "1", "--modes", "fast", "--fault", "hang",
                  "--run-timeout", "8")
    assert p.returncode == 1 and not r["passed"]
    (hang,) = r["hangs"]
    assert (hang["mode"], hang["case"], hang["variant"]) == ("fast", 0, 1)
    assert "Timeout" in hang["stacks"] and "in run_delayed" in hang["stacks"]     # where it stalled
    spec = json.loads(hang["replay"].split("--replay ", 1)[1].strip("'"))
    assert (spec["case"], spec["only_variant"], spec["mode"]) == (0, 1, "fast") and "fault" not in spec
    assert "hang: fast case 0 v1" in p.stdout


def test_a_wrong_token_is_a_mismatch(tmp_path):
    p, r = stress(tmp_path, "--cases", "1", "--variants", "1", "--modes", "det", "--fault", "mismatch")
    assert p.returncode == 1 and not r["hangs"] and not r["errors"]
    (bad,) = r["mismatches"]
    assert bad["variant"] == 1 and "request 0" in bad["detail"]
