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
