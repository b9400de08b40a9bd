"""``upstream._runtime_bridge``: upstream's ``mock.patch`` of torch's FSDP runtime
functions by name sees the calls of the FSDP under test, and nothing outlives the test."""

from __future__ import annotations

import importlib
import textwrap
from typing import Any
from unittest import mock

import pytest

from fsdptest import api
from fsdptest.adapters import TORCH_SEAMS
from upstream._runtime_bridge import runtime_seams_bridged

# Upstream's idiom (test_fsdp_fine_tune.py's): read the original off torch's module,
# patch torch's name with a counter that calls it. Two units, three backwards.
PATCHES_TORCH_NAMES = textwrap.dedent(
    """
    from unittest import mock

    import torch
    import torch.distributed.fsdp._runtime_utils  # upstream reaches it through torch
    from torch import nn

    from fsdptest.api import FullyShardedDataParallel as FSDP
    from upstream.common_distributed import skip_if_lt_x_gpu
    from upstream.common_fsdp import FSDPTest

    RUNTIME = "torch.distributed.fsdp._runtime_utils"


    class TestPatchesTorchNames(FSDPTest):
        @skip_if_lt_x_gpu(2)
        def test_counts_post_backward_reshards_and_hooks(self):
            model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
            model[1] = FSDP(model[1])
            model = FSDP(model)
            calls = {"reshard": 0, "hook": 0}
            orig_reshard = torch.distributed.fsdp._runtime_utils._post_backward_reshard
            orig_hook = torch.distributed.fsdp._runtime_utils._register_post_backward_hook

            def counting_reshard(*args, **kwargs):
                calls["reshard"] += 1
                return orig_reshard(*args, **kwargs)

            def counting_hook(*args, **kwargs):
                calls["hook"] += 1
                return orig_hook(*args, **kwargs)

            with mock.patch(f"{RUNTIME}._post_backward_reshard", counting_reshard), mock.patch(
                f"{RUNTIME}._register_post_backward_hook", counting_hook
            ):
                for _ in range(3):
                    model(torch.randn(2, 4)).sum().backward()
            self.assertEqual(calls["reshard"], 6)
            self.assertGreaterEqual(calls["hook"], 6)
            model(torch.randn(2, 4)).sum().backward()  # unpatched again: still trains
            self.assertEqual(calls["reshard"], 6)
    """
)


@pytest.mark.parametrize("impl", ["local", "torch"])
def test_upstream_patch_of_torch_runtime_names_counts_the_fsdp_under_test(
    inner: Any, impl: str
) -> None:
    """A counter patched over torch's ``_post_backward_reshard`` and
    ``_register_post_backward_hook`` by name counts each unit's calls under both
    implementations, and the originals the test read still run the FSDP."""
    run = inner(PATCHES_TORCH_NAMES, "-p", "upstream.plugin", "--fsdp-impl", impl)
    run.result.assert_outcomes(passed=1)


@pytest.mark.skipif(not api.ADAPTER.is_project_fsdp, reason="bridges this project's seams")
def test_bridge_leads_torch_names_to_our_seams_and_puts_both_back() -> None:
    """In the block torch's name holds our function and ours calls through torch's
    name (so a patch of it is what ours runs); after it both are as before."""
    runtime = importlib.import_module("torch.distributed.fsdp._runtime_utils")
    state_class = importlib.import_module("fsdp._runtime").FSDPState
    torch_before = runtime._post_backward_reshard
    ours_before = state_class.__dict__["_post_backward_reshard"]
    assert TORCH_SEAMS.post_backward_reshard == f"{runtime.__name__}._post_backward_reshard"
    with runtime_seams_bridged():
        assert runtime._post_backward_reshard is ours_before
        assert state_class.__dict__["_post_backward_reshard"] is not ours_before
        with mock.patch.object(runtime, "_post_backward_reshard", lambda *a: ("patched", a)):
            assert state_class._post_backward_reshard("state", "handle") == (
                "patched",
                ("state", "handle"),
            )
    assert runtime._post_backward_reshard is torch_before
    assert state_class.__dict__["_post_backward_reshard"] is ours_before
