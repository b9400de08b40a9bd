"""Bugs planted in torch's FSDP2 (``fully_shard``): each must be killed by the FSDP2 suites.

Usage (from the checkout root, with the project's virtualenv active)::

    python bench/fsdp2_planted_bugs.py list
    python bench/fsdp2_planted_bugs.py run                      # every bug, then the baseline
    python bench/fsdp2_planted_bugs.py run --bugs no_gradient_division,reduce_dtype_ignored
    python bench/fsdp2_planted_bugs.py run --json docs/runs/fsdp2-planted-bugs.json
    python bench/fsdp2_planted_bugs.py run --search 12 --json docs/runs/fsdp2-planted-bugs-search.json

[Note: Planting a bug in every process of a session]
The suites' ranks are processes spawned by the harness, which import torch on their
own. ``run`` writes a ``sitecustomize.py`` into a scratch directory put first on
``PYTHONPATH`` and sets ``FSDP2_PLANTED_BUG``: every Python process of the session
(pytest, its xdist workers, every rank) then loads this file by path when it starts
and calls ``plant(name)``, which imports torch's FSDP2 and monkeypatches it. The
patch is in place before any test module imports torch's ``fully_shard``, and
before a rank takes the baseline its per-test isolation restores to, so it holds
for the whole session. Nothing on disk is changed (the virtualenv is shared).

[Note: A bug is killed]
A bug is killed when the session over its target suites reports a failed test
(or subtest) and exits with pytest's ``TESTS_FAILED`` (1), or with
``INTERRUPTED`` (2), which is how pytest-xdist ends a session that ``-x`` stopped.
Any other end (a usage or internal error, an interruption without a failure) is
reported as such, not as a kill. The baseline, the same targets with no bug planted, must exit 0 under
``--fsdp-impl torch``, or the kills mean nothing (``run`` runs it last and says so).
Each bug names the BUGS.md class it belongs to and the suite files expected to kill
it; ``-x`` stops a session at its first failure, whose test id is recorded.

[Note: The searches against planted bugs]
``run --search N`` plants each bug the same way and runs only the FSDP2 searches
(``suites/fsdp2/test_fsdp2_search.py``, N derandomized programs per world size and
mode): the parity mode holds the planted torch to the replicated reference, and
the conformance mode holds it to this project's ``fully_shard`` (``--fsdp-reference
local``), which no bug touches: an FSDP2 implementation gates another. A bug that
only changes collectives or state-dict types (which no number shows) is killed by
the conformance mode alone. The baseline is the same session with no bug.

The patches reach into torch 2.13's private modules
(``torch.distributed.fsdp._fully_shard``); on another torch a bug whose target is
missing fails to plant, and its session reports that as an error, not a kill.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BUG_ENV = "FSDP2_PLANTED_BUG"
SUITES = "suites/fsdp2"
_FSDP2 = "torch.distributed.fsdp._fully_shard"


@dataclass(frozen=True)
class Bug:
    name: str
    what: str
    bugs_class: str
    """The class of BUGS.md it belongs to ("-" for an API contract)."""
    targets: tuple[str, ...]
    """The suite files (under suites/fsdp2) expected to kill it."""


def _module(name: str) -> Any:
    import importlib

    return importlib.import_module(f"{_FSDP2}.{name}")


def _wrap_foreach_reduce(change: Callable[[dict[str, Any]], None]) -> None:
    """``foreach_reduce`` (as the parameter group calls it) with its arguments changed."""
    group = _module("_fsdp_param_group")
    original = group.foreach_reduce
    signature = inspect.signature(original)

    @functools.wraps(original)
    def patched(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        change(bound.arguments)
        return original(*bound.args, **bound.kwargs)

    group.foreach_reduce = patched


def _reduce_in_grad_dtype(arguments: dict[str, Any]) -> None:
    arguments["reduce_dtype"] = arguments["unsharded_grads"][0].dtype


def _no_division() -> None:
    import torch.distributed as dist

    collectives = _module("_fsdp_collectives")
    sums = (None, None, dist.ReduceOp.SUM, dist.ReduceOp.SUM)
    collectives._get_gradient_divide_factors = lambda *args, **kwargs: sums


def _post_forward_mesh(always: bool) -> None:
    fully_shard_module = _module("_fully_shard")
    original = fully_shard_module._get_post_forward_mesh_info
    fully_shard_module._get_post_forward_mesh_info = lambda _, mesh_info: original(
        always, mesh_info
    )


def _sync_never_reenabled() -> None:
    module_class = _module("_fully_shard").FSDPModule
    original = module_class.set_requires_gradient_sync

    def patched(self: Any, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        if not requires_gradient_sync:
            original(self, requires_gradient_sync, recurse=recurse)

    module_class.set_requires_gradient_sync = patched


def _local_state_dict() -> None:
    from torch import nn
    from torch.distributed.tensor import DTensor

    def state_dict(self: Any, *args: Any, **kwargs: Any) -> Any:
        values = nn.Module.state_dict(self, *args, **kwargs)
        for key, value in values.items():
            if isinstance(value, DTensor):
                values[key] = value.to_local()
        return values

    _module("_fully_shard").FSDPModule.state_dict = state_dict


def _skip_all_reduce(arguments: dict[str, Any]) -> None:
    arguments["all_reduce_grads"] = False


def _no_forward_prefetch() -> None:
    _module("_fully_shard").FSDPModule.set_modules_to_forward_prefetch = lambda self, modules: None


def _identity_method(name: str) -> None:
    state_class = _module("_fsdp_state").FSDPState
    if name == "_cast_forward_inputs":
        setattr(state_class, name, lambda self, args, kwargs: (args, kwargs))
    else:
        setattr(state_class, name, lambda self, output: output)


def _ignored_params_managed() -> None:
    fully_shard_module = _module("_fully_shard")
    original = fully_shard_module._get_modules_and_states
    fully_shard_module._get_modules_and_states = lambda module, device, _: original(
        module, device, None
    )


def _clear_sharded_grads(arguments: dict[str, Any]) -> None:
    for fsdp_param in arguments["fsdp_params"]:
        fsdp_param.sharded_param.grad = None


def _placement_fn_ignored() -> None:
    fully_shard_module = _module("_fully_shard")
    original = fully_shard_module._init_param_group
    signature = inspect.signature(original)

    def patched(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(*args, **kwargs)
        bound.arguments["shard_placement_fn"] = None
        return original(*bound.args, **bound.kwargs)

    fully_shard_module._init_param_group = patched


def _no_unshard_in_backward() -> None:
    group_class = _module("_fsdp_param_group").FSDPParamGroup
    group_class.pre_backward = lambda self, default_prefetch, *unused: None


BUGS: dict[str, tuple[Bug, Callable[[], None]]] = {
    bug.name: (bug, plant)
    for bug, plant in (
        (
            Bug(
                "reduce_dtype_ignored",
                "gradients are reduced in the compute dtype, not MixedPrecisionPolicy.reduce_dtype",
                "1",
                ("test_fsdp2_mixed_precision.py",),
            ),
            lambda: _wrap_foreach_reduce(_reduce_in_grad_dtype),
        ),
        (
            Bug(
                "no_gradient_division",
                "the reduced gradient is the sum over ranks, never divided by the world size",
                "2",
                ("test_fsdp2_training.py",),
            ),
            _no_division,
        ),
        (
            Bug(
                "reshard_after_forward_ignored",
                "every group reshards after forward, whatever reshard_after_forward says",
                "-",
                ("test_fsdp2_comm.py",),
            ),
            lambda: _post_forward_mesh(True),
        ),
        (
            Bug(
                "never_reshard_after_forward",
                "no group reshards after forward, whatever reshard_after_forward says",
                "-",
                ("test_fsdp2_comm.py",),
            ),
            lambda: _post_forward_mesh(False),
        ),
        (
            Bug(
                "gradient_sync_never_reenabled",
                "set_requires_gradient_sync(True) is "
                "ignored: gradients stay unsynced after a no-sync backward",
                "4",
                ("test_fsdp2_comm.py",),
            ),
            _sync_never_reenabled,
        ),
        (
            Bug(
                "state_dict_not_dtensors",
                "state_dict() holds the local shards as plain tensors instead of DTensors",
                "9",
                ("test_fsdp2_state_dict.py",),
            ),
            _local_state_dict,
        ),
        (
            Bug(
                "hsdp_replicas_never_synced",
                "HSDP never all-reduces the gradients over the replica dimension",
                "3",
                ("test_fsdp2_training.py",),
            ),
            lambda: _wrap_foreach_reduce(_skip_all_reduce),
        ),
        (
            Bug(
                "forward_prefetch_ignored",
                "set_modules_to_forward_prefetch does nothing",
                "13",
                ("test_fsdp2_comm.py",),
            ),
            _no_forward_prefetch,
        ),
        (
            Bug(
                "output_dtype_ignored",
                "MixedPrecisionPolicy.output_dtype does not cast the outputs",
                "9",
                ("test_fsdp2_mixed_precision.py",),
            ),
            lambda: _identity_method("_cast_output_dtype"),
        ),
        (
            Bug(
                "cast_forward_inputs_ignored",
                "floating-point forward inputs are never cast to param_dtype",
                "9",
                ("test_fsdp2_mixed_precision.py",),
            ),
            lambda: _identity_method("_cast_forward_inputs"),
        ),
        (
            Bug(
                "ignored_params_sharded",
                "ignored_params are sharded and reduced like the others",
                "-",
                ("test_fsdp2_init.py",),
            ),
            _ignored_params_managed,
        ),
        (
            Bug(
                "sharded_grad_overwritten",
                "a reduced gradient replaces the sharded gradient "
                "already there instead of adding to it",
                "4",
                ("test_fsdp2_module_api.py",),
            ),
            lambda: _wrap_foreach_reduce(_clear_sharded_grads),
        ),
        (
            Bug(
                "shard_placement_fn_ignored",
                "shard_placement_fn is not asked: every parameter is sharded on dim 0",
                "5",
                ("test_fsdp2_sharding.py",),
            ),
            _placement_fn_ignored,
        ),
        (
            Bug(
                "no_unshard_in_backward",
                "a group resharded after forward is not all-gathered again before its backward",
                "11",
                ("test_fsdp2_training.py",),
            ),
            _no_unshard_in_backward,
        ),
    )
}


def plant(name: str) -> None:
    """Monkeypatches bug ``name`` into torch's FSDP2 in this process."""
    BUGS[name][1]()


