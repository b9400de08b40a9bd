# An FSDP test file in the style of upstream's test/distributed/fsdp/test_fsdp_apply.py
# and test_fsdp_clip_grad_norm.py, written for this project. Only its imports differ
# from a file written against torch.testing._internal; each says what it replaces.
# tests/upstream/test_upstream_compat.py runs it as test_fsdp_apply_and_clip.py, under both
# --fsdp-impl local and --fsdp-impl torch, with --map-cuda-to-cpu on a CPU machine.

import itertools
import sys
from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import upstream.fsdp_traversal as traversal_utils  # torch.distributed.fsdp._traversal_utils
from fsdptest.api import (  # torch.distributed.fsdp
    FullyShardedDataParallel as FSDP,
)
from fsdptest.api import ModuleWrapPolicy, ShardingStrategy  # torch.distributed.fsdp(.wrap)
from upstream.common_device_type import (  # torch.testing._internal.common_device_type
    instantiate_device_type_tests,
)
from upstream.common_distributed import skip_if_lt_x_gpu  # ..._internal.common_distributed
from upstream.common_fsdp import (  # torch.testing._internal.common_fsdp
    FSDP_DEVICES,
    CUDAInitMode,
    DEVICEInitMode,
    FSDPInitMode,
    FSDPTest,
    NestedWrappedModule,
    TransformerWithSharedParams,
    _assert_module_states,
    _zero_model,
    get_devtype,
    get_full_params,
    subtest_name,
)
from upstream.common_utils import (  # torch.testing._internal.common_utils
    TEST_WITH_DEV_DBG_ASAN,
    parametrize,
    run_tests,
)

if not dist.is_available():
    print("Distributed not available, skipping tests", file=sys.stderr)
    sys.exit(0)

if TEST_WITH_DEV_DBG_ASAN:
    print("Skip dev-asan as torch + multiprocessing spawn have known issues", file=sys.stderr)
    sys.exit(0)

device_type = torch.device(get_devtype())

sharding_names = {
    str(ShardingStrategy.FULL_SHARD): "full_shard",
    str(ShardingStrategy.NO_SHARD): "no_shard",
}
sharding_name = partial(subtest_name, sharding_names)


class TestApply(FSDPTest):
    @property
    def world_size(self):
        if torch.cuda.is_available() and torch.cuda.device_count() < 2:
            return torch.cuda.device_count()
        return 2

    @torch.no_grad()
    def _init_linear_weights(self, m):
        if type(m) is nn.Linear:
            m.weight.fill_(1.0)
            m.bias.fill_(1.0)

    def check_weights(self, fsdp, expected_tensor_fn, check):
        with FSDP.summon_full_params(fsdp, recurse=True):
            linear_modules = [module for module in fsdp.modules() if type(module) is nn.Linear]
            for module in linear_modules:
                for param in module.parameters():
                    expected = expected_tensor_fn(param)
                    check(param, expected, f"Got {param} but expected {expected}")

    def _check_apply(self, fsdp):
        # Assert linear weights are not all 1.0
        self.check_weights(
            fsdp, lambda param: torch.empty_like(param).fill_(1.0), self.assertNotEqual
        )
        fsdp.apply(self._init_linear_weights)
        # Ensure all weights are 1.0
        self.check_weights(fsdp, lambda param: torch.empty_like(param).fill_(1.0), self.assertEqual)

    @skip_if_lt_x_gpu(2)
    def test_nested_module_apply(self):
        """Checks that ``apply`` with a non-FSDP root reaches every nested unit."""
        nested_module = NestedWrappedModule.init(
            self.process_group,
            FSDPInitMode.RECURSIVE,
            DEVICEInitMode.DEVICE_AFTER,
            fsdp_kwargs={"device_id": device_type.type},
        )
        fsdp_module = FSDP(nested_module, self.process_group).cuda(self.rank)
        self._check_apply(fsdp_module)
        # The root and its three nested units, each with its own flat parameter
        self.assertEqual(len(traversal_utils._get_fsdp_handles(fsdp_module)), 4)
        fsdp_module(*nested_module.get_input(device_type))
        states = traversal_utils._get_fsdp_states(fsdp_module)
        self.assertEqual([bool(state._is_root) for state in states], [True, False, False, False])

    @skip_if_lt_x_gpu(2)
    def test_transformer_module_apply(self):
        """Checks that ``apply`` reaches the root unit and the auto-wrapped layers."""
        transformer = TransformerWithSharedParams.init(
            self.process_group,
            FSDPInitMode.RECURSIVE,
            CUDAInitMode.CUDA_AFTER,
            fsdp_kwargs={"device_id": device_type.type},
        )
        self._check_apply(transformer)

    @skip_if_lt_x_gpu(2)
    def test_apply_in_summon_raises_error(self):
        """Checks that ``apply`` inside ``summon_full_params`` raises an error."""
        transformer = TransformerWithSharedParams.init(
            self.process_group,
            FSDPInitMode.RECURSIVE,
            DEVICEInitMode.DEVICE_AFTER,
            fsdp_kwargs={"device_id": device_type.type},
        )
        with transformer.summon_full_params(transformer):
            with self.assertRaisesRegex(ValueError, "expected to be in states"):
                transformer.apply(self._init_linear_weights)

    @skip_if_lt_x_gpu(2)
    @parametrize(
        "sharding_strategy", [ShardingStrategy.FULL_SHARD, ShardingStrategy.NO_SHARD], sharding_name
    )
    def test_parity_with_ddp(self, device, sharding_strategy):
        """Trains a nested model under FSDP and DDP in lockstep for both init modes."""
        self.assertEqual(torch.device(device).type, self.device_type)
        self.run_subtests(
            {
                "device_init_mode": [DEVICEInitMode.DEVICE_BEFORE, DEVICEInitMode.DEVICE_AFTER],
                "use_orig_params": [False, True],
            },
            self._test_fsdp_parity,
            NestedWrappedModule,
            FSDPInitMode.RECURSIVE,
            sharding_strategy=sharding_strategy,
        )


