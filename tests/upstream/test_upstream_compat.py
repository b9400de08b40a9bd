"""The ``upstream`` package: upstream-style FSDP test files run here after changing
only their imports; upstream's test names; ``--map-cuda-to-cpu``."""

from __future__ import annotations

import inspect
import sys
import textwrap
import unittest
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from harness._rank.cuda_mapping import mapped
from tests.conftest import INNER_DEVICE
from upstream.common_device_type import instantiate_device_type_tests
from upstream.common_distributed import TEST_SKIPS, skip_if_lt_x_gpu
from upstream.common_fsdp import (
    CUDAInitMode,
    DEVICEInitMode,
    DummyProcessGroup,
    FSDPInitMode,
    NestedWrappedModule,
    as_device_init_mode,
    subtest_name,
)
from upstream.common_utils import instantiate_parametrized_tests, parametrize, subtest

UPSTREAM_STYLE_FILE = Path(__file__).parent / "upstream_style" / "fsdp_apply_and_clip.py"
UPSTREAM_DTENSOR_FILE = Path(__file__).parent / "upstream_style" / "fsdp_dtensor.py"
ON_CPU = INNER_DEVICE == "cpu"


# -- the proof: an upstream-style file, both implementations --------------------------------


@pytest.mark.parametrize("impl", ["local", "torch"])
def test_upstream_style_file_passes_under_both_implementations(
    inner: Any, impl: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tests/upstream/upstream_style/fsdp_apply_and_clip.py (upstream's idioms, only the imports
    changed) passes on CPU ranks, with upstream's class and test names. The GPUs are hidden:
    upstream's ``TestApply.world_size`` is the GPU count where there are GPUs, so on a one-GPU
    machine its tests run on one rank and ``skip_if_lt_x_gpu(2)`` skips them, as upstream's."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    run = inner(
        UPSTREAM_STYLE_FILE.read_text(),
        "-p",
        "upstream.plugin",
        "--fsdp-impl",
        impl,
        "--map-cuda-to-cpu",
        "--device",
        "cpu",
        "-v",
    )
    run.result.assert_outcomes(passed=7)
    for name in (
        "TestApplyCUDA::test_nested_module_apply_cuda PASSED",
        "TestApplyCUDA::test_transformer_module_apply_cuda PASSED",
        "TestApplyCUDA::test_apply_in_summon_raises_error_cuda PASSED",
        "TestApplyCUDA::test_parity_with_ddp_full_shard_cuda PASSED",
        "TestApplyCUDA::test_parity_with_ddp_no_shard_cuda PASSED",
        "TestClipGradNormCUDA::test_non_root_cuda PASSED",
        "TestClipGradNormCUDA::test_ddp_parity_cuda PASSED",
    ):
        assert name in run.text
    assert "24 subtests ran, 0 failed, 0 skipped" in run.text


A_RANK_FAILS = textwrap.dedent(
    """
    class TestARankFails(DTensorTestBase):
        @with_comms
        @skip_if_lt_x_gpu(4)
        def test_rank_one_fails(self):
            mesh = init_device_mesh(self.device_type, (self.world_size,))
            if self.rank == 1:
                raise RuntimeError("rank 1 fails on purpose")
            dist.all_reduce(torch.ones(1, device=self.device_type), group=mesh.get_group())


    """
)