SITECUSTOMIZE = """\
import os
if os.environ.get({env!r}):
    import importlib.util
    _spec = importlib.util.spec_from_file_location("fsdp2_planted_bugs", {path!r})
    _bugs = importlib.util.module_from_spec(_spec)
    import sys
    sys.modules["fsdp2_planted_bugs"] = _bugs  # dataclasses look their module up there
    _spec.loader.exec_module(_bugs)
    _bugs.plant(os.environ[{env!r}])
    os.environ[{env!r} + "_DONE"] = os.environ[{env!r}]
"""


@contextlib.contextmanager
def _planting_environment() -> Iterator[dict[str, str]]:
    """An environment whose Python processes plant ``FSDP2_PLANTED_BUG`` at start."""
    with tempfile.TemporaryDirectory(prefix="fsdp2-bugs-") as scratch:
        site = Path(scratch) / "sitecustomize.py"
        site.write_text(SITECUSTOMIZE.format(env=BUG_ENV, path=str(Path(__file__).resolve())))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [scratch, env.get("PYTHONPATH")]))
        yield env


@dataclass(frozen=True)
class Outcome:
    bug: str
    what: str
    bugs_class: str
    targets: tuple[str, ...]
    exit_status: int
    killed: bool
    first_failure: str
    seconds: float


