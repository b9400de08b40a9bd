"""Communication hooks (port of upstream ``test_fsdp_comm_hooks.py``).

A hook registered on the root replaces FSDP's gradient reduction in every unit:
sharded strategies call ``hook(state, padded_unsharded_grad, shard_output)``,
``NO_SHARD`` calls ``hook(state, grad)``. The hooks and states under test are
torch's generic ones (``torch.distributed.algorithms._comm_hooks.default_hooks``),
which both implementations must accept.

[Note: Low-precision hooks on the CPU]
Upstream runs the fp16 and bf16 compression hooks on NCCL only. Gloo sums
float16 and bfloat16 tensors too, and what is compared (a hook against
``MixedPrecision(reduce_dtype=...)``) does not depend on the backend, so both
hooks run on the CPU as well. One line of the hooks cannot: after casting the
reduced gradient back to the parameter dtype, ``default_hooks._decompress``
calls ``record_stream(torch.cpu.current_stream())`` on the low-precision
tensor, which CPU tensors reject (``RuntimeError: unknown parameter type``)
whichever FSDP calls the hook. Recording a tensor on a stream only tells
the CUDA caching allocator when it may reuse the memory, so on the CPU the call
is made a no-op for CPU tensors while the hook runs (``_cpu_record_stream``).
Whether the hook still fails without that is asserted once, so that a fix in
torch shows up here.

[Note: Hybrid strategies on the CPU under torch's FSDP]
Built without process groups, a hybrid strategy shards within a node and
replicates across nodes. Torch's FSDP counts a node's ranks with
``torch.cpu.device_count()`` on a CPU run, which is 1: the shard group has one
rank, and torch switches the strategy to ``NO_SHARD`` ("FSDP is switching to
use `NO_SHARD` instead of ShardingStrategy.HYBRID_SHARD since the world size
is 1"), after which a hook is accepted. For torch on the CPU the test asserts
that; our FSDP shards over all ranks of a CPU host and refuses the hook.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms._comm_hooks import default_hooks

from fsdptest import FSDPTest
from fsdptest.api import ADAPTER, FSDP, MixedPrecision, ModuleWrapPolicy, ShardingStrategy
from harness import current_device, parametrize

SHARDING_STRATEGIES = [
    ShardingStrategy.NO_SHARD,
    ShardingStrategy.FULL_SHARD,
    ShardingStrategy.SHARD_GRAD_OP,
]


@contextlib.contextmanager
def _cpu_record_stream() -> Iterator[None]:
    """``Tensor.record_stream`` is a no-op for CPU tensors inside (see [Note:
    Low-precision hooks on the CPU])."""
    record_stream = torch.Tensor.record_stream

    def record_unless_cpu(tensor: torch.Tensor, stream: object) -> None:
        if tensor.device.type != "cpu":
            record_stream(tensor, stream)  # type: ignore[arg-type]

    with mock.patch.object(torch.Tensor, "record_stream", record_unless_cpu):
        yield


def _seed() -> None:
    torch.manual_seed(0)
    if torch.cuda.is_available():
        torch.cuda.manual_seed(0)


class Net(nn.Module):
    """``Linear(8, 16), ReLU, Linear(16, 8)`` (nested units when ``has_wrapping``),
    then ``Linear(8, 4)``."""

    def __init__(
        self,
        has_wrapping: bool,
        sharding_strategy: ShardingStrategy | None,
        mixed_precision: MixedPrecision | None = None,
    ) -> None:
        # to ensure determinism
        _seed()
        super().__init__()
        device = current_device()
        if has_wrapping:
            self.net = FSDP(
                nn.Sequential(
                    nn.Linear(8, 16),
                    nn.ReLU(),
                    FSDP(
                        nn.Linear(16, 8),
                        device_id=device,
                        sharding_strategy=sharding_strategy,
                        mixed_precision=mixed_precision,
                    ),
                ),
                device_id=device,
                sharding_strategy=sharding_strategy,
                mixed_precision=mixed_precision,
            )
        else:
            self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
        self.out = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.relu(self.net(x)))


class DummyState:
    __slots__ = ["noise", "process_group"]

    def __init__(self, process_group: dist.ProcessGroup | None, noise: int) -> None:
        self.process_group = process_group
        self.noise = noise


class DummyHook:
    """Hooks that are only registered, never run: used unbound, as upstream does."""

    def dummy_hook_for_no_shard_fsdp(self, state: DummyState, grad: torch.Tensor) -> None:
        """Adds some noise to a gradient, then all-reduces it."""
        grad.add_(state.noise)
        dist.all_reduce(grad, group=state.process_group)

    def custom_reduce_scatter(
        self, output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None = None
    ) -> None:
        """A reduce-scatter that does nothing."""

    def dummy_hook_for_sharded_fsdp(
        self, state: DummyState, grad: torch.Tensor, output: torch.Tensor
    ) -> None:
        """Adds some noise to a gradient, then reduce-scatters it with a no-op."""
        grad.add_(state.noise)
        assert state.process_group is not None
        self.custom_reduce_scatter(output, grad, group=state.process_group)


def _dummy_hook(sharding_strategy: ShardingStrategy) -> object:
    # As upstream: the NO_SHARD-signature hook for sharded strategies and vice
    # versa; only registration is checked.
    if sharding_strategy != ShardingStrategy.NO_SHARD:
        return DummyHook.dummy_hook_for_no_shard_fsdp
    return DummyHook.dummy_hook_for_sharded_fsdp


class TestCommunicationHooks(FSDPTest):
    @parametrize("sharding_strategy", SHARDING_STRATEGIES)
    def test_default_communication_hook_behavior(
        self, sharding_strategy: ShardingStrategy | None
    ) -> None:
        """Without a registered hook, FSDP averages the gradient over the ranks."""
        out_dim = self.world_size
        net = nn.Linear(1, out_dim, bias=False)
        inpt = torch.tensor([self.rank]).float().to(self.device)
        net_default_hook = FSDP(net, device_id=self.device, sharding_strategy=sharding_strategy).to(
            self.device
        )

        # Check that no hook is registered in any unit.
        for entry in FSDP.fsdp_modules(net_default_hook):
            self.assertEqual(entry._comm_hook, None)

        for _ in range(4):
            # Clear gradients
            net_default_hook.zero_grad()
            loss = net_default_hook(inpt).sum()
            loss.backward()
            # For each worker, the gradient on the weight should be worker_rank.
            grad = net_default_hook.params[0].grad
            expected_grad = sum(i for i in range(dist.get_world_size())) / dist.get_world_size()
            # Verify default hook produces expected gradients
            self.assertEqual(
                grad[0].item(),
                expected_grad,
                msg=f"Expected hook grad of {expected_grad} but got {grad[0].item()}",
            )

    def _get_submodules(self, fsdp_net: nn.Module) -> list[nn.Module]:
        return [
            submodule for submodule in FSDP.fsdp_modules(fsdp_net) if not submodule.check_is_root()
        ]

    def _init_model(
        self,
        core: nn.Module,
        sharding_strategy: ShardingStrategy | None,
        mixed_precision: MixedPrecision | None = None,
    ) -> nn.Module:
        return FSDP(
            core,
            device_id=self.device,
            sharding_strategy=sharding_strategy,
            mixed_precision=mixed_precision,
        ).to(self.device)

    @parametrize("has_wrapping", [True, False])
    @parametrize("sharding_strategy", SHARDING_STRATEGIES)
    def test_default_communication_hook_initialization(
        self, has_wrapping: bool, sharding_strategy: ShardingStrategy | None
    ) -> None:
        """A hook registered on the root reaches every unit, and only once."""
        fsdp_model_with_hook = self._init_model(
            Net(has_wrapping=has_wrapping, sharding_strategy=sharding_strategy),
            sharding_strategy=sharding_strategy,
        )

        # Check that no hook is registered in any unit.
        for fsdp_module in FSDP.fsdp_modules(fsdp_model_with_hook):
            self.assertEqual(fsdp_module._comm_hook, None)

        dummy_state = DummyState(process_group=None, noise=1234)
        dummy_hook = _dummy_hook(sharding_strategy)

        fsdp_model_with_hook.register_comm_hook(dummy_state, dummy_hook)

        # Check that we can't register comm hook twice
        with self.assertRaisesRegex(AssertionError, "^A communication hook is already registered$"):
            fsdp_model_with_hook.register_comm_hook(dummy_state, dummy_hook)

        # Check dummy hook was registered for the root and all submodules if any
        for fsdp_module in FSDP.fsdp_modules(fsdp_model_with_hook):
            self.assertEqual(fsdp_module._comm_hook, dummy_hook)
            self.assertEqual(fsdp_module._comm_hook_state, dummy_state)

    @parametrize("sharding_strategy", SHARDING_STRATEGIES)
    def test_registering_hook_non_root(self, sharding_strategy: ShardingStrategy | None) -> None:
        """Registering a hook on a unit that is not the root fails."""
        fsdp_model_with_hook = self._init_model(
            Net(has_wrapping=True, sharding_strategy=sharding_strategy),
            sharding_strategy=sharding_strategy,
        )
        dummy_state = DummyState(process_group=None, noise=1234)
        dummy_hook = _dummy_hook(sharding_strategy)
        # Creating a list of non-root submodules to test
        submodules = self._get_submodules(fsdp_model_with_hook)
        # Check that assertion is raised for registering a comm hook on a non-root
        with self.assertRaisesRegex(
            AssertionError, "^register_comm_hook can only be called on a root instance.$"
        ):
            submodules[1].register_comm_hook(dummy_state, dummy_hook)

    def test_registering_hook_hybrid_strategy(self) -> None:
        """Hybrid strategies refuse communication hooks."""
        for sharding_strategy in (
            ShardingStrategy.HYBRID_SHARD,
            ShardingStrategy._HYBRID_SHARD_ZERO2,
        ):
            model = Net(False, None, None).to(device=self.device)
            fsdp_model = FSDP(
                model,
                auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
                sharding_strategy=sharding_strategy,
            )
            dummy_state = DummyState(process_group=None, noise=1234)
            dummy_hook = DummyHook.dummy_hook_for_sharded_fsdp
            if ADAPTER.limitations.hybrid_falls_back_on_cpu:
                # See [Note: Hybrid strategies on the CPU under torch's FSDP].
                self.assertEqual(fsdp_model.sharding_strategy, ShardingStrategy.NO_SHARD)
                fsdp_model.register_comm_hook(dummy_state, dummy_hook)
                continue
            with self.assertRaisesRegex(
                AssertionError, "Communication hook is not supported for hybrid strategies"
            ):
                fsdp_model.register_comm_hook(dummy_state, dummy_hook)

    @parametrize("sharding_strategy", SHARDING_STRATEGIES)
    def test_registering_hook_submodules(self, sharding_strategy: ShardingStrategy | None) -> None:
        """A hook already set on any unit of the tree blocks registration on the root."""
        fsdp_model_with_hook = self._init_model(
            Net(has_wrapping=True, sharding_strategy=sharding_strategy),
            sharding_strategy=sharding_strategy,
        )
        dummy_state = DummyState(process_group=None, noise=1234)
        dummy_hook = _dummy_hook(sharding_strategy)
        submodules = self._get_submodules(fsdp_model_with_hook)

        # Simulate a registration of a hook on a submodule
        submodules[1]._comm_hook = dummy_hook
        # Check that an error is raised when some of submodules have a non-default hook assigned
        with self.assertRaisesRegex(AssertionError, "^A communication hook is already registered$"):
            fsdp_model_with_hook.register_comm_hook(dummy_state, dummy_hook)

    def _check_low_precision_hook(
        self,
        state: default_hooks.LowPrecisionState,
        hook: object,
        sharding_strategy: ShardingStrategy | None,
        dtype: torch.dtype,
        has_wrapping: bool,
    ) -> None:
        # keep everything deterministic for input data
        _seed()

        fsdp_with_hook = self._init_model(
            Net(has_wrapping=has_wrapping, sharding_strategy=sharding_strategy),
            sharding_strategy=sharding_strategy,
        )
        fsdp_with_hook.register_comm_hook(state, hook)

        mp_only_grad = MixedPrecision(reduce_dtype=dtype)
        fsdp_with_mp = self._init_model(
            Net(
                has_wrapping=has_wrapping,
                sharding_strategy=sharding_strategy,
                mixed_precision=mp_only_grad,
            ),
            sharding_strategy=sharding_strategy,
            mixed_precision=mp_only_grad,
        )

        optim_hook = torch.optim.SGD(fsdp_with_hook.parameters(), lr=0.1)
        optim_mp = torch.optim.SGD(fsdp_with_mp.parameters(), lr=0.1)

        in_data = torch.rand(16, 8).to(self.device)
        fsdp_with_hook.train()
        fsdp_with_mp.train()
        loss_hook = fsdp_with_hook(in_data).sum()
        loss_mp = fsdp_with_mp(in_data).sum()
        on_cpu = self.device.type == "cpu"
        with _cpu_record_stream() if on_cpu else contextlib.nullcontext():
            loss_hook.backward()
        # Make sure grads were cast to the parameter's precision
        self.assertEqual(fsdp_with_hook.params[0].grad.dtype, state.parameter_type)
        loss_mp.backward()
        optim_hook.step()
        optim_mp.step()

        dist.barrier()

        for hook_param, mp_param in zip(fsdp_with_hook.parameters(), fsdp_with_mp.parameters()):
            self.assertEqual(hook_param.grad, mp_param.grad)

    def test_low_precision_hook_record_stream_on_cpu(self) -> None:
        """For a CPU gradient torch's low-precision hooks fail in ``_decompress`` (see
        [Note: Low-precision hooks on the CPU]); asserted so that a fix in torch shows up.
        The CPU gradient is reduced over a gloo group: NCCL has no CPU backend."""
        group = dist.new_group(backend="gloo")
        state = default_hooks.LowPrecisionState(process_group=group)
        grad = torch.ones(4)
        with self.assertRaisesRegex(RuntimeError, "unknown parameter type"):
            default_hooks.fp16_compress_hook(state, grad)

    @parametrize("has_wrapping", [True, False])
    @parametrize("sharding_strategy", SHARDING_STRATEGIES)
    def test_fp16_hook(
        self, has_wrapping: bool, sharding_strategy: ShardingStrategy | None
    ) -> None:
        """The fp16 compression hook reduces like ``MixedPrecision(reduce_dtype=float16)``
        (see [Note: Low-precision hooks on the CPU])."""
        state = default_hooks.LowPrecisionState(process_group=_default_group())
        hook = default_hooks.fp16_compress_hook
        self._check_low_precision_hook(state, hook, sharding_strategy, torch.float16, has_wrapping)

    @parametrize("has_wrapping", [True, False])
    @parametrize("sharding_strategy", SHARDING_STRATEGIES)
    def test_bf16_hook(
        self, has_wrapping: bool, sharding_strategy: ShardingStrategy | None
    ) -> None:
        """The bf16 compression hook reduces like ``MixedPrecision(reduce_dtype=bfloat16)``
        (see [Note: Low-precision hooks on the CPU])."""
        state = default_hooks.LowPrecisionState(process_group=_default_group())
        hook = default_hooks.bf16_compress_hook
        self._check_low_precision_hook(state, hook, sharding_strategy, torch.bfloat16, has_wrapping)

    @parametrize("keep_low_precision_grads", [False, True])
    @parametrize("sharding_strategy", SHARDING_STRATEGIES)
    def test_low_precision_hook_with_mixed_precision(
        self, sharding_strategy: ShardingStrategy, keep_low_precision_grads: bool
    ) -> None:
        """With param and reduce mixed precision, torch's low-precision hooks are
        handed the gradient in the dtype backward produced it (``param_dtype``,
        not cast to ``reduce_dtype``) and cast the reduced one back to their
        state's ``parameter_type`` themselves; FSDP casts it no further but for
        sharded strategies with ``keep_low_precision_grads`` (``param_dtype``)."""
        precision = MixedPrecision(
            param_dtype=torch.bfloat16,
            reduce_dtype=torch.float16,
            keep_low_precision_grads=keep_low_precision_grads,
        )
        fsdp_model = self._init_model(
            Net(has_wrapping=True, sharding_strategy=sharding_strategy, mixed_precision=precision),
            sharding_strategy=sharding_strategy,
            mixed_precision=precision,
        )
        state = default_hooks.LowPrecisionState(process_group=_default_group())
        fsdp_model.register_comm_hook(state, default_hooks.fp16_compress_hook)
        handed: list[tuple[torch.dtype, torch.dtype]] = []
        low_precision_hook = default_hooks._low_precision_hook

        def observed(prec: torch.dtype, *args: object) -> None:
            handed.append((prec, args[1].dtype))  # type: ignore[attr-defined]
            low_precision_hook(prec, *args)  # type: ignore[arg-type]

        loss = fsdp_model(torch.rand(4, 8, device=self.device)).sum()
        on_cpu = self.device.type == "cpu"
        with mock.patch.object(default_hooks, "_low_precision_hook", observed):
            with _cpu_record_stream() if on_cpu else contextlib.nullcontext():
                loss.backward()
        self.assertEqual(handed, [(torch.float16, torch.bfloat16)] * 3)  # one per unit
        keeps_param_dtype = keep_low_precision_grads and sharding_strategy in (
            ShardingStrategy.FULL_SHARD,
            ShardingStrategy.SHARD_GRAD_OP,
        )
        expected = torch.bfloat16 if keeps_param_dtype else state.parameter_type
        for name, param in fsdp_model.named_parameters():
            self.assertIsNotNone(param.grad, name)
            self.assertEqual(param.grad.dtype, expected, name)


def _default_group() -> dist.ProcessGroup:
    return dist.distributed_c10d._get_default_group()