@pytest.mark.parametrize("impl", ["local", "torch"])
def test_upstream_style_dtensor_file_runs_with_its_ranks_and_survives_a_failing_rank(
    inner: Any, impl: str
) -> None:
    """tests/upstream/upstream_style/fsdp_dtensor.py (device meshes, DTensorTestBase,
    with_comms, skip_if_lt_x_gpu(4), tensor parallelism; only the imports changed)
    runs with 4 ranks at --world-size 2 and passes under both implementations,
    meshes made in subtests included; a test in front of it whose rank 1 fails
    while the others wait in a collective is reported with rank 1's error, and
    the tests after it pass on a fresh pool."""
    source = UPSTREAM_DTENSOR_FILE.read_text().replace(
        "class TestDeviceMeshStateDict(", A_RANK_FAILS + "class TestDeviceMeshStateDict(", 1
    )
    run = inner(
        source,
        "-p",
        "upstream.plugin",
        "--fsdp-impl",
        impl,
        "--map-cuda-to-cpu",
        "--world-size",
        "2",
        "-v",
    )
    run.result.assert_outcomes(passed=6, failed=1)
    for name in (
        "TestARankFails::test_rank_one_fails FAILED",
        "TestDeviceMeshStateDictCUDA::test_sharded_values_are_dtensors_hybrid_False_cuda PASSED",
        "TestDeviceMeshStateDictCUDA::test_sharded_values_are_dtensors_hybrid_True_cuda PASSED",
        "TestDeviceMeshStateDictCUDA::test_state_dict_round_trip_cuda PASSED",
        "TestDeviceMeshStateDictCUDA::test_meshes_made_in_subtests_cuda PASSED",
        "TestDeviceMeshStateDictCUDA::test_create_chunk_dtensor_cuda PASSED",
        "TestFSDPWithTensorParallel::test_fsdp_over_data_parallel_dim PASSED",
    ):
        assert name in run.text
    report = run.section("test_rank_one_fails")
    assert "rank 1" in report and "RuntimeError: rank 1 fails on purpose" in report
    assert "world_size=4" in report
    assert "3 subtests ran, 0 failed, 0 skipped" in run.text


RUN_AS_SCRIPT = textwrap.dedent(
    """
    import torch
    from upstream.common_device_type import instantiate_device_type_tests
    from upstream.common_distributed import skip_if_lt_x_gpu
    from upstream.common_fsdp import FSDPTest
    from upstream.common_utils import run_tests


    class TestScript(FSDPTest):
        @skip_if_lt_x_gpu(2)
        def test_ranks(self, device):
            assert torch.device(device).type == self.device_type
            assert self.world_size == 2 and self.rank in (0, 1)


    instantiate_device_type_tests(TestScript, globals(), only_for=("cuda",))

    if __name__ == "__main__":
        run_tests()
    """
)


def test_run_tests_runs_the_file_under_pytest(inner: Any, pytester: pytest.Pytester) -> None:
    """``python test_file.py <pytest arguments>`` runs the file's tests (run_tests())."""
    path = pytester.makepyfile(test_script=RUN_AS_SCRIPT)
    result = pytester.run(
        sys.executable, str(path), "-p", "harness.plugin", "--device", INNER_DEVICE, "-v"
    )
    assert result.ret == 0, result.stdout.str()
    result.stdout.fnmatch_lines(["*TestScriptCUDA::test_ranks_cuda PASSED*"])


# -- --map-cuda-to-cpu -------------------------------------------------------------------------

CUDA_MAPPING = textwrap.dedent(
    """
    import pytest, torch
    from torch import nn
    from torch.overrides import BaseTorchFunctionMode
    from harness import DistributedTest


    class TestMapping(DistributedTest):
        @pytest.mark.map_cuda_to_cpu
        def test_marked_resolves_cuda_to_the_rank_device(self):
            layer = nn.Linear(2, 2).cuda()
            x = torch.ones(2, device="cuda").to("cuda:1") + torch.zeros(2).cuda(self.rank)
            assert layer(x).device == self.device == torch.device("cpu")

        def test_unmarked_test_sees_no_mapping(self):
            assert torch._C._len_torch_function_stack() == 0
            with pytest.raises((AssertionError, RuntimeError)):
                torch.ones(1).cuda()

        @pytest.mark.map_cuda_to_cpu
        def test_leaves_a_mode_pushed(self):
            BaseTorchFunctionMode().__enter__()
            assert torch._C._len_torch_function_stack() == 2

        def test_next_test_starts_without_modes(self):
            assert torch._C._len_torch_function_stack() == 0
    """
)


@pytest.mark.skipif(not ON_CPU, reason="the mapping applies to CPU ranks only")
def test_cuda_mapping_is_opt_in_per_test_and_undone_after_it(inner: Any) -> None:
    """The marker maps CUDA devices in its test only; the mode stack is empty again
    after every test, also after a test that left a mode of its own pushed."""
    run = inner(CUDA_MAPPING, "-v")
    run.result.assert_outcomes(passed=4)


