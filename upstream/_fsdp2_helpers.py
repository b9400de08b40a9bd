"""Upstream's FSDP2 test helpers (``torch.testing._internal.common_fsdp``'s
``patch_*``, ``reduce_scatter_with_assert``, ``check_sharded_parity`` and
``compiled_fsdp_test``) on the FSDP under test; ``upstream.common_fsdp``
re-exports them.

[Note: Upstream's FSDP2 patches on any implementation]
Upstream's ``patch_all_gather(new)`` and its siblings replace one private part of
torch's FSDP2 for a ``with`` block. Here each acts on the seam of that name of the
implementation under test (``fsdptest.api.FSDP2_SEAMS``; [Note: FSDP2 seams] in
``fsdptest.fsdp2``): torch's under ``--fsdp-impl torch``, the one an implementation
declares otherwise; an implementation that declares no such seam skips the test,
naming it. Upstream's barriers around the swap keep threads of one process in step;
the ranks here are processes, each patching its own copy, so there are none.

[Note: Compiled compute]
``compiled_fsdp_test`` runs the test once per mode, as upstream's: ``EAGER``, and
``COMPILED_COMPUTE``, where the test's ``fully_shard`` is replaced by one that also
compiles the module it shards (those of ``compile_compute_on_module`` only, when
given). Upstream loops over the modes inside one test and passes over the compiled
one with a warning where Triton is missing; here each mode is a parametrization
(``test_x[EAGER]``, ``test_x[COMPILED_COMPUTE]``), and the compiled one is a skip
that says why where it cannot run: inductor compiles for the device through Triton,
which a rank without a CUDA GPU lacks.
"""

from __future__ import annotations

import enum
import functools
import inspect
import unittest
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from fsdptest.api import FSDP2_SEAMS

TestFn = Callable[..., Any]


def patch_all_gather(
    new_all_gather_into_tensor: Callable[..., Any],
) -> AbstractContextManager[None]:
    """All-gathers of the FSDP under test go to ``new_all_gather_into_tensor``,
    called as torch's ``all_gather_single(output, input, group=...)``."""
    return FSDP2_SEAMS.patch("all_gather", new_all_gather_into_tensor)


def patch_reduce_scatter(
    new_reduce_scatter_tensor: Callable[..., Any],
) -> AbstractContextManager[None]:
    """Reduce-scatters go to ``new_reduce_scatter_tensor``, called as torch's
    ``reduce_scatter_single(output, input, op=..., group=...)``."""
    return FSDP2_SEAMS.patch("reduce_scatter", new_reduce_scatter_tensor)


def patch_all_reduce(new_all_reduce: Callable[..., Any]) -> AbstractContextManager[None]:
    """All-reduces (HSDP's replica reduction) go to ``new_all_reduce``."""
    return FSDP2_SEAMS.patch("all_reduce", new_all_reduce)


def patch_unshard(new_unshard: Callable[..., Any]) -> AbstractContextManager[None]:
    """The parameter group's ``unshard(self, async_op=False)``."""
    return FSDP2_SEAMS.patch("unshard", new_unshard)


def patch_reshard(new_reshard: Callable[..., Any]) -> AbstractContextManager[None]:
    """The parameter group's ``reshard(self)``."""
    return FSDP2_SEAMS.patch("reshard", new_reshard)


def patch_post_backward(new_post_backward: Callable[..., Any]) -> AbstractContextManager[None]:
    """The parameter group's ``post_backward(self, *unused)``."""
    return FSDP2_SEAMS.patch("post_backward", new_post_backward)


def patch_register_post_backward_hook_backward(
    new_backward: Callable[..., Any],
) -> AbstractContextManager[None]:
    """The ``backward(ctx, *grads)`` of the autograd function that runs the
    post-backward."""
    return FSDP2_SEAMS.patch("register_post_backward_hook_backward", new_backward)


def reduce_scatter_with_assert(
    cls: unittest.TestCase,
    orig_reduce_scatter: Callable[..., Any],
    assert_fn: Callable[[torch.Tensor], None],
    *args: Any,
    **kwargs: Any,
) -> Any:
    """Calls ``assert_fn(output)`` on the reduce-scatter's output, then the original."""
    if args:
        output = args[0]
    elif "output" in kwargs:
        output = kwargs["output"]
    else:
        raise AssertionError(
            f"Cannot get reduce-scatter output from\nargs: {args}\nkwargs: {kwargs}"
        )
    assert_fn(output)
    return orig_reduce_scatter(*args, **kwargs)


