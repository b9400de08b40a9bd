"""``use_orig_params=True`` (port of upstream ``test_fsdp_use_orig_params.py``).

What is pinned down: parity with DDP (and with ``use_orig_params=False``) under
several parameter groups and hyperparameters, frozen parameters, two optimizers,
several forwards per backward and ``summon_full_params`` between forwards; which
part of each original parameter a rank exposes; the writeback of parameters and
gradients the user changes (and its errors); FQNs during forward; ``no_sync``
(also with mixed precision); non-uniform ``requires_grad``; ``torch.compile``.

DDP gets ``device_ids`` only on GPUs (``_ddp``): on the CPU it takes none.
``TestMultiTensorApply`` (a plain ``TestCase`` upstream) runs in one rank, so that
its CUDA case runs in a rank that owns a GPU, never in the pytest process.
"""

from __future__ import annotations

import copy
import functools
import itertools
import os
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import TransformerDecoderLayer, TransformerEncoderLayer
from torch.nn.parallel import DistributedDataParallel as DDP

from fsdptest import FSDPTest
from fsdptest.api import (
    _FSDP_SKIP_WRITEBACK_CHECK,
    _FSDP_USE_FULL_PREC_IN_EVAL,
    FSDP,
    NO_RESHARD_AFTER_FORWARD_STRATEGIES,
    BackwardPrefetch,
    CPUOffload,
    MixedPrecision,
    ModuleWrapPolicy,
    ShardingStrategy,
    StateDictType,
    always_wrap_policy,
    clean_tensor_name,
)
from fsdptest.interface import DeviceInitMode, FSDPInitMode
from fsdptest.races import skip_torch_offload_race
from harness import DistributedTest
from models import TransformerWithSharedParams

ParamGroup = dict[str, Any]
OptimClass = type[torch.optim.Optimizer]


def _ddp(module: nn.Module, device: torch.device, **kwargs: Any) -> DDP:
    """DDP over ``module``, with ``device_ids`` naming the GPU (none on the CPU)."""
    device_ids = [device.index] if device.type == "cuda" else None
    return DDP(module, device_ids=device_ids, **kwargs)


def _env_flag(enabled: bool) -> str:
    """Both values are written, so a later subtest never inherits an earlier one's."""
    return "1" if enabled else "0"


def _has_unit_with_weight_and_bias_in_shard(fsdp_model: nn.Module) -> bool:
    """Whether some FSDP unit holds part of a weight and part of a bias in this rank's
    shard. With ``use_orig_params=True`` each original parameter is its local part
    (empty when the rank holds none of it), so this reads the parameters each unit
    manages itself (not those of units nested in it)."""
    for unit in FSDP.fsdp_modules(fsdp_model):
        nested = {
            id(p)
            for inner in FSDP.fsdp_modules(unit)
            if inner is not unit
            for p in inner.parameters()
        }
        local = [
            clean_tensor_name(name)
            for name, param in unit.named_parameters()
            if id(param) not in nested and param.numel() > 0
        ]
        if any("weight" in n for n in local) and any("bias" in n for n in local):
            return True
    return False


