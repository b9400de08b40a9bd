"""Construction rules and assorted runtime behaviour (port of upstream ``test_fsdp_misc.py``).

[Note: Devices on a CPU run]
Upstream runs on accelerators, where ``device_id`` is an index or an indexed
device and a module left on the CPU is a mistake worth a warning. On a CPU run
the CPU is the compute device, so:

- an integer ``device_id`` names an accelerator index (``torch.device(0)`` is an
  accelerator): the ``use_index`` variant is skipped, and ``torch.device("cpu")``
  needs no index, so FSDP gives no "explicit index" warning for it;
- a CPU module is where it should be: no "passed-in `module` is on CPU" warning;
- checks that tell the CPU apart from an accelerator (a module on both, the
  parameter-device checks of lazy initialisation) need an accelerator
  (``requires_gpu``): a CPU run has no wrong device to put parameters on
  (``.to("meta")`` replaces the registered flat parameter instead of moving it,
  in both implementations);
- torch's ``sync_module_states`` refuses CPU tensors whatever the compute device
  ("The module has CPU parameters or buffers when `sync_module_states=True`"),
  so on a CPU run torch's FSDP cannot use it: those tests assert that
  limitation for ``--fsdp-impl torch``, while ours broadcasts on the CPU when
  the CPU is the compute device (and raises torch's error when an accelerator is).

Upstream's ``FSDPTestMultiThread`` classes run threads over a threaded process
group; here they are ordinary multi-process classes of the same world size.
"""

from __future__ import annotations

import contextlib
import copy
import os
import re
import warnings
from collections import namedtuple
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.optim import _apply_optimizer_in_backward
from torch.nn.parallel import DistributedDataParallel as DDP

from fsdptest import FSDPTest
from fsdptest.api import (
    _FSDP_USE_FULL_PREC_IN_EVAL,
    _FSDP_USE_UNSAFE_SETATTR,
    ADAPTER,
    FSDP,
    HOMOGENEOUS_ATTR_NAMES,
    CPUOffload,
    FlatParameter,
    ModuleWrapPolicy,
    ShardingStrategy,
    always_wrap_policy,
    transformer_auto_wrap_policy,
)
from fsdptest.interface import DeviceInitMode, FSDPInitMode
from harness import parametrize
from models import NestedWrappedModule, TransformerWithSharedParams

NO_INDEX_ON_CPU = (
    "an integer device_id names an accelerator index (torch.device(0) is an accelerator); "
    "a CPU run has none"
)
NEEDS_ACCELERATOR = (
    "tells the CPU apart from an accelerator device (a CPU run has one device, the CPU)"
)
TORCH_SYNC_MODULE_STATES_ON_CPU = (
    "The module has CPU parameters or buffers when `sync_module_states=True`"
)


def _torch_cannot_sync_on(device: torch.device) -> bool:
    """See [Note: Devices on a CPU run]."""
    return ADAPTER.limitations.needs_accelerator and device.type == "cpu"


class MyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(2, 2)
        self.b = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x + y))


class MLP(nn.Module):
    """common_fsdp's ``MLP``: in_proj (dim -> 4 dim), relu, out_proj, relu."""

    def __init__(self, dim: int, device: torch.device | None = None) -> None:
        super().__init__()
        self.in_proj = nn.Linear(dim, 4 * dim, device=device)
        self.out_proj = nn.Linear(4 * dim, dim, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.out_proj(F.relu(self.in_proj(x))))


def _assert_module_states(
    test: FSDPTest, model: nn.Module, equal: bool, group: dist.ProcessGroup
) -> None:
    """common_fsdp's ``_assert_module_states``: every rank's parameters and buffers
    against rank 0's, equal or not equal (gathered as tensors: the object
    collectives need numpy, which this environment lacks)."""
    tensors = [t.detach() for _, t in model.named_parameters()]
    tensors += [t.detach() for _, t in model.named_buffers()]
    # On the rank's device (a CPU module too): NCCL gathers device tensors only.
    local = torch.cat([t.reshape(-1).float() for t in tensors]).to(test.device)
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, local, group=group)
    sizes = [t.numel() for t in tensors]
    for other in gathered[1:]:
        for ref, tensor in zip(gathered[0].split(sizes), other.split(sizes), strict=True):
            if equal:
                test.assertEqual(ref, tensor)
            else:
                test.assertNotEqual(ref, tensor)


def _device_of_index(device: torch.device) -> torch.device:
    """``device`` with its index made explicit (the CPU has none)."""
    if device.type == "cpu":
        return device
    return torch.device(device.type, device.index)


