"""FSDP2 programs as plain data (fsdptest.fsdp2search.program and .drawing): replay
ids round-trip, bad programs are refused with what is wrong, and the drawn
programs are valid, with the parity mode's rules (Adam only in full precision, a
``reshard`` before every call that uses the sharded parameters)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fsdptest.fsdp2search.drawing import USE_SHARDED, programs, reshard_values
from fsdptest.fsdp2search.program import NETS, Op, Program


def _program(**changes: object) -> Program:
    fields: dict[str, object] = {
        "world_size": 4,
        "net": "nested",
        "sharded": ("0.0", "1"),
        "reshard_after_forward": (2, False, True),
        "mixed_precision": "bf16-fp32",
        "replicas": 2,
        "ops": (Op("train", (True, None, False, 2)), Op("step", (True,))),
    }
    fields.update(changes)
    return Program(**fields)  # type: ignore[arg-type]


def test_replay_id_round_trips() -> None:
    program = _program()
    replayed = Program.from_replay_id(program.replay_id())
    assert replayed == program
    assert program.replay_id().startswith("fsdp2:")


def test_other_replay_ids_are_refused() -> None:
    with pytest.raises(ValueError, match="not an FSDP2 program's replay id"):
        Program.from_replay_id("eNoLcg1yBQAC2AE3")


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"net": "resnet"}, "net 'resnet'"),
        ({"sharded": ("9",)}, "are not all candidates"),
        ({"reshard_after_forward": (True,)}, "one value per sharded module"),
        ({"mixed_precision": "fp8"}, "mixed precision 'fp8'"),
        ({"replicas": 3}, "3 replicas do not divide world size 4"),
        ({"optimizer": "lbfgs"}, "optimizer 'lbfgs'"),
    ],
)
def test_bad_programs_are_refused_naming_what_is_wrong(
    changes: dict[str, object], named: str
) -> None:
    with pytest.raises(ValueError, match=named.replace("(", r"\(")):
        _program(**changes)


def test_unknown_calls_are_refused() -> None:
    with pytest.raises(ValueError, match="'jump' is not an FSDP2 program's call"):
        Op("jump")


def test_describe_names_every_call() -> None:
    text = _program().describe()
    assert "mesh 2x2 (HSDP)" in text
    assert "0.0 (reshard_after_forward=2)" in text
    assert "op 1: step(True)" in text


def test_reshard_values_divide_the_shard_group() -> None:
    assert reshard_values(4) == [True, False, 1, 2, 4]
    assert reshard_values(3) == [True, False, 1, 3]


@settings(max_examples=60, derandomize=True, database=None, deadline=None)
@given(st.sampled_from([2, 3, 4]), st.sampled_from(["conformance", "parity"]), st.data())
def test_drawn_programs_are_valid(world_size: int, mode: str, data: st.DataObject) -> None:
    program = data.draw(programs(world_size, mode, 8))
    assert program.world_size == world_size
    assert not program.problems()
    assert set(program.sharded) <= set(NETS[program.net])
    if mode == "parity":
        if program.mixed_precision != "none":
            assert program.optimizer == "sgd"
        for before, op in zip(program.ops, program.ops[1:], strict=False):
            if op.name in USE_SHARDED:
                assert before.name == "reshard", program.describe()
        if program.ops and program.ops[0].name in USE_SHARDED:
            pytest.fail(f"a first call that uses the sharded parameters:\n{program.describe()}")


@pytest.mark.filterwarnings("ignore::hypothesis.errors.NonInteractiveExampleWarning")
def test_an_unknown_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="mode 'fuzz'"):
        programs(2, "fuzz", 4).example()
