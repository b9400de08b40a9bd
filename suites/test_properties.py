"""Property-based parity search: FSDP trains like DDP on drawn models, FSDP
configurations and schedules.

Hypothesis draws each example in the pytest process and sends it to the pooled
ranks, which train it under FSDP and under DDP in lockstep and check every
property of ``fsdptest.properties.lockstep`` (losses, gradients and their
None-ness, clipping norms, 1/N shards, state-dict round trips, parameters). A
failing example is shrunk on the pool; its report prints the minimal example and
the command that replays it (``--replay-example``). Budgets: the hypothesis
profiles ``ci`` (default) and ``deep`` (see fsdptest.properties.search).
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fsdptest import FSDPTest
from fsdptest.properties.examples import Example
from fsdptest.properties.lockstep import check_example
from fsdptest.properties.search import PropertySearch
from fsdptest.properties.strategies import examples

WORLD_SIZES = (2, 3, 4)


class PropertyRanks(FSDPTest):
    """The rank side: one example per call (not collected: no ``Test`` prefix)."""

    def check(self, example: Example) -> None:
        check_example(self, example)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@given(data=st.data())
def test_fsdp_trains_like_ddp(
    property_search: PropertySearch, world_size: int, data: st.DataObject
) -> None:
    """Every drawn example keeps every property (see fsdptest.properties.lockstep)."""
    example = data.draw(examples(property_search.target(world_size)), label="example")
    property_search.check(PropertyRanks, example)


def test_replay_example(property_search: PropertySearch, replayed_example: Example) -> None:
    """The example of ``--replay-example`` keeps every property."""
    property_search.check(PropertyRanks, replayed_example)