SEARCH = "test_fsdp2_search.py"


def _search_arguments(programs: int) -> tuple[str, ...]:
    """The FSDP2 searches alone, ``programs`` derandomized programs per world size
    and mode, this project's ``fully_shard`` as the conformance reference (see
    [Note: The searches against planted bugs])."""
    return ("-k", "programs", "--fsdp-reference", "local", "--conformance-scenarios", str(programs))


def _session(
    env: dict[str, str],
    bug: str,
    targets: tuple[str, ...],
    workers: int,
    world_size: int | None,
    extra: tuple[str, ...] = (),
) -> tuple[int, str, float]:
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-x",
        "-q",
        "-p",
        "no:cacheprovider",
        "--fsdp-impl",
        "torch",
        *(("--world-size", str(world_size)) if world_size else ()),
        "-n",
        str(workers),
        *extra,
        *(f"{SUITES}/{target}" for target in targets),
    ]
    started = time.monotonic()
    result = subprocess.run(
        command, cwd=ROOT, env={**env, BUG_ENV: bug}, capture_output=True, text=True
    )
    failures = [
        f"{test} {config}".strip()
        for config, test in re.findall(
            r"^(?:FAILED|ERROR|SUBFAILED(\[.*?\]))(?: \([^)]*\))? (\S+)", result.stdout, re.M
        )
    ]
    return result.returncode, (failures[0] if failures else ""), time.monotonic() - started


