"""Named scenarios where our FSDP once behaved differently from torch's.

Each test asserts what torch's FSDP does (so it passes under ``--fsdp-impl
torch`` as well): names, dtypes, values, errors and warnings that a user sees.
The differential search (``fsdptest.conformance``) covers the families; these
are the cases it, or a user, found first. Where torch's own behaviour is a
defect that ours does not copy, the test says so and asserts both.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from fsdptest import FSDPTest
from fsdptest.api import (
    FSDP,
    FullStateDictConfig,
    MixedPrecision,
    OptimStateKeyType,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictSettings,
    StateDictType,
)
from fsdptest.limitations import TORCH_OFFLOAD_TO_CPU_ERROR, torch_on_cpu
from harness.collectives import Collective, CollectiveRecorder


class _TwoLinears(nn.Module):
    """Two linears and a float32 buffer; ``wrap_first`` makes the first one a unit."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 4)
        self.b = nn.Linear(4, 2)
        self.register_buffer("buf", torch.arange(3.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def _nested(device: torch.device, **kwargs: object) -> nn.Module:
    torch.manual_seed(0)
    module = _TwoLinears().to(device)
    module.a = FSDP(module.a, **kwargs)
    return FSDP(module, **kwargs)


def _plain_state_dict(device: torch.device) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return _TwoLinears().to(device).state_dict()


class TestTorchConformance(FSDPTest):
    world_size = 2

    # -- names and wrapping ------------------------------------------------------------------

    def test_flat_parameter_is_a_parameter_of_the_wrapped_module(self) -> None:
        """The flat parameter is registered on the wrapped module, so its name
        carries the wrapper prefix (torch's ``_fsdp_wrapped_module._flat_param``)."""
        model = _nested(self.device)
        names = [name for name, _ in model.named_parameters()]
        self.assertEqual(
            names,
            [
                "_fsdp_wrapped_module._flat_param",
                "_fsdp_wrapped_module.a._fsdp_wrapped_module._flat_param",
            ],
        )
        self.assertIs(model.module._flat_param, dict(model.named_parameters())[names[0]])
        self.assertEqual(len(list(model.module.a.module.parameters(recurse=False))), 1)

    def test_original_attributes_require_grad_as_the_flat_parameter(self) -> None:
        """With ``use_orig_params=False`` the original parameter attributes
        (``module.a.weight``) say ``requires_grad`` as the flat parameter does,
        between and during iterations, for every strategy."""

        def body(strategy: ShardingStrategy, frozen: bool) -> None:
            torch.manual_seed(0)
            module = _TwoLinears().to(self.device)
            module.requires_grad_(not frozen)
            model = FSDP(module, sharding_strategy=strategy)

            def flags() -> list[bool]:
                attributes = [
                    getattr(m, n) for m in (module.a, module.b) for n in ("weight", "bias")
                ]
                return [a.requires_grad for a in attributes]

            self.assertEqual(flags(), [not frozen] * 4)
            out = model(torch.ones(2, 3, device=self.device))
            self.assertEqual(flags(), [not frozen] * 4)
            if not frozen:
                out.sum().backward()
            self.assertEqual(flags(), [not frozen] * 4)

        strategies = [ShardingStrategy.FULL_SHARD, ShardingStrategy.NO_SHARD]
        self.run_subtests({"strategy": strategies, "frozen": [False, True]}, body)

    def test_wrapping_a_unit_again(self) -> None:
        """``FSDP(FSDP(m))`` is allowed: the inner unit keeps the parameters, the
        outer one is the root, and the state dict is the unwrapped module's."""
        torch.manual_seed(0)
        model = FSDP(FSDP(_TwoLinears().to(self.device)))
        self.assertEqual(
            [name for name, _ in model.named_parameters()],
            ["_fsdp_wrapped_module._fsdp_wrapped_module._flat_param"],
        )
        out = model(torch.ones(2, 3, device=self.device))
        out.sum().backward()
        self.assertIsNotNone(next(model.parameters()).grad)
        self.assertEqual([m.check_is_root() for m in FSDP.fsdp_modules(model)], [True, False])
        self.assertEqual(model.state_dict(), _plain_state_dict(self.device))

    def test_module_inside_an_activation_checkpointing_wrapper(self) -> None:
        """``FSDP(checkpoint_wrapper(m)).module`` is ``m``, and the flat parameter
        is registered on ``m``; the state dict is the unwrapped module's."""
        torch.manual_seed(0)
        inner = _TwoLinears().to(self.device)
        model = FSDP(checkpoint_wrapper(inner))
        self.assertIs(model.module, inner)
        self.assertEqual(
            [name for name, _ in model.named_parameters()],
            ["_fsdp_wrapped_module._checkpoint_wrapped_module._flat_param"],
        )
        self.assertEqual(model.state_dict(), _plain_state_dict(self.device))

    def test_fsdp_modules_root_only_answers_by_lazy_initialisation(self) -> None:
        """``fsdp_modules(m, root_only=True)`` initialises the units it finds
        and returns the roots: below an initialised root there are none, and a
        unit found first (here outside its enclosing unit) becomes a root."""
        model = _nested(self.device)
        model(torch.ones(2, 3, device=self.device))
        self.assertEqual(FSDP.fsdp_modules(model.a, root_only=True), [])
        self.assertEqual(FSDP.fsdp_modules(model.module, root_only=True), [])
        self.assertEqual(FSDP.fsdp_modules(model, root_only=True), [model])
        fresh = _nested(self.device)
        self.assertEqual(FSDP.fsdp_modules(fresh.module, root_only=True), [fresh.module.a])
        self.assertTrue(fresh.module.a._is_root)

    # -- state dicts -------------------------------------------------------------------------

    def test_state_dict_inside_summon_full_params(self) -> None:
        """A full or sharded state dict saved inside ``summon_full_params`` holds
        the summoned parameters (with and without writeback); loaded inside it, it
        writes into them, and writeback keeps what was loaded."""
        expected = _plain_state_dict(self.device)

        def body(kind: StateDictType, writeback: bool) -> None:
            model = _nested(self.device)
            with FSDP.summon_full_params(model, writeback=writeback):
                with FSDP.state_dict_type(model, kind):
                    saved = model.state_dict()
            self.assertEqual(sorted(saved), sorted(expected))
            if kind is StateDictType.FULL_STATE_DICT:
                self.assertEqual(saved, expected)
            changed = {k: v + 1 for k, v in expected.items()}
            with FSDP.summon_full_params(model, writeback=writeback):
                with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
                    self.assertEqual(model.load_state_dict(changed), ((), ()))
            want = changed if writeback else expected
            with FSDP.summon_full_params(model):
                for name, param in model.named_parameters():
                    self.assertEqual(param, want[name])

        self.run_subtests(
            {
                "kind": [StateDictType.FULL_STATE_DICT, StateDictType.SHARDED_STATE_DICT],
                "writeback": [True, False],
            },
            body,
        )

    def test_state_dict_inside_rank0_only_summon(self) -> None:
        """Inside ``summon_full_params(rank0_only=True)`` rank 0 saves the full
        dict; the other ranks, which hold only their shards, fail torch's check
        in the innermost unit's hook, which sees the keys before any prefix is
        cleaned (or save nothing under a ``rank0_only`` state-dict config)."""

        def body(rank0_only_config: bool) -> None:
            model = _nested(self.device)
            config = FullStateDictConfig(rank0_only=rank0_only_config)
            with FSDP.summon_full_params(model, writeback=False, rank0_only=True):
                with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):
                    if self.rank == 0:
                        self.assertEqual(model.state_dict(), _plain_state_dict(self.device))
                    elif rank0_only_config:
                        self.assertEqual(model.state_dict(), {})
                    else:
                        with self.assertRaisesRegex(
                            AssertionError,
                            r"FSDP assumes _fsdp_wrapped_module\.a\.weight is in the state_dict "
                            r"but the state_dict only has odict_keys\(\["
                            r"'_fsdp_wrapped_module\._flat_param', '_fsdp_wrapped_module\.buf', "
                            r"'_fsdp_wrapped_module\.a\._flat_param'\]\)\. "
                            r"prefix=_fsdp_wrapped_module\.a\., module_name=, param_name=weight "
                            r"rank=1\.",
                        ):
                            model.state_dict()

        self.run_subtests({"rank0_only_config": [False, True]}, body)

    def test_no_shard_warnings(self) -> None:
        """``NO_SHARD`` is deprecated (a ``FutureWarning`` per unit built), and
        each of a ``NO_SHARD`` unit's four state-dict hooks warns that a full
        state dict is used, with torch's texts (the load hooks' lose a space)."""
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = _nested(self.device, sharding_strategy=ShardingStrategy.NO_SHARD)
        deprecated = [w for w in caught if issubclass(w.category, FutureWarning)]
        self.assertEqual(
            [str(w.message) for w in deprecated],
            [
                "The `NO_SHARD` sharding strategy is deprecated. If having issues, please use "
                "`DistributedDataParallel` instead."
            ]
            * 2,
        )
        prefix = "When using ``NO_SHARD`` for ``ShardingStrategy``, full_state_dict will"
        for loading, text in ((False, prefix + " be returned."), (True, prefix + "be returned.")):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
                    state_dict = model.state_dict()
                    if loading:
                        caught.clear()
                        model.load_state_dict(state_dict)
            texts = [str(w.message) for w in caught if "NO_SHARD" in str(w.message)]
            self.assertEqual(texts, [text] * 4)
            self.assertEqual(state_dict, _plain_state_dict(self.device))

    def test_apply_before_forward_keeps_original_buffer_dtypes(self) -> None:
        """``apply`` before the first forward does not make buffer mixed precision
        forget the buffers' dtypes: state dicts save them as they were built,
        non-float buffers are never cast."""
        torch.manual_seed(0)
        module = _TwoLinears().to(self.device)
        dtypes = {"f64": torch.float64, "i64": torch.int64, "flag": torch.bool}
        for name, dtype in dtypes.items():
            module.register_buffer(name, torch.ones(2, dtype=dtype, device=self.device))
        model = FSDP(module, mixed_precision=MixedPrecision(buffer_dtype=torch.float16))
        model.apply(lambda m: None)
        saved = {"buf": torch.float32, **dtypes}
        for _ in range(2):
            state_dict = model.state_dict()
            self.assertEqual({k: state_dict[k].dtype for k in saved}, saved)
            model(torch.ones(2, 3, device=self.device))
        buffers = {name.split(".")[-1]: b.dtype for name, b in model.named_buffers()}
        self.assertEqual(
            buffers,
            {"buf": torch.float16, "f64": torch.float16, "i64": torch.int64, "flag": torch.bool},
        )

    def test_low_precision_gradient_dtypes(self) -> None:
        """``keep_low_precision_grads``: sharded strategies keep the gradient in
        ``param_dtype``, ``NO_SHARD`` in the reduce dtype."""

        def body(strategy: ShardingStrategy) -> None:
            torch.manual_seed(0)
            mixed = MixedPrecision(
                param_dtype=torch.bfloat16,
                reduce_dtype=torch.float16,
                keep_low_precision_grads=True,
            )
            module = _TwoLinears().to(self.device)
            model = FSDP(module, sharding_strategy=strategy, mixed_precision=mixed)
            model(torch.ones(2, 3, device=self.device)).float().sum().backward()
            no_shard = strategy is ShardingStrategy.NO_SHARD
            expected = torch.float16 if no_shard else torch.bfloat16
            self.assertEqual([p.grad.dtype for p in model.parameters()], [expected])

        strategies = [ShardingStrategy.FULL_SHARD, ShardingStrategy.NO_SHARD]
        self.run_subtests({"strategy": strategies}, body)

    # -- summon_full_params -----------------------------------------------------------------

    def test_summoning_a_summoned_unit_raises(self) -> None:
        """A summon inside a summon that already covers one of its units raises."""

        def body(inner_on_child: bool) -> None:
            model = _nested(self.device)
            with FSDP.summon_full_params(model):
                with self.assertRaisesRegex(
                    AssertionError,
                    "Cannot manually unshard parameters when already unsharding parameters",
                ):
                    with FSDP.summon_full_params(model.a if inner_on_child else model):
                        pass
            with FSDP.summon_full_params(model, recurse=False):
                with FSDP.summon_full_params(model.a):
                    names = [name for name, _ in model.named_parameters()]
            self.assertEqual(names, ["a.weight", "a.bias", "b.weight", "b.bias"])

        self.run_subtests({"inner_on_child": [True, False]}, body)

    def test_summon_with_grads_counts_missing_gradients_in_int32(self) -> None:
        """``summon_full_params(with_grads=True)`` all-gathers the parameters, then
        counts the ranks without a gradient with an int32 all-reduce."""
        model = _nested(self.device, use_orig_params=True)
        model(torch.ones(2, 3, device=self.device)).sum().backward()
        with CollectiveRecorder() as recorder:
            with FSDP.summon_full_params(model, with_grads=True):
                pass
        counts = [c.input_dtype for c in recorder.of(Collective.ALL_REDUCE)]
        self.assertEqual(counts, [torch.int32, torch.int32])

    def test_summon_argument_errors_and_warning(self) -> None:
        """Torch's texts: the error for ``writeback`` with ``rank0_only``, and the
        ``offload_to_cpu`` warning (its words run together as torch's do), twice
        per unit (torch checks the arguments twice)."""
        model = _nested(self.device)
        with self.assertRaisesRegex(
            NotImplementedError, r"^writeback=True and rank0_only=True is not supported yet$"
        ):
            with FSDP.summon_full_params(model, writeback=True, rank0_only=True):
                pass
        text = (
            "offload_to_cpu=True and rank0_only=False may result in theunsharded parameters "
            "being redundantly copied to CPU memory for GPUs sharing the same CPU memory, "
            "which risks CPU OOM. We recommend using offload_to_cpu=True with rank0_only=True."
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if torch_on_cpu():  # see fsdptest.limitations: fails after the first unit's warnings
                with self.assertRaisesRegex(RuntimeError, TORCH_OFFLOAD_TO_CPU_ERROR):
                    with FSDP.summon_full_params(model, offload_to_cpu=True):
                        pass
            else:
                with FSDP.summon_full_params(model, offload_to_cpu=True):
                    pass
        texts = [str(w.message) for w in caught if "offload_to_cpu" in str(w.message)]
        self.assertEqual(texts, [text] * (2 if torch_on_cpu() else 4))

    # -- misuse ------------------------------------------------------------------------------

    def test_misuse_errors(self) -> None:
        """Torch's error types and texts: a plain tensor in a sharded state dict,
        a sharding strategy given by name, rekeying a dict whose keys are flat
        parameters."""
        model = _nested(self.device)
        with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            state_dict = model.state_dict()
            state_dict["b.bias"] = torch.zeros(2, device=self.device)
            with self.assertRaisesRegex(
                AssertionError, r"^Expected ShardedTensor, got <class 'torch\.Tensor'>$"
            ):
                model.load_state_dict(state_dict)
        with self.assertRaisesRegex(KeyError, "FULL_SHARD"):
            FSDP(nn.Linear(2, 2).to(self.device), sharding_strategy="FULL_SHARD")
        optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model(torch.ones(2, 3, device=self.device)).sum().backward()
        optim.step()
        with self.assertRaisesRegex(
            RuntimeError,
            r"^Each parameter should only map to one parameter name but got 2: "
            r"\['b\.weight', 'b\.bias'\]$",
        ):
            FSDP.rekey_optim_state_dict(
                optim.state_dict(), OptimStateKeyType.PARAM_NAME, model, optim=optim
            )

    # -- state-dict settings ----------------------------------------------------------------

    def test_set_state_dict_type_returns_the_first_units_settings(self) -> None:
        """Units may differ in config values (not in type): setting the root's
        type returns the root's previous settings and overrides the child's."""
        model = _nested(self.device)
        child_config = FullStateDictConfig(offload_to_cpu=True)
        FSDP.set_state_dict_type(model.a, StateDictType.FULL_STATE_DICT, child_config)
        with self.assertRaisesRegex(AssertionError, "must have the same state dict settings"):
            FSDP.get_state_dict_type(model)
        previous = FSDP.set_state_dict_type(model, StateDictType.SHARDED_STATE_DICT)
        self.assertEqual(previous.state_dict_type, StateDictType.FULL_STATE_DICT)
        self.assertEqual(previous.state_dict_config, FullStateDictConfig())
        settings = FSDP.get_state_dict_type(model.a)
        self.assertEqual(settings.state_dict_config, ShardedStateDictConfig())
        FSDP.set_state_dict_type(model.a, StateDictType.LOCAL_STATE_DICT)
        with self.assertRaisesRegex(
            AssertionError, r"^All FSDP modules should have the same state_dict_type\.$"
        ):
            FSDP.set_state_dict_type(model, StateDictType.FULL_STATE_DICT)

    def test_state_dict_settings_of_a_module_without_units(self) -> None:
        """No units: ``get_state_dict_type`` is None and ``set_state_dict_type``
        returns settings that are all None."""
        module = nn.Linear(2, 2)
        self.assertIsNone(FSDP.get_state_dict_type(module))
        self.assertEqual(
            FSDP.set_state_dict_type(module, StateDictType.SHARDED_STATE_DICT),
            StateDictSettings(None, None, None),
        )

    # -- clip_grad_norm_ ---------------------------------------------------------------------

    def test_clip_grad_norm_without_sharded_units(self) -> None:
        """When no unit shards (here: every module ignored, so no unit has
        parameters), ``clip_grad_norm_`` is ``nn.utils.clip_grad_norm_``: the
        local norm, and no warning when there are no gradients."""
        torch.manual_seed(0)
        module = _TwoLinears().to(self.device)
        model = FSDP(module, ignored_modules=[module.a, module.b])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            norm = model.clip_grad_norm_(1.0)
        self.assertEqual(
            [str(w.message) for w in caught if "clip_grad_norm_" in str(w.message)], []
        )
        self.assertEqual(norm, torch.tensor(0.0))
        torch.manual_seed(self.rank)
        model(torch.randn(2, 3, device=self.device)).sum().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        expected = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))
        self.assertEqual(model.clip_grad_norm_(1.0), expected)
