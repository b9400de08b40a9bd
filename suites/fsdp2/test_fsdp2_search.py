"""The FSDP2 searches: drawn ``fully_shard`` programs (a model, which submodules
are sharded and how, a mesh, mixed precision, offload, and calls: training with
the gradient-sync toggles, steps, ``unshard``/``reshard``, explicit prefetching,
state dicts, DCP round trips, clipping) run on the pooled ranks.

- ``conformance``: the FSDP under test (``--fsdp-impl``) observed the same as the
  reference (``--fsdp-reference``, torch's ``fully_shard`` by default): losses,
  local shards and gradients, collectives, state-dict entries, errors.
- ``parity``: the FSDP under test shows the numbers of a replicated reference
  (DDP's, with ``no_sync`` for the gradient-sync toggles).

Notes: fsdptest.fsdp2search (programs, drawing, run, replica, check, search).
A failure prints the program and the ``--replay-example`` line that replays it
(``test_replay_program``).
"""

from __future__ import annotations

import pytest

from fsdptest.fsdp2search.drawing import MODES
from fsdptest.fsdp2search.program import Program
from fsdptest.fsdp2search.search import Fsdp2Search
from harness.rank_calls import RankCalls
from suites.fsdp2.helpers import FSDP2Test

WORLD_SIZES = (2, 3, 4)


class Fsdp2SearchRanks(FSDP2Test):
    """The rank side: one program per call (not collected: no ``Test`` prefix)."""

    def conformance(self, program: Program, impl: str, reference: str) -> None:
        from fsdptest.fsdp2search.check import conform

        conform(program, impl, reference, self.device)

    def parity(self, program: Program, impl: str) -> None:
        from fsdptest.fsdp2search.check import match_replica

        match_replica(program, impl, self.device)


@pytest.mark.fsdp2
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_fully_shard_programs(fsdp2_search: Fsdp2Search, world_size: int, mode: str) -> None:
    """Every drawn program runs the same under both implementations (conformance),
    or with the replicated reference's numbers (parity)."""
    fsdp2_search.search(Fsdp2SearchRanks, world_size, mode)


@pytest.mark.fsdp2
@pytest.mark.parametrize("mode", MODES)
def test_replay_program(fsdp2_search: Fsdp2Search, replayed_program: Program, mode: str) -> None:
    """The program of ``--replay-example``, checked as ``mode`` does."""
    fsdp2_search.check(Fsdp2SearchRanks, replayed_program, mode)


TORCH_DEFECT_PROGRAMS = {
    # the shortest program of each fsdptest.fsdp2search.check.TORCH_DEFECTS entry
    "STALE_ALL_GATHER_AFTER_LOAD": "fsdp2:eNolj9EOgyAMRf-lz2TR7c1fMYYQKRsJUtPWubjs31f0pSnlcHr5wk5copd8IAx3BxUVBquiGMGBvAJH64YRulsHkwPGc-ZDUmSfiHc72b3yhq4VY5b8wehXxjlLptqEVNF0lFKhYHgKRbDJ1pLnIDD0DhLTgQafJqBV82Kp2F7Ls2Wh1bhxBOWQK7hr4yWqWymunyY3QvN70aDoY57VuHOM71DO3uIJth89fn8XbFZn",
    "SPLIT_SIZES_AFTER_POST_FORWARD_UNSHARD": "fsdp2:eNo1j0GOwyAMRe_itVslTNVFroKiyC1GRSKADGmqjubuY1J1gcU3z_-bX9izRLfU8GaYLgiJG0xaa2MHCPVB4vQ2WRjOgzb6Gc-famBGED6YhXxjWXyWXZXyBg2OeEFPsbJya3ixW4rwPdSQk4b48mNONz9e1Sx7HzPpXJONu2mJ4U4VphHBS35z-j7l0sKq24o6kKO1DxcFrYUmFBKgPSI_wZi2GNHMM1rY0rGpAt3paPGToupZBVTu_xz-_gHLSlit",
}


class TorchDefectRanks(FSDP2Test):
    """Runs a program under torch's ``fully_shard`` alone (not collected)."""

    def torch_fails(self, program: Program, expected: str) -> None:
        from fsdptest.fsdp2search.run import Fsdp2Runtime, ProgramRun, mesh_of

        mesh = mesh_of(program, self.device_type)
        seen = ProgramRun(program, Fsdp2Runtime("torch"), mesh, self.device).run()
        errors = [str(o.value) for o in seen if o.key == "error"]
        self.assertTrue(errors and errors[0].startswith(expected), f"torch ended with {errors}")

    def torch_is_stale(self, program: Program) -> None:
        """torch's forward after the load computes with the parameters from before
        it: its values leave the replicated reference's there, not before."""
        from fsdptest.fsdp2search.check import by_key, load_after_non_last_backward
        from fsdptest.fsdp2search.replica import Replica
        from fsdptest.fsdp2search.run import Fsdp2Runtime, ProgramRun, mesh_of

        load = load_after_non_last_backward(program)
        assert load is not None, "the program has no load after a backward that was not the last"
        mesh = mesh_of(program, self.device_type)
        seen = ProgramRun(program, Fsdp2Runtime("torch"), mesh, self.device).run()
        expected = Replica(program, self.device).run()
        differences = by_key(program, expected, seen, {"rtol": 1e-5, "atol": 1e-5})
        self.assertTrue(differences, "torch's run shows the replicated reference's values")
        self.assertIn(f"op {load + 1} ", differences[0])


@pytest.mark.fsdp2
@pytest.mark.parametrize("name", sorted(TORCH_DEFECT_PROGRAMS))
def test_torch_defects_still_fail(rank_calls: RankCalls, name: str) -> None:
    """Each defect of torch's FSDP2 that the conformance search allows still shows
    on its program ([Note: Where torch's FSDP2 fails and the implementation under
    test does not] in fsdptest.fsdp2search.check)."""
    from fsdptest.fsdp2search.check import STALE_AFTER_LOAD, TORCH_DEFECTS

    program = Program.from_replay_id(TORCH_DEFECT_PROGRAMS[name])
    if name == STALE_AFTER_LOAD:
        outcome = rank_calls.run(
            TorchDefectRanks, "torch_is_stale", program.world_size, program=program
        )
    else:
        outcome = rank_calls.run(
            TorchDefectRanks,
            "torch_fails",
            program.world_size,
            program=program,
            expected=TORCH_DEFECTS[name],
        )
    assert outcome.passed, outcome.report