SINGLE_PROCESS_CUDA = textwrap.dedent(
    """
    import torch

    from upstream.common_distributed import skip_if_lt_x_gpu
    from upstream.common_utils import TestCase


    class TestSingleProcess(TestCase):
        @skip_if_lt_x_gpu(1)
        def test_names_cuda(self):
            moved = torch.rand(3).to("cuda")
            built = torch.zeros(2, device="cuda")
            self.assertEqual({moved.device.type, built.device.type}, {"cpu"})


    def test_next_test_starts_without_modes():
        assert torch._C._len_torch_function_stack() == 0
    """
)


@pytest.mark.skipif(torch.cuda.is_available(), reason="maps CUDA where the process has none")
def test_single_process_upstream_tests_follow_map_cuda_to_cpu(inner: Any) -> None:
    """An upstream ``TestCase`` test (run in the pytest process, not in ranks) that
    names CUDA devices runs mapped to the CPU under ``--map-cuda-to-cpu``, and fails
    without it, as a CPU rank's test does; the mode is gone after the test."""
    run = inner(SINGLE_PROCESS_CUDA, "-p", "upstream.plugin", "--map-cuda-to-cpu")
    run.result.assert_outcomes(passed=2)
    unmapped = inner(SINGLE_PROCESS_CUDA, "-p", "upstream.plugin")
    unmapped.result.assert_outcomes(passed=1, failed=1)


def test_cuda_mapping_resolves_device_arguments_and_restores_the_mode_stack() -> None:
    depth = torch._C._len_torch_function_stack()
    cpu = torch.device("cpu")
    with mapped(True, cpu):
        module = nn.Linear(2, 3).cuda()
        built = nn.Linear(2, 3, device="cuda")
        tensors = [
            torch.zeros(2, device="cuda"),
            torch.randn(2, device=torch.device("cuda", 1)),
            torch.ones(2).cuda(0),
            torch.ones(2).to("cuda", torch.float16),
            torch.empty_like(torch.ones(1), device=0),
            module.weight.new_zeros(3, device="cuda:0"),
        ]
        module.to(torch.device("cuda"))
        by_index = nn.Linear(2, 3).to(1)  # Module.to(<int>): through _parse_to
        by_index.to(0, torch.float64)
        torch.overrides.BaseTorchFunctionMode().__enter__()  # left pushed on purpose
    assert torch._C._len_torch_function_stack() == depth
    devices = {t.device for t in [*tensors, module.weight, built.weight, by_index.weight]}
    assert devices == {cpu}
    assert tensors[3].dtype == torch.float16
    assert by_index.weight.dtype == torch.float64
    with mapped(False, cpu):
        assert torch._C._len_torch_function_stack() == depth
    with mapped(True, torch.device("meta")):  # a rank that is not on the CPU: unmapped
        assert torch._C._len_torch_function_stack() == depth


def test_cuda_mapping_counts_one_gpu_per_rank_and_restores_the_count() -> None:
    """Outside a process group the block counts one GPU (the one rank); the count
    is torch's own again after it."""
    count = torch.cuda.device_count
    with mapped(True, torch.device("cpu")):
        assert torch.cuda.device_count() == 1
    assert torch.cuda.device_count is count


GPU_SIZED = textwrap.dedent(
    """
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    from upstream.common_distributed import skip_if_lt_x_gpu
    from upstream.common_fsdp import FSDPTest


    class TestSizedByItsGPUs(FSDPTest):
        @property
        def world_size(self):
            return min(4, torch.cuda.device_count())

        @skip_if_lt_x_gpu(2)
        def test_ddp_with_device_ids(self):
            assert self.world_size == dist.get_world_size() == torch.cuda.device_count()
            model = DDP(nn.Linear(3, 3).cuda(), device_ids=[self.rank])
            assert model.device_ids is None
            DDP(nn.Linear(3, 3).cuda(), device_ids=[self.rank], output_device=self.rank)
            model(torch.randn(2, 3).cuda()).sum().backward()
            ones = torch.ones(1).cuda()
            dist.all_reduce(ones)
            assert ones.item() == self.world_size
    """
)


