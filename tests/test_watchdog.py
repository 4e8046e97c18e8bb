"""The step watchdog (engine/watchdog.py): a step that stalls ends the process with every
thread's stack and exit code 70; a step that does not, does not. The stalls run in child
processes (the watchdog ends its process)."""

import subprocess
import sys
import textwrap

import pytest

from zipfusion import LLM, EngineConfig, SamplingParams
from zipfusion.engine.watchdog import EXIT_CODE, Watchdog


def run_child(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout)


def test_a_stalled_step_ends_the_process_with_the_stacks():
    p = run_child("""
        import time
        from zipfusion.engine.watchdog import Watchdog
        w = Watchdog(0.3)
        w.begin()
        def waiting_for_the_gpu():
            time.sleep(30)
        waiting_for_the_gpu()
        print("not reached")
    """)
    assert p.returncode == EXIT_CODE, p.stderr
    assert "step 1 stalled" in p.stderr and "waiting_for_the_gpu" in p.stderr
    assert "not reached" not in p.stdout


def test_an_engine_step_that_stalls_is_reported_not_hung():
    # the runner's forward replaced by one that never comes back in time, as a GPU kernel
    # spinning for ever would. The steps before it run under a long timeout: on a loaded machine
    # a normal first step may take longer than the 1 s the stall is caught in.
    p = run_child("""
        import time
        from zipfusion import LLM, SamplingParams
        llm = LLM("demo", device="cpu", watchdog_timeout_s=1.0)
        run = llm.engine.runner.run
        def stuck_forward(out):
            time.sleep(60)
            return run(out)
        watchdog = llm.engine.watchdog
        watchdog.timeout_s = 600.0
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))      # steps within the timeout
        print("first done", flush=True)
        watchdog.timeout_s = 1.0
        llm.engine.runner.run = stuck_forward
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
        print("not reached")
    """)
    assert p.returncode == EXIT_CODE, p.stderr[-2000:]
    assert "first done" in p.stdout and "not reached" not in p.stdout
    assert "stuck_forward" in p.stderr and "watchdog_timeout_s=1" in p.stderr


def test_steps_within_the_timeout_and_close():
    with LLM("demo", device="cpu", watchdog_timeout_s=30) as llm:
        w = llm.engine.watchdog
        assert isinstance(w, Watchdog) and w._thread.is_alive()
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 4
        assert w._since is None                           # no step in progress between steps
    w._thread.join(5)
    assert not w._thread.is_alive()                       # close() stopped it


def test_defaults_and_errors():
    cfg = EngineConfig()
    assert cfg.async_scheduling is True and cfg.watchdog_timeout_s is None
    with LLM("demo", device="cpu") as llm:                # the CPU: off whatever the config, nothing overlaps
        assert llm.engine.watchdog is None and llm.engine.async_scheduling is False
    for bad in (-1, "5", True):
        with pytest.raises(ValueError, match="watchdog_timeout_s must be a number >= 0"):
            EngineConfig(watchdog_timeout_s=bad)
    with pytest.raises(ValueError, match="watchdog timeout must be > 0"):
        Watchdog(0)
