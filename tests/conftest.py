"""Shared test settings."""

import os

import torch

if not torch.cuda.is_available():
    # one place for the CPU Triton interpreter, set before any test module imports triton
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

# CI (CI=true) replays the same examples every run, so a landing never hinges on a lucky draw;
# local runs keep drawing new examples. Slow example generation is expected on a busy 2-core box.
settings.register_profile("ci", derandomize=True, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci" if os.environ.get("CI") else "dev")


@pytest.fixture(autouse=True, scope="session")
def one_torch_thread():
    """Tests use tiny tensors and models: one torch thread is several times faster than two on
    a busy 2-core CI machine, and results do not depend on the thread count."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