@pytest.mark.skipif(not ON_CPU, reason="the mapping applies to CPU ranks only")
def test_gpu_sized_class_and_ddp_device_ids_under_cuda_mapping(inner: Any) -> None:
    """Under --map-cuda-to-cpu a class whose world_size counts CUDA devices gets the
    ranks --world-size gives (3 here), not the error for zero ranks, and
    ``DDP(module, device_ids=[rank])`` of a CPU module works in them; without the
    mapping the class asks for 0 ranks, which is the setup error."""
    run = inner(GPU_SIZED, "--map-cuda-to-cpu", "--world-size", "3", "-v")
    run.result.assert_outcomes(passed=1)
    assert "PASSED (3 ranks, cpu/gloo)" in run.text
    unmapped = inner(GPU_SIZED, "-v")
    unmapped.result.assert_outcomes(errors=1)
    assert "TestSizedByItsGPUs.world_size is 0" in unmapped.text


# -- what a test declares it needs, and what it may not leave behind ---------------------------

DECLARED_RANKS = textwrap.dedent(
    """
    import pytest
    from upstream.common_distributed import skip_if_lt_x_gpu
    from upstream.common_fsdp import FSDPTest


    class TestRanks(FSDPTest):
        @skip_if_lt_x_gpu(4)
        def test_needs_four(self):
            assert self.world_size == 4

        @skip_if_lt_x_gpu(1)
        def test_needs_one(self):
            assert self.world_size == 3  # --world-size, which is larger

        @pytest.mark.min_world_size(5)
        def test_marked(self):
            assert self.world_size == 5


    class TestPinned(FSDPTest):
        world_size = 2

        @skip_if_lt_x_gpu(4)
        def test_pinned_size_wins(self):
            assert self.world_size == 2


    class TestProperty(FSDPTest):
        @property
        def world_size(self):
            return 3

        def test_property(self):
            assert self.world_size == 3
    """
)


@pytest.mark.skipif(not ON_CPU, reason="GPU runs skip tests needing more GPUs than they see")
def test_skip_if_lt_x_gpu_gives_the_test_its_ranks(inner: Any) -> None:
    """``skip_if_lt_x_gpu(n)`` (the ``min_world_size(n)`` marker) runs a test of a class
    that does not pin its world size with max(--world-size, n) ranks on CPU; a pinned
    world size (an attribute or a property) is kept."""
    run = inner(DECLARED_RANKS, "-p", "upstream.plugin", "--world-size", "3")
    run.result.assert_outcomes(passed=5)


MODELS_PATCHED = textwrap.dedent(
    """
    import models
    from harness import DistributedTest


    class TestModels(DistributedTest):
        def test_patches_a_model(self):
            models.MLP.forward = None
            models.EXTRA = 1

        def test_sees_the_original(self):
            assert models.MLP.forward is not None
            assert not hasattr(models, "EXTRA")
    """
)


def test_models_are_restored_outside_this_repository(inner: Any) -> None:
    """The FSDP layer's plugin asks the ranks to restore ``models`` after every test,
    without this repository's ini (the inner session runs in a bare directory)."""
    run = inner(MODELS_PATCHED, "-p", "upstream.plugin", "-p", "fsdptest.plugin")
    run.result.assert_outcomes(passed=2)


BROADCAST_RANK0_ONLY = textwrap.dedent(
    """
    import torch
    from upstream.common_fsdp import FSDPTest, _broadcast_state_dict


    class TestBroadcast(FSDPTest):
        world_size = 3

        def test_rank0_only_dict_reaches_every_rank(self):
            sent = {
                "b.weight": torch.arange(6, dtype=torch.float32).view(2, 3),
                "a.count": torch.tensor(7, dtype=torch.int64),
                "half": torch.full((4,), 0.5, dtype=torch.float16),
            }
            got = _broadcast_state_dict(self.rank, sent if self.rank == 0 else {})
            assert list(got) == list(sent)
            for name, tensor in sent.items():
                assert got[name].dtype == tensor.dtype, name
                assert torch.equal(got[name].cpu(), tensor), name

        def test_each_rank_passing_its_copy_gets_rank0s_values(self):
            mine = {"w": torch.full((2, 2), float(self.rank))}
            got = _broadcast_state_dict(self.rank, mine)
            assert torch.equal(got["w"].cpu(), torch.zeros(2, 2))
    """
)


