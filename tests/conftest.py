"""Shared test settings: how Triton runs, the ``gpu`` marker, Hypothesis profiles.

Triton kernels run compiled on a CUDA GPU and through the Triton interpreter on the CPU. Which
one is fixed when ``triton`` is first imported (``TRITON_INTERPRET``), so it is chosen here,
once for the whole run, before any test module is collected: the interpreter where no CUDA GPU
is present. Triton is imported right away so that no test module can change it later.

Tests that need a CUDA GPU are marked ``@pytest.mark.gpu`` (or ``pytest.param(...,
marks=pytest.mark.gpu)``): without a GPU the hook below skips them with the reason. Kernel test
modules that run on the GPU where there is one and through the interpreter elsewhere say so
with a module-level ``DEVICE = "cuda" if torch.cuda.is_available() else "cpu"``; on a GPU the
hook marks their tests ``gpu`` too, so on the GPU machine ``python -m pytest -m gpu`` runs every
test that touches the GPU.

The README's test command runs the files in parallel (pytest-xdist: ``-n auto --dist loadfile``,
each file in one worker so its module fixtures are built once): every test runs on one torch
thread, most of the time in the Triton interpreter (one core), so one process left every other
core idle. At most :data:`MAX_WORKERS` workers, each a torch process of its own.
"""

import os
import zlib

import pytest
import torch
from hypothesis import HealthCheck, settings

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"
try:
    import triton  # noqa: F401,E402  (fixes the interpreter choice for the run)
except ImportError:       # no Triton on this platform: the Triton tests skip or fail by themselves
    pass

_NO_GPU = pytest.mark.skip(reason="needs a CUDA GPU (marked gpu)")
MAX_WORKERS = 8


@pytest.hookimpl(optionalhook=True)          # pytest-xdist's hook: a run without xdist knows none
def pytest_xdist_auto_num_workers(config):
    """``-n auto``: a worker per core this process may use, at most :data:`MAX_WORKERS`."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):          # non-Linux
        cores = os.cpu_count() or 1
    return max(1, min(MAX_WORKERS, cores))


@pytest.hookimpl(tryfirst=True)             # before ``-m`` selects by marker
def pytest_collection_modifyitems(config, items):
    """On a GPU, mark ``gpu`` the tests of modules whose ``DEVICE`` is CUDA; without one, skip
    the tests marked ``gpu``."""
    if CUDA:
        for item in items:
            if getattr(item.module, "DEVICE", None) == "cuda":
                item.add_marker(pytest.mark.gpu)
        return
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(_NO_GPU)


# CI (CI=true) replays the same examples every run, so a landing never hinges on a lucky draw;
# local runs keep drawing new examples. Slow example generation is expected on a busy 2-core box.
settings.register_profile("ci", derandomize=True, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci" if os.environ.get("CI") else "dev")


def pytest_addoption(parser):
    parser.addoption("--cuda-define", action="append", default=[], metavar="NAME[=VALUE]",
                     help="build zipfusion's CUDA decode kernel with this preprocessor define (repeatable), "
                          "e.g. ZF_ESC_KIND: the tests then check that build variant")


def pytest_configure(config):
    defines = config.getoption("--cuda-define")
    if defines:
        from zipfusion.kernels.cuda_attention import set_build_defines
        set_build_defines(*defines)


@pytest.fixture
def environ(monkeypatch):
    """``environ(NAME=value or None, ...)``: set (None: unset) environment variables and have
    zipfusion read them afresh (``config.environment``; read afresh again after the test)."""
    from zipfusion.config import environment

    def set_vars(**values):
        for name, value in values.items():
            if value is None:
                monkeypatch.delenv(name, raising=False)
            else:
                monkeypatch.setenv(name, value)
        environment.cache_clear()
    yield set_vars
    environment.cache_clear()


@pytest.fixture
def seed(request):
    """A fixed seed per test and parametrization (from its id): reruns draw the same inputs."""
    return zlib.crc32(request.node.nodeid.encode()) % 2**31


@pytest.fixture(autouse=True, scope="session")
def one_torch_thread():
    """Tests use tiny tensors and models: one torch thread is several times faster than two on
    a busy 2-core CI machine, and results do not depend on the thread count."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
