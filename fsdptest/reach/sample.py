"""Samples of what the searches draw, without running anything (see [Note: How
reach is measured] in fsdptest.reach): the conformance search's programs for
CPU and for accelerator ranks, the property search's examples, at world sizes
2, 3 and 4, each read into the rows it exercises."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis.stateful import run_state_machine_as_test

from fsdptest.conformance import scenario as sc
from fsdptest.conformance.drawing import machine_for
from fsdptest.conformance.search import BUDGETS
from fsdptest.conformance.target import Target
from fsdptest.implementations import BUILTIN_MODULES
from fsdptest.properties import strategies
from fsdptest.reach.features import example_rows, scenario_rows

WORLD_SIZES = (2, 3, 4)
COLUMNS = ("property search (CPU)", "conformance (CPU)", "conformance (accelerator)")


def _settings(count: int, steps: int | None = None) -> settings:
    extra: dict[str, Any] = {} if steps is None else {"stateful_step_count": steps}
    return settings(
        max_examples=count,
        derandomize=True,
        database=None,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        **extra,
    )


def conformance_rows(device_type: str, count: int) -> set[str]:
    """The rows of ``count`` drawn programs per world size (the deep budget's
    program length), ours against torch's FSDP on ``device_type`` ranks."""
    rows: set[str] = set()

    def collect(scenario: sc.Scenario) -> None:
        rows.update(scenario_rows(scenario))

    for world_size in WORLD_SIZES:
        target = Target(BUILTIN_MODULES["local"], BUILTIN_MODULES["torch"], device_type, world_size)
        machine = machine_for(target, collect)
        steps = BUDGETS["deep"].steps
        run_state_machine_as_test(machine, settings=_settings(count, steps))
    return rows


def property_rows(count: int) -> set[str]:
    """The rows of ``count`` drawn examples per world size (ours, CPU ranks)."""
    rows: set[str] = set()
    for world_size in WORLD_SIZES:
        target = strategies.Target("local", "cpu", world_size)
        _draw(strategies.examples(target), count, lambda e: rows.update(example_rows(e)))
    return rows


def _draw(strategy: Any, count: int, collect: Callable[[Any], None]) -> None:
    @_settings(count)
    @given(strategy)
    def draw(value: Any) -> None:
        collect(value)

    draw()


def sample(count: int) -> dict[str, set[str]]:
    """Each column's drawn rows."""
    return {
        COLUMNS[0]: property_rows(count),
        COLUMNS[1]: conformance_rows("cpu", count),
        COLUMNS[2]: conformance_rows("cuda", count),
    }