def _planted(env: dict[str, str], name: str) -> bool:
    """Whether a Python process of the environment starts with ``name`` planted."""
    probe = f"import os; print(os.environ.get({BUG_ENV + '_DONE'!r}))"
    result = subprocess.run(
        [sys.executable, "-c", probe], env={**env, BUG_ENV: name}, capture_output=True, text=True
    )
    return result.stdout.strip() == name


def run(names: list[str], workers: int, world_size: int, search: int = 0) -> list[Outcome]:
    outcomes = []
    extra = _search_arguments(search) if search else ()
    size = None if search else world_size  # the searches draw world sizes 2, 3 and 4
    with _planting_environment() as env:
        for name in names:
            bug = BUGS[name][0]
            if not _planted(env, name):
                raise SystemExit(f"{name} could not be planted (see its sitecustomize error)")
            targets = (SEARCH,) if search else bug.targets
            status, failure, seconds = _session(env, name, targets, workers, size, extra)
            outcome = Outcome(
                name,
                bug.what,
                bug.bugs_class,
                targets,
                status,
                status in (1, 2) and bool(failure),
                failure,
                round(seconds, 1),
            )
            print(_line(outcome), flush=True)
            outcomes.append(outcome)
        targets = (
            (SEARCH,)
            if search
            else tuple(sorted({t for name in names for t in BUGS[name][0].targets}))
        )
        status, failure, seconds = _session(env, "", targets, workers, size, extra)
        print(
            f"baseline (no bug) over {', '.join(targets)}: exit {status} in {seconds:.0f} s"
            + (f", first failure {failure}" if failure else ""),
            flush=True,
        )
        outcomes.append(
            Outcome(
                "(baseline)",
                "no bug planted",
                "-",
                targets,
                status,
                False,
                failure,
                round(seconds, 1),
            )
        )
    return outcomes


def _line(outcome: Outcome) -> str:
    verdict = "KILLED" if outcome.killed else f"SURVIVED (exit {outcome.exit_status})"
    return f"{outcome.bug:32} {verdict:22} {outcome.seconds:6.0f} s  {outcome.first_failure}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("list", help="the bugs, their class and target suites")
    runner = commands.add_parser("run", help="plant each bug and run its target suites")
    runner.add_argument("--bugs", default="", help="comma-separated names (default: all)")
    runner.add_argument("--workers", type=int, default=2, help="pytest -n (default 2)")
    runner.add_argument("--world-size", type=int, default=2)
    runner.add_argument("--json", type=Path, default=None, help="write the outcomes here")
    runner.add_argument(
        "--search",
        type=int,
        default=0,
        metavar="N",
        help="run only the FSDP2 searches, N programs per world size and mode, with this "
        "project's fully_shard as the conformance reference",
    )
    args = parser.parse_args()
    if args.command == "list":
        for bug, _ in BUGS.values():
            print(f"{bug.name:32} class {bug.bugs_class:3} {', '.join(bug.targets):34} {bug.what}")
        return
    names = [n for n in args.bugs.split(",") if n] or list(BUGS)
    unknown = sorted(set(names) - set(BUGS))
    if unknown:
        parser.error(f"unknown bugs {unknown}; known: {', '.join(BUGS)}")
    outcomes = run(names, args.workers, args.world_size, args.search)
    if args.json:
        args.json.write_text(json.dumps([asdict(o) for o in outcomes], indent=2) + "\n")
    survivors = [o.bug for o in outcomes[:-1] if not o.killed]
    baseline_ok = outcomes[-1].exit_status == 0
    print(
        f"{len(outcomes) - 1 - len(survivors)} of {len(outcomes) - 1} bugs killed; "
        f"baseline {'green' if baseline_ok else 'NOT green'}"
    )
    sys.exit(0 if not survivors and baseline_ok else 1)


if __name__ == "__main__":
    main()
