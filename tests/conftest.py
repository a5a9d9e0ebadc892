"""Shared fixtures. Every test is checked for leftovers: no mode, hook or wrapper may remain."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest
import torch

# A fault of gradtrace's own code while it records fails the test that meets it, instead of
# stopping the recording with a note (tracer.record.failsafe); subprocesses inherit it.
os.environ.setdefault("GRADTRACE_STRICT", "1")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--update-golden", action="store_true", default=False,
                     help="rewrite golden files under tests/golden from the current output")


@pytest.fixture
def one_thread() -> Iterator[None]:
    """torch on one CPU thread for the test (a module opts in with ``pytestmark``): step logs and
    watches compare fingerprints, and the order of a multi-threaded reduction can change them."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def update_golden(request: pytest.FixtureRequest) -> bool:
    return bool(request.config.getoption("--update-golden"))


def _installed_state() -> tuple[int, int, int, int, int, object, object]:
    from torch.nn.modules import module as nn_module
    from torch.overrides import _get_current_function_mode_stack

    # (every global hook dict torch.compile looks at: a leftover id in one makes it warn for good)
    return (len(nn_module._global_forward_pre_hooks), len(nn_module._global_forward_hooks),
            len(nn_module._global_forward_hooks_with_kwargs), len(nn_module._global_forward_hooks_always_called),
            len(_get_current_function_mode_stack()),
            torch.autograd.function.Function.__dict__["apply"],
            torch.autograd.function.BackwardCFunction.__dict__["apply"])


@pytest.fixture(autouse=True)
def nothing_left_installed():
    """After each test: no TorchFunctionMode, global module hook or apply wrapper remains."""
    before = _installed_state()
    yield
    after = _installed_state()
    assert after == before, f"tracer left something installed: before={before} after={after}"
    from tracer.record.recorder import active_recorder

    assert active_recorder() is None, "a recorder is still active after the test"


@pytest.fixture(autouse=True)
def _excepthook_kept():
    """Each test starts with the process's sys.excepthook: torch.distributed's init_process_group
    replaces it for good ("[rank0]: " before every traceback line), and under pytest-xdist a test
    that initialised a group can run before one that reads a traceback in the same worker."""
    hook = sys.excepthook
    yield
    sys.excepthook = hook


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture
def tmp_trace(tmp_path):
    return os.fspath(tmp_path / "step.gtrace")


requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture
def one_rank():
    """A one-rank gloo process group for the test (distributed recording in process)."""
    import torch.distributed as dist  # only the distributed tests ask for this fixture

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    hook = sys.excepthook  # init_process_group replaces it for good (prefixes "[rank0]: ")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
        sys.excepthook = hook


@pytest.fixture
def node_hook_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the grad nodes whose gradtrace hook (pre-hook or hook) runs, in order."""
    from tracer.record import autograd

    calls: list[str] = []
    real = autograd.node_hook

    def counting(ref: object, name: str, grads: object, *rest: object) -> None:
        calls.append(name)
        real(ref, name, grads, *rest)  # type: ignore[arg-type]

    monkeypatch.setattr(autograd, "node_hook", counting)
    return calls
