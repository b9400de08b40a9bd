"""The property search finds bugs: run against a deliberately broken FSDP (ours,
patched in the ranks), it fails and shrinks to a small example that names the
trigger, printed with its replay line; and its examples are plain data."""

from __future__ import annotations

import re
import textwrap
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdptest.properties.examples import (
    NO_SYNC,
    Between,
    Block,
    Config,
    Example,
    Layer,
    LayerKind,
    Model,
    Sharding,
    Step,
)
from fsdptest.properties.strategies import Target, examples

# The property test of suites/test_properties.py, at one world size, with a rank
# side whose setUp breaks our FSDP (the ranks restore fsdp after every call).
BROKEN_SUITE = textwrap.dedent(
    """
    import pytest
    from hypothesis import given, strategies as st

    import fsdp._comm
    import fsdp._grads
    from fsdptest.properties.strategies import examples
    from suites.test_properties import PropertyRanks

    _true_factors = fsdp._comm.gradient_divide_factors
    _true_prepare = fsdp._grads.FlatParamGrads.prepare_for_backward


    def _halving_at_three(world_size):
        # divides the gradient sum of three ranks by two
        return (2.0, 1.0) if world_size == 3 else _true_factors(world_size)


    def _dropping_no_sync(grads):
        # forgets the gradient accumulated under no_sync
        if grads.unsharded_pending() is not None:
            grads.flat_param.grad = None
        _true_prepare(grads)


    class BrokenRanks(PropertyRanks):
        def setUp(self):
            fsdp._comm.gradient_divide_factors = _halving_at_three
            fsdp._grads.FlatParamGrads.prepare_for_backward = _dropping_no_sync


    @pytest.mark.parametrize("world_size", [{world_size}])
    @given(data=st.data())
    def test_broken(property_search, world_size, data):
        example = data.draw(examples(property_search.target(world_size)), label="example")
        property_search.check(BrokenRanks, example)
    """
)


def _minimal_example(inner: Any, world_size: int) -> tuple[Example, str]:
    """[Note: Searches shrink on CPU ranks]
    What these tests assert is the search's shrinking, which does not depend on the
    device, and hypothesis stops shrinking after five minutes: on a GPU machine
    under ``-n``, each example's ranks wait for GPU leases, and a run there stopped
    at a larger example than the minimal one (docs/runs/gpu-runs.md, run 50). Their
    inner sessions run on CPU ranks, as CI's do."""
    source = BROKEN_SUITE.format(world_size=world_size)
    run = inner(source, "--property-examples", "30", cpu=True)
    run.result.assert_outcomes(failed=1)
    report = run.section("test_broken")
    replay_ids = re.findall(r"--replay-example (\S+)", report)
    assert replay_ids, report
    return Example.from_replay_id(replay_ids[-1]), report


def test_a_wrong_divide_factor_shrinks_to_one_layer_at_three_ranks(inner: Any) -> None:
    """Dividing by 2 instead of 3 breaks every example at three ranks: the
    search reports the simplest one, with the property it broke."""
    example, report = _minimal_example(inner, 3)
    assert example.world_size == 3
    assert len(example.model.blocks) == 1 and example.model.layer_count() == 1
    assert len(example.steps) == 1 and example.steps[0].microbatches == "S"
    assert "[parameters] at the end" in report or "[gradients]" in report
    assert "Draw 1 (example): Example(world_size=3, seed=" in report  # hypothesis's line
    assert "test_replay_example' --fsdp-impl local --replay-example" in report


def test_a_dropped_no_sync_gradient_shrinks_to_one_no_sync_microbatch(inner: Any) -> None:
    """Forgetting what ``no_sync`` accumulated breaks only schedules with a
    ``no_sync`` microbatch before a synced one: the minimal example has one."""
    example, report = _minimal_example(inner, 2)
    assert example.model.layer_count() <= 2
    assert len(example.steps) == 1 and example.steps[0].microbatches == NO_SYNC + "S"
    assert "[parameters] at the end" in report or "[gradients]" in report


EXAMPLE = Example(
    world_size=4,
    model=Model(
        vocab=5,
        width=3,
        blocks=(Block((Layer(LayerKind.LINEAR, 7, frozen=True), Layer(LayerKind.TIED))),),
        tied_head=True,
    ),
    config=Config(sharding=Sharding.HYBRID_SHARD, replicas=2, use_orig_params=True),
    steps=(Step("NNS", set_to_none=False, then=Between.SUMMON_EDIT), Step()),
)


def test_an_example_renders_readably_and_replays_from_its_id() -> None:
    assert EXAMPLE.describe() == textwrap.dedent(
        """\
        world_size=4, seed=0
          model:  tokens(vocab=5, batch=2x3) -> embedding(3) -> [linear(3->7, frozen), tied(7->7)] -> projection(7->3) -> head(3->5, tied to the embedding)
          fsdp:   HYBRID_SHARD, replicas=2, use_orig_params=True, backward_prefetch=BACKWARD_PRE, no auto-wrap
          steps:  0: NNS zero_grad(set_to_none=False) then summon_edit; 1: S zero_grad(set_to_none=True)"""
    )
    assert Example.from_replay_id(EXAMPLE.replay_id()) == EXAMPLE


@pytest.mark.parametrize("impl", ["local", "torch"])
@settings(max_examples=200, deadline=None, database=None)
@given(data=st.data())
def test_drawn_examples_are_valid_plain_data(impl: str, data: st.DataObject) -> None:
    """What every rank rebuilds the model from: replayable, steps ending synced,
    hybrid meshes that divide the world, torch's limitations left out."""
    world_size = data.draw(st.sampled_from([2, 3, 4]))
    example = data.draw(examples(Target(impl, "cpu", world_size)))
    assert Example.from_replay_id(example.replay_id()) == example
    assert all(step.microbatches.endswith("S") for step in example.steps)
    config = example.config
    assert world_size % config.replicas == 0
    assert not (config.ignored_blocks and config.mixed_precision is not None)
    if impl == "torch":
        assert not config.offload_params
        assert not (config.sharding.is_hybrid() and config.replicas == world_size)
        if config.use_orig_params:
            assert Between.LOCAL_STATE_DICT not in {step.then for step in example.steps}
