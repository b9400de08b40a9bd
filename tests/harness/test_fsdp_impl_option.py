"""``--fsdp-impl`` names any FSDP implementation: a module path, an entry point of the
group ``fsdptest.implementations``, or a built-in name; unknown names are usage
errors; a missing public name fails naming it; private seams skip with the reason."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path
from typing import Any

import pytest

from fsdptest.implementations import ENTRY_POINT_GROUP, Implementation, resolve

ROOT = Path(__file__).resolve().parents[2]
SUITE = ROOT / "suites" / "test_construction.py"
SEAM_SUITE = ROOT / "suites" / "test_fsdp_backward_prefetch.py"
EXAMPLE = "tests.harness.example_impl"

# Appended to a suite: proves, inside the ranks, which implementation served it.
PROBE = textwrap.dedent(
    """

    from harness import DistributedTest as _ProbeBase


    class TestImplementationProbe(_ProbeBase):
        def test_the_facade_serves_the_example_module(self):
            import fsdptest.api
            import tests.harness.example_impl

            assert fsdptest.api.IMPLEMENTATION.module == "tests.harness.example_impl"
            assert fsdptest.api.FSDP is tests.harness.example_impl.FullyShardedDataParallel
            assert fsdptest.api.wrap is tests.harness.example_impl.wrap
    """
)


def _register(tmp: Path, monkeypatch: pytest.MonkeyPatch, name: str, module: str) -> None:
    """Installs, on PYTHONPATH, a distribution whose entry point registers ``name``."""
    info = tmp / "site" / "example_fsdp-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: example-fsdp\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\n{name} = {module}\n")
    monkeypatch.setenv("PYTHONPATH", f"{info.parent}{os.pathsep}{os.environ['PYTHONPATH']}")


def _suite_with_probe() -> str:
    return SUITE.read_text() + PROBE


def test_a_suite_runs_through_a_module_path(inner: Any) -> None:
    """suites/test_construction.py passes against the example adapter named by its module
    path, as it does against ours, and the ranks use the adapter's names."""
    reference = inner(SUITE.read_text())
    counts = reference.result.parseoutcomes()
    run = inner(_suite_with_probe(), "--fsdp-impl", EXAMPLE)
    run.result.assert_outcomes(passed=counts["passed"] + 1, skipped=counts.get("skipped", 0))
    assert f"fsdp implementation: {EXAMPLE} (module path)" in run.text


def test_a_suite_runs_through_an_entry_point(
    inner: Any, pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A distribution registering ``example = tests.harness.example_impl`` in the entry-point group
    makes ``--fsdp-impl example`` run the suite against the adapter."""
    _register(pytester.path, monkeypatch, "example", EXAMPLE)
    run = inner(_suite_with_probe(), "--fsdp-impl", "example", "-k", "Probe or nested_unit_inside")
    assert run.result.parseoutcomes().get("passed", 0) >= 2, run.text
    run.result.assert_outcomes(passed=run.result.parseoutcomes()["passed"])
    assert (
        "fsdp implementation: example = tests.harness.example_impl (entry point of example-fsdp)"
        in run.text
    )


def test_unknown_name_is_a_usage_error_listing_the_known_ones(
    inner: Any, pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    _register(pytester.path, monkeypatch, "example", EXAMPLE)
    run = inner("def test_nothing():\n    pass\n", "--fsdp-impl", "no_such_fsdp")
    assert run.result.ret == pytest.ExitCode.USAGE_ERROR
    error = run.result.stderr.str()
    assert "--fsdp-impl 'no_such_fsdp' is neither a known FSDP implementation" in error
    assert (
        "Known: local (fsdp), torch (torch.distributed.fsdp), example (tests.harness.example_impl)"
        in error
    )
    assert "INTERNALERROR" not in run.text + error


PARTIAL = textwrap.dedent(
    """
    '''An FSDP module with only part of the API: no ShardedGradScaler.'''
    from fsdp import (
        BackwardPrefetch, CPUOffload, FullyShardedDataParallel, MixedPrecision, ShardingStrategy,
    )
    from fsdp.wrap import ModuleWrapPolicy
    """
)


def test_a_missing_public_name_fails_naming_it(inner: Any, pytester: pytest.Pytester) -> None:
    """A suite importing a name the implementation lacks fails at collection, naming the
    implementation, the name and where it was looked for."""
    (pytester.path / "partial_fsdp.py").write_text(PARTIAL)
    grad_scaler_suite = (ROOT / "suites" / "test_grad_scaler.py").read_text()
    run = inner(grad_scaler_suite, "--fsdp-impl", "partial_fsdp")
    run.result.assert_outcomes(errors=1)
    assert (
        "MissingFromImplementation: the FSDP under test (partial_fsdp, module path) has no "
        "ShardedGradScaler (looked in partial_fsdp)"
    ) in run.text


def test_private_seams_skip_with_the_reason(inner: Any) -> None:
    """A suite patching a runtime seam (SEAMS) is skipped, with the reason, for an
    implementation that does not have our or torch's internals."""
    run = inner(SEAM_SUITE.read_text(), "--fsdp-impl", EXAMPLE, "-rs")
    run.result.assert_outcomes(skipped=1)
    assert (
        "needs SEAMS (the runtime functions tests patch), a private part of this project's "
        "and torch's FSDP that the FSDP under test (tests.harness.example_impl) does not have"
    ) in run.text


@pytest.mark.parametrize(
    "name,kind",
    [("local", "local"), ("torch", "torch"), ("fsdp", "local"), (EXAMPLE, EXAMPLE)],
)
def test_a_name_resolves_to_its_module_and_kind(name: str, kind: str) -> None:
    """A module path naming a built-in module is that built-in implementation."""
    impl = resolve(name)
    assert isinstance(impl, Implementation) and impl.kind == kind
