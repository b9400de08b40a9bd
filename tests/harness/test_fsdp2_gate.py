"""The test layer gates FSDP2 implementations: an FSDP2 test against an
implementation without FSDP2 is a skip naming what is missing, never a pass, and a
session of nothing else fails; an FSDP2-only implementation runs FSDP2 tests, its
declared seams patched by upstream's helpers, an undeclared seam a named skip."""

from __future__ import annotations

import textwrap
from typing import Any

FSDP1_ONLY = "tests.harness.example_impl"
FSDP2_ONLY = "tests.harness.example_fsdp2_impl"

FSDP2_TESTS = textwrap.dedent(
    """
    import torch
    from torch import nn
    from fsdptest import FSDPTest
    from fsdptest.api import FSDPModule, fully_shard
    from upstream.common_fsdp import patch_register_post_backward_hook_backward, patch_unshard
    from upstream.fsdp2_param_group import FSDPParamGroup


    class TestFSDP2(FSDPTest):
        def test_shards_and_counts_unshards(self):
            model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
            fully_shard(model[0])
            fully_shard(model)
            assert isinstance(model, FSDPModule)
            calls = []
            original = FSDPParamGroup.unshard

            def counted(self, *args, **kwargs):
                calls.append(1)
                return original(self, *args, **kwargs)

            with patch_unshard(counted):
                model(torch.ones(2, 3)).sum().backward()
            assert len(calls) >= 2, calls

        def test_undeclared_seam(self):
            with patch_register_post_backward_hook_backward(lambda *a: None):
                raise AssertionError("an undeclared seam must skip before this")
    """
)

MARKED_AND_PLAIN = textwrap.dedent(
    """
    import pytest
    from fsdptest import FSDPTest


    @pytest.mark.fsdp2
    class TestMarked(FSDPTest):
        def test_needs_fsdp2(self):
            from fsdptest.api import fully_shard

            fully_shard(None)


    def test_plain():
        assert True
    """
)


def test_fsdp2_tests_skip_naming_what_is_missing_and_a_session_of_skips_fails(inner: Any) -> None:
    """Against an FSDP1-only implementation both FSDP2 tests skip before any rank
    starts, naming the missing FSDPModule; with nothing else in the session it fails."""
    run = inner(FSDP2_TESTS, "--fsdp-impl", FSDP1_ONLY, "-rs")
    run.result.assert_outcomes(skipped=2)
    assert run.result.ret == 1
    assert "needs FSDP2 (fully_shard and FSDPModule)" in run.text
    assert f"{FSDP1_ONLY} has no fully_shard and no FSDPModule" in run.text
    assert "no test passed: 2 test(s) that need FSDP2 were skipped" in run.text
    assert "rank pools: 0 started" in run.text


def test_a_session_that_passed_something_stays_green(inner: Any) -> None:
    """A test marked ``fsdp2`` (its module imports no FSDP2 name) skips the same way;
    beside a passing test the session passes, and the skip says why."""
    run = inner(MARKED_AND_PLAIN, "--fsdp-impl", FSDP1_ONLY, "-rs")
    run.result.assert_outcomes(passed=1, skipped=1)
    assert "needs FSDP2 (fully_shard and FSDPModule)" in run.text
    assert run.result.ret == 0
    assert "no test passed" not in run.text


def test_an_fsdp2_only_implementation_runs_through_its_declared_seams(inner: Any) -> None:
    """An implementation with FSDP2 and no FullyShardedDataParallel is accepted: the
    test patching a declared seam passes, the one patching an undeclared seam skips
    naming the seam and where it looked."""
    run = inner(FSDP2_TESTS, "--fsdp-impl", FSDP2_ONLY, "-rs")
    run.result.assert_outcomes(passed=1, skipped=1)
    assert "needs the FSDP2 seam 'register_post_backward_hook_backward'" in run.text
    assert f"{FSDP2_ONLY}._fully_shard.SEAMS" in run.text
