"""The conformance search finds bugs nobody told it about: each of the bugs
planted below (one to three lines of our FSDP changed, in the ranks, each in
another kind of observation) makes the search at two ranks fail, and shrink to
a small scenario whose report names the observation the bug changed, with the
line that replays it. And scenarios are plain data that replay from their ids.

The bugs run in one inner session (one pool of ranks): a rank class per bug,
whose ``check`` patches our FSDP before running the scenario (the ranks
restore ``fsdp`` after every call, so each bug lives for one scenario). The
reference is torch's FSDP, untouched.
"""

from __future__ import annotations

import os
import re
import textwrap
from typing import Any

import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from fsdptest.conformance import scenario as sc
from fsdptest.conformance.drawing import machine_for
from fsdptest.conformance.target import Target

# Each bug: a function of the inner module that patches our FSDP (in the ranks),
# and what its report must name (a regular expression).
BUGS: dict[str, str] = {
    "buffer_dtype": r"buffer .*\.dtype",
    "missing_warning": r"warnings",
    "exception_message": r"exception",
    "comm_hook_state": r"comm hook called with",
    "fsdp_modules_root_only": r"fsdp modules",
    "nested_state_dict_type": r"settings after leaving|previous settings|settings",
    "summon_writeback": r"parameter|attribute|full parameters|full state dict",
    "clip_dtype": r"total norm.*\.dtype",
    "extra_collective": r"collectives",
    "grads_zeros_not_none": r"\.grad",
    "forward_input_cast": r"forward \(root\) input",
    "optim_state_aliases_live_step": r"optimizer state dict \d+ changed since saved",
    "gradient_divide_factor": r"parameter|\.grad|loss|total norm",
}

