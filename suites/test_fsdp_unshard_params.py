"""``summon_full_params`` (port of upstream ``test_fsdp_unshard_params.py``, the
modern home of the former ``test_fsdp_summon_full_params.py`` tests).

Each unit in scope gathers its parameters in full precision and exposes them
under their original names; ``writeback`` copies changes back to the shards
(``NO_SHARD`` without offloading exposes the real storage, so changes persist
anyway); ``rank0_only`` keeps other ranks sharded; ``offload_to_cpu`` exposes
CPU copies; ``with_grads`` (``use_orig_params`` only) gathers the gradients
too. A unit whose unsharded parameter forward kept keeps it, except under
parameter mixed precision. Summoning inside forward or backward raises.

On a CPU run torch's ``offload_to_cpu=True`` frees the storage of the
parameters it exposes (``Tensor.cpu()`` of a CPU tensor is not a copy), so
those configurations are skipped for ``--fsdp-impl torch`` on the CPU
(``TORCH_OFFLOAD_TO_CPU_ON_CPU``); ours exposes a copy there too.
"""

from __future__ import annotations

import contextlib
import itertools
import math
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from fsdptest import FSDPTest
from fsdptest.api import (
    ADAPTER,
    FLAT_PARAM,
    FSDP,
    CPUOffload,
    FlatParameter,
    FlatParamHandle,
    MixedPrecision,
    ModuleWrapPolicy,
    ShardingStrategy,
    clean_tensor_name,
)
from fsdptest.interface import DeviceInitMode, FSDPInitMode
from harness import current_device
from models import NestedWrappedModule, TransformerWithSharedParams

TORCH_OFFLOAD_TO_CPU_ON_CPU = (
    "torch's summon_full_params(offload_to_cpu=True) with the CPU as compute device exposes "
    "parameters whose storage it then frees (Tensor.cpu() of a CPU tensor is no copy): reading "
    "them raises 'setStorage: ... out of bounds' or crashes the rank (SIGSEGV)"
)


def _skip_torch_offload_to_cpu_on_cpu(offload_to_cpu: bool) -> None:
    if offload_to_cpu and ADAPTER.limitations.offload_to_cpu_on_cpu:
        pytest.skip(TORCH_OFFLOAD_TO_CPU_ON_CPU)


def _fsdp_handles(module: nn.Module) -> list[FlatParamHandle]:
    """torch's ``traversal_utils._get_fsdp_handles`` for wrapper-built models."""
    return [unit._handle for unit in FSDP.fsdp_modules(module) if unit._handle is not None]


def _ddp(module: nn.Module) -> DDP:
    device = current_device()
    return DDP(module, device_ids=[device.index]) if device.type == "cuda" else DDP(module)