class TestFSDPUseOrigParamsMultipleParamGroups(FSDPTest):
    """Tests multiple parameter groups."""

    @property
    def world_size(self) -> int:
        return 2

    def _get_param_groups(self, model: nn.Module) -> list[ParamGroup]:
        """Constructs separate parameter groups for weights, biases, and other
        parameters."""
        param_groups: list[ParamGroup] = [
            {"params": [], "weight_decay": 0.1, "lr": 1e-2},
            {"params": [], "weight_decay": 0.01, "lr": 1e-3},
            {"params": []},
        ]
        for param_name, param in model.named_parameters():
            if "weight" in param_name:
                param_groups[0]["params"].append(param)
            elif "bias" in param_name:
                param_groups[1]["params"].append(param)
            else:
                param_groups[2]["params"].append(param)
        return param_groups

    def _get_optim(
        self, model: nn.Module, optim_class: OptimClass, multi_tensor: bool
    ) -> torch.optim.Optimizer:
        """Constructs an optimizer with three parameter groups, one for weights, one
        for biases, and one for everything else, each with different weight decay
        and learning rates."""
        param_groups = self._get_param_groups(model)
        return optim_class(param_groups, lr=5e-3, foreach=multi_tensor)

    def _get_ddp_transformer(self, find_unused_params: bool) -> DDP:
        """Returns a transformer with shared parameters wrapped with DDP."""
        model = TransformerWithSharedParams.init(
            self.process_group,
            FSDPInitMode.NO_FSDP,
            DeviceInitMode.BEFORE,
            deterministic=True,
        )
        return _ddp(model, self.device, find_unused_parameters=find_unused_params)

    def _get_fsdp_transformer_and_optim(
        self,
        cuda_init_mode: DeviceInitMode,
        init_optim_before_wrap: bool,
        optim_class: OptimClass,
        multi_tensor: bool,
        sharding_strategy: ShardingStrategy,
        backward_prefetch: BackwardPrefetch | None,
        cpu_offload: CPUOffload | None,
    ) -> tuple[FSDP, torch.optim.Optimizer]:
        """Returns a transformer with shared parameters wrapped with FSDP and a
        corresponding optimizer."""
        # Each transformer layer has several linear layers, so this policy with
        # the parameter groups puts different hyperparameters in one FlatParameter.
        fsdp_kwargs = {
            "auto_wrap_policy": ModuleWrapPolicy(
                {
                    TransformerEncoderLayer,
                    TransformerDecoderLayer,
                }
            ),
            "use_orig_params": True,
            "sharding_strategy": sharding_strategy,
            "backward_prefetch": backward_prefetch,
            "cpu_offload": cpu_offload,
        }
        model = TransformerWithSharedParams.init(
            self.process_group,
            FSDPInitMode.NO_FSDP,
            cuda_init_mode,
            deterministic=True,
        )
        if init_optim_before_wrap:
            fsdp_optim = self._get_optim(model, optim_class, multi_tensor)
            fsdp_model = FSDP(model, self.process_group, **fsdp_kwargs)
        else:
            fsdp_model = FSDP(model, self.process_group, **fsdp_kwargs)
            fsdp_optim = self._get_optim(fsdp_model, optim_class, multi_tensor)
        if cuda_init_mode == DeviceInitMode.AFTER and not fsdp_model.cpu_offload.offload_params:
            fsdp_model = fsdp_model.to(self.device)
        return fsdp_model, fsdp_optim

    def _check_train_parity(
        self,
        ddp_model: DDP,
        ddp_optim: torch.optim.Optimizer,
        fsdp_model: FSDP,
        fsdp_optim: torch.optim.Optimizer,
        set_to_none: bool,
        num_iters: int = 10,
    ) -> None:
        """Checks training parity between DDP and FSDP."""
        device = self.device
        for i in range(num_iters):
            iter_losses = []
            for model, optim in ((ddp_model, ddp_optim), (fsdp_model, fsdp_optim)):
                module = model.module
                # Two different `zero_grad()` timings.
                if i % 2 == 0:
                    optim.zero_grad(set_to_none=set_to_none)  # pre-forward
                inp = module.get_input(device)
                output = model(*inp)
                loss = module.get_loss(inp, output).to(device)
                iter_losses.append(loss)
                if i % 2 == 1:
                    optim.zero_grad(set_to_none=set_to_none)  # pre-backward
                module.run_backward(loss)
                # Step DDP on the CPU to match FSDP if it offloads.
                if model is ddp_model and fsdp_model.cpu_offload.offload_params:
                    model.to(torch.device("cpu"))
                optim.step()
                if model is ddp_model and fsdp_model.cpu_offload.offload_params:
                    model.to(device)
            torch.testing.assert_close(iter_losses[0], iter_losses[1])
            iter_losses.clear()
        self._check_ddp_fsdp_param_parity(ddp_model, fsdp_model)

    def _check_ddp_fsdp_param_parity(self, ddp_model: DDP, fsdp_model: FSDP) -> None:
        with FSDP.summon_full_params(fsdp_model):
            for (n1, p1), (n2, p2) in zip(
                ddp_model.module.named_parameters(), fsdp_model.named_parameters()
            ):
                # Allow for FSDP prefixes.
                self.assertEqual(n1, clean_tensor_name(n2))
                torch.testing.assert_close(p1, p2)

    def _get_sharding_strategy_from_str(self, sharding_strategy_str: str) -> ShardingStrategy:
        if sharding_strategy_str == "no_shard":
            sharding_strategy = ShardingStrategy.NO_SHARD
        elif sharding_strategy_str == "shard_grad_op":
            sharding_strategy = ShardingStrategy.SHARD_GRAD_OP
        elif sharding_strategy_str == "full_shard":
            sharding_strategy = ShardingStrategy.FULL_SHARD
        else:
            raise ValueError(f"Invalid string: {sharding_strategy_str}")
        return sharding_strategy

    @pytest.mark.requires_gpu("Inductor needs a GPU")
    @pytest.mark.requires_module("triton", reason="Inductor+gpu needs triton and recent GPU arch")
    def test_fsdp_compile(self) -> None:
        """A compiled FSDP model trains with the same losses as an eager one."""
        self.run_subtests(
            {
                "sharding_strategy": [
                    ShardingStrategy.FULL_SHARD,
                    ShardingStrategy.SHARD_GRAD_OP,
                    ShardingStrategy.NO_SHARD,
                ],
                "skip_fsdp_guards": [True, False],
            },
            self._test_fsdp_compile,
        )

    def _test_fsdp_compile(
        self, sharding_strategy: ShardingStrategy, skip_fsdp_guards: bool
    ) -> None:
        # Patched rather than assigned, so the setting does not outlive the subtest.
        with torch._dynamo.config.patch(skip_fsdp_guards=skip_fsdp_guards):
            fsdp_kwargs = {
                "auto_wrap_policy": ModuleWrapPolicy(
                    {
                        TransformerEncoderLayer,
                        TransformerDecoderLayer,
                    }
                ),
                "use_orig_params": True,
                "sharding_strategy": sharding_strategy,
                "backward_prefetch": BackwardPrefetch.BACKWARD_PRE,
                "cpu_offload": CPUOffload(False),
            }
            base_model = TransformerWithSharedParams.init(
                self.process_group,
                FSDPInitMode.NO_FSDP,
                DeviceInitMode.BEFORE,
                deterministic=True,
            )
            ref_model = FSDP(copy.deepcopy(base_model), self.process_group, **fsdp_kwargs)
            ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
            model = FSDP(copy.deepcopy(base_model), self.process_group, **fsdp_kwargs)
            model = torch.compile(model)
            optim = torch.optim.Adam(model.parameters(), lr=1e-2)
            for _ in range(10):
                losses = []
                inp = ref_model.get_input(self.device)
                for _model, _optim in ((ref_model, ref_optim), (model, optim)):
                    _optim.zero_grad()
                    loss = _model(*inp).sum()
                    losses.append(loss)
                    loss.backward()
                    _optim.step()
                self.assertEqual(losses[0], losses[1])

    # 96 subtests of 10 DDP and FSDP steps each: 0.4-0.65 s a subtest on the
    # 2-core CPU machine under `-n 2` (docs/suites.md), several times that on a
    # loaded machine, which can pass the default 600 s deadline.
    @pytest.mark.dist_timeout(2400)
    @pytest.mark.parametrize("sharding_strategy_str", ["no_shard", "shard_grad_op", "full_shard"])
    def test_diff_hyperparams(self, sharding_strategy_str: str) -> None:
        """Parity with DDP with parameter groups of different hyperparameters."""
        sharding_strategy = self._get_sharding_strategy_from_str(sharding_strategy_str)
        self.run_subtests(
            {
                "cuda_init_mode": [
                    DeviceInitMode.BEFORE,
                    DeviceInitMode.AFTER,
                ],
                "init_optim_before_wrap": [False, True],
                "optim_class": [torch.optim.AdamW],
                "multi_tensor": [False, True],
                "set_to_none": [False, True],
                "backward_prefetch": [
                    None,
                    BackwardPrefetch.BACKWARD_PRE,
                    BackwardPrefetch.BACKWARD_POST,
                ],
                "skip_writeback_check": [False, True],
            },
            self._test_diff_hyperparams,
            cpu_offload=CPUOffload(offload_params=False),
            sharding_strategy=sharding_strategy,
        )

    @pytest.mark.parametrize("sharding_strategy_str", ["no_shard", "shard_grad_op", "full_shard"])
    def test_diff_hyperparams_cpu_offload(self, sharding_strategy_str: str) -> None:
        """Parity with DDP with parameter groups of different hyperparameters and CPU
        offloading (apart from ``test_diff_hyperparams``: upstream saw issues when
        subtests switch from ``offload_params=False`` to ``True``)."""
        sharding_strategy = self._get_sharding_strategy_from_str(sharding_strategy_str)
        for skip_writeback_check in (False, True):
            self._test_diff_hyperparams(
                cuda_init_mode=DeviceInitMode.BEFORE,
                init_optim_before_wrap=False,
                optim_class=torch.optim.Adam,
                multi_tensor=False,
                set_to_none=False,
                backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
                cpu_offload=CPUOffload(offload_params=True),
                sharding_strategy=sharding_strategy,
                skip_writeback_check=skip_writeback_check,
            )

    def _test_diff_hyperparams(
        self,
        cuda_init_mode: DeviceInitMode,
        init_optim_before_wrap: bool,
        optim_class: OptimClass,
        multi_tensor: bool,
        set_to_none: bool,
        backward_prefetch: BackwardPrefetch | None,
        cpu_offload: CPUOffload,
        sharding_strategy: ShardingStrategy,
        skip_writeback_check: bool,
    ) -> None:
        """``init_optim_before_wrap``: build the FSDP optimizer before wrapping the
        model (else after); both are allowed, for flexibility."""
        if cuda_init_mode == DeviceInitMode.AFTER and cpu_offload.offload_params:
            return  # not supported
        skip_torch_offload_race(self, [sharding_strategy], cpu_offload, use_orig_params=True)
        os.environ[_FSDP_SKIP_WRITEBACK_CHECK] = _env_flag(skip_writeback_check)
        ddp_model = self._get_ddp_transformer(find_unused_params=False)
        ddp_optim = self._get_optim(ddp_model, optim_class, multi_tensor)
        fsdp_model, fsdp_optim = self._get_fsdp_transformer_and_optim(
            cuda_init_mode=cuda_init_mode,
            init_optim_before_wrap=init_optim_before_wrap,
            optim_class=optim_class,
            multi_tensor=multi_tensor,
            sharding_strategy=sharding_strategy,
            backward_prefetch=backward_prefetch,
            cpu_offload=cpu_offload,
        )
        self._check_train_parity(ddp_model, ddp_optim, fsdp_model, fsdp_optim, set_to_none)

    def test_diff_trainability(self) -> None:
        """Parity with DDP with parameter groups when one group (the biases) is frozen."""
        self.run_subtests(
            {
                "multi_tensor": [False, True],
                "sharding_strategy": [
                    ShardingStrategy.FULL_SHARD,
                    ShardingStrategy.SHARD_GRAD_OP,
                    ShardingStrategy.NO_SHARD,
                ],
            },
            self._test_diff_trainability,
        )

    def _test_diff_trainability(
        self, multi_tensor: bool, sharding_strategy: ShardingStrategy
    ) -> None:
        optim_class = torch.optim.Adam
        ddp_model = self._get_ddp_transformer(find_unused_params=True)
        ddp_optim = self._get_optim(ddp_model, optim_class, multi_tensor)
        fsdp_model, fsdp_optim = self._get_fsdp_transformer_and_optim(
            cuda_init_mode=DeviceInitMode.BEFORE,
            init_optim_before_wrap=False,
            optim_class=optim_class,
            multi_tensor=multi_tensor,
            sharding_strategy=sharding_strategy,
            backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
            cpu_offload=None,
        )
        # Freeze all biases (which happen to be in the same parameter group).
        for param_name, param in ddp_model.named_parameters():
            if "bias" in param_name:
                param.requires_grad_(False)
        for param_name, param in fsdp_model.named_parameters():
            if "bias" in param_name:
                param.requires_grad_(False)
        self._check_train_parity(ddp_model, ddp_optim, fsdp_model, fsdp_optim, False)

    def test_multiple_optimizers(self) -> None:
        """Two optimizers of which only one sets gradients to ``None``: parity with DDP,
        and ``None`` and non-``None`` gradients exposed right after forward."""
        self.run_subtests(
            {
                "sharding_strategy": [
                    ShardingStrategy.FULL_SHARD,
                    ShardingStrategy.SHARD_GRAD_OP,
                ]
            },
            self._test_multiple_optimizers,
        )

    def _test_multiple_optimizers(self, sharding_strategy: ShardingStrategy) -> None:
        ddp_model = self._get_ddp_transformer(find_unused_params=True)
        ddp_param_groups = self._get_param_groups(ddp_model)
        assert len(ddp_param_groups) == 3, f"{len(ddp_param_groups)}"
        fsdp_model, _ = self._get_fsdp_transformer_and_optim(
            cuda_init_mode=DeviceInitMode.BEFORE,
            init_optim_before_wrap=False,
            optim_class=torch.optim.Adam,  # the returned optimizer is not used
            multi_tensor=False,
            sharding_strategy=sharding_strategy,
            backward_prefetch=BackwardPrefetch.BACKWARD_PRE,
            cpu_offload=None,
        )
        fsdp_param_groups = self._get_param_groups(fsdp_model)
        assert len(fsdp_param_groups) == 3, f"{len(fsdp_param_groups)}"
        # Every transformer parameter is a weight or a bias: only the first two
        # groups are used. Adam and AdamW correct their bias by the step count,
        # which advances for a zero gradient but not for a `None` one, so they
        # tell a zero gradient from a `None` gradient.
        optim_ctors = [
            functools.partial(torch.optim.Adam, lr=5e-3),
            functools.partial(torch.optim.AdamW, lr=1e-2),
        ]
        ddp_optims = [
            ctor(group["params"]) for ctor, group in zip(optim_ctors, ddp_param_groups[:2])
        ]
        fsdp_optims = [
            ctor(group["params"]) for ctor, group in zip(optim_ctors, fsdp_param_groups[:2])
        ]
        device = self.device
        assert _has_unit_with_weight_and_bias_in_shard(fsdp_model), (
            f"Rank {self.rank} does not have a `FlatParameter` with both a "
            "weight and a bias in its shard, meaning that this test is vacuous"
        )

        def run_iter() -> None:
            """One iteration that generates gradients, then parity."""
            iter_losses = []
            for model, optims in ((ddp_model, ddp_optims), (fsdp_model, fsdp_optims)):
                module = model.module
                inp = module.get_input(device)
                output = model(*inp)
                loss = module.get_loss(inp, output).to(device)
                iter_losses.append(loss)
                module.run_backward(loss)
                for optim in optims:
                    optim.step()
            torch.testing.assert_close(iter_losses[0], iter_losses[1])
            iter_losses.clear()
            self._check_ddp_fsdp_param_parity(ddp_model, fsdp_model)

        run_iter()

        # Only the weights' gradients are set to None.
        ddp_optims[0].zero_grad(set_to_none=True)
        fsdp_optims[0].zero_grad(set_to_none=True)
        inp = ddp_model.module.get_input(device)
        ddp_output = ddp_model(*inp)
        fsdp_output = fsdp_model(*inp)

        # After forward FSDP exposes the gradients: None for the weights, the
        # others for the biases. Strategies that keep the unsharded parameters
        # from forward to backward do not expose them then.
        if sharding_strategy in NO_RESHARD_AFTER_FORWARD_STRATEGIES:
            return
        for (ddp_n, ddp_p), (fsdp_n, fsdp_p) in zip(
            ddp_model.module.named_parameters(), fsdp_model.named_parameters()
        ):
            self.assertEqual(ddp_n, clean_tensor_name(fsdp_n))
            if fsdp_p.numel() == 0:
                # Not in this rank's shard.
                self.assertTrue(fsdp_p.grad is None)
                continue
            if ddp_p.grad is None:
                self.assertTrue(fsdp_p.grad is None)
            else:
                self.assertEqual(ddp_p.flatten(), fsdp_p.flatten())
                self.assertEqual(ddp_p.grad.flatten(), fsdp_p.grad.flatten())
        self._check_ddp_fsdp_param_parity(ddp_model, fsdp_model)

        # Finish the iteration: backward and optimizer steps.
        ddp_loss = ddp_model.module.get_loss(inp, ddp_output).to(device)
        fsdp_loss = fsdp_model.module.get_loss(inp, fsdp_output).to(device)
        ddp_model.module.run_backward(ddp_loss)
        fsdp_model.module.run_backward(fsdp_loss)
        for optim in itertools.chain(ddp_optims, fsdp_optims):
            optim.step()
        self._check_ddp_fsdp_param_parity(ddp_model, fsdp_model)

        # One more iteration confirms the bias corrections.
        run_iter()
        self._check_ddp_fsdp_param_parity(ddp_model, fsdp_model)