PLANTED = textwrap.dedent(
    '''
    import contextlib
    import copy
    import dataclasses

    import pytest
    import torch

    import fsdp._clip_grad
    import fsdp._comm
    import fsdp._state_dict.optim_unit
    import fsdp._orig_params
    import fsdp._reduce
    import fsdp._runtime
    import fsdp._unshard_params
    import fsdp.fully_sharded_data_parallel as fsdp_module
    from fsdp.api import StateDictType
    from suites.test_conformance import ConformanceRanks

    FSDP = fsdp_module.FullyShardedDataParallel
    State = fsdp._runtime.FSDPState


    def buffer_dtype():
        """Buffers are cast to param_dtype instead of buffer_dtype."""
        original = State._cast_buffers

        def cast(self, full_precision):
            config = self.config
            mp = config.mixed_precision
            wrong = dataclasses.replace(mp, buffer_dtype=mp.param_dtype)
            self.config = dataclasses.replace(config, mixed_precision=wrong)
            try:
                original(self, full_precision)
            finally:
                self.config = config

        State._cast_buffers = cast


    def missing_warning():
        """The deprecated optimizer-state APIs no longer warn."""
        fsdp._state_dict.warn_legacy = lambda current, replacement: None


    def exception_message():
        """register_comm_hook's refusal for hybrid strategies says it differently."""
        original = FSDP.register_comm_hook

        def register(self, state, hook):
            try:
                return original(self, state, hook)
            except AssertionError as error:
                raise AssertionError(str(error).replace("not supported", "unsupported")) from None

        FSDP.register_comm_hook = register


    def comm_hook_state():
        """A communication hook is handed a copy of its state, not the state."""

        original = fsdp._reduce._hook_reduce

        def hook_reduce(grad, plan, hook):
            return original(grad, plan, hook._replace(state=copy.copy(hook.state)))

        fsdp._reduce._hook_reduce = hook_reduce


    def fsdp_modules_root_only():
        """fsdp_modules ignores root_only."""
        original = FSDP.fsdp_modules
        FSDP.fsdp_modules = staticmethod(lambda module, root_only=False: original(module))


    def nested_state_dict_type():
        """Leaving a state_dict_type context restores the default settings, not
        the ones set_state_dict_type had set."""

        @contextlib.contextmanager
        def state_dict_type(module, kind, config=None, optim_config=None):
            FSDP.set_state_dict_type(module, kind, config, optim_config)
            try:
                yield
            finally:
                FSDP.set_state_dict_type(module, StateDictType.FULL_STATE_DICT)

        FSDP.state_dict_type = staticmethod(state_dict_type)


    def summon_writeback():
        """summon_full_params(writeback=False) writes back all the same."""
        original = fsdp._unshard_params.SummonedUnit.exit
        fsdp._unshard_params.SummonedUnit.exit = (
            lambda self, writeback: original(self, writeback or not self.rank0_only)
        )


    def clip_dtype():
        """clip_grad_norm_ returns the norm in float64."""
        original = fsdp_module.clip_grad_norm
        fsdp_module.clip_grad_norm = lambda *args: original(*args).double()


    def extra_collective():
        """The root's forward all-reduces one more element."""
        original = State.pre_forward

        def pre_forward(self, args, kwargs):
            if self.is_root:
                fsdp._comm.all_reduce(torch.zeros(1, device=self.compute_device), self.process_group)
            return original(self, args, kwargs)

        State.pre_forward = pre_forward


    def grads_zeros_not_none():
        """Original parameters without a sharded gradient get zeros, not None."""
        original = fsdp._orig_params.OrigParamViews.show_sharded_grads

        def show(self, grad):
            original(self, grad)
            if grad is None:
                for param in self.params:
                    if param.requires_grad and param.grad is None:
                        param.grad = torch.zeros_like(param)

        fsdp._orig_params.OrigParamViews.show_sharded_grads = show


    def forward_input_cast():
        """Integer forward inputs (token ids) are cast to param_dtype too."""
        fsdp._runtime._cast_floats = lambda dtype, args, kwargs: fsdp._runtime._apply_to_tensors(
            lambda t: t.to(dtype), (args, kwargs)
        )


    def optim_state_aliases_live_step():
        """A saved optimizer state's scalar (Adam's step) is the live tensor."""
        original = fsdp._state_dict.optim_unit.UnitLayout.gather_flat_state

        def gather(self, state, to_save, form):
            saved = original(self, state, to_save, form)
            for entry in saved:
                for name, value in state.items():
                    if torch.is_tensor(value) and value.dim() == 0 and name in entry:
                        entry[name] = value
            return saved

        fsdp._state_dict.optim_unit.UnitLayout.gather_flat_state = gather


    def gradient_divide_factor():
        """Gradients are summed, never divided by the world size."""
        fsdp._comm.gradient_divide_factors = lambda world_size: (1.0, 1.0)


    def _broken(name):
        plant = globals()[name]

        def check(self, scenario, impl, reference):
            plant()
            ConformanceRanks.check(self, scenario, impl, reference)

        return type(f"Broken_{name}", (ConformanceRanks,), {"check": check, "__module__": __name__})


    BUGS = {BUGS}
    for _name in BUGS:
        globals()[f"Broken_{_name}"] = _broken(_name)


    @pytest.mark.parametrize("bug", BUGS)
    def test_planted(conformance_search, bug):
        conformance_search.search(globals()[f"Broken_{bug}"], 2)
    '''
)


FULL_PROOF_ENV = "FSDPTEST_PLANTED_BUGS"
CHEAP_BUG = "clip_dtype"  # found in the first scenario, shrunk in seconds


# The derandomized scenarios each planted bug's search may use.
BUDGET = 100


def _failures(inner: Any, bugs: list[str]) -> dict[str, tuple[sc.Scenario, str]]:
    source = PLANTED.replace("{BUGS}", repr(bugs))
    # on CPU ranks: [Note: Searches shrink on CPU ranks] in tests/conformance/test_property_search.py
    run = inner(source, "--conformance-scenarios", str(BUDGET), cpu=True)
    found = {}
    for bug in bugs:
        report = run.section(f"test_planted[{bug}]")
        replay_ids = re.findall(r"--replay-example (\S+)", report)
        assert replay_ids, f"{bug}: the search did not fail\n{report[-3000:]}"
        found[bug] = (sc.Scenario.from_replay_id(replay_ids[-1]), report)
    run.result.assert_outcomes(failed=len(bugs))
    return found


