"""The reference an example's FSDP model is compared with: DDP over the same
model, computing in FSDP's mixed precision when the example has one.

[Note: The mixed-precision reference]
FSDP's ``MixedPrecision(param_dtype=d)`` computes every operation of forward
and backward with parameters cast to ``d`` (layer norms and embeddings too),
reduces gradients in ``reduce_dtype`` (else ``d``), and keeps and steps fp32
parameters. Autocast is not that (it keeps layer norms in fp32 and embeddings
in the parameter's dtype), so the reference is DDP over a module that casts
each parameter to ``d`` inside its forward (``torch.func.functional_call``;
the cast's backward brings the gradient back to fp32 for DDP's reducer), casts
buffers to ``buffer_dtype`` and floating-point root inputs to ``d`` as FSDP
does, and reduces with DDP's compress hook of the reduce dtype (cast, divide
by the world size, all-reduce, cast back; torch's own bf16 hook needs NCCL).
Classes in
``_module_classes_to_ignore`` (LayerNorm here) keep fp32 parameters and get
their input in fp32 and their output back in the input's dtype, as torch's FSDP
does for them when it auto-wraps. What is left differs only by rounding: the
order of the division, gradients accumulated in ``d`` under ``no_sync`` and
kept in ``d`` with ``keep_low_precision_grads``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from fsdptest.properties.examples import DType, Example, Precision, Wrap
from harness.testcase import current_device

DTYPES = {DType.FLOAT16: torch.float16, DType.BFLOAT16: torch.bfloat16}


def dtype_of(dtype: DType | None) -> torch.dtype | None:
    return None if dtype is None else DTYPES[dtype]


class CastingModule(nn.Module):
    """Runs ``model`` with its parameters and buffers cast as FSDP's mixed precision
    casts them (see [Note: The mixed-precision reference])."""

    def __init__(self, model: nn.Module, precision: Precision, full_precision_norms: bool) -> None:
        super().__init__()
        self.model = model
        self._param_dtype = dtype_of(precision.param_dtype)
        self._buffer_dtype = dtype_of(precision.buffer_dtype)
        self._casts_inputs = precision.cast_root_forward_inputs or precision.cast_forward_inputs
        self._kept: set[str] = set()
        if full_precision_norms and self._param_dtype is not None:
            for name, module in model.named_modules():
                if isinstance(module, nn.LayerNorm):
                    self._kept.update(f"{name}.{p}" for p, _ in module.named_parameters())
                    _run_in_fp32(module)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._param_dtype is not None and self._casts_inputs and x.is_floating_point():
            x = x.to(self._param_dtype)
        values: dict[str, torch.Tensor] = {}
        for name, param in self.model.named_parameters():
            keep = self._param_dtype is None or name in self._kept
            values[name] = param if keep else param.to(self._param_dtype)
        for name, buffer in self.model.named_buffers():
            cast = self._buffer_dtype is not None and buffer.is_floating_point()
            values[name] = buffer.to(self._buffer_dtype) if cast else buffer
        return torch.func.functional_call(self.model, values, (x,))


def _run_in_fp32(module: nn.Module) -> None:
    """Casts the module's input to fp32 and its output back to the input's dtype."""
    input_dtype: list[torch.dtype] = []

    def pre(_: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        input_dtype[:] = [args[0].dtype]
        return tuple(a.float() if torch.is_tensor(a) and a.is_floating_point() else a for a in args)

    def post(_: nn.Module, args: tuple[Any, ...], output: torch.Tensor) -> torch.Tensor:
        return output.to(input_dtype[0])

    module.register_forward_pre_hook(pre)
    module.register_forward_hook(post)


def reference(example: Example, model: nn.Module) -> DDP:
    """DDP over ``model`` (cast as the example's FSDP casts it), ignoring the
    parameters and buffers of the example's ignored blocks as FSDP does."""
    precision = example.config.mixed_precision
    module: nn.Module = model
    prefix = ""
    if precision is not None:
        full_precision_norms = (
            precision.norms_in_full_precision and example.config.wrap is not Wrap.NONE
        )
        module = CastingModule(model, precision, full_precision_norms)
        prefix = "model."
    ignored = [
        f"{prefix}blocks.{i}.{name}"
        for i in example.config.ignored_blocks
        for name, _ in _params_and_buffers(model.blocks[i])  # type: ignore[index]
    ]
    if ignored:
        DDP._set_params_and_buffers_to_ignore_for_model(module, ignored)
    device = current_device()
    ddp = DDP(module, device_ids=[device.index] if device.type == "cuda" else None)
    hook = _compress_hook(precision)
    if hook is not None:
        ddp.register_comm_hook(None, hook)
    return ddp


def _params_and_buffers(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every name, tied ones included: DDP keeps a tied parameter under any name
    that is not ignored."""
    return [
        *module.named_parameters(remove_duplicate=False),
        *module.named_buffers(remove_duplicate=False),
    ]


def _compress_hook(precision: Precision | None) -> Any:
    """DDP's gradient reduction in FSDP's reduce dtype, if that is a low one."""
    reduce_dtype = None if precision is None else precision.reduce_dtype or precision.param_dtype
    if reduce_dtype is None:
        return None
    dtype = DTYPES[reduce_dtype]

    def hook(_: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        compressed = buffer.to(dtype).div_(dist.get_world_size())
        future = dist.all_reduce(compressed, async_op=True).get_future()  # type: ignore[union-attr]

        def decompress(done: torch.futures.Future[Any]) -> torch.Tensor:
            return buffer.copy_(done.value()[0])

        return future.then(decompress)

    # DDP compares the annotations with the classes themselves; this module's are strings.
    hook.__annotations__ = {"bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]}
    return hook


def inner_model(reference: DDP) -> nn.Module:
    """The example's model inside the reference."""
    module = reference.module
    return module.model if isinstance(module, CastingModule) else module