class TestUnshardParamsBase(FSDPTest):
    """What the sharded and the unsharded (world size 1) cases share."""

    def _test_unshard_params_writeback(
        self, writeback: bool, check_outer: bool, **fsdp_kwargs: Any
    ) -> None:
        model = nn.Sequential(
            nn.Linear(5, 5, bias=False, device=self.device),
            nn.Linear(5, 3, bias=False, device=self.device),
        )
        model[0] = FSDP(model[0], **fsdp_kwargs)
        model = FSDP(model, **fsdp_kwargs)
        uses_sharded_strategy = model.sharding_strategy != ShardingStrategy.NO_SHARD
        offloading_params = model.cpu_offload.offload_params

        # `.parameters()` is depth-first: the root's own parameter comes first.
        outer_param = next(model.parameters())
        inner_param = next(model[0].parameters())
        param_to_check = outer_param if check_outer else inner_param

        # A known value in every element of the *sharded* parameter ...
        with torch.no_grad():
            param_to_check.zero_()
            param_to_check += self.rank + 2
        # ... and zeros written to the *unsharded* parameters.
        with FSDP.summon_full_params(model, writeback=writeback), torch.no_grad():
            for param in model.parameters():
                param.zero_()

        # Whether the zeros persisted, read at the first element of the shard.
        param_elem_to_check = param_to_check[0]
        if param_elem_to_check.numel() > 1:
            # use_orig_params with NO_SHARD keeps the 2-D shape.
            param_elem_to_check = param_elem_to_check[0]
        if writeback or (not uses_sharded_strategy and not offloading_params):
            # Without sharding or offloading the exposed storage is the real
            # one, so writes persist whatever `writeback` says.
            self.assertEqual(param_elem_to_check, 0)
        else:
            self.assertEqual(param_elem_to_check, self.rank + 2)
        if offloading_params:
            for param in model.parameters():
                self.assertEqual(param.device, torch.device("cpu"))

    def _get_test_unshard_params_writeback_config(self) -> dict[str, list[Any]]:
        return {
            "writeback": [True, False],
            "check_outer": [True, False],
            "mixed_precision": [MixedPrecision(param_dtype=torch.float16), None],
            "cpu_offload": [CPUOffload(offload_params=False), CPUOffload(offload_params=True)],
            "use_orig_params": [True, False],
        }

    def _test_unshard_params_param_data(
        self,
        rank0_only: bool,
        offload_to_cpu: bool,
        cpu_offload: CPUOffload,
        mixed_precision: MixedPrecision | None,
        use_orig_params: bool,
    ) -> None:
        _skip_torch_offload_to_cpu_on_cpu(offload_to_cpu)
        local_model = NestedWrappedModule.init(
            self.process_group,
            FSDPInitMode.NO_FSDP,
            DeviceInitMode.BEFORE,
            fsdp_kwargs={"device_id": self.device},
            deterministic=True,
        )
        # No FSDP at the top: several FSDP roots (checked below).
        fsdp_model = NestedWrappedModule.init(
            self.process_group,
            FSDPInitMode.RECURSIVE,
            DeviceInitMode.BEFORE,
            fsdp_kwargs={
                "cpu_offload": cpu_offload,
                "mixed_precision": mixed_precision,
                "use_orig_params": use_orig_params,
            },
            deterministic=True,
        )
        self.assertFalse(isinstance(fsdp_model, FSDP))
        # The parameters no unit manages.
        non_fsdp_managed_param_names = {
            "module.0.weight",
            "module.0.bias",
            "module.3.weight",
            "module.3.bias",
        }
        with FSDP.summon_full_params(
            fsdp_model,
            rank0_only=rank0_only,
            writeback=not rank0_only,
            offload_to_cpu=offload_to_cpu,
        ):
            if not rank0_only or self.rank == 0:
                for p1, (n2, p2) in zip(local_model.parameters(), fsdp_model.named_parameters()):
                    self.assertEqual(p1.shape, p2.shape)
                    if offload_to_cpu and clean_tensor_name(n2) not in non_fsdp_managed_param_names:
                        self.assertEqual(torch.device("cpu"), p2.device)
                    else:
                        self.assertEqual(p1.device, p2.device)
                    # Full precision, whatever the mixed precision.
                    self.assertEqual(p1.dtype, p2.dtype)
                    self.assertEqual(p1, p2)
                    self.assertTrue(isinstance(p2, nn.Parameter))
            else:
                # Other ranks stay sharded: each flat parameter has its sharded size.
                for handle in _fsdp_handles(fsdp_model):
                    if handle.uses_sharded_strategy:
                        self.assertEqual(handle.flat_param.shape, handle.flat_param._sharded_size)
                    else:
                        self.assertEqual(
                            handle.flat_param.shape, handle.flat_param._unpadded_unsharded_size
                        )
        # Summoning initialised each top-level unit as a root of its own.
        num_fsdp_roots = sum(bool(unit._is_root) for unit in FSDP.fsdp_modules(fsdp_model))
        self.assertGreater(num_fsdp_roots, 1)

    def _get_test_unshard_params_param_data_config(self) -> dict[str, list[Any]]:
        return {
            "rank0_only": [False, True],
            "offload_to_cpu": [False, True],
            "cpu_offload": [CPUOffload(offload_params=False), CPUOffload(offload_params=True)],
            "mixed_precision": [MixedPrecision(param_dtype=torch.float16), None],
            "use_orig_params": [True, False],
        }


def _two_level_model(device: torch.device, **fsdp_kwargs: Any) -> nn.Module:
    """FSDP(Sequential(FSDP(Linear(5, 5)), Linear(5, 3))), without biases."""
    return FSDP(
        nn.Sequential(
            FSDP(nn.Linear(5, 5, bias=False, device=device), **fsdp_kwargs),
            nn.Linear(5, 3, bias=False, device=device),
        ),
        **fsdp_kwargs,
    )