class TestFSDPMiscMultiProcess(FSDPTest):
    world_size = 2

    @pytest.mark.parametrize(
        "use_index",
        # Decided before any rank starts (a skip inside the ranks must reach the
        # controller from every rank within the fail-grace).
        [pytest.param(True, marks=pytest.mark.requires_gpu(NO_INDEX_ON_CPU)), False],
        ids=["True", "False"],
    )
    def test_fsdp_device_id(self, use_index: bool) -> None:
        """``device_id`` moves a CPU module to the device, accepts a module already
        there, and a device without an index means the current device."""
        dev_id: int | torch.device = self.device.index if use_index else self.device

        def _check_device_matches(module: nn.Module, device_id: int | torch.device) -> None:
            devices = {p.device for p in module.parameters() if isinstance(p, FlatParameter)}
            assert len(devices) > 0
            self.assertEqual(1, len(devices))
            found = devices.pop()
            expected = (
                torch.device(self.device.type, device_id)
                if isinstance(device_id, int)
                else device_id
            )
            self.assertEqual(expected, found)

        # A CPU module is moved to the device.
        nested = NestedWrappedModule.init(
            self.process_group,
            FSDPInitMode.RECURSIVE,
            DeviceInitMode.NEVER,
            fsdp_kwargs={"device_id": dev_id},
        )
        _check_device_matches(nested, dev_id)
        # A module already on the device with the same device_id raises nothing.
        nested = NestedWrappedModule.init(
            self.process_group,
            FSDPInitMode.RECURSIVE,
            DeviceInitMode.BEFORE,
            fsdp_kwargs={"device_id": dev_id},
        )
        _check_device_matches(nested, dev_id)
        # A device without an index means the current device (with a warning on
        # an accelerator; the CPU needs no index).
        no_index = torch.device(self.device.type)
        kwargs = {"device_id": no_index}
        if self.device.type == "cpu":
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                nested = NestedWrappedModule.init(
                    self.process_group,
                    FSDPInitMode.RECURSIVE,
                    DeviceInitMode.BEFORE,
                    fsdp_kwargs=kwargs,
                )
            self.assertFalse(any("explicit index" in str(w.message) for w in caught))
        else:
            with self.assertWarnsRegex(UserWarning, "does not have an explicit index"):
                nested = NestedWrappedModule.init(
                    self.process_group,
                    FSDPInitMode.RECURSIVE,
                    DeviceInitMode.BEFORE,
                    fsdp_kwargs=kwargs,
                )
        _check_device_matches(nested, _device_of_index(self.device))

    def test_fsdp_zero2_eval_with_prefetch(self) -> None:
        """SHARD_GRAD_OP with forward prefetch trains, evaluates under no_grad and
        trains again like DDP (and FSDP consumes no random numbers: dropout agrees)."""

        class Mnist(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.conv1 = nn.Conv2d(1, 32, 3, 1)
                self.conv2 = nn.Conv2d(32, 64, 3, 1)
                self.dropout1 = nn.Dropout(0.25)
                self.dropout2 = nn.Dropout(0.5)
                self.fc1 = nn.Linear(9216, 128)
                self.fc2 = nn.Linear(128, 10)
                self.ln = nn.LayerNorm(9216)

            def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
                x = F.relu(self.conv1(x))
                x = F.relu(self.conv2(x))
                x = F.max_pool2d(x, 2)
                x = self.dropout1(x)
                x = torch.flatten(x, 1)
                x = self.ln(x)
                x = F.relu(self.fc1(x))
                x = self.dropout2(x)
                output = F.log_softmax(self.fc2(x), dim=1)
                return F.cross_entropy(output, y)

        # Every rank builds the same models (the harness seeds every rank alike).
        model = Mnist().to(self.device)
        model1 = Mnist().to(self.device)
        model1.load_state_dict(model.state_dict())
        fsdp_model = FSDP(
            model,
            sharding_strategy=ShardingStrategy.SHARD_GRAD_OP,
            forward_prefetch=True,
            use_orig_params=True,
            auto_wrap_policy=ModuleWrapPolicy([nn.Linear, nn.Conv2d]),
        )
        ddp_model = DDP(model1)
        fsdp_opt = torch.optim.SGD(fsdp_model.parameters(), lr=1e-4)
        ddp_opt = torch.optim.SGD(ddp_model.parameters(), lr=1e-4)

        def seed(value: int) -> None:
            torch.manual_seed(value)
            if self.device.type == "cuda":
                torch.cuda.manual_seed(value)

        def train_iters() -> None:
            for i in range(5):
                x = torch.randn(8, 1, 28, 28, device=self.device).requires_grad_()
                y = torch.randint(low=0, high=9, size=(8,), device=self.device)
                losses = []
                grads = []
                for m, opt in ((fsdp_model, fsdp_opt), (ddp_model, ddp_opt)):
                    # The same dropout masks: FSDP must consume no random numbers.
                    seed(self.rank + i)
                    loss = m(x, y).sum()
                    losses.append(loss)
                    loss.backward()
                    opt.step()
                    grads.append(x.grad)
                    opt.zero_grad()
                self.assertTrue(torch.allclose(losses[0], losses[1]), msg=f"{losses}")
                self.assertTrue(torch.allclose(grads[0], grads[1]))

        seed(self.rank + 20231010)
        train_iters()
        with torch.no_grad():
            fsdp_model.eval()
            ddp_model.eval()
            for _ in range(5):
                x = torch.randn(8, 1, 28, 28, device=self.device).requires_grad_()
                y = torch.randint(low=0, high=9, size=(8,), device=self.device)
                fsdp_loss = fsdp_model(x, y)
                ddp_loss = ddp_model(x, y)
                self.assertTrue(torch.allclose(fsdp_loss, ddp_loss))
        fsdp_model.train()
        ddp_model.train()
        train_iters()

    @parametrize("use_second_layer", [True, False])
    @parametrize("sharding_strategy", [ShardingStrategy.NO_SHARD, None])
    def test_fsdp_module_no_compute_grad(
        self, use_second_layer: bool, sharding_strategy: ShardingStrategy | None
    ) -> None:
        """A unit whose output is unused (or that never runs) keeps a None
        gradient and does not block the backward."""

        class MyModel(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.a = nn.Linear(10, 10)
                self.b = nn.Linear(10, 10)

            def forward(self, x: torch.Tensor, y: torch.Tensor) -> Any:
                out1 = self.a(x)
                if use_second_layer:
                    return out1, self.b(y)
                return out1

        fsdp = FSDP(
            MyModel().to(self.device),
            sharding_strategy=sharding_strategy,
            auto_wrap_policy=always_wrap_policy,
        )
        x = torch.randn(10, 10, device=self.device)
        y = torch.randn(10, 10, device=self.device)
        for _ in range(4):
            if use_second_layer:
                a, _ = fsdp(x, y)
            else:
                a = fsdp(x, y)
            loss = a.sum()
            loss.backward()
            # self.a receives a gradient, self.b does not.
            a_grad = fsdp.module.a._handle.flat_param.grad
            b_grad = fsdp.module.b._handle.flat_param.grad
            self.assertIsNotNone(a_grad)
            self.assertIsNone(b_grad)

    def test_fsdp_not_all_outputs_used_in_loss(self) -> None:
        """A root whose second output stops being used in the loss still reshards
        after backward and trains like the local model."""
        self.run_subtests(
            {
                "sharding_strategy": [
                    ShardingStrategy.FULL_SHARD,
                    ShardingStrategy.SHARD_GRAD_OP,
                    ShardingStrategy.NO_SHARD,
                ]
            },
            self._test_fsdp_not_all_outputs_used_in_loss,
        )

    def _test_fsdp_not_all_outputs_used_in_loss(self, sharding_strategy: ShardingStrategy) -> None:
        class MyModule(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.lin1 = nn.Linear(4, 4)
                self.lin2 = nn.Linear(4, 4)

            def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                return self.lin1(x), self.lin2(x)

        def _check_resharded(fsdp_module: nn.Module) -> None:
            handle = fsdp_module._handle
            if not handle:
                return
            param = handle.flat_param
            if handle.uses_sharded_strategy:
                full_param = param._full_param_padded
                self.assertEqual(full_param.untyped_storage().size(), 0)
            self.assertEqual(param.data_ptr(), param._local_shard.data_ptr())

        torch.manual_seed(0)
        m = MyModule().to(self.device)
        local = copy.deepcopy(m)
        m.lin1 = FSDP(m.lin1, sharding_strategy=sharding_strategy)
        m = FSDP(m, sharding_strategy=sharding_strategy)
        opt = torch.optim.SGD(m.parameters(), lr=1e-3)
        local_opt = torch.optim.SGD(local.parameters(), lr=1e-3)
        for i in range(6):
            t = torch.ones(4, device=self.device)
            a, b = m(t)
            local_a, local_b = local(t)
            if i < 2:
                # Both outputs are used in the loss for the first two iterations.
                loss = (a @ b).sum()
                loss_local = (local_a @ local_b).sum()
            else:
                # lin2's output is unused from the third iteration on.
                loss = a.sum()
                loss_local = local_a.sum()
            loss.backward()
            loss_local.backward()
            _check_resharded(m)
            opt.step()
            local_opt.step()
            with FSDP.summon_full_params(m):
                local_params = list(local.parameters())
                fsdp_params = list(m.parameters())
                self.assertEqual(len(local_params), len(fsdp_params))
                changed = False
                for p, q in zip(local_params, fsdp_params):
                    torch.testing.assert_close(p, q)
                    changed |= bool(torch.any(p.detach() != 0))
                self.assertTrue(changed)
            opt.zero_grad()
            local_opt.zero_grad()
        dist.barrier()

    def test_fsdp_optim_overlap_no_use_orig_params_error(self) -> None:
        """Optimizers in backward need ``use_orig_params=True``: the first forward raises."""
        fsdp_overlap = FSDP(
            MyModel().to(self.device),
            auto_wrap_policy=always_wrap_policy,
            use_orig_params=False,
        )
        _apply_optimizer_in_backward(
            optimizer_class=torch.optim.SGD,
            params=fsdp_overlap.parameters(),
            optimizer_kwargs={"lr": 0.03},
            register_hook=False,
        )
        inp = torch.randn(10, 10, device=self.device)
        with self.assertRaisesRegex(RuntimeError, "only supported with use_orig_params=True"):
            fsdp_overlap(inp, inp)

    def test_fsdp_optimizer_overlap(self) -> None:
        """Optimizers applied in backward step each parameter like an optimizer after
        backward, and leave no gradient behind."""
        torch.manual_seed(0)
        for cpu_offload in [True, False]:
            if cpu_offload and ADAPTER.limitations.cpu_offload_on_cpu:
                continue  # torch cannot offload parameters without an accelerator
            offload = CPUOffload(offload_params=cpu_offload)
            model = MyModel().to(self.device)
            model_overlap = copy.deepcopy(model)
            fsdp = FSDP(
                model,
                auto_wrap_policy=always_wrap_policy,
                use_orig_params=True,
                cpu_offload=offload,
            )
            fsdp_overlap = FSDP(
                model_overlap,
                auto_wrap_policy=always_wrap_policy,
                use_orig_params=True,
                cpu_offload=offload,
            )
            optim = torch.optim.SGD(fsdp.parameters(), lr=0.03)
            _apply_optimizer_in_backward(
                torch.optim.SGD,
                fsdp_overlap.parameters(),
                optimizer_kwargs={"lr": 0.03},
                register_hook=False,
            )
            for p in fsdp_overlap.parameters():
                assert hasattr(p, "_in_backward_optimizers")
            for p1, p2 in zip(fsdp.parameters(), fsdp_overlap.parameters()):
                self.assertEqual(p1, p2)
            with FSDP.summon_full_params(fsdp_overlap):
                fsdp_overlap_prev_params = [
                    (n, p.clone()) for n, p in fsdp_overlap.named_parameters()
                ]
            for _ in range(6):
                inp = torch.randn(2, 2, device=self.device)
                with torch.no_grad():
                    inp_clone = inp.clone()
                fsdp(inp, inp).sum().backward()
                fsdp_overlap(inp_clone, inp_clone).sum().backward()
                optim.step()
                optim.zero_grad()
                # The overlapped optimizers stepped and freed the gradients.
                for fsdp_unit in FSDP.fsdp_modules(fsdp_overlap):
                    handle = fsdp_unit._handle
                    if handle:
                        self.assertIsNone(
                            handle.sharded_grad, "Overlapped FSDP sharded_grad is not None!"
                        )
                # The parameters changed since the last iteration.
                with FSDP.summon_full_params(fsdp_overlap, with_grads=True):
                    for (n, p), (n_prev, p_prev) in zip(
                        fsdp_overlap.named_parameters(), fsdp_overlap_prev_params
                    ):
                        self.assertNotEqual(p, p_prev, msg=f"{n_prev} Params not updated")
                        self.assertEqual(n, n_prev)
                with FSDP.summon_full_params(fsdp_overlap):
                    fsdp_overlap_prev_params = [
                        (n, p.clone()) for n, p in fsdp_overlap.named_parameters()
                    ]
                # Both models agree, and neither keeps a gradient.
                with (
                    FSDP.summon_full_params(fsdp_overlap),
                    FSDP.summon_full_params(fsdp),
                ):
                    for (n_overlap, p_overlap), (n, p) in zip(
                        fsdp_overlap.named_parameters(), fsdp.named_parameters()
                    ):
                        self.assertEqual(n_overlap, n)
                        self.assertEqual(p, p_overlap, msg=f"Params not equal at {n}")
                        self.assertIsNone(p.grad, msg=f"Expected None grad for {n}")
                        self.assertIsNone(p_overlap.grad, msg=f"Expected None grad for {n}")

    def test_fsdp_cpu_training(self) -> None:
        """FSDP trains on the CPU over a gloo group like DDP, for every strategy."""
        gloo_pg = dist.new_group(backend="gloo")
        for ss in [
            ShardingStrategy.NO_SHARD,
            ShardingStrategy.FULL_SHARD,
            ShardingStrategy.SHARD_GRAD_OP,
        ]:
            torch.manual_seed(42)
            model = MyModel()
            ref_model = DDP(copy.deepcopy(model), process_group=gloo_pg)
            model = FSDP(
                model,
                sharding_strategy=ss,
                auto_wrap_policy=always_wrap_policy,
                process_group=gloo_pg,
                device_id=torch.device("cpu"),
            )
            ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
            optim = torch.optim.Adam(model.parameters(), lr=1e-2)
            torch.manual_seed(42 + self.rank)
            inp = torch.randn(2, 2)
            for _ in range(10):
                losses = []
                for _model, _optim in ((ref_model, ref_optim), (model, optim)):
                    loss = _model(inp, inp).sum()
                    losses.append(loss)
                    loss.backward()
                    _optim.step()
                    _optim.zero_grad()
                self.assertEqual(losses[0], losses[1])

    def test_fsdp_cpu_init_stays_on_cpu(self) -> None:
        """A CPU module wrapped without ``device_id`` stays on the CPU (with a
        warning on an accelerator) and trains once moved."""
        if self.device.type == "cpu":
            # See [Note: Devices on a CPU run]: the CPU is the compute device.
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                fsdp_model = self._cpu_nested_fsdp()
            self.assertFalse(any("passed-in `module` is on CPU" in str(w.message) for w in caught))
        else:
            with self.assertWarnsRegex(UserWarning, "passed-in `module` is on CPU"):
                fsdp_model = self._cpu_nested_fsdp()
        devices = {p.device for p in fsdp_model.parameters()}
        self.assertEqual(1, len(devices))
        self.assertEqual(torch.device("cpu"), devices.pop())
        fsdp_model = fsdp_model.to(self.device)
        # Inputs on the CPU are moved to the compute device.
        inp = fsdp_model.module.get_input(device=torch.device("cpu"))
        fsdp_model(*inp).sum().backward()

    def _cpu_nested_fsdp(self) -> nn.Module:
        nested = NestedWrappedModule.init(
            self.process_group, FSDPInitMode.RECURSIVE, DeviceInitMode.NEVER
        )
        return FSDP(nested, self.process_group)

    def test_cpu_init_with_sync_module_states(self) -> None:
        """``sync_module_states`` with a CPU module needs ``device_id``; with it,
        buffers are moved and rank 0's values broadcast."""
        nested = NestedWrappedModule.init(
            self.process_group, FSDPInitMode.NO_FSDP, DeviceInitMode.NEVER
        )
        if self.device.type == "cpu" and ADAPTER.limitations.syncs_cpu_module_states:
            # The CPU is the compute device: the CPU module is synced.
            FSDP(nested, self.process_group, sync_module_states=True)
        else:
            with self.assertRaisesRegex(ValueError, TORCH_SYNC_MODULE_STATES_ON_CPU):
                FSDP(nested, self.process_group, sync_module_states=True)

        # Buffers are moved to the device and synchronized.
        nested = NestedWrappedModule.init(
            self.process_group, FSDPInitMode.NO_FSDP, DeviceInitMode.NEVER
        )
        nested.buf = nn.Buffer(torch.ones((2, 2)) * self.rank)
        nested.module[0].buf = nn.Buffer(torch.ones((3, 2)) * self.rank)
        kwargs = {
            "auto_wrap_policy": ModuleWrapPolicy({nn.Linear}),
            "device_id": self.device,
            "sync_module_states": True,
        }
        if _torch_cannot_sync_on(self.device):
            with self.assertRaisesRegex(ValueError, TORCH_SYNC_MODULE_STATES_ON_CPU):
                FSDP(nested, self.process_group, **kwargs)
            return
        nested = FSDP(nested, self.process_group, **kwargs)
        self.assertEqual(nested.buf.device, self.device)
        self.assertEqual(nested.buf, torch.zeros((2, 2), device=self.device))
        inner_buf = nested.module.module[0].buf
        self.assertEqual(inner_buf.device, self.device)
        self.assertEqual(inner_buf, torch.zeros((3, 2), device=self.device))


class TestFSDPMiscMultiThread(FSDPTest):
    world_size = 2

    def test_fsdp_namedtuple(self) -> None:
        """Every tensor of a namedtuple output gets a pre-backward hook."""

        class MyModule(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.lin = nn.Linear(100, 100)

            def forward(self, x: Any) -> Any:
                return x

        m = MyModule().to(self.device)
        fsdp = FSDP(m)
        t = torch.ones(1, device=self.device, requires_grad=True)
        MyOutputType = namedtuple("MyOutputType", ["a", "b", "c", "d"], defaults=(t, t, t, t))
        inp = MyOutputType()
        out = fsdp(inp)
        # Every output tensor has FSDP's pre-backward hook.
        for x in out:
            self.assertNotEqual([], list(x._backward_hooks.values()))

    def test_device_id_auto_wrap(self) -> None:
        """``device_id`` reaches every auto-wrapped child."""
        self.run_subtests({"use_callable": [False, True]}, self._test_device_id_auto_wrap)

    def _test_device_id_auto_wrap(self, use_callable: bool) -> None:
        module_classes = {nn.TransformerEncoderLayer, nn.TransformerDecoderLayer}
        if use_callable:

            def auto_wrap_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
                return transformer_auto_wrap_policy(
                    module, recurse, nonwrapped_numel, transformer_layer_cls=module_classes
                )

        else:
            auto_wrap_policy = ModuleWrapPolicy(module_classes)  # type: ignore[assignment]
        fsdp_kwargs = {"auto_wrap_policy": auto_wrap_policy, "device_id": self.device}
        fsdp_model = TransformerWithSharedParams.init(
            self.process_group, FSDPInitMode.RECURSIVE, DeviceInitMode.BEFORE, fsdp_kwargs
        )
        for fsdp_module in FSDP.fsdp_modules(fsdp_model):
            self.assertEqual(fsdp_module.compute_device, _device_of_index(self.device))

    def test_fsdp_device_id_cpu_offload(self) -> None:
        """With ``device_id`` and parameter offloading the shards stay on the CPU."""
        self.run_subtests({"use_orig_params": [False, True]}, self._test_fsdp_device_id_cpu_offload)

    def _test_fsdp_device_id_cpu_offload(self, use_orig_params: bool) -> None:
        class MyModel(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.seq = nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 10))
                self.lin = nn.Linear(10, 10)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return self.lin(self.seq(x))

        model = MyModel()
        model = FSDP(
            model,
            auto_wrap_policy=ModuleWrapPolicy({nn.Sequential}),
            cpu_offload=CPUOffload(offload_params=True),
            device_id=self.device,
            use_orig_params=use_orig_params,
        )
        cpu_device = torch.device("cpu")
        for fsdp_unit in FSDP.fsdp_modules(model):
            handle = fsdp_unit._handle
            if handle:
                self.assertEqual(handle.flat_param.device, cpu_device)

    @pytest.mark.requires_gpu(NEEDS_ACCELERATOR)
    def test_module_device_mismatches_device_id(self) -> None:
        """A module on another device than ``device_id`` raises (the module is not moved)."""
        context = (
            self.assertRaisesRegex(ValueError, f"cuda:{self.rank} vs cuda:0")
            if self.rank != 0
            else contextlib.nullcontext()
        )
        with context:
            NestedWrappedModule.init(
                self.process_group,
                FSDPInitMode.RECURSIVE,
                DeviceInitMode.BEFORE,
                fsdp_kwargs={"device_id": 0},
            )

    @pytest.mark.requires_gpu(NEEDS_ACCELERATOR)
    def test_cpu_gpu_module(self) -> None:
        """A module partly on the CPU and partly on the device needs ``device_id``."""

        class CPUGPUModule(nn.Module):
            def __init__(self, device: torch.device) -> None:
                super().__init__()
                self.a = nn.Linear(1, 1).to(device)
                self.b = nn.Linear(1, 1)

        cpu_gpu = CPUGPUModule(self.device)
        fsdp = FSDP(cpu_gpu, device_id=self.device)
        for param in fsdp.parameters():
            self.assertEqual(param.device, self.device)
        with self.assertRaisesRegex(RuntimeError, "please pass in device_id"):
            FSDP(CPUGPUModule(self.device))

    def test_fsdp_ignored_module_meta(self) -> None:
        """Meta-device materialisation skips ignored modules."""

        class CPUGPUModule(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.a = nn.Linear(1, 1)
                self.b = nn.Linear(1, 1)

        with torch.device("meta"):
            m = CPUGPUModule()
        m = FSDP(m, device_id=self.device, ignored_modules=[m.a], use_orig_params=True)
        meta_device = torch.device("meta")
        self.assertEqual(meta_device, next(m.a.parameters()).device)

        # The same with an explicit param_init_fn.
        with torch.device("meta"):
            m = CPUGPUModule()
        m = FSDP(
            m,
            device_id=self.device,
            ignored_modules=[m.a],
            use_orig_params=True,
            param_init_fn=lambda m: m.to_empty(device=self.device, recurse=False),
        )
        self.assertEqual(meta_device, next(m.a.parameters()).device)

    @pytest.mark.requires_gpu(NEEDS_ACCELERATOR)
    def test_fsdp_device_id_no_move_ignored_params_and_bufs(self) -> None:
        """``device_id`` does not move ignored parameters and buffers."""

        class CPUGPUModule(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.a = nn.Linear(1, 1)
                self.b = nn.Linear(1, 1)
                self.a.buf = nn.Buffer(torch.ones(1))

        m = CPUGPUModule()
        m = FSDP(m, device_id=self.device, ignored_modules=[m.a], use_orig_params=True)
        ignored_params = m.a.parameters()
        ignored_bufs = m.a.buffers()
        for t in (*ignored_params, *ignored_bufs):
            self.assertEqual(torch.device("cpu"), t.device)

    @pytest.mark.requires_gpu("a module on two accelerators needs two accelerators")
    def test_multigpu_module(self) -> None:
        """A module on two accelerators raises."""

        class MultiGPUModule(nn.Module):
            def __init__(self, rank: int, world_size: int) -> None:
                super().__init__()
                self.a = nn.Linear(1, 1).to(torch.device("cuda", rank))
                self.b = nn.Linear(1, 1).to(torch.device("cuda", (rank + 1) % world_size))

        with self.assertRaisesRegex(RuntimeError, "FSDP only supports single device modules"):
            FSDP(MultiGPUModule(self.device.index, torch.cuda.device_count()))

    def test_no_params(self) -> None:
        """A module without parameters wraps, with the current device as its
        compute device (checked against ``device_id``)."""
        # A CPU module, a module on the device, and device_id.
        FSDP(nn.ReLU())
        FSDP(nn.ReLU().to(self.device))
        FSDP(nn.ReLU(), device_id=self.device)
        if self.device.type == "cpu":
            return  # the mismatch below needs an accelerator index other than this rank's
        context = (
            self.assertRaisesRegex(ValueError, f"Inconsistent.*cuda:{self.rank} vs cuda:0")
            if self.rank != 0
            else contextlib.nullcontext()
        )
        with context:
            FSDP(nn.ReLU().to(self.device), device_id=0)

    def test_fsdp_same_model_across_ranks(self) -> None:
        """``sync_module_states`` makes every rank start from rank 0's parameters and buffers."""

        class MyModel(nn.Module):
            def __init__(self, rank: int) -> None:
                super().__init__()
                # Seed by rank so that each rank's model differs.
                torch.manual_seed(rank)
                if torch.cuda.is_available():
                    torch.cuda.manual_seed(rank)
                self.lin = nn.Linear(10, 10, bias=False)
                self.buffer = nn.Buffer(torch.ones(1) * rank)

        m = MyModel(self.rank).to(self.device)
        _assert_module_states(self, m, equal=False, group=self.process_group)
        if _torch_cannot_sync_on(self.device):
            with self.assertRaisesRegex(ValueError, TORCH_SYNC_MODULE_STATES_ON_CPU):
                FSDP(m, sync_module_states=True)
            return
        fsdp = FSDP(m, sync_module_states=True)
        with fsdp.summon_full_params(fsdp):
            _assert_module_states(self, fsdp, equal=True, group=self.process_group)
        # The same with a CPU module and device_id.
        m = MyModel(self.rank)
        _assert_module_states(self, m, equal=False, group=self.process_group)
        fsdp = FSDP(m, device_id=self.device, sync_module_states=True)
        with fsdp.summon_full_params(fsdp):
            _assert_module_states(self, fsdp, equal=True, group=self.process_group)

    def test_homogeneous_attributes(self) -> None:
        """Units of one tree must agree on the homogeneous attributes: the first
        forward raises otherwise."""
        attr_name_and_values = [
            ("_use_orig_params", False, True),
            ("limit_all_gathers", False, True),
            ("_use_full_prec_in_eval", False, True),
        ]
        self.assertEqual(
            [name for name, _, _ in attr_name_and_values], list(HOMOGENEOUS_ATTR_NAMES)
        )
        self.run_subtests(
            {"attr_name_and_values": attr_name_and_values},
            self._test_homogeneous_attributes,
        )

    def _test_homogeneous_attributes(self, attr_name_and_values: tuple[str, bool, bool]) -> None:
        model = NestedWrappedModule.init(
            self.process_group, FSDPInitMode.NO_FSDP, DeviceInitMode.BEFORE, {}
        )
        attr_name = attr_name_and_values[0]
        if attr_name == "_use_full_prec_in_eval":
            model.module[1] = FSDP(model.module[1])
            os.environ[_FSDP_USE_FULL_PREC_IN_EVAL] = "1"
            fsdp_model = FSDP(model)
        else:
            fsdp_kwargs_inner = {attr_name.lstrip("_"): attr_name_and_values[1]}
            fsdp_kwargs_outer = {attr_name.lstrip("_"): attr_name_and_values[2]}
            model.module[1] = FSDP(model.module[1], **fsdp_kwargs_inner)
            fsdp_model = FSDP(model, **fsdp_kwargs_outer)
        # The check runs at lazy initialisation, i.e. at the first forward.
        with self.assertRaisesRegex(ValueError, f"Expects one homogeneous value for {attr_name}"):
            inp = fsdp_model.module.get_input(self.device)
            fsdp_model(*inp)

    def test_fsdp_unsupported_module_cls(self) -> None:
        """Wrapping a container without forward (ModuleList, ModuleDict) warns."""
        regex = r"FSDP will not all-gather parameters for containers that do not implement forward"
        model = nn.ModuleList([MLP(8, torch.device("cpu")) for _ in range(3)])
        with self.assertWarnsRegex(UserWarning, regex):
            FSDP(model, device_id=self.device.type)
        model = nn.ModuleDict({"1": MLP(8, torch.device("cpu")), "2": MLP(8, torch.device("cpu"))})
        with self.assertWarnsRegex(UserWarning, regex):
            FSDP(model)


class TestFSDPMiscWorldSize1(FSDPTest):
    world_size = 1

    def test_world_size_1_sharding_strategy_warning(self) -> None:
        """At world size 1 FSDP switches to NO_SHARD, with a warning unless asked for it."""
        warning_prefix = "FSDP is switching to use `NO_SHARD` instead of"
        # No warning when NO_SHARD is asked for.
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            FSDP(nn.Linear(3, 3).to(self.device), sharding_strategy=ShardingStrategy.NO_SHARD)
            for warning in w:
                self.assertTrue(
                    warning.category is not UserWarning
                    or not str(warning.message).startswith(warning_prefix)
                )
        # A warning for FULL_SHARD, given or by default, and for SHARD_GRAD_OP.
        warning_suffix = " since the world size is 1."
        expected_regex_full_shard = (
            warning_prefix + " " + str(ShardingStrategy.FULL_SHARD) + warning_suffix
        )
        with self.assertWarnsRegex(UserWarning, expected_regex_full_shard):
            FSDP(nn.Linear(3, 3).to(self.device), sharding_strategy=ShardingStrategy.FULL_SHARD)
        with self.assertWarnsRegex(UserWarning, expected_regex_full_shard):
            FSDP(nn.Linear(3, 3).to(self.device))
        expected_regex_shard_grad_op = (
            warning_prefix + " " + str(ShardingStrategy.SHARD_GRAD_OP) + warning_suffix
        )
        with self.assertWarnsRegex(UserWarning, expected_regex_shard_grad_op):
            FSDP(
                nn.Linear(3, 3).to(self.device),
                sharding_strategy=ShardingStrategy.SHARD_GRAD_OP,
            )

    @pytest.mark.requires_gpu(NEEDS_ACCELERATOR)
    def test_training_device_mismatch_errors(self) -> None:
        """The first forward checks where the parameters are: on the compute
        device, or on the CPU when offloading."""
        device = _device_of_index(self.device)
        model = FSDP(nn.Linear(10, 10))
        expected = (
            "An FSDP-managed module unexpectedly has parameters on cpu. Make sure to move "
            f"the module to {device} before training."
        )
        with self.assertRaisesRegex(RuntimeError, re.escape(expected)):
            model(torch.randn((2, 10)))
        model = FSDP(nn.Linear(10, 10), cpu_offload=CPUOffload(offload_params=True))
        model.to(device)
        expected = (
            "An FSDP-managed module with parameter CPU offloading enabled has parameters on "
            f"{device}. Make sure to not move the module from CPU when offloading parameters."
        )
        with self.assertRaisesRegex(RuntimeError, re.escape(expected)):
            model(torch.randn((2, 10)))

    def test_unsafe_setattr(self) -> None:
        """FSDP sets original parameter names through the module's ``__setattr__``
        unless ``FSDP_USE_UNSAFE_SETATTR=1``."""
        self.run_subtests({"use_orig_params": [False, True]}, self._test_unsafe_setattr)

    def _test_unsafe_setattr(self, use_orig_params: bool) -> None:
        called_setattr_override = False

        class SetattrLinear(nn.Module):
            def __init__(self, in_dim: int, out_dim: int, device: torch.device) -> None:
                super().__init__()
                self.weight = nn.Parameter(torch.randn((in_dim, out_dim), device=device))

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return x @ self.weight

            def __setattr__(self, name: str, value: Any) -> None:
                nonlocal called_setattr_override
                called_setattr_override = True
                return super().__setattr__(name, value)

        # The default calls the override.
        module = SetattrLinear(5, 5, self.device)
        fsdp_module = FSDP(module, use_orig_params=use_orig_params)
        inp = torch.randn((8, 5), device=self.device)
        called_setattr_override = False
        fsdp_module(inp)
        self.assertTrue(called_setattr_override)

        # Unsafe setattr bypasses it.
        os.environ[_FSDP_USE_UNSAFE_SETATTR] = "1"
        module = SetattrLinear(5, 5, self.device)
        fsdp_module = FSDP(module, use_orig_params=use_orig_params)
        called_setattr_override = False
        fsdp_module(inp)
        self.assertFalse(called_setattr_override)

        # "0" is the default again.
        os.environ[_FSDP_USE_UNSAFE_SETATTR] = "0"
        module = SetattrLinear(5, 5, self.device)
        fsdp_module = FSDP(module, use_orig_params=use_orig_params)
        called_setattr_override = False
        fsdp_module(inp)
        self.assertTrue(called_setattr_override)