def test_broadcast_state_dict_takes_a_rank0_only_dict(inner: Any) -> None:
    """``_broadcast_state_dict`` sends rank 0's keys, dtypes and shapes first, so
    the other ranks may pass an empty dict (what a ``rank0_only`` full state dict is
    there), as upstream's tests of rank-0 checkpoints do."""
    run = inner(BROADCAST_RANK0_ONLY, "-p", "upstream.plugin")
    run.result.assert_outcomes(passed=2)


# -- upstream's names, without ranks -----------------------------------------------------------


def _instantiate(generic: type, **kwargs: Any) -> dict[str, Any]:
    scope: dict[str, Any] = {generic.__name__: generic}
    instantiate_device_type_tests(generic, scope, **kwargs)
    return scope


def _tests(cls: type) -> list[str]:
    return sorted(name for name in vars(cls) if name.startswith("test"))


def test_device_type_instantiation_uses_upstream_names() -> None:
    class TestThing:
        @parametrize("use_orig_params", [False, True])
        def test_a(self, device: str, use_orig_params: bool) -> tuple[str, bool]:
            return device, use_orig_params

        def test_b(self) -> str:
            return self.device_type  # type: ignore[attr-defined,no-any-return]

    scope = _instantiate(TestThing, only_for=("cuda", "hpu", "xpu"), allow_xpu=True)
    assert list(scope) == ["TestThingCUDA"]
    cls = scope["TestThingCUDA"]
    assert cls.__qualname__ == "TestThingCUDA" and cls.__module__ == __name__
    assert _tests(cls) == [
        "test_a_use_orig_params_False_cuda",
        "test_a_use_orig_params_True_cuda",
        "test_b_cuda",
    ]
    assert _tests(TestThing) == []
    # no parameters for pytest to look up as fixtures; the device is the test's
    assert list(inspect.signature(cls.test_a_use_orig_params_True_cuda).parameters) == ["self"]
    if not torch.cuda.is_available():  # else this would initialise CUDA in the pytest process
        assert cls().test_a_use_orig_params_True_cuda() == ("cpu", True)
        assert cls().test_b_cuda() == "cpu"


def test_device_type_instantiation_filters_devices_like_upstream() -> None:
    def generic() -> type:
        class TestBoth:
            def test_x(self) -> None: ...

        return TestBoth

    assert list(_instantiate(generic())) == ["TestBothCPU", "TestBothCUDA"]
    assert list(_instantiate(generic(), except_for="cuda")) == ["TestBothCPU"]
    scope = _instantiate(generic(), only_for=["cpu"])
    assert _tests(scope["TestBothCPU"]) == ["test_x_cpu"]
    assert scope["TestBothCPU"]().device_type == "cpu"
    with pytest.raises(AssertionError, match="both except_for and only_for"):
        _instantiate(generic(), only_for="cpu", except_for="cpu")


def test_parametrize_names_values_as_upstream_does() -> None:
    names = {"True": "offload", "False": "no_offload"}

    @instantiate_parametrized_tests
    class TestNames:
        @parametrize("dtype", [torch.float16, torch.bfloat16])
        @parametrize("lr", [0.5])
        def test_stacked(self, dtype: torch.dtype, lr: float) -> None: ...

        @parametrize("mode", [DEVICEInitMode.DEVICE_BEFORE, DEVICEInitMode.DEVICE_AFTER])
        def test_enum(self, mode: DEVICEInitMode) -> None: ...

        @parametrize("offload", [True, False], lambda offload: subtest_name(names, offload))
        def test_name_fn(self, offload: bool) -> None: ...

        @parametrize("a,b", [subtest((1, 2), name="small"), (3, "x")])
        def test_subtest(self, a: int, b: object) -> None: ...

    assert _tests(TestNames) == sorted(
        [
            "test_enum_mode0",
            "test_enum_mode1",
            "test_name_fn_offload",
            "test_name_fn_no_offload",
            "test_stacked_float16_lr_0_5",
            "test_stacked_bfloat16_lr_0_5",
            "test_subtest_small",
            "test_subtest_a_3_b_x",
        ]
    )


