"""Hypothesis draws conformance scenarios (pytest-process side).

[Note: Programs are drawn by a rule-based state machine]
A scenario's model and constructor arguments are drawn by strategies (the
property search's, extended: ``fsdptest.properties.strategies``), its program
by ``ProgramMachine``, a hypothesis ``RuleBasedStateMachine``: each rule
appends one API call (or, ``train_step``, the calls of one optimizer step) to
the program, and its precondition reads an abstract state the rules keep
(whether a forward waits for its backward, which contexts are open, the
state-dict settings in effect, what was saved under which settings, whether a
communication hook is registered or the lazy initialisation ran). So every
drawn program is one a user could write (misuses are rules of their own), and
shrinking deletes calls and simplifies their arguments without ever producing
a program the preconditions rule out: a load whose save was deleted is
deleted too, or re-drawn against another save.

The machine does not call FSDP. Its teardown closes the contexts left open,
appends the closing observation (``Final``) and hands the finished scenario to
the search, which runs it as ONE call of the pooled ranks: a rank call cannot
keep a process group, a model or a collective open between calls, and a
program whose calls ran in separate rank calls could not be replayed from its
id. A failure raised there is an ordinary failing example to hypothesis, which
shrinks the program step by step on the pool. The alternative, a generator of
op lists written here with the same bookkeeping inside an ``@st.composite``,
would need its own shrinking-aware validity checks; the state machine gives
preconditions, bundles of saved objects and step deletion for free.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from fsdptest.conformance import scenario as sc
from fsdptest.conformance.drawing_state import Saved, SavedOptim, StateDictRules
from fsdptest.conformance.history import GradHistory
from fsdptest.conformance.setups import fit_inputs, ignored, nets, setups
from fsdptest.conformance.target import Target
from fsdptest.properties.examples import Sharding

# The search's own hooks twice as often as torch's low-precision hooks (which
# observe less: what they are handed is not recorded).
_H = sc.HookKind
HOOK_KINDS = (_H.RECORDING, _H.LOCAL, _H.RECORDING, _H.LOCAL, _H.FP16_COMPRESS, _H.BF16_COMPRESS)


# -- the program -------------------------------------------------------------------------------

NORMS = (2.0, 1.0, float("inf"))
# A training step's zero_grad: none (the first: what shrinking tends to), set_to_none=True
# (the default, drawn most), set_to_none=False.
ZERO_GRADS = (None, True, True, False)
MAX_NORMS = (0.05, 1000.0)


class ProgramMachine(StateDictRules, RuleBasedStateMachine):
    """Draws a scenario and checks it (see [Note: Programs are drawn by a
    rule-based state machine]). A subclass made by ``machine_for`` sets the
    target and the check."""

    TARGET: Target
    CHECK: Callable[[sc.Scenario], None]

    def __init__(self) -> None:
        super().__init__()
        self.net: sc.Net | None = None
        self.setup = sc.Setup()
        self.seed = 0
        self.ops: list[sc.Op] = []
        self.pending = False  # a forward waits for its backward
        self.inited = False  # a forward ran (FSDP's lazy initialisation)
        self.contexts: list[tuple[str, sc.Settings]] = []  # open contexts, innermost last
        self.settings = sc.Settings(configs=False)
        self.saved: list[Saved] = []
        self.saved_optim: list[SavedOptim] = []
        self.hooked = False
        self.history = GradHistory()  # see fsdptest.conformance.history
        self.kept = False  # a forward ran since the last synced backward (unsharded kept)
        self.eval_mode = False  # the model's train(False) is in effect
        self.scaler_growth: tuple[int | None] | None = None  # the scaler's growth_interval

    # -- the scenario's model and arguments ------------------------------------------------

    @initialize(data=st.data())
    def choose_model(self, data: st.DataObject) -> None:
        target = self.TARGET
        setup = data.draw(setups(target), label="setup")
        net = data.draw(nets(setup), label="net")
        setup = fit_inputs(setup, net)
        setup = data.draw(ignored(setup, net), label="ignored")
        self.setup, self.net = target.fit(setup, net)
        self.seed = data.draw(st.integers(0, 2**16), label="seed")
        # A hook is registered before the first forward, so programs that start
        # training at once (most) seldom reach the hook rules: one scenario in
        # five registers one first.
        hook = data.draw(st.sampled_from((None,) * 24 + HOOK_KINDS), label="hook")
        if hook is not None:
            self.register_comm_hook(hook)

    # -- helpers ---------------------------------------------------------------------------------

    def _in(self, name: str) -> bool:
        return any(kind == name for kind, _ in self.contexts)

    def _free(self) -> bool:
        """No forward waits for its backward and no summon is open."""
        return self.net is not None and not self.pending and not self._in("summon")

    def _add(self, *ops: sc.Op) -> None:
        self.ops.extend(ops)
        if any(isinstance(op, (sc.Forward, sc.EnterSummon)) for op in ops):
            self.history.written_back()
        if any(isinstance(op, (sc.OptimStep, sc.ScalerStep)) for op in ops):
            self.history.stepped()
        if self.eval_mode and any(isinstance(op, sc.Forward) for op in ops):
            self.history.eval_forward_ran()

    def _may_change_parameters(self) -> bool:
        """No step, load, edit, replacement or apply in eval mode or after an eval
        forward where the reference reuses the eval forward's full-precision
        copies (``FULL_PRECISION_EVAL_COPY_KEPT``)."""
        if not self.TARGET.keeps_stale_full_precision(self.setup):
            return True
        return not (self.eval_mode or self.history.eval_forwarded)

    # -- training ------------------------------------------------------------------------------

    @precondition(lambda self: self._free() and self._may_change_parameters())
    @rule(
        microbatches=st.lists(st.booleans(), min_size=1, max_size=3),
        set_to_none=st.sampled_from(ZERO_GRADS),
        clip=st.none() | st.tuples(st.sampled_from(MAX_NORMS), st.sampled_from(NORMS)),
    )
    def train_step(
        self,
        microbatches: list[bool],
        set_to_none: bool | None,
        clip: tuple[float, float] | None,
    ) -> None:
        """Maybe ``zero_grad`` (``set_to_none`` None: the gradients of the last step
        accumulate), forward and backward per microbatch (``True``: under
        ``no_sync``, the last one synced), maybe ``clip_grad_norm_``, ``step``.
        A step without ``zero_grad`` comes first in ``ZERO_GRADS``: shrinking
        turns steps into their three calls (a program that needs two steps is
        then 7 calls long, with 8 it would be 9)."""
        may_no_sync = self.TARGET.may_accumulate(self.setup, self.net) and not self._in("no_sync")
        if self._fresh_gradients_only():
            microbatches, set_to_none = microbatches[:1], True
        windowed_any = may_no_sync and any(microbatches[:-1])
        onto_gradient = self.TARGET.may_no_sync_onto_gradient(self.setup)
        if windowed_any and not onto_gradient:
            set_to_none = True
        if set_to_none is not None:
            self._zero_grad(set_to_none)
        synced = False  # a synced backward of this step ran: a window then starts onto its gradient
        for i, no_sync in enumerate(microbatches):
            windowed = may_no_sync and no_sync and i < len(microbatches) - 1
            windowed = windowed and (onto_gradient or not synced)
            synced = synced or not windowed
            self._backward_ran(windowed)
            if windowed:
                self._add(sc.EnterNoSync())
            self._add(sc.Forward(), sc.Backward())
            if windowed:
                self._add(sc.Exit())
        self.inited = True
        self.kept = self._in("no_sync")
        if clip is not None:
            self._clip(*clip)
        self._add(sc.OptimStep())

    def _hook_needs_fresh_gradients(self) -> bool:
        return self.hooked and not self.TARGET.may_accumulate_hooked(self.setup)

    def _fresh_gradients_only(self) -> bool:
        """Every backward starts from no gradient: a hook that cannot accumulate,
        or torch's offload limitation (``OFFLOAD_ACCUMULATION_OUTSIDE_NO_SYNC``)."""
        offload = self.TARGET.offload_keeps_newest_gradient(self.setup)
        return offload or self._hook_needs_fresh_gradients()

    def _clip(self, max_norm: float, norm_type: float) -> None:
        user_grads = self.history.user_grads and not self.TARGET.may_clip_inf_of_user_gradients()
        if norm_type == float("inf") and (
            user_grads or not self.TARGET.may_clip_inf(self.setup, self.net)
        ):
            norm_type = 2.0
        self._add(sc.ClipGradNorm(max_norm, norm_type))

    @precondition(lambda self: self._free())
    @rule(no_grad=st.booleans())
    def forward(self, no_grad: bool) -> None:
        """A forward on its own (not inside a summon: torch's FSDP then all-gathers
        on some ranks only under ``rank0_only``, and gloo aborts)."""
        if self.history.has_grads and self._fresh_gradients_only():
            no_grad = True
        self._add(sc.Forward(no_grad=no_grad))
        self.pending = not no_grad
        self.inited = True
        self.kept = True

    @precondition(lambda self: self.pending and not self._in("summon"))
    @rule()
    def forward_again(self) -> None:
        """Another forward before the waiting one's backward: one backward through
        both losses (several forwards before one backward)."""
        self._add(sc.Forward(again=True))

    @precondition(lambda self: self.pending)
    @rule()
    def backward(self) -> None:
        self._add(sc.Backward())
        self._backward_ran(self._in("no_sync"))
        self.pending = False
        self.kept = self.kept and self._in("no_sync")

    @precondition(lambda self: self._free() and self._may_change_parameters())
    @rule()
    def optim_step(self) -> None:
        self._add(sc.OptimStep())

    @precondition(
        lambda self: (
            self.net is not None
            and not self._in("summon")
            and (not self.pending or self.TARGET.may_zero_grad_before_backward(self.setup))
        )
    )
    @rule(set_to_none=st.booleans(), on_model=st.booleans())
    def zero_grad(self, set_to_none: bool, on_model: bool) -> None:
        self._zero_grad(set_to_none, on_model)

    def _zero_grad(self, set_to_none: bool, on_model: bool = False) -> None:
        """Gradients set aside by a ``no_sync`` backward are only zeroed where
        torch's FSDP is a side (``ZERO_GRAD_KEEPS_GRADIENT_SET_ASIDE_BY_NO_SYNC``)."""
        if self.history.set_aside and not self.TARGET.may_clear_set_aside_gradient():
            set_to_none = False
        self._add(sc.ZeroGrad(set_to_none=set_to_none, on_model=on_model))
        self.history.zero_grad(set_to_none)

    def _backward_ran(self, windowed: bool) -> None:
        self.history.backward(windowed, sharded=self.setup.sharding is not Sharding.NO_SHARD)

    @precondition(lambda self: self.net is not None and not self._in("summon"))
    @rule(mode=st.booleans())
    def train(self, mode: bool) -> None:
        """Back to training only before the first eval forward where the reference
        reuses its full-precision copies (``FULL_PRECISION_EVAL_COPY_KEPT``)."""
        if self.history.eval_forwarded and self.TARGET.keeps_stale_full_precision(self.setup):
            mode = False
        self._add(sc.Train(mode=mode))
        self.eval_mode = not mode

    @precondition(
        lambda self: (
            self._free()
            and not self._in("no_sync")
            and self.TARGET.may_accumulate(self.setup, self.net)
            and (not self.history.has_grads or self.TARGET.may_no_sync_onto_gradient(self.setup))
        )
    )
    @rule()
    def enter_no_sync(self) -> None:
        self._add(sc.EnterNoSync())
        self.contexts.append(("no_sync", self.settings))

    @precondition(lambda self: bool(self.contexts) and not self.pending)
    @rule()
    def exit(self) -> None:
        self._exit()

    def _exit(self) -> None:
        # Only a state_dict_type context restores the type it was entered under:
        # one set inside a summon or no_sync stays after it.
        name, entered_under = self.contexts.pop()
        if name == "state_dict_type":
            self.settings = entered_under
        self._add(sc.Exit())

    @precondition(lambda self: self._free())
    @rule(max_norm=st.sampled_from(MAX_NORMS), norm_type=st.sampled_from(NORMS))
    def clip_grad_norm(self, max_norm: float, norm_type: float) -> None:
        self._clip(max_norm, norm_type)

    # -- summon, apply, hooks, misuse ----------------------------------------------------------------

    @precondition(lambda self: self._free())
    @rule(
        recurse=st.booleans().map(lambda b: not b),
        writeback=st.booleans().map(lambda b: not b),
        rank0_only=st.booleans(),
        offload_to_cpu=st.booleans(),
        with_grads=st.booleans(),
    )
    def enter_summon(
        self,
        recurse: bool,
        writeback: bool,
        rank0_only: bool,
        offload_to_cpu: bool,
        with_grads: bool,
    ) -> None:
        """Options torch documents as invalid are not drawn (rank0_only with
        writeback raises; with_grads needs use_orig_params)."""
        with_grads = with_grads and self.TARGET.may_summon_grads(self.setup, self.net)
        self._summon(recurse, writeback, rank0_only, offload_to_cpu, with_grads)

    def _summon(
        self,
        recurse: bool,
        writeback: bool,
        rank0_only: bool,
        offload_to_cpu: bool,
        with_grads: bool,
    ) -> None:
        after_window = self._in("no_sync") and self.history.has_grads
        if after_window and not self.TARGET.may_summon_grads_after_no_sync_backward():
            with_grads = False
        self._add(
            sc.EnterSummon(
                recurse=recurse,
                writeback=writeback and not rank0_only,
                rank0_only=rank0_only,
                offload_to_cpu=offload_to_cpu and self.TARGET.may_summon_offload(),
                with_grads=with_grads,
            )
        )
        self.contexts.append(("summon", self.settings))

    # [Note: Rules of their own for what few scenarios reach]
    # Hypothesis enables a random subset of the rules per program (swarm
    # testing) and picks among the enabled ones uniformly, so a behaviour that
    # needs two rules in order, or one option of a rule among several and a
    # setup that allows it, is reached by a few programs in a hundred or none.
    # Two such behaviours are rules of their own, each a whole block: a
    # summon with writeback=False whose edit is discarded (``edit_summoned``)
    # and a summon that reads gradients (``summon_gradients``: use_orig_params
    # only, no frozen parameters, no kept low-precision gradients). A third,
    # ``register_comm_hook_to_run``, registers the recording hook on a unit that
    # is not hybrid (``register_comm_hook`` draws every kind on any unit, and a
    # hybrid unit's refusal ends the program). A block
    # is one step for the shrinker, which cannot keep a part of it: an
    # optimizer checkpoint between two training steps, drawn so, left the
    # shrunk examples of other bugs at ten calls and more.
    # ``enter_summon``, ``edit_parameters``, ``save_optim_state`` and
    # ``train_step`` still draw every other combination.

    @precondition(lambda self: self._free() and self._may_change_parameters())
    @rule(recurse=st.booleans().map(lambda b: not b), offload_to_cpu=st.booleans())
    def edit_summoned(self, recurse: bool, offload_to_cpu: bool) -> None:
        """``with summon_full_params(..., writeback=False): edit the parameters`` on
        every rank: what the documented discarding keeps (see [Note: Rules of
        their own for what few scenarios reach]; edits that write back are
        ``enter_summon``'s and ``edit_parameters``')."""
        self._summon(recurse, False, False, offload_to_cpu, with_grads=False)
        self._add(sc.EditParams())
        self._exit()

    @precondition(lambda self: self._free() and self.TARGET.may_summon_grads(self.setup, self.net))
    @rule(recurse=st.booleans().map(lambda b: not b), rank0_only=st.booleans(), edit=st.booleans())
    def summon_gradients(self, recurse: bool, rank0_only: bool, edit: bool) -> None:
        """``with summon_full_params(..., with_grads=True): read the gradients``, or
        with ``edit`` (and writeback) edit them (see [Note: Rules of their own for
        what few scenarios reach])."""
        edit = edit and not rank0_only and not self._in("no_sync")
        if edit and not self.history.has_grads:  # gradients to edit
            self._add(sc.Forward(), sc.Backward())
            self.inited = True
            self._backward_ran(False)
            self.kept = self._in("no_sync")
        self._summon(recurse, True, rank0_only, False, with_grads=True)
        if edit:
            self._add(sc.EditParams(grads=True))
        self._exit()

    @precondition(
        lambda self: (
            self.net is not None
            and not self.pending
            and self.TARGET.may_edit_parameters(self.setup, self.history.resharded)
            and self._may_change_parameters()
        )
    )
    @rule()
    def edit_parameters(self) -> None:
        self._add(sc.EditParams())

    @precondition(
        lambda self: (
            self._free()
            and not self._in("no_sync")
            and not self.TARGET.offload_keeps_newest_gradient(self.setup)
            and self.TARGET.may_set_gradients(self.setup)
            and (not self.history.some_grads_set or self.TARGET.may_set_gradients_after_some())
            and self.TARGET.may_set_gradients_of_frozen_units(self.setup, self.net)
        )
    )
    @rule(none_first=st.booleans(), only_first=st.booleans())
    def set_gradients(self, none_first: bool, only_first: bool) -> None:
        """``p.grad = ...`` for every listed parameter, as a user writes it, or the
        first one's alone."""
        self._add(sc.SetGrads(none_first=none_first, only_first=only_first))
        self.history.set_by_user(some=only_first or none_first)

    @precondition(
        lambda self: (
            self._free()
            and self.setup.use_orig_params
            and (not self.kept or self.TARGET.may_replace_data_after_forward())
            and self._may_change_parameters()
        )
    )
    @rule(flatten=st.sampled_from((False, False, False, True)))
    def replace_parameter_data(self, flatten: bool) -> None:
        """``p.data = ...`` for every original parameter (``flatten``: of another
        shape, a misuse)."""
        flatten = flatten and self.TARGET.may_replace_data_of_another_shape(self.setup)
        self._add(sc.ReplaceData(flatten=flatten))
        self.history.data_replaced()

    @precondition(
        lambda self: (
            self._free()
            and self.setup.use_orig_params
            and not self.kept
            and not self._in("no_sync")
            and not self.history.has_grads
            and self.TARGET.may_replace_parameters(self.net)
            and self._may_change_parameters()
        )
    )
    @rule()
    def replace_parameters(self) -> None:
        """``setattr(module, name, nn.Parameter(...))`` for every original
        parameter between iterations (no gradients: they are not preserved), then
        a new optimizer over the new parameters."""
        self._add(sc.ReplaceParams())
        self.history.params_replaced_by_user()

    @precondition(
        lambda self: (
            self._free()
            and not self._in("no_sync")
            and self.TARGET.may_scale_gradients()
            and self._may_change_parameters()
        )
    )
    @rule(clip=st.booleans(), growth_interval=st.sampled_from((None, 1)))
    def scaled_train_step(self, clip: bool, growth_interval: int | None) -> None:
        """A training step through the implementation's ``ShardedGradScaler``:
        ``zero_grad``, forward, ``scaler.scale(loss).backward()``, maybe
        ``unscale_`` and ``clip_grad_norm_``, ``scaler.step``, ``scaler.update``.
        The program's scaler is made by its first scaled backward, so every later
        one repeats that one's ``growth_interval``."""
        if self.scaler_growth is None:
            self.scaler_growth = (growth_interval,)
        backward = sc.ScaledBackward(growth_interval=self.scaler_growth[0])
        self._zero_grad(True)
        self._add(sc.Forward(), backward, sc.ScalerStep(clip))
        self.inited = True
        self._backward_ran(False)
        self.kept = False

    @precondition(lambda self: self._free() and self._may_change_parameters())
    @rule(fn=st.sampled_from(list(sc.ApplyFn)))
    def apply(self, fn: sc.ApplyFn) -> None:
        self._add(sc.Apply(fn=fn))

    @precondition(lambda self: self.net is not None and not self.inited and not self.hooked)
    @rule(kind=st.sampled_from(HOOK_KINDS))
    def register_comm_hook(self, kind: sc.HookKind) -> None:
        self._add(sc.RegisterCommHook(kind=kind))
        self.hooked = True

    @precondition(
        lambda self: (
            self.net is not None
            and not self.inited
            and not self.hooked
            and not self.setup.sharding.is_hybrid()
        )
    )
    @rule()
    def register_comm_hook_to_run(self) -> None:
        """The recording hook where it runs (not a hybrid unit's refusal): see
        [Note: Rules of their own for what few scenarios reach]."""
        self.register_comm_hook(sc.HookKind.RECORDING)

    @precondition(lambda self: self.net is not None)
    @rule(root_only=st.booleans())
    def fsdp_modules(self, root_only: bool) -> None:
        self._add(sc.FsdpModules(root_only=root_only))

    @precondition(lambda self: self.net is not None and not self.pending)
    @rule(misuse=st.sampled_from(["state_dict inside summon", "wrap the root again"]))
    def misuse(self, misuse: str) -> None:
        """One rule for every misuse, so that programs hold few: ``state_dict()``
        inside ``summon_full_params``; ``FSDP(model)`` of the FSDP root before its
        lazy initialisation (after it, every later call of torch's FSDP fails its
        root check)."""
        if misuse == "state_dict inside summon" and self._may_save_inside_summon():
            self._add(sc.SaveStateDict())
            self.saved.append(Saved(self.settings))
        elif misuse == "wrap the root again" and self._may_wrap_again():
            self._add(sc.WrapAgain())

    def _may_save_inside_summon(self) -> bool:
        rank0_only = any(
            isinstance(op, sc.EnterSummon) and op.rank0_only for op in self._open_summons()
        )
        return self._in("summon") and self.TARGET.may_save_inside_summon(self.settings, rank0_only)

    def _open_summons(self) -> list[sc.EnterSummon]:
        """The summons entered and not left (contexts are closed innermost first)."""
        opened: list[sc.Op] = []
        for op in self.ops:
            if isinstance(op, (sc.EnterSummon, sc.EnterNoSync, sc.EnterStateDictType)):
                opened.append(op)
            elif isinstance(op, sc.Exit) and opened:
                opened.pop()
        return [op for op in opened if isinstance(op, sc.EnterSummon)]

    def _may_wrap_again(self) -> bool:
        """Not inside a context; after a call that lazily initialises the root (a
        forward, a state dict, a summon, ...) only where the reference allows it."""
        quiet = (sc.Train, sc.ZeroGrad, sc.SetStateDictType)
        initialised = not all(isinstance(op, quiet) for op in self.ops)
        return not self.contexts and self.TARGET.may_wrap_again(self.setup, initialised)

    # -- the end -------------------------------------------------------------------------------

    def scenario(self) -> sc.Scenario:
        """The program drawn so far, its contexts closed, with the closing observation."""
        ops = list(self.ops)
        if self.pending:
            ops.append(sc.Backward())
        ops.extend(sc.Exit() for _ in self.contexts)
        closing_save = self._closing_save()
        if closing_save is not None:
            ops.append(sc.SaveOptimState(api=closing_save))
        ops.append(sc.Final())
        assert self.net is not None
        return sc.Scenario(self.TARGET.world_size, self.net, self.setup, tuple(ops), self.seed)

    def _closing_save(self) -> sc.OptimApi | None:
        """An optimizer state dict saved before the closing observation where the
        program stepped and a save is allowed: the closing observation steps once
        more after a save, so every such program observes whether a saved state
        aliases the live one, not only the few that drew a save before a step."""
        stepped = any(isinstance(op, (sc.OptimStep, sc.ScalerStep)) for op in self.ops)
        if not stepped or not self._may_save_optim():
            return None
        # After the exits: the outermost state_dict_type context restores its own.
        typed = [
            entered_under for name, entered_under in self.contexts if name == "state_dict_type"
        ]
        outer = typed[0] if typed else self.settings
        local = outer.kind is sc.StateDictKind.LOCAL
        return sc.OptimApi.FULL if local else sc.OptimApi.OPTIM_STATE_DICT

    def teardown(self) -> None:
        if self.net is not None:
            type(self).CHECK(self.scenario())


def machine_for(target: Target, check: Callable[[sc.Scenario], None]) -> type[ProgramMachine]:
    """A ``ProgramMachine`` that draws for ``target`` and hands each scenario to ``check``."""
    attributes: dict[str, Any] = {"TARGET": target, "CHECK": staticmethod(check)}
    return type(f"ConformanceProgramWorld{target.world_size}", (ProgramMachine,), attributes)