class TestUnshardParams(TestUnshardParamsBase):
    world_size = 2

    def test_unshard_params_writeback(self) -> None:
        """``writeback`` decides whether changes persist (other arguments default)."""
        self.run_subtests(
            self._get_test_unshard_params_writeback_config(),
            self._test_unshard_params_writeback,
        )

    def test_unshard_params_param_data(self) -> None:
        """Parameters of a non-FSDP root are exposed correctly for every argument
        combination (``recurse=True``)."""
        self.run_subtests(
            self._get_test_unshard_params_param_data_config(),
            self._test_unshard_params_param_data,
        )

    def test_unshard_singleton_param_writeback(self) -> None:
        """``writeback=True`` of a one-element parameter: writes to padding do not persist."""
        model = FSDP(nn.Linear(1, 1, bias=False, device=self.device))
        flat_param = model._handle.flat_param
        self.assertEqual(1, flat_param.numel())
        # A known value in the *sharded* flat parameter (padding on ranks other than 0).
        with torch.no_grad():
            flat_param[0] = self.rank + 2
        with FSDP.summon_full_params(model, writeback=True):
            self.assertEqual(1, flat_param.numel())
            with torch.no_grad():
                flat_param.zero_()
        # Not strictly required for correctness: padding keeps its value.
        if self.rank == 0:
            self.assertEqual(0, flat_param[0])
        else:
            self.assertEqual(self.rank + 2, flat_param[0])

    def test_unshard_params_respects_reshard(self) -> None:
        """Summoning keeps the reshard state forward and backward left (the root
        keeps its unsharded parameter after forward), except under mixed
        precision, whose full-precision summon frees the low-precision copy."""
        self.run_subtests(
            {
                "rank0_only": [False, True],
                "offload_to_cpu": [False, True],
                "mixed_precision": [MixedPrecision(param_dtype=torch.float16), None],
                "use_orig_params": [False, True],
            },
            self._test_unshard_params_respects_reshard,
        )

    def _test_unshard_params_respects_reshard(
        self,
        rank0_only: bool,
        offload_to_cpu: bool,
        mixed_precision: MixedPrecision | None,
        use_orig_params: bool,
    ) -> None:
        _skip_torch_offload_to_cpu_on_cpu(offload_to_cpu)
        model = _two_level_model(
            self.device, mixed_precision=mixed_precision, use_orig_params=use_orig_params
        )
        outer_flat_param = model._handle.flat_param
        inner_flat_param = model.module[0]._handle.flat_param
        # Uniform sharding with padding across ranks.
        expected_outer_flat_param_unsharded_numel = outer_flat_param.numel() * self.world_size

        def _get_unsharded_storage_size(flat_param: FlatParameter) -> int:
            return flat_param._full_param_padded.untyped_storage().size() // (
                flat_param._full_param_padded.element_size()
            )

        # The root keeps its unsharded parameter after forward, the inner unit
        # does not; both reshard after backward.
        output = model(torch.zeros(5, device=self.device))
        self.assertEqual(
            expected_outer_flat_param_unsharded_numel,
            _get_unsharded_storage_size(outer_flat_param),
        )
        self.assertEqual(0, _get_unsharded_storage_size(inner_flat_param))
        output.sum().backward()
        self.assertEqual(0, _get_unsharded_storage_size(outer_flat_param))
        self.assertEqual(0, _get_unsharded_storage_size(inner_flat_param))

        # Summoning between forward and backward, and after backward, keeps that.
        output = model(torch.zeros(5, device=self.device))
        with FSDP.summon_full_params(
            model,
            rank0_only=rank0_only,
            writeback=not rank0_only,
            offload_to_cpu=offload_to_cpu,
        ):
            pass
        if mixed_precision is not None:
            # The full-precision summon invalidates the low-precision unsharded
            # copy (it would not see changes made in the summon).
            expected_outer_flat_param_unsharded_numel = 0
        self.assertEqual(
            expected_outer_flat_param_unsharded_numel,
            _get_unsharded_storage_size(outer_flat_param),
        )
        self.assertEqual(0, _get_unsharded_storage_size(inner_flat_param))
        output.sum().backward()
        with FSDP.summon_full_params(
            model,
            rank0_only=rank0_only,
            writeback=not rank0_only,
            offload_to_cpu=offload_to_cpu,
        ):
            pass
        self.assertEqual(0, _get_unsharded_storage_size(outer_flat_param))
        self.assertEqual(0, _get_unsharded_storage_size(inner_flat_param))

    def test_unshard_params_recurse(self) -> None:
        """``recurse`` decides whether nested units are summoned too."""
        self.run_subtests(
            {
                "recurse": [False, True],
                "unshard_outer": [False, True],
                "mixed_precision": [MixedPrecision(param_dtype=torch.float16), None],
                "use_orig_params": [False, True],
            },
            self._test_unshard_params_recurse,
        )

    def _test_unshard_params_recurse(
        self,
        recurse: bool,
        unshard_outer: bool,
        mixed_precision: MixedPrecision | None,
        use_orig_params: bool,
    ) -> None:
        model = _two_level_model(
            self.device, mixed_precision=mixed_precision, use_orig_params=use_orig_params
        )
        unsharded_inner_numel = 5 * 5
        unsharded_outer_numel = 5 * 3
        if use_orig_params:
            # One original parameter per flat parameter: padding only for
            # divisibility by the world size, none for alignment.
            unsharded_inner_numel = _round_up(unsharded_inner_numel, self.world_size)
            unsharded_outer_numel = _round_up(unsharded_outer_numel, self.world_size)
        sharded_inner_numel = math.ceil(unsharded_inner_numel / self.world_size)
        sharded_outer_numel = math.ceil(unsharded_outer_numel / self.world_size)
        inner_flat_param = model.module[0]._handle.flat_param
        outer_flat_param = model._handle.flat_param
        self.assertEqual(sharded_inner_numel, inner_flat_param.numel())
        self.assertEqual(sharded_outer_numel, outer_flat_param.numel())
        expected_outer_numel = unsharded_outer_numel if unshard_outer else sharded_outer_numel
        expected_inner_numel = (
            unsharded_inner_numel if recurse or not unshard_outer else sharded_inner_numel
        )
        module_to_unshard = model if unshard_outer else model[0]
        with FSDP.summon_full_params(module_to_unshard, recurse=recurse):
            self.assertEqual(expected_outer_numel, outer_flat_param.numel())
            self.assertEqual(expected_inner_numel, inner_flat_param.numel())

    def test_named_parameters_and_buffers(self) -> None:
        """Inside a summon a top-level FSDP model names its parameters and buffers
        like the unwrapped module."""
        self.run_subtests(
            {"prefix": ["", "test_prefix"], "recurse": [False, True]},
            self._test_named_parameters_and_buffers,
        )

    def _test_named_parameters_and_buffers(self, prefix: str, recurse: bool) -> None:
        model = NestedWrappedModule.init(
            self.process_group, FSDPInitMode.NO_FSDP, DeviceInitMode.BEFORE, deterministic=True
        )
        model.buffer = nn.Buffer(torch.ones(1))
        # FSDP at the top: a non-FSDP root would keep FSDP prefixes in the names.
        fsdp_model = FSDP(
            NestedWrappedModule.init(
                self.process_group,
                FSDPInitMode.NO_FSDP,
                DeviceInitMode.BEFORE,
                deterministic=True,
            ),
            self.process_group,
        )
        fsdp_model.buffer = nn.Buffer(torch.ones(1))
        with FSDP.summon_full_params(fsdp_model):
            for call in ["named_parameters", "named_buffers"]:
                for (n1, p1), (n2, p2) in itertools.zip_longest(
                    getattr(fsdp_model, call)(prefix=prefix, recurse=recurse),
                    getattr(model, call)(prefix=prefix, recurse=recurse),
                ):
                    self.assertEqual(n1, n2)
                    self.assertEqual(p1, p2)

    def test_with_grads_core(self) -> None:
        """``with_grads=True`` gathers DDP's gradients; edits persist with
        ``writeback`` (or NO_SHARD without offloading)."""
        self.run_subtests(
            {
                "writeback": [False, True],
                "offload_to_cpu": [False, True],
                "sharding_strategy": [
                    ShardingStrategy.FULL_SHARD,
                    ShardingStrategy.SHARD_GRAD_OP,
                    ShardingStrategy.NO_SHARD,
                ],
                "use_orig_params": [True],
            },
            self._test_with_grads_core,
        )

    def _test_with_grads_core(
        self,
        writeback: bool,
        offload_to_cpu: bool,
        sharding_strategy: ShardingStrategy,
        use_orig_params: bool,
    ) -> None:
        writeback_factor = 2

        def _check_grads(
            ddp_model: DDP, fsdp_model: nn.Module, old_fsdp_grads: list[torch.Tensor] | None
        ) -> None:
            """Edits of the gathered gradients persist or not; the gathered
            values equal DDP's."""
            with FSDP.summon_full_params(
                fsdp_model, writeback=writeback, offload_to_cpu=offload_to_cpu, with_grads=True
            ):
                for (n1, p1), (n2, p2) in zip(
                    ddp_model.module.named_parameters(), fsdp_model.named_parameters()
                ):
                    self.assertEqual(n1, clean_tensor_name(n2))
                    assert p1.grad is not None
                    torch.testing.assert_close(p1.grad, p2.grad)
                    # Not all zeros, or the edit below would prove nothing.
                    assert torch.count_nonzero(p2.grad) > 0
                    p2.grad *= writeback_factor
            new_fsdp_grads = [p.grad for p in fsdp_model.parameters() if p.grad is not None]
            writeback_persists = writeback or (
                sharding_strategy == ShardingStrategy.NO_SHARD and not offload_to_cpu
            )
            assert old_fsdp_grads is not None
            for old_grad, new_grad in zip(old_fsdp_grads, new_fsdp_grads):
                if writeback_persists:
                    torch.testing.assert_close(old_grad * writeback_factor, new_grad)
                else:
                    torch.testing.assert_close(old_grad, new_grad)
            if writeback_persists:
                # The same edit on DDP's gradients keeps them comparable.
                for param in ddp_model.parameters():
                    param.grad *= writeback_factor

        def _get_error_context(is_supported: bool) -> contextlib.AbstractContextManager[Any]:
            # Some configurations are not implemented.
            if is_supported:
                return contextlib.nullcontext()
            return self.assertRaises(NotImplementedError)

        def _get_fsdp_grads(fsdp_model: nn.Module, is_supported: bool) -> list[torch.Tensor]:
            if not is_supported:
                return []  # unused
            return [p.grad.clone() for p in fsdp_model.parameters() if p.grad is not None]

        is_supported = use_orig_params and not offload_to_cpu
        model = TransformerWithSharedParams.init(
            self.process_group, FSDPInitMode.NO_FSDP, DeviceInitMode.BEFORE, deterministic=True
        )
        ddp_model = _ddp(model)
        fsdp_model = TransformerWithSharedParams.init(
            self.process_group,
            FSDPInitMode.RECURSIVE,
            DeviceInitMode.BEFORE,
            deterministic=True,
            fsdp_kwargs={
                "use_orig_params": use_orig_params,
                "sharding_strategy": sharding_strategy,
                "device_id": self.device,
            },
        )
        with FSDP.summon_full_params(fsdp_model):
            for p1, p2 in zip(ddp_model.module.parameters(), fsdp_model.parameters()):
                assert torch.all(torch.isclose(p1, p2))

        # After backward.
        inp = fsdp_model.get_input(self.device)
        ddp_out = ddp_model(*inp)
        fsdp_out = fsdp_model(*inp)
        ddp_out.sum().backward()
        fsdp_out.sum().backward()
        old_fsdp_grads = _get_fsdp_grads(fsdp_model, is_supported)
        with _get_error_context(is_supported):
            _check_grads(ddp_model, fsdp_model, old_fsdp_grads)

        # Between forward and backward.
        inp = fsdp_model.get_input(self.device)
        ddp_out = ddp_model(*inp)
        fsdp_out = fsdp_model(*inp)
        old_fsdp_grads = _get_fsdp_grads(fsdp_model, is_supported)
        with _get_error_context(is_supported):
            _check_grads(ddp_model, fsdp_model, old_fsdp_grads)

    def test_with_grads_none_grads(self) -> None:
        """When no rank has a gradient, every original parameter's ``.grad`` is None."""
        self.run_subtests(
            {
                "sharding_strategy": [
                    ShardingStrategy.FULL_SHARD,
                    ShardingStrategy.SHARD_GRAD_OP,
                    ShardingStrategy.NO_SHARD,
                ]
            },
            self._test_with_grads_none_grads,
        )

    def _test_with_grads_none_grads(self, sharding_strategy: ShardingStrategy) -> None:
        fsdp_model = TransformerWithSharedParams.init(
            self.process_group,
            FSDPInitMode.RECURSIVE,
            DeviceInitMode.BEFORE,
            deterministic=True,
            fsdp_kwargs={
                "use_orig_params": True,
                "sharding_strategy": sharding_strategy,
                "device_id": self.device,
            },
        )
        for fsdp_module in FSDP.fsdp_modules(fsdp_model):
            if fsdp_module._handle:
                assert fsdp_module._handle.flat_param.grad is None
        with FSDP.summon_full_params(fsdp_model, with_grads=True):
            for param in fsdp_model.parameters():
                self.assertTrue(param.grad is None)

    def test_unshard_submodule(self) -> None:
        """Summoning a child unit exposes its original parameters, not its flat one."""
        model = nn.Sequential(
            nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16)),
            nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16)),
        ).to(self.device)
        model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy((nn.Sequential,)))
        with FSDP.summon_full_params(model[0]):
            for param_name, _ in model[0].named_parameters():
                self.assertFalse(FLAT_PARAM in param_name)
            self.assertGreater(len(list(model[0].parameters())), 1)