class TestFSDPUseOrigParamsUnshardReshard(FSDPTest):
    """Tests the unshard/reshard flow."""

    @property
    def world_size(self) -> int:
        return 2

    def _get_fsdp_models_and_optims(
        self, sharding_strategy: ShardingStrategy, cpu_offload: CPUOffload
    ) -> tuple[FSDP, torch.optim.Optimizer, FSDP, torch.optim.Optimizer]:
        """Returns a pair of (FSDP model, optimizer) for ``use_orig_params=False``
        and ``True``, respectively."""
        skip_torch_offload_race(self, [sharding_strategy], cpu_offload, use_orig_params=True)
        lr = 1e-2
        fsdp_kwargs = {
            "sharding_strategy": sharding_strategy,
            "cpu_offload": cpu_offload,
            "use_orig_params": False,
        }
        fsdp_model = TransformerWithSharedParams.init(
            self.process_group,
            FSDPInitMode.RECURSIVE,
            DeviceInitMode.BEFORE,
            fsdp_kwargs=fsdp_kwargs,
            deterministic=True,
        )
        optim = torch.optim.Adam(fsdp_model.parameters(), foreach=False, lr=lr)
        fsdp_kwargs["use_orig_params"] = True
        fsdp_model_orig_params = TransformerWithSharedParams.init(
            self.process_group,
            FSDPInitMode.RECURSIVE,
            DeviceInitMode.BEFORE,
            fsdp_kwargs=fsdp_kwargs,
            deterministic=True,
        )
        optim_orig_params = torch.optim.Adam(
            fsdp_model_orig_params.parameters(), foreach=False, lr=lr
        )
        return fsdp_model, optim, fsdp_model_orig_params, optim_orig_params

    def _check_fsdp_parameter_parity(self, fsdp1: FSDP, fsdp2: FSDP) -> None:
        """Checks that two FSDP instances have the same model parameters."""
        with FSDP.summon_full_params(fsdp1), FSDP.summon_full_params(fsdp2):
            for (n1, p1), (n2, p2) in zip(fsdp1.named_parameters(), fsdp2.named_parameters()):
                self.assertEqual(n1, n2)
                torch.testing.assert_close(p1, p2)

    def _get_fsdp_parity_subtest_config(self) -> dict[str, list[Any]]:
        return {
            "sharding_strategy": [
                ShardingStrategy.NO_SHARD,
                ShardingStrategy.SHARD_GRAD_OP,
                ShardingStrategy.FULL_SHARD,
            ],
        }

    @pytest.mark.parametrize("offload_params", [False, True])
    def test_multiple_forward(self, offload_params: bool) -> None:
        """``use_orig_params=True`` has parity with ``False`` when running several
        forward passes before a backward pass."""
        cpu_offload = CPUOffload(offload_params=offload_params)
        self.run_subtests(
            self._get_fsdp_parity_subtest_config(),
            self._test_multiple_forward,
            cpu_offload=cpu_offload,
        )

    def _test_multiple_forward(
        self, sharding_strategy: ShardingStrategy, cpu_offload: CPUOffload
    ) -> None:
        (
            fsdp_model,
            optim,
            fsdp_model_orig_params,
            optim_orig_params,
        ) = self._get_fsdp_models_and_optims(sharding_strategy, cpu_offload)
        device = self.device
        for _ in range(3):
            inp1 = fsdp_model.get_input(device)
            _inp2 = fsdp_model.get_input(device)
            inp2 = tuple(t + torch.ones_like(t) for t in _inp2)  # different from `inp1`
            # In each list, element 0 is the baseline and element 1 the test.
            losses1 = []
            losses2 = []
            losses = []
            for _model, _optim in (fsdp_model, optim), (fsdp_model_orig_params, optim_orig_params):
                _optim.zero_grad()
                loss1 = _model(*inp1)
                losses1.append(loss1)
                loss2 = _model(*inp2)
                losses2.append(loss2)
                loss = (loss1 + loss2).sum()
                losses.append(loss)
                _model.run_backward(loss)
                _optim.step()
            self.assertEqual(losses1[0], losses1[1])
            self.assertEqual(losses2[0], losses2[1])
            self.assertEqual(losses[0], losses[1])
        self._check_fsdp_parameter_parity(fsdp_model, fsdp_model_orig_params)

    @pytest.mark.parametrize("offload_params", [False, True])
    def test_summon_between_two_forwards(self, offload_params: bool) -> None:
        """``use_orig_params=True`` has parity with ``False`` when running a forward,
        ``summon_full_params()`` and another forward before a backward."""
        cpu_offload = CPUOffload(offload_params=offload_params)
        self.run_subtests(
            self._get_fsdp_parity_subtest_config(),
            self._test_summon_between_two_forwards,
            cpu_offload=cpu_offload,
        )

    def _test_summon_between_two_forwards(
        self, sharding_strategy: ShardingStrategy, cpu_offload: CPUOffload
    ) -> None:
        (
            fsdp_model,
            optim,
            fsdp_model_orig_params,
            optim_orig_params,
        ) = self._get_fsdp_models_and_optims(sharding_strategy, cpu_offload)
        device = self.device
        for _ in range(3):
            optim.zero_grad()
            optim_orig_params.zero_grad()

            inp1 = fsdp_model.get_input(device)
            loss1 = fsdp_model(*inp1)
            loss_orig_params1 = fsdp_model_orig_params(*inp1)
            self.assertEqual(loss1, loss_orig_params1)

            # Calls into `summon_full_params()`.
            self._check_fsdp_parameter_parity(fsdp_model, fsdp_model_orig_params)

            inp2 = fsdp_model.get_input(device)
            loss2 = fsdp_model(*inp2)
            loss_orig_params2 = fsdp_model_orig_params(*inp2)
            self.assertEqual(loss2, loss_orig_params2)

            loss = (loss1 + loss2).sum()
            loss_orig_params = (loss_orig_params1 + loss_orig_params2).sum()
            fsdp_model.run_backward(loss)
            fsdp_model_orig_params.run_backward(loss_orig_params)
            optim.step()
            optim_orig_params.step()
        self._check_fsdp_parameter_parity(fsdp_model, fsdp_model_orig_params)