def _problems(failures: dict[str, tuple[sc.Scenario, str]]) -> list[str]:
    problems = []
    for bug, (scenario, report) in failures.items():
        differences = report[report.find("differs from the reference") :][:3000]
        if not re.search(BUGS[bug], differences):
            problems.append(f"{bug}: the differences do not name {BUGS[bug]!r}:\n{differences}")
        if len(scenario.ops) > 9:
            problems.append(
                f"{bug}: not shrunk ({len(scenario.ops)} calls):\n{scenario.describe()}"
            )
        if "test_replay_scenario' --fsdp-impl local --fsdp-reference torch" not in report:
            problems.append(f"{bug}: no replay line")
    return problems


def test_a_planted_bug_is_found_and_shrunk(inner: Any) -> None:
    """clip_grad_norm_ returning float64: the search fails on it and shrinks the
    program to the one call (the whole list: ``test_every_planted_bug_...``)."""
    failures = _failures(inner, [CHEAP_BUG])
    assert not _problems(failures), _problems(failures)
    scenario, _ = failures[CHEAP_BUG]
    kinds = [type(op) for op in scenario.ops]
    # Every call drawn before the clipping is gone. Calls after it that touch no
    # gradient (parameter edits) are not always deleted within the shrinking
    # the search gets on a loaded machine; the program stays at most four calls.
    assert kinds[0] is sc.ClipGradNorm and kinds[-1] is sc.Final, scenario.describe()
    assert len(kinds) <= 4 and set(kinds[1:-1]) <= {sc.EditParams}, scenario.describe()


def test_a_survey_lists_each_failed_scenario_with_its_replay_line(inner: Any) -> None:
    """``--conformance-survey`` goes on past failures; its verdict names every failed
    scenario by its first difference and the line that replays it, so a run on a
    lent machine is readable from its output alone."""
    source = PLANTED.replace("{BUGS}", repr([CHEAP_BUG]))
    run = inner(source, "--conformance-scenarios", "12", "--conformance-survey", cpu=True)
    run.result.assert_outcomes(failed=1)
    report = run.section(f"test_planted[{CHEAP_BUG}]")
    counted = re.search(r"(\d+) scenarios at world size 2 failed \(a survey; full reports", report)
    assert counted, report[-3000:]
    firsts = re.findall(r"^E?\s*- (op \d+ \(.*)$", report, re.M)
    replays = re.findall(r"test_replay_scenario' --fsdp-impl local .*--replay-example \S+", report)
    assert len(firsts) == len(replays) == min(int(counted.group(1)), 20), report[-3000:]
    assert all("clip" in first for first in firsts), firsts


@pytest.mark.skipif(
    not os.environ.get(FULL_PROOF_ENV),
    reason=f"the thirteen planted bugs take about 9 minutes on two CPU cores: {FULL_PROOF_ENV}=1",
)
@pytest.mark.timeout(1800)
@pytest.mark.parametrize("bug", sorted(BUGS))
def test_every_planted_bug_is_found_and_shrunk(inner: Any, bug: str) -> None:
    """Each bug fails the search with a small scenario (at most 8 calls before
    the closing observation) whose differences name what the bug changed, and
    its report prints the line that replays it. One inner session per bug
    (``-k bug_name`` runs one alone)."""
    problems = _problems(_failures(inner, [bug]))
    assert not problems, "\n\n".join(problems)


def _valid(scenario: sc.Scenario) -> None:
    assert sc.Scenario.from_replay_id(scenario.replay_id()) == scenario
    assert isinstance(scenario.ops[-1], sc.Final)
    entered = (sc.EnterNoSync, sc.EnterSummon, sc.EnterStateDictType)
    depth = 0
    for op in scenario.ops:
        depth += isinstance(op, entered) - isinstance(op, sc.Exit)
        assert depth >= 0, scenario.describe()
    assert depth == 0, scenario.describe()
    _loads_match_the_type_in_effect(scenario)
    setup = scenario.setup
    assert scenario.world_size % setup.replicas == 0
    assert not setup.offload_params and not setup.sync_module_states  # torch on CPU ranks
    if setup.sharding.is_hybrid():
        assert setup.replicas < scenario.world_size  # torch: a one-rank shard group
    if any(isinstance(op, sc.WrapAgain) for op in scenario.ops):
        assert setup.mixed_precision is None  # torch's FSDP(FSDP(m)) with mixed precision fails


