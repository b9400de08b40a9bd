"""Installing the package changes no one else's pytest: a foreign project in the
same environment, with its own ``--device``/``--world-size``/``--subtest``/``--launcher``
options, its own hypothesis profile and plain unittest tests, runs as it would
without the package: with all three ``pytest11`` plugins, and with each of them
disabled in turn. The plugins import neither torch nor hypothesis nor expecttest
there."""

from __future__ import annotations

import textwrap

import pytest

PLUGINS = ("harness.plugin", "fsdptest.plugin", "upstream.plugin")

FOREIGN_CONFTEST = textwrap.dedent(
    """
    import pytest
    from hypothesis import settings

    settings.register_profile("foreign", max_examples=7, database=None)
    settings.load_profile("foreign")


    def pytest_addoption(parser):
        parser.addoption("--device", default="tpu", help="this project's own device")
        parser.addoption("--world-size", type=int, default=8)
        parser.addoption("--subtest", default="all")
        parser.addoption("--launcher", default="gdb", help="this project's own launcher")


    @pytest.fixture
    def device(request):
        return request.config.getoption("device")
    """
)

FOREIGN_TESTS = textwrap.dedent(
    """
    import sys
    import unittest

    from hypothesis import given, strategies as st

    DRAWN = []


    @given(st.integers())
    def test_draws_under_its_own_profile(x):
        DRAWN.append(x)


    def test_its_profile_was_used():
        assert len(DRAWN) == 7


    def test_its_options_are_its_own(device, pytestconfig):
        assert device == "npu"
        assert pytestconfig.getoption("world_size") == 3
        assert pytestconfig.getoption("subtest") == "some"
        assert pytestconfig.getoption("launcher") == "lldb"


    def test_nothing_heavy_was_imported_for_it():
        assert [m for m in ("torch", "expecttest") if m in sys.modules] == []


    class TestPlain(unittest.TestCase):
        def test_plain(self):
            self.assertEqual(sorted([3, 1, 2]), [1, 2, 3])
    """
)


@pytest.fixture
def foreign(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    """A project of its own, run with nothing but the environment's plugins."""
    for name in ("PYTEST_ADDOPTS", "PYTEST_PLUGINS", "PYTEST_DISABLE_PLUGIN_AUTOLOAD"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT", raising=False)
    pytester.makeconftest(FOREIGN_CONFTEST)
    pytester.makepyfile(test_foreign=FOREIGN_TESTS)
    return pytester


@pytest.mark.parametrize("disabled", [None, *PLUGINS])
def test_a_foreign_project_runs_unchanged(foreign: pytest.Pytester, disabled: str | None) -> None:
    """With every plugin, and with each disabled alone (``-p no:harness.plugin``
    was an INTERNALERROR: the others implement its hooks)."""
    args = ["-p", "no:cacheprovider", "--device", "npu", "--world-size", "3", "--subtest", "some"]
    args += ["--launcher", "lldb"]
    if disabled is not None:
        args += ["-p", f"no:{disabled}"]
    result = foreign.runpytest_subprocess(*args)
    output = result.stdout.str() + result.stderr.str()
    assert "INTERNALERROR" not in output, output
    result.assert_outcomes(passed=5)


def test_the_plugins_are_there_for_that_project(foreign: pytest.Pytester) -> None:
    """The foreign project's options won; the runner's own names stay available."""
    result = foreign.runpytest_subprocess("-p", "no:cacheprovider", "--help")
    help_text = result.stdout.str()
    assert "--dist-device" in help_text and "--dist-world-size" in help_text
    assert "--fsdp-impl" in help_text
    assert "--dist-launcher" in help_text and "--gpu-lease-dir" in help_text
    assert "this project's own device" in help_text
    assert "this project's own launcher" in help_text
    assert "the same as --dist-device" not in help_text  # no alias where --device is taken
    assert "the same as --dist-launcher" not in help_text


def test_without_a_foreign_option_the_short_spellings_are_the_runners(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(test_nothing="def test_nothing(): pass")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--help")
    help_text = result.stdout.str()
    for alias, canonical in (
        ("--device", "--dist-device"),
        ("--world-size", "--dist-world-size"),
        ("--subtest", "--dist-subtest"),
        ("--launcher", "--dist-launcher"),
    ):
        assert f"the same as {canonical}" in help_text, alias