def _round_up(numel: int, multiple: int) -> int:
    return numel + (-numel) % multiple


class TestUnshardParamsNoShard(TestUnshardParamsBase):
    world_size = 1

    def test_unshard_params_writeback_no_shard(self) -> None:
        """``writeback`` at world size 1 (NO_SHARD)."""
        self.run_subtests(
            self._get_test_unshard_params_writeback_config(),
            self._test_unshard_params_writeback,
        )

    def test_unshard_params_param_data_no_shard(self) -> None:
        """Parameter data at world size 1; ``offload_to_cpu`` is not supported
        with NO_SHARD (see ``test_offload_to_cpu_no_shard_raises``)."""
        config = self._get_test_unshard_params_param_data_config()
        config["offload_to_cpu"] = [False]
        self.run_subtests(config, self._test_unshard_params_param_data)


class TestUnshardParamsErrors(TestUnshardParamsBase):
    world_size = 2

    def test_unshard_params_from_forward_raises(self) -> None:
        """Summoning inside forward raises."""

        class MyModule(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.a = nn.Parameter(torch.zeros(5))

            def forward(self, fsdp_module: nn.Module) -> None:
                with fsdp_module.summon_full_params(fsdp_module):
                    pass

        model = FSDP(MyModule()).to(self.device)
        with self.assertRaisesRegex(
            AssertionError, "Cannot manually unshard parameters during forward/backward"
        ):
            model(model)

    def test_unshard_params_from_backward_raises(self) -> None:
        """Summoning inside backward raises."""
        model = FSDP(nn.Linear(2, 1, device=self.device))
        output = model(torch.ones(2, device=self.device))

        def invalid_backward_hook(*args: Any, **kwargs: Any) -> None:
            with FSDP.summon_full_params(model):
                pass

        self.assertTrue(output.requires_grad)
        output.register_hook(invalid_backward_hook)
        with self.assertRaisesRegex(
            AssertionError, "Cannot manually unshard parameters during forward/backward"
        ):
            output.backward()

    def test_rank0_only_with_writeback_raises(self) -> None:
        """``rank0_only`` with ``writeback`` raises."""
        nested_wrapped_module = NestedWrappedModule.init(
            self.process_group, FSDPInitMode.RECURSIVE, DeviceInitMode.BEFORE
        )
        with self.assertRaisesRegex(NotImplementedError, "is not supported"):
            with FSDP.summon_full_params(nested_wrapped_module, rank0_only=True, writeback=True):
                pass

    def test_offload_to_cpu_no_shard_raises(self) -> None:
        """With NO_SHARD, ``rank0_only`` with ``writeback`` raises too (as upstream
        wrote it, this re-tests that combination rather than ``offload_to_cpu``)."""
        nested_wrapped_module = NestedWrappedModule.init(
            self.process_group,
            FSDPInitMode.RECURSIVE,
            DeviceInitMode.BEFORE,
            {"sharding_strategy": ShardingStrategy.NO_SHARD},
        )
        with self.assertRaisesRegex(NotImplementedError, "is not supported"):
            with FSDP.summon_full_params(nested_wrapped_module, rank0_only=True, writeback=True):
                pass