class TestClipGradNorm(FSDPTest):
    @skip_if_lt_x_gpu(2)
    def test_non_root(self, device):
        """Checks that calling ``clip_grad_norm_()`` on a non-root FSDP instance raises."""

        class Model(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.lin1 = nn.Linear(5, 5)
                self.lin2 = nn.Linear(5, 5)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return self.lin2(self.lin1(x))

        model = Model().cuda()
        model.lin2 = FSDP(model.lin2)
        fsdp_model = FSDP(model)
        fsdp_model(torch.randn((2, 5), device="cuda")).sum().backward()
        error_regex = "should only be called on the root FSDP instance"
        with self.assertRaisesRegex(RuntimeError, error_regex):
            fsdp_model.lin2.clip_grad_norm_(max_norm=2)

    @skip_if_lt_x_gpu(2)
    def test_ddp_parity(self, device):
        """Checks the total norm, the clipped gradients and the step against DDP."""
        self.run_subtests(
            {
                "max_norm": [1, 2.5],
                "norm_type": [2, float("inf")],
                "sharding_strategy": [ShardingStrategy.FULL_SHARD, ShardingStrategy.NO_SHARD],
                "use_orig_params": [False, True],
            },
            self._test_ddp_parity,
            device,
        )

    def _test_ddp_parity(self, device, max_norm, norm_type, sharding_strategy, use_orig_params):
        local_model = TransformerWithSharedParams.init(
            self.process_group,
            FSDPInitMode.NO_FSDP,
            DEVICEInitMode.DEVICE_BEFORE,
            deterministic=True,
        )
        ddp_model = DDP(local_model)
        fsdp_kwargs = {
            "use_orig_params": use_orig_params,
            "device_id": device_type.type,
            "sharding_strategy": sharding_strategy,
            "auto_wrap_policy": ModuleWrapPolicy(
                {nn.TransformerEncoderLayer, nn.TransformerDecoderLayer}
            ),
        }
        fsdp_model = TransformerWithSharedParams.init(
            self.process_group,
            FSDPInitMode.RECURSIVE,
            CUDAInitMode.CUDA_BEFORE,
            deterministic=True,
            fsdp_kwargs=fsdp_kwargs,
        )
        _assert_module_states(ddp_model.module, self.process_group, self.assertEqual)
        ddp_optim = torch.optim.Adam(ddp_model.parameters(), lr=1e-2)
        fsdp_optim = torch.optim.Adam(fsdp_model.parameters(), lr=1e-2)
        LARGE_FACTOR = 100
        inp = ddp_model.module.get_input(torch.device(device))
        for model in (ddp_model, fsdp_model):
            out = model(*inp)
            loss = model.module.get_loss(inp, out)
            loss.backward()
        for param in itertools.chain(ddp_model.parameters(), fsdp_model.parameters()):
            if param.grad is not None:  # gradients may be None with use_orig_params
                param.grad *= LARGE_FACTOR
        orig_ddp_grads = [param.grad.detach().clone() for param in ddp_model.parameters()]
        ddp_total_norm = torch.nn.utils.clip_grad_norm_(
            ddp_model.parameters(), max_norm=max_norm, norm_type=norm_type
        )
        fsdp_total_norm = fsdp_model.clip_grad_norm_(max_norm=max_norm, norm_type=norm_type)
        self.assertEqual(ddp_total_norm, fsdp_total_norm)
        for param, orig_grad in zip(ddp_model.parameters(), orig_ddp_grads):
            assert not torch.equal(param.grad, orig_grad), (
                "Expected gradient to be modified by clip_grad_norm_()"
            )
        ddp_optim.step()
        fsdp_optim.step()
        with FSDP.summon_full_params(fsdp_model):
            for (n1, p1), (n2, p2) in zip(
                ddp_model.module.named_parameters(), fsdp_model.named_parameters()
            ):
                self.assertEqual(n1, n2)
                self.assertEqual(p1, p2)
        # get_full_params gives the unsharded parameters in the same order
        self.assertEqual(get_full_params(fsdp_model), list(ddp_model.module.parameters()))
        _zero_model(fsdp_model)
        for param in get_full_params(fsdp_model):
            self.assertEqual(param, torch.zeros_like(param))


instantiate_device_type_tests(TestApply, globals(), only_for=FSDP_DEVICES, allow_xpu=True)
instantiate_device_type_tests(TestClipGradNorm, globals(), only_for=FSDP_DEVICES, allow_xpu=True)

if __name__ == "__main__":
    run_tests()
