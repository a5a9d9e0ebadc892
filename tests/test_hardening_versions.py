"""No version counter of the program's tensors moves because of gradtrace (issue 45, item 6).

gradtrace writes into no tensor of the program's, but what it held changed what autograd does:
autograd sums a gradient into another in place, and a leaf's accumulator keeps the gradient
itself as ``.grad``, only when nobody else holds it (its tensor, or for the sum its storage).
Reading a storage through ``untyped_storage()`` leaves a Python object that holds the storage
for good: under ``hash="fast"`` (every fingerprint staged) and ``hash="md5"`` (tensors over 256
KiB), the gradient of a head shared by several feature levels was summed out of place, and its
``.grad`` came out with another version counter than without the trace.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest

import tracer
from tests.version_recipes import versions_after

# 64 channels: the shared head's weight is 144 KiB, its gradient summed from three levels; 128:
# 576 KiB, over the size MD5 snapshots on the pool instead of hashing at once.
CHANNELS = 128


@pytest.fixture(scope="module")
def untraced() -> dict[str, int | None]:
    return versions_after(None, CHANNELS)


@pytest.mark.parametrize("options", [{"hash": "none"}, {"hash": "md5"}, {"hash": "fast"},
                                     {"hash": "none", "check_numerics": True},
                                     {"hash": "md5", "optimizer_ops": True, "node_runs": True}],
                         ids=["none", "md5", "fast", "check_numerics", "md5-every-op"])
def test_every_version_counter_is_the_untraced_one(untraced: dict[str, int | None], options: dict[str, Any]) -> None:
    # (what the recipe is about: the shared head's gradient summed in place, state and buffers there)
    assert untraced["head.weight.grad"] == 3 and untraced["head.weight.exp_avg"] == 2
    assert {"stem_bn.running_var", "cls.bias.exp_avg_sq"} <= set(untraced)

    def traced() -> contextlib.AbstractContextManager[Any]:
        return tracer.trace(**options)

    got = versions_after(traced, CHANNELS)
    assert {name: (v, got.get(name)) for name, v in untraced.items() if got.get(name) != v} == {}
    assert set(got) == set(untraced)