def check_sharded_parity(
    cls: Any,
    replicated_module: nn.Module,
    sharded_module: nn.Module,
    prefixes_to_ignore: tuple[str, ...] = (),
) -> None:
    """Each sharded parameter (and gradient) is a DTensor whose local shard equals
    the replicated one distributed with the same mesh and placements; names match
    once ``prefixes_to_ignore`` are removed; a missing replicated gradient means a
    missing sharded one."""
    pairs = zip(
        replicated_module.named_parameters(), sharded_module.named_parameters(), strict=True
    )
    for (replicated_name, replicated), (sharded_name, sharded) in pairs:
        for prefix in prefixes_to_ignore:
            sharded_name = sharded_name.replace(prefix, "")
        cls.assertEqual(replicated_name, sharded_name)
        cls.assertIsInstance(sharded, DTensor)
        _check_like(cls, replicated, sharded, f"{sharded_name}")
        if replicated.grad is None:
            cls.assertIsNone(sharded.grad, f"{sharded_name}.grad")
            continue
        cls.assertIsNotNone(sharded.grad, f"{sharded_name}.grad")
        cls.assertIsInstance(sharded.grad, DTensor)
        _check_like(cls, replicated.grad, sharded.grad, f"{sharded_name}.grad")


def _check_like(cls: Any, replicated: torch.Tensor, sharded: DTensor, what: str) -> None:
    mesh, placements = sharded.device_mesh, tuple(sharded.placements)
    if placements == (Shard(0), Shard(0)):
        raise AssertionError(
            f"{what}: FSDP's (Shard(0), Shard(0)) layout differs from distribute_tensor(), "
            "so equality cannot be checked with it"
        )
    # The replicated tensor is the same on every rank: each takes its own part
    # (src_data_rank=None) instead of receiving it from rank 0 by a scatter.
    expected = distribute_tensor(replicated.detach(), mesh, placements, src_data_rank=None)
    cls.assertEqual(sharded.to_local(), expected.to_local(), msg=what)


class FullyShardMode(enum.Enum):
    """The modes ``compiled_fsdp_test`` runs a test in."""

    EAGER = enum.auto()
    COMPILED_COMPUTE = enum.auto()


def compile_unavailable() -> str | None:
    """Why compiled compute cannot run on this rank, or None (see [Note: Compiled compute])."""
    from torch.utils._triton import has_triton

    if has_triton():
        return None
    return (
        "compiled compute needs Triton (torch.utils._triton.has_triton() is False on this "
        "rank: inductor compiles for the device through it); upstream's compiled_fsdp_test "
        "runs only the eager mode where it is missing"
    )


def compiled_fsdp_test(compile_compute_on_module: type | None = None) -> Callable[[TestFn], TestFn]:
    """Runs the test eagerly and with compiled compute (see [Note: Compiled compute])."""

    def decorator(func: TestFn) -> TestFn:
        @functools.wraps(func)
        def wrapper(*args: Any, fully_shard_mode: FullyShardMode, **kwargs: Any) -> Any:
            if fully_shard_mode is FullyShardMode.EAGER:
                return func(*args, **kwargs)
            reason = compile_unavailable()
            if reason is not None:
                raise unittest.SkipTest(reason)
            with _compiling_fully_shard(func, compile_compute_on_module):
                return func(*args, **kwargs)

        signature = inspect.signature(func)
        mode = inspect.Parameter("fully_shard_mode", inspect.Parameter.KEYWORD_ONLY)
        wrapper.__dict__["__signature__"] = signature.replace(
            parameters=[*signature.parameters.values(), mode]
        )
        modes = list(FullyShardMode)
        marked: TestFn = pytest.mark.parametrize(
            "fully_shard_mode", modes, ids=[m.name for m in modes]
        )(wrapper)
        return marked

    return decorator


@contextmanager
def _compiling_fully_shard(func: TestFn, on_module: type | None) -> Iterator[None]:
    """The test module's global ``fully_shard`` also compiles what it shards."""
    namespace = func.__globals__
    original = namespace["fully_shard"]

    def fully_shard_with_compiled_compute(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        sharded = original(module, *args, **kwargs)
        if on_module is None or isinstance(module, on_module):
            module.compile()
        return sharded

    namespace["fully_shard"] = fully_shard_with_compiled_compute
    try:
        yield
    finally:
        namespace["fully_shard"] = original