class ParamAccessModel(nn.Module):
    """Two linear layers whose flat parameters split at known offsets over two ranks
    (fp32, 16-byte alignment):

    - ``lin1``: 5 * 5 = 25 numel, padded to 26: 13 on each rank.
    - ``lin2``: 5 * 7 weight + 1 alignment padding + 7 bias = 43 numel, padded to
      44: 22 of the weight on rank 0; 13 of the weight, the padding and the 7 of
      the bias on rank 1.
    """

    lin1: nn.Linear
    lin2: nn.Linear

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(42)
        self.lin1 = nn.Linear(5, 5, bias=False)
        self.lin2 = nn.Linear(5, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.lin1(x)
        z = nn.functional.relu(z)
        z = self.lin2(z)
        return z

    def get_input(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        return (torch.randn((2, 5)).to(device),)

    def get_loss(self, inp: tuple[torch.Tensor, ...], out: torch.Tensor) -> torch.Tensor:
        return out.sum()


# The part of each full parameter (flattened) that rank 0 and rank 1 hold; see
# ``ParamAccessModel``.
_LOCAL_PARTS: dict[str, tuple[slice, slice]] = {
    "lin1.weight": (slice(0, 13), slice(13, None)),
    "lin2.weight": (slice(0, 22), slice(22, None)),
    "lin2.bias": (slice(0, 0), slice(0, None)),
}


class TestFSDPUseOrigParamsParamAccess(FSDPTest):
    """Tests original parameter access."""

    @property
    def world_size(self) -> int:
        # Two ranks: the test hard codes which part of each parameter a rank holds.
        return 2

    def test_access_params_after_forward(self) -> None:
        """Between forward and backward the original parameters are readable and hold
        this rank's part (which ``use_orig_params=False`` does not support)."""
        self.run_subtests(
            {
                "sharding_strategy": [
                    ShardingStrategy.NO_SHARD,
                    ShardingStrategy.FULL_SHARD,
                    ShardingStrategy.SHARD_GRAD_OP,
                ],
            },
            self._test_access_params_after_forward,
        )

    def _test_access_params_after_forward(self, sharding_strategy: ShardingStrategy) -> None:
        # NOTE (upstream): to be changed if FSDP's sharding algorithm changes; until
        # then it sanity-checks the `use_orig_params=True` implementation.
        ddp_model = _ddp(ParamAccessModel().to(self.device), self.device)
        fsdp_model = FSDP(
            ParamAccessModel().to(self.device),
            sharding_strategy=sharding_strategy,
            auto_wrap_policy=always_wrap_policy,
            use_orig_params=True,
        )
        lr = 1e-2
        ddp_optim = torch.optim.Adam(ddp_model.parameters(), lr=lr)
        fsdp_optim = torch.optim.Adam(fsdp_model.parameters(), lr=lr)
        device = self.device

        inp = fsdp_model.get_input(device)
        ddp_out = ddp_model(*inp)
        fsdp_out = fsdp_model(*inp)
        self._check_parameter_parity(ddp_model, fsdp_model, sharding_strategy, True)

        ddp_loss = ddp_model.module.get_loss(inp, ddp_out)
        fsdp_loss = fsdp_model.get_loss(inp, fsdp_out)
        ddp_loss.backward()
        fsdp_loss.backward()
        ddp_optim.step()
        fsdp_optim.step()
        self._check_parameter_parity(ddp_model, fsdp_model, sharding_strategy, False)

        inp = fsdp_model.get_input(device)
        ddp_out = ddp_model(*inp)
        fsdp_out = fsdp_model(*inp)
        self._check_parameter_parity(ddp_model, fsdp_model, sharding_strategy, True)

    def _check_parameter_parity(
        self,
        ddp_model: DDP,
        fsdp_model: FSDP,
        sharding_strategy: ShardingStrategy,
        between_fwd_and_bwd: bool,
    ) -> None:
        assert self.rank in (0, 1), f"Expects world size of 2 but got {self.world_size}"
        # NO_SHARD exposes unflattened parameters, and strategies that keep the
        # unsharded parameters after forward do not use sharded views then.
        whole = sharding_strategy == ShardingStrategy.NO_SHARD or (
            between_fwd_and_bwd and sharding_strategy in NO_RESHARD_AFTER_FORWARD_STRATEGIES
        )
        for (n1, p1), (n2, p2) in zip(
            ddp_model.module.named_parameters(), fsdp_model.named_parameters()
        ):
            self.assertEqual(n1, clean_tensor_name(n2))
            if not whole:
                p1 = p1.flatten()[_LOCAL_PARTS[n1][self.rank]]
            torch.testing.assert_close(p1, p2)


class TestFSDPUseOrigParamsWriteback(FSDPTest):
    """Tests parameter and gradient writeback."""

    class Model(nn.Module):
        """Two biased linear layers, seeded, built directly on ``device``."""

        lin1: nn.Linear
        lin2: nn.Linear

        def __init__(self, device: torch.device) -> None:
            super().__init__()
            torch.manual_seed(42)
            self.lin1 = nn.Linear(5, 5, bias=True, device=device)
            self.lin2 = nn.Linear(5, 7, bias=True, device=device)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            z = self.lin1(x)
            z = nn.functional.relu(z)
            z = self.lin2(z)
            return z

        def get_input(self, device: torch.device) -> tuple[torch.Tensor, ...]:
            return (torch.randn((2, 5)).to(device),)

        def get_loss(self, inp: tuple[torch.Tensor, ...], out: torch.Tensor) -> torch.Tensor:
            return out.sum()

    @property
    def world_size(self) -> int:
        # Two ranks: the tests hard code which rank holds which parameter.
        return 2

    def _check_param_parity(self, ddp_model: DDP, fsdp_model: FSDP) -> None:
        with FSDP.summon_full_params(fsdp_model):
            for (n1, p1), (n2, p2) in zip(
                ddp_model.module.named_parameters(), fsdp_model.named_parameters()
            ):
                self.assertEqual(n1, n2)
                torch.testing.assert_close(p1, p2)

    def test_param_writeback(self) -> None:
        """Changes to the original parameters (``.data`` or the variable) are written
        back to the flat parameter."""
        self.run_subtests(
            {
                "change_first_weight": [True, False],  # first vs. second `weight`
                "change_data": [True, False],  # change `.data` vs. variable itself
            },
            self._test_param_writeback,
        )

    def _test_param_writeback(self, change_first_weight: bool, change_data: bool) -> None:
        def transform_param(param: nn.Parameter) -> nn.Parameter:
            return nn.Parameter(torch.ones_like(param) * 2)

        # Check that the writeback propagates.
        ddp_model = _ddp(TestFSDPUseOrigParamsWriteback.Model(self.device), self.device)
        fsdp_model = FSDP(TestFSDPUseOrigParamsWriteback.Model(self.device), use_orig_params=True)
        ddp = ddp_model.module  # for brevity
        fsdp = fsdp_model.module
        if change_first_weight:
            if change_data:
                ddp.lin1.weight.data = transform_param(ddp.lin1.weight)
                fsdp.lin1.weight.data = transform_param(fsdp.lin1.weight)
            else:
                ddp.lin1.weight = transform_param(ddp.lin1.weight)
                fsdp.lin1.weight = transform_param(fsdp.lin1.weight)
        else:
            if change_data:
                ddp.lin2.weight.data = transform_param(ddp.lin2.weight)
                fsdp.lin2.weight.data = transform_param(fsdp.lin2.weight)
            else:
                ddp.lin2.weight = transform_param(ddp.lin2.weight)
                fsdp.lin2.weight = transform_param(fsdp.lin2.weight)
        self._check_param_parity(ddp_model, fsdp_model)  # triggers a writeback

    def test_grad_writeback(self) -> None:
        """Changes to the original parameters' gradients are written back (an
        optimizer step stands in for reading them)."""
        self.run_subtests(
            {
                "change_first_weight_grad": [False, True],
                "change_data": [False, True],  # change `.data` vs. variable itself
                "set_to_none": [False, True],
            },
            self._test_grad_writeback,
        )

    def _test_grad_writeback(
        self, change_first_weight_grad: bool, change_data: bool, set_to_none: bool
    ) -> None:
        if change_data and set_to_none:
            return  # not well-defined

        def transform_grad(param: nn.Parameter) -> torch.Tensor | None:
            return None if set_to_none else torch.ones_like(param) * 2

        ddp_model = _ddp(TestFSDPUseOrigParamsWriteback.Model(self.device), self.device)
        fsdp_model = FSDP(TestFSDPUseOrigParamsWriteback.Model(self.device), use_orig_params=True)
        lr = 1e-2
        # TODO (upstream): with `summon_full_params(with_grads=True)`, check the
        # gradients directly; for now an optimizer step stands in.
        ddp_optim = torch.optim.Adam(ddp_model.parameters(), lr=lr)
        fsdp_optim = torch.optim.Adam(fsdp_model.parameters(), lr=lr)

        # Generate an initial gradient.
        inp = fsdp_model.get_input(self.device)
        ddp_out = ddp_model(*inp)
        fsdp_out = fsdp_model(*inp)
        ddp_out.sum().backward()
        fsdp_out.sum().backward()

        # Change the gradient through the original parameters.
        ddp = ddp_model.module  # for brevity
        fsdp = fsdp_model.module
        if change_first_weight_grad:
            if change_data:
                ddp.lin1.weight.grad.data = transform_grad(ddp.lin1.weight)
                if fsdp.lin1.weight.grad is not None:
                    fsdp.lin1.weight.grad.data = transform_grad(fsdp.lin1.weight)
            else:
                ddp.lin1.weight.grad = transform_grad(ddp.lin1.weight)
                fsdp.lin1.weight.grad = transform_grad(fsdp.lin1.weight)
        else:
            if change_data:
                ddp.lin2.weight.grad.data = transform_grad(ddp.lin2.weight)
                if fsdp.lin2.weight.grad is not None:
                    fsdp.lin2.weight.grad.data = transform_grad(fsdp.lin2.weight)
            else:
                ddp.lin2.weight.grad = transform_grad(ddp.lin2.weight)
                fsdp.lin2.weight.grad = transform_grad(fsdp.lin2.weight)
        ddp_optim.step()
        fsdp_optim.step()
        self._check_param_parity(ddp_model, fsdp_model)  # triggers a writeback

        # Intentionally do not zero the gradient to check writeback.
        inp = fsdp_model.get_input(self.device)
        ddp_out = ddp_model(*inp)
        fsdp_out = fsdp_model(*inp)
        ddp_out.sum().backward()
        fsdp_out.sum().backward()
        ddp_optim.step()
        fsdp_optim.step()
        self._check_param_parity(ddp_model, fsdp_model)  # triggers a writeback

    def test_writeback_shape_mismatch(self) -> None:
        """Writing back a parameter and gradient of another shape fails with
        "Cannot writeback"."""
        fsdp_model = FSDP(TestFSDPUseOrigParamsWriteback.Model(self.device), use_orig_params=True)
        fsdp = fsdp_model.module  # for brevity
        assert self.rank in (0, 1), f"Expects world size of 2 but got {self.world_size}"
        with self.assertRaisesRegex(RuntimeError, "Cannot writeback"):
            # Change the parameter and its gradient to ones with 1 added to each
            # dimension, forcing a shape mismatch at the writeback.
            if self.rank == 0:
                # Change `lin1.weight.grad` since it exists on rank 0.
                lin1_weight_shape = list(fsdp.lin1.weight.shape)
                for dim_index in range(len(lin1_weight_shape)):
                    lin1_weight_shape[dim_index] += 1
                fsdp.lin1.weight = nn.Parameter(
                    torch.randn(torch.Size(lin1_weight_shape), device=fsdp.lin1.weight.device)
                )
                fsdp.lin1.weight.grad = torch.randn(
                    torch.Size(lin1_weight_shape), device=fsdp.lin1.weight.device
                )
            elif self.rank == 1:
                # Change `lin2.weight.grad` since it exists (partially) on rank 1.
                lin2_weight_shape = list(fsdp.lin2.weight.shape)
                for dim_index in range(len(lin2_weight_shape)):
                    lin2_weight_shape[dim_index] += 1
                fsdp.lin2.weight = nn.Parameter(
                    torch.randn(torch.Size(lin2_weight_shape), device=fsdp.lin2.weight.device)
                )
                fsdp.lin2.weight.grad = torch.randn(
                    torch.Size(lin2_weight_shape), device=fsdp.lin2.weight.device
                )
            with FSDP.summon_full_params(fsdp_model):  # triggers a writeback
                ...

    def test_writeback_between_fwd_and_bwd_for_no_reshard_raises(self) -> None:
        """Under SHARD_GRAD_OP, changing a parameter (its storage or the variable)
        between forward and backward fails in backward."""
        fsdp_kwargs = {
            "sharding_strategy": ShardingStrategy.SHARD_GRAD_OP,
            "auto_wrap_policy": ModuleWrapPolicy({nn.Linear}),
            "use_orig_params": True,
        }
        fsdp_wrapper = functools.partial(FSDP, **fsdp_kwargs)
        assert_msg = "FSDP does not support changing the parameters between forward and backward"

        # The parameter's storage no longer a view into the flat parameter.
        fsdp_model = fsdp_wrapper(TestFSDPUseOrigParamsWriteback.Model(self.device))
        inp = fsdp_model.get_input(self.device)
        loss = fsdp_model(*inp).sum()
        fsdp_model.lin1.weight.data = fsdp_model.lin1.weight.clone()
        with self.assertRaisesRegex(AssertionError, assert_msg):
            loss.backward()

        # The parameter variable itself replaced.
        fsdp_model = fsdp_wrapper(TestFSDPUseOrigParamsWriteback.Model(self.device))
        inp = fsdp_model.get_input(self.device)
        loss = fsdp_model(*inp).sum()
        fsdp_model.lin1._fsdp_wrapped_module.weight = nn.Parameter(fsdp_model.lin1.weight.clone())
        with self.assertRaisesRegex(AssertionError, assert_msg):
            loss.backward()

    def test_no_reshard_and_mixed_precision(self) -> None:
        """The writeback is not falsely triggered by: train forward -> full-precision
        unshard -> train forward; train forward -> eval forward; train
        forward/backward -> eval forward -> model checkpoint."""
        self.run_subtests(
            {"use_full_prec_in_eval": [False, True]},
            self._test_no_reshard_and_mixed_precision,
        )

    def _test_no_reshard_and_mixed_precision(self, use_full_prec_in_eval: bool) -> None:
        os.environ[_FSDP_USE_FULL_PREC_IN_EVAL] = _env_flag(use_full_prec_in_eval)
        fsdp_kwargs = {
            "sharding_strategy": ShardingStrategy.SHARD_GRAD_OP,
            "auto_wrap_policy": ModuleWrapPolicy({nn.Linear}),
            "mixed_precision": MixedPrecision(param_dtype=torch.float16),
            "use_orig_params": True,
        }
        fsdp_model = FSDP(TestFSDPUseOrigParamsWriteback.Model(self.device), **fsdp_kwargs)
        inp = fsdp_model.get_input(self.device)

        # Train forward -> full-precision unshard -> train forward.
        fsdp_model(*inp)
        with FSDP.summon_full_params(fsdp_model):
            ...
        fsdp_model(*inp)

        # Train forward -> eval forward.
        fsdp_model.train()
        fsdp_model(*inp)
        fsdp_model.eval()
        fsdp_model(*inp)

        # Train forward/backward -> eval forward -> model checkpoint.
        fsdp_model.train()
        fsdp_model(*inp).sum().backward()
        fsdp_model.eval()
        fsdp_model(*inp)
        with FSDP.state_dict_type(fsdp_model, StateDictType.SHARDED_STATE_DICT):
            sd = fsdp_model.state_dict()
            fsdp_model.load_state_dict(sd)
        fsdp_model(*inp).sum().backward()


class TestFSDPUseOrigParamsFQNs(FSDPTest):
    def test_named_parameters_in_forward(self) -> None:
        """During forward, ``named_parameters()`` returns the original FQNs with the
        original (unsharded) shapes."""
        param_shapes: list[torch.Size | None] = [None, None]
        assert_equal_fn = self.assertEqual

        class Model(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.lin = nn.Linear(5, 5)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                # Allow for FSDP prefixes.
                param_names = [clean_tensor_name(tup[0]) for tup in self.named_parameters()]
                params = [tup[1] for tup in self.named_parameters()]
                assert param_shapes[0] is not None and param_shapes[1] is not None, (
                    "`param_sizes` should be set"
                )
                assert_equal_fn(param_names, ["lin.weight", "lin.bias"])
                assert_equal_fn(params[0].shape, param_shapes[0])
                assert_equal_fn(params[1].shape, param_shapes[1])
                return self.lin(x)

        model = Model().to(self.device)
        # The *unsharded* original shapes, which the forward must see.
        param_shapes[0] = model.lin.weight.shape
        param_shapes[1] = model.lin.bias.shape
        fsdp_model = FSDP(model, use_orig_params=True)
        inp = torch.randn((2, 5), device=self.device)
        fsdp_model(inp)


class TestFSDPUseOrigParamsNoSync(FSDPTest):
    @property
    def world_size(self) -> int:
        return 2

    def test_no_sync_correctness(self) -> None:
        """``no_sync()`` accumulates the same (unsharded) gradients with
        ``use_orig_params=True`` as with ``False``."""
        self.run_subtests(
            {
                "sharding_strategy": [
                    ShardingStrategy.FULL_SHARD,
                    ShardingStrategy.SHARD_GRAD_OP,
                    ShardingStrategy.NO_SHARD,
                ],
            },
            self._test_no_sync_correctness,
        )

    def _test_no_sync_correctness(self, sharding_strategy: ShardingStrategy) -> None:
        model = nn.Linear(7, 1, bias=False, device=self.device)
        fsdp_kwargs = {"sharding_strategy": sharding_strategy}
        model_use_flat_params = FSDP(copy.deepcopy(model), use_orig_params=False, **fsdp_kwargs)
        model_use_orig_params = FSDP(model, use_orig_params=True, **fsdp_kwargs)
        optim_use_flat_params = torch.optim.AdamW(model_use_flat_params.parameters(), foreach=True)
        optim_use_orig_params = torch.optim.AdamW(model_use_orig_params.parameters(), foreach=True)

        inp = torch.randn((2, 7), device=self.device)
        grad = torch.randn((2, 1), device=self.device)

        # Reference gradients from one forward/backward.
        out_use_flat_params = model_use_flat_params(inp)
        out_use_orig_params = model_use_orig_params(inp)
        torch.testing.assert_close(out_use_flat_params, out_use_orig_params)
        out_use_flat_params.backward(grad)
        out_use_orig_params.backward(grad)
        self._check_param_grad_parity(model_use_flat_params, model_use_orig_params)
        ref_grads_use_flat_params = _grads(model_use_flat_params)
        ref_grads_use_orig_params = _grads(model_use_orig_params)

        # A forward/backward in `no_sync()`.
        optim_use_flat_params.zero_grad(set_to_none=True)
        optim_use_orig_params.zero_grad(set_to_none=True)
        for model in (model_use_flat_params, model_use_orig_params):
            with model.no_sync():
                out = model(inp)
                out.backward(grad)
        self._check_param_grad_parity(model_use_flat_params, model_use_orig_params)

        # A forward/backward outside `no_sync()`.
        for model in (model_use_flat_params, model_use_orig_params):
            out = model(inp)
            out.backward(grad)
        self._check_param_grad_parity(model_use_flat_params, model_use_orig_params)

        # Gradients accumulated over two iterations: twice the reference ones.
        for grad_, ref_grad in zip(_grads(model_use_flat_params), ref_grads_use_flat_params):
            torch.testing.assert_close(grad_, 2 * ref_grad)
        for grad_, ref_grad in zip(_grads(model_use_orig_params), ref_grads_use_orig_params):
            torch.testing.assert_close(grad_, 2 * ref_grad)

    def _check_param_grad_parity(self, _baseline_model: nn.Module, _test_model: nn.Module) -> None:
        """Assumes ``nn.Linear(7, 1, bias=False)`` (one weight) so that the baseline
        (flat) and test (original) parameters compare directly; on rank 1 the
        baseline includes 1 element of padding."""
        self.assertEqual(len(list(_baseline_model.parameters())), 1)
        self.assertEqual(len(list(_test_model.parameters())), 1)
        for flat_param, orig_param in zip(_baseline_model.parameters(), _test_model.parameters()):
            # The baseline may have padding.
            self.assertGreaterEqual(flat_param.numel(), orig_param.numel())
            unpadded_param_numel = orig_param.numel()
            # For `NO_SHARD`, `use_orig_params=True` presents unflattened
            # parameters, while `False` presents flattened ones.
            torch.testing.assert_close(flat_param[:unpadded_param_numel], orig_param.flatten())
            # Right after `no_sync()` the gradient is unsharded while the
            # parameter is sharded, so their numels differ; for
            # `use_orig_params=False` it is flattened, for `True` unflattened.
            unpadded_grad_numel = orig_param.grad.numel()
            torch.testing.assert_close(
                flat_param.grad[:unpadded_grad_numel].reshape(orig_param.grad.shape),
                orig_param.grad,
            )

    def test_no_sync_mixed_precision(self) -> None:
        """With parameter mixed precision, gradients are fp16 inside ``no_sync()`` and
        fp32 after a synchronizing backward."""
        self.run_subtests(
            {
                "sharding_strategy": [
                    ShardingStrategy.FULL_SHARD,
                    ShardingStrategy.SHARD_GRAD_OP,
                    ShardingStrategy.NO_SHARD,
                ]
            },
            self._test_no_sync_mixed_precision,
        )

    def _test_no_sync_mixed_precision(self, sharding_strategy: ShardingStrategy) -> None:
        model = nn.Linear(3, 3, device=self.device)
        mixed_precision = MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float32)
        fsdp_kwargs = {
            "sharding_strategy": sharding_strategy,
            "mixed_precision": mixed_precision,
            "use_orig_params": True,
        }
        fsdp_model = FSDP(model, **fsdp_kwargs)
        inp = torch.randn((2, 3), device=self.device)
        with fsdp_model.no_sync():
            # Each `no_sync()` backward leaves the gradients in the low precision
            # parameter dtype (fp16).
            fsdp_model(inp).sum().backward()
            self._assert_grad_dtypes(fsdp_model, torch.float16)
            fsdp_model(inp).sum().backward()
            self._assert_grad_dtypes(fsdp_model, torch.float16)
        # The backward outside `no_sync()` casts them to full precision for the
        # optimizer step.
        fsdp_model(inp).sum().backward()
        self._assert_grad_dtypes(fsdp_model, torch.float32)

    def _assert_grad_dtypes(self, model: nn.Module, dtype: torch.dtype) -> None:
        for param in model.parameters():
            if param.grad is not None:
                self.assertEqual(param.grad.dtype, dtype)


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]


class TestFSDPUseOrigParamsInit(FSDPTest):
    def test_non_uniform_requires_grad(self) -> None:
        """Weights and frozen biases flattened into one FlatParameter keep their own
        ``requires_grad``."""
        model = nn.Sequential(
            nn.Linear(3, 3, device=self.device),
            nn.Linear(3, 3, device=self.device),
        )
        # Freeze the biases only, flattening them with the weights into one
        # `FlatParameter`: a non-uniform `requires_grad`.
        model[0].bias.requires_grad = False
        model[1].bias.requires_grad = False
        fsdp_model = FSDP(model, use_orig_params=True)
        self.assertTrue(fsdp_model[0].weight.requires_grad)
        self.assertFalse(fsdp_model[0].bias.requires_grad)
        self.assertTrue(fsdp_model[1].weight.requires_grad)
        self.assertFalse(fsdp_model[1].bias.requires_grad)


# Large enough to have triggered stack corruption.
NUM_SIZE0_TENSORS = 1000


class TestMultiTensorApply(DistributedTest):
    world_size = 1

    def test_multi_tensor_apply_size0_tensors_cpu(self) -> None:
        """``_foreach_mul_`` over many empty CPU tensors does not crash."""
        size0_tensors = [torch.empty(0, device="cpu") for _ in range(NUM_SIZE0_TENSORS)]
        # Check that this does not segfault.
        torch._foreach_mul_(size0_tensors, 0.1)

    @pytest.mark.requires_gpu("no cuda")
    def test_multi_tensor_apply_size0_tensors_cuda(self) -> None:
        """``_foreach_mul_`` over many empty CUDA tensors does not crash."""
        size0_tensors = [torch.empty(0, device=self.device) for _ in range(NUM_SIZE0_TENSORS)]
        # Check that this does not segfault.
        torch._foreach_mul_(size0_tensors, 0.1)
