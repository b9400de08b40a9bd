"""Differential conformance: everything a user can observe of the FSDP under test
(``--fsdp-impl``) equals what the reference FSDP (``--fsdp-reference``, torch's
by default) shows, on drawn models, constructor arguments and programs of API
calls.

Hypothesis draws each scenario in the pytest process (``fsdptest.conformance.drawing``:
a rule-based state machine draws the program) and sends it to the pooled
ranks, which run it under both implementations and compare everything
``fsdptest.conformance.execute`` observes, up to the allowed differences
(``fsdptest.conformance.allowed``). A failing scenario is shrunk on the pool;
its report prints the minimal scenario and the command that replays it.
Budgets: ``fsdptest.conformance.search`` ([Note: Conformance budgets]).
"""

from __future__ import annotations

import pytest

from fsdptest import FSDPTest
from fsdptest.conformance.fixed import fitted, fixed_sample
from fsdptest.conformance.scenario import Scenario
from fsdptest.conformance.search import ConformanceSearch
from fsdptest.reach.features import scenario_rows

WORLD_SIZES = (2, 3, 4)
FIXED = fixed_sample()


class ConformanceRanks(FSDPTest):
    """The rank side: one scenario per call (not collected: no ``Test`` prefix)."""

    def check(self, scenario: Scenario, impl: str, reference: str) -> None:
        from fsdptest.conformance.check import check_scenario

        check_scenario(scenario, impl, reference)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_fsdp_conforms_to_the_reference(
    conformance_search: ConformanceSearch, world_size: int
) -> None:
    """Every drawn scenario is observed the same under both implementations."""
    conformance_search.search(ConformanceRanks, world_size)


def test_replay_scenario(
    conformance_search: ConformanceSearch, replayed_scenario: Scenario
) -> None:
    """The scenario of ``--replay-example`` is observed the same under both."""
    conformance_search.check(ConformanceRanks, replayed_scenario)


@pytest.mark.parametrize("name", sorted(FIXED))
def test_fixed_scenario(conformance_search: ConformanceSearch, name: str) -> None:
    """Each scenario of the fixed sample ([Note: A fixed sample beside the drawn
    one] in fsdptest.conformance.fixed) still exercises its row of the reach
    table, and is observed the same under both implementations."""
    fixed = FIXED[name]
    target = conformance_search.target(fixed.scenario.world_size)
    if not fixed.runs_here(target):
        pytest.skip(
            f"{fixed.row}: the reference cannot run it on {target.device_type} ranks "
            "(the accelerator runs cover it)"
        )
    scenario = fitted(fixed, target)
    rows = scenario_rows(scenario)
    assert fixed.row in rows, f"{name} no longer exercises {fixed.row!r}:\n{scenario.describe()}"
    conformance_search.check(ConformanceRanks, scenario)