def test_subtest_decorators_apply_to_their_case_only() -> None:
    @instantiate_parametrized_tests
    class TestSkipOne:
        @parametrize("n", [subtest(0, name="zero", decorators=[pytest.mark.skip]), 1])
        def test_n(self, n: int) -> int:
            return n

    assert getattr(TestSkipOne.test_n_zero, "pytestmark", None)
    assert not getattr(TestSkipOne.test_n_n_1, "pytestmark", None)
    assert TestSkipOne().test_n_n_1() == 1


def test_upstream_init_modes_mean_the_layer_modes() -> None:
    for before in (DEVICEInitMode.DEVICE_BEFORE, CUDAInitMode.CUDA_BEFORE):
        assert before.is_before() and not before.is_after()
    assert as_device_init_mode(CUDAInitMode.CUDA_AFTER) is as_device_init_mode(
        DEVICEInitMode.DEVICE_AFTER
    )
    model = NestedWrappedModule.init(
        DummyProcessGroup(rank=0, size=1), FSDPInitMode.NO_FSDP, CUDAInitMode.CUDA_NEVER
    )
    assert {p.device for p in model.parameters()} == {torch.device("cpu")}


def test_skip_if_lt_x_gpu_runs_on_cpu_and_keeps_the_signature() -> None:
    @skip_if_lt_x_gpu(8)
    def body(self: object, device: str) -> str:
        return device

    assert list(inspect.signature(body).parameters) == ["self", "device"]
    if not torch.cuda.is_available():
        assert body(None, "cpu") == "cpu"
    assert TEST_SKIPS["multi-gpu-2"].message == "Need at least 2 CUDA devices"


# -- upstream's FSDP-adjacent private helpers in the facade -----------------------------------


def test_facade_gives_ours_private_helpers_or_skips_naming_them() -> None:
    """``fsdptest.api`` gives our FSDP's equivalents of torch's private helpers that
    upstream files import (``_get_param_to_fqns`` as torch's), and a stand-in that
    skips, naming it, where ours has none (the exec-order tracer)."""
    import torch.distributed.fsdp._common_utils as torch_common

    from fsdptest import api

    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    model[1].weight = model[0].weight
    for dedup in (True, False):
        ours = {tuple(v) for v in api._get_param_to_fqns(model, dedup).values()}
        torch_s = {tuple(v) for v in torch_common._get_param_to_fqns(model, dedup).values()}
        assert ours == torch_s
    if api.ADAPTER.is_project_fsdp:
        with pytest.raises(unittest.SkipTest, match="_ExecOrderTracer"):
            api._ExecOrderTracer()
        assert api._create_chunk_dtensor.__module__ == "fsdp._shard_utils"


def test_meshes_over_destroyed_groups_leave_torch_mesh_registries() -> None:
    """Torch before 2.13 maps sliced meshes to their roots (and roots to flattened
    meshes) in ``_mesh_resources``, keyed by meshes that compare by shape and ranks:
    the entries over a test's destroyed groups go, the others stay."""
    import torch.distributed.device_mesh as device_mesh

    from harness._rank.isolation import forget_meshes_of

    class FakeMesh:
        def __init__(self, names: list[str]) -> None:
            self._dim_group_names = names

    resources = device_mesh._mesh_resources
    child, root, kept = FakeMesh(["3"]), FakeMesh(["3", "4"]), FakeMesh(["0"])
    resources.child_to_root_mapping = {child: root, kept: kept}  # type: ignore[attr-defined]
    resources.root_to_flatten_mapping = {kept: {"dp_tp": child}}  # type: ignore[attr-defined]
    stack_depth = len(resources.mesh_stack)
    resources.mesh_stack.extend([root, kept])  # type: ignore[list-item]
    try:
        forget_meshes_of({"4"})
        assert resources.child_to_root_mapping == {kept: kept}  # type: ignore[attr-defined]
        assert resources.mesh_stack[stack_depth:] == [kept]
        forget_meshes_of({"3"})
        assert resources.root_to_flatten_mapping == {}  # type: ignore[attr-defined]
    finally:
        del resources.child_to_root_mapping, resources.root_to_flatten_mapping  # type: ignore[attr-defined]
        del resources.mesh_stack[stack_depth:]