def _loads_match_the_type_in_effect(scenario: sc.Scenario) -> None:
    """A state dict is loaded under the kind it was saved under. Exiting a summon
    or no_sync leaves the type that set_state_dict_type set inside it; exiting a
    state_dict_type context restores the type it was entered under."""
    kind, restores, saved = sc.StateDictKind.FULL, [], []
    for op in scenario.ops:
        if isinstance(op, (sc.EnterNoSync, sc.EnterSummon)):
            restores.append(None)
        elif isinstance(op, sc.EnterStateDictType):
            restores.append(kind)
            kind = op.settings.kind
        elif isinstance(op, sc.SetStateDictType):
            kind = op.settings.kind
        elif isinstance(op, sc.Exit):
            kind = restores.pop() or kind
        elif isinstance(op, sc.SaveStateDict):
            saved.append(kind)
        elif isinstance(op, sc.LoadStateDict):
            assert saved[op.slot] is kind, scenario.describe()


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_drawn_scenarios_are_valid_plain_data(world_size: int) -> None:
    """What the ranks rebuild a scenario from: plain data, the same after a round
    trip through its replay id; programs end with the closing observation and
    close every context they open; what torch's FSDP is not asked on CPU ranks,
    and what ours is not asked yet, is not drawn."""
    target = Target("fsdp", "torch.distributed.fsdp", "cpu", world_size)
    chosen = settings(max_examples=100, stateful_step_count=30, database=None, deadline=None)
    run_state_machine_as_test(machine_for(target, _valid), settings=chosen)


def test_arguments_left_out_are_at_torch_documented_defaults() -> None:
    """The search leaves out an argument at its documented default ([Note: Calls
    as a user writes them] in fsdptest.conformance.implementation); the table it
    reads is torch's signatures' defaults (FSDP's ``sharding_strategy=None`` is
    documented as FULL_SHARD), so a change in torch fails here."""
    import dataclasses
    import enum
    import inspect

    import torch.distributed.fsdp as torch_fsdp

    from fsdptest.conformance.implementation import DEFAULTS

    FSDP = torch_fsdp.FullyShardedDataParallel
    callables = {
        "FullyShardedDataParallel": FSDP.__init__,
        "summon_full_params": FSDP.summon_full_params,
        "clip_grad_norm_": FSDP.clip_grad_norm_,
        "fsdp_modules": FSDP.fsdp_modules,
    }
    for name, table in DEFAULTS.items():
        if name in callables:
            params = inspect.signature(callables[name]).parameters
            actual = {k: params[k].default for k in table}
        else:
            fields = {f.name: f.default for f in dataclasses.fields(getattr(torch_fsdp, name))}
            actual = {k: fields[k] for k in table}
        if name == "FullyShardedDataParallel":
            assert actual.pop("sharding_strategy") is None
            table = {k: v for k, v in table.items() if k != "sharding_strategy"}
        actual = {k: v.name if isinstance(v, enum.Enum) else v for k, v in actual.items()}
        assert actual == table, name


def test_an_error_raised_in_pieces_is_compared_by_what_it_says() -> None:
    """torch 2.11 raises some errors with each sentence a separate argument, which
    ``str()`` shows as a tuple: the observed message is the pieces joined, as
    torch 2.13 (and this project's FSDP) write the same message in one string."""
    from fsdptest.conformance.observe import catching

    pieces = ("Found state_dict_type LOCAL_STATE_DICT.", "DeviceMesh is not compatible.")
    for args in (pieces, (" ".join(pieces),)):
        with catching() as caught:
            raise RuntimeError(*args)
        assert caught[0].error == ("RuntimeError", " ".join(pieces))
    with catching() as caught:
        raise KeyError("key")
    assert caught[0].error == ("KeyError", "'key'")
