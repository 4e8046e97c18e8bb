"""benchmarks/schedule_sim.py: the workload scenarios' scheduling at the Llama-8B shape on the
meta device (no model). At full size it reproduced issue 20's 56 preemptions of 24 requests;
the fixed admission runs them, and the 8K burst, without one, computing each prompt once."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
import schedule_sim  # noqa: E402  (benchmarks/schedule_sim.py)


@pytest.mark.parametrize("scenario", ["deterministic", "burst"])
@pytest.mark.parametrize("mode", ["compressed", "uncompressed"])
def test_full_size_scenarios_run_without_preemption(scenario, mode):
    r = schedule_sim.simulate(scenario, mode, 0.96, "estimate")
    assert r["preemptions"] == 0
    # every prompt computed once (a prompt's last token may ride as a decode row: not counted)
    assert r["prompt_tokens"] - r["requests"] <= r["prefill_tokens_computed"] <= r["prompt_tokens"]
    open_peak = {"deterministic": 15, "burst": 50}[scenario]      # what fits at open size
    assert r["peak_batch"] > open_peak if mode == "compressed" else r["peak_batch"] == open_peak
