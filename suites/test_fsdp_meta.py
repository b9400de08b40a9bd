"""Meta-device initialisation (port of upstream ``test_fsdp_meta.py``).

A module built on the meta device is materialised by FSDP: with
``param_init_fn`` called on each of the unit's modules, or by default with
``to_empty`` and ``reset_parameters()`` of each module that has parameters or
buffers of its own. Either way the result equals the same model built on the
device and reset. The torchdistX variants need the optional ``torchdistx``
package, which is not installed for torch 2.13 (nor published for it).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from fsdptest import FSDPTest
from fsdptest.api import (
    FSDP,
    MixedPrecision,
    ModuleWrapPolicy,
    always_wrap_policy,
    enable_wrap,
    wrap,
)
from harness import current_device, parametrize

try:
    from torchdistx import deferred_init  # type: ignore[import-not-found]
except ImportError:
    _TORCHDISTX_AVAIL = False
else:
    _TORCHDISTX_AVAIL = True

TORCHDISTX_SKIP = "Test requires torchdistX: https://github.com/pytorch/torchdistX"
requires_torchdistx = pytest.mark.skipif(not _TORCHDISTX_AVAIL, reason=TORCHDISTX_SKIP)


def _reset_params_if_meta(is_meta: bool, model: nn.Module) -> None:
    # For the reference model: the meta model's values come from reset_parameters().
    if is_meta:
        for module in model.modules():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()


class MyLinear(nn.Linear):
    """A linear layer whose ``reset_parameters`` is deterministic."""

    def reset_parameters(self, *args: object, **kwargs: object) -> None:
        torch.manual_seed(42)
        with torch.no_grad():
            # Xavier init is a function of the shape only.
            torch.nn.init.xavier_uniform_(self.weight, 1.0)


class MyBuffer(nn.Module):
    """A module with a buffer and no parameter."""

    def __init__(self, device: torch.device | str) -> None:
        super().__init__()
        self.buf = nn.Buffer(torch.empty((3, 3), device=device))

    def reset_parameters(self, *args: object, **kwargs: object) -> None:
        torch.manual_seed(42)
        # Xavier init is a function of the shape only.
        torch.nn.init.xavier_uniform_(self.buf, 0.5)


class MyModel(nn.Module):
    def __init__(self, device: torch.device | str) -> None:
        super().__init__()
        self.lin1 = MyLinear(2, 2, bias=False, device=device)
        self.lin2 = MyLinear(2, 2, bias=False, device=device)
        self.buf_mod = MyBuffer(device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(self.lin1(x))


class NestedModel(nn.Module):
    """lin1 and l3 are wrapped by ``wrap`` inside an ``enable_wrap`` context."""

    def __init__(self, device: torch.device | str) -> None:
        super().__init__()
        self.lin1 = MyLinear(2, 2, bias=False, device=device)
        self.lin1 = wrap(self.lin1)
        self.lin2 = MyLinear(2, 2, bias=False, device=device)
        self.l3 = MyModel(device=device)
        self.l3 = wrap(self.l3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l3(self.lin2(self.lin1(x)))


def _init_with_reset_params(module: nn.Module) -> None:
    """A ``param_init_fn``: to_empty + reset_parameters for a module with meta states."""
    has_meta_states = any(
        t.is_meta for t in (*module.parameters(recurse=False), *module.buffers(recurse=False))
    )
    if has_meta_states:
        module.to_empty(device=current_device(), recurse=False)
        module.reset_parameters()  # type: ignore[operator]


def _init_with_torchdistX(module: nn.Module) -> None:
    def check_fn(k: nn.Module) -> bool:
        return not isinstance(k, FSDP)

    deferred_init.materialize_module(module, check_fn=check_fn)


class TestFSDPWithMetaDevice(FSDPTest):
    world_size = 2

    def _compare_fsdp(self, fsdp1: nn.Module, fsdp2: nn.Module) -> None:
        with FSDP.summon_full_params(fsdp1), FSDP.summon_full_params(fsdp2):
            for p1, p2 in zip(fsdp1.parameters(), fsdp2.parameters()):
                self.assertTrue(torch.allclose(p1, p2), f"{p1} vs {p2}")

    def _train_and_compare(self, fsdp_meta: nn.Module, fsdp_regular: nn.Module) -> None:
        meta_opt = torch.optim.SGD(fsdp_meta.parameters(), lr=1e-3)
        regular_opt = torch.optim.SGD(fsdp_regular.parameters(), lr=1e-3)
        self._compare_fsdp(fsdp_meta, fsdp_regular)
        inp = torch.randn(10, 2, device=self.device)
        fsdp_meta(inp).sum().backward()
        fsdp_regular(inp).sum().backward()
        meta_opt.step()
        regular_opt.step()
        self._compare_fsdp(fsdp_meta, fsdp_regular)

    def _test_simple_model_with_meta_device(
        self,
        meta_module_fn: Callable[[], nn.Module],
        init_fn: Callable[[nn.Module], None] | None = None,
    ) -> None:
        # Auto-wrapped: each module its own unit.
        model = meta_module_fn()
        is_meta = next(model.parameters()).is_meta
        fsdp_meta = FSDP(model, auto_wrap_policy=always_wrap_policy, param_init_fn=init_fn)
        regular = MyModel(device=self.device)
        _reset_params_if_meta(is_meta, regular)
        fsdp_regular = FSDP(regular, auto_wrap_policy=always_wrap_policy)
        self._train_and_compare(fsdp_meta, fsdp_regular)
        # One unit for the whole model.
        model = meta_module_fn()
        fsdp_meta = FSDP(model, param_init_fn=init_fn)
        regular = MyModel(device=self.device)
        _reset_params_if_meta(is_meta, regular)
        fsdp_regular = FSDP(regular, auto_wrap_policy=always_wrap_policy)
        self._train_and_compare(fsdp_meta, fsdp_regular)

    def test_simple_model_with_meta_device_reset_params(self) -> None:
        """A meta model with a param_init_fn of to_empty + reset_parameters equals
        the model built on the device."""

        def meta_module_fn() -> nn.Module:
            return MyModel(device="meta")

        self._test_simple_model_with_meta_device(meta_module_fn, _init_with_reset_params)

    def test_simple_model_with_meta_device_default_init(self) -> None:
        """Without param_init_fn FSDP runs to_empty + reset_parameters itself
        (also for a module with only a buffer)."""

        def meta_module_fn() -> nn.Module:
            return MyModel(device="meta")

        self._test_simple_model_with_meta_device(meta_module_fn)

    @requires_torchdistx
    def test_simple_model_with_torchdistX_default_init(self) -> None:
        def meta_module_fn() -> nn.Module:
            return deferred_init.deferred_init(MyModel, device=self.device)

        self._test_simple_model_with_meta_device(meta_module_fn)

    @requires_torchdistx
    def test_simple_model_with_torchdistX_init_fn(self) -> None:
        def meta_module_fn() -> nn.Module:
            return deferred_init.deferred_init(MyModel, device=self.device)

        self._test_simple_model_with_meta_device(meta_module_fn, init_fn=_init_with_torchdistX)

    def _test_nested_model_with_meta_device(
        self,
        auto_wrap: bool,
        meta_module_fn: Callable[[], nn.Module],
        init_fn: Callable[[nn.Module], None] | None = None,
    ) -> None:
        if auto_wrap:
            module = meta_module_fn()
            is_meta = next(module.parameters()).is_meta or next(module.buffers()).is_meta
            fsdp_meta = FSDP(module, auto_wrap_policy=always_wrap_policy, param_init_fn=init_fn)
            module_regular = NestedModel(device=self.device)
            _reset_params_if_meta(is_meta, module_regular)
            fsdp_regular = FSDP(module_regular, auto_wrap_policy=always_wrap_policy)
        else:
            with enable_wrap(wrapper_cls=FSDP, param_init_fn=init_fn):
                module = meta_module_fn()
                is_meta = next(module.parameters()).is_meta
                # Modules that are not wrapped by FSDP themselves are still
                # initialised: they bubble up into a larger unit.
                fsdp_meta = wrap(module)
            module_regular = NestedModel(device=self.device)
            _reset_params_if_meta(is_meta, module_regular)
            with enable_wrap(wrapper_cls=FSDP):
                module_regular.lin1 = wrap(module_regular.lin1)
                module_regular.l3 = wrap(module_regular.l3)
                fsdp_regular = wrap(module_regular)
        self._train_and_compare(fsdp_meta, fsdp_regular)

    @parametrize("auto_wrap", [True, False])
    def test_nested_model_with_meta_device_reset_params(self, auto_wrap: bool) -> None:
        """A nested meta model with a to_empty + reset_parameters param_init_fn,
        wrapped automatically or with wrap(), equals the model built on the device."""

        def meta_module_fn() -> nn.Module:
            return NestedModel(device="meta")

        self._test_nested_model_with_meta_device(
            auto_wrap=auto_wrap, meta_module_fn=meta_module_fn, init_fn=_init_with_reset_params
        )

    @parametrize("auto_wrap", [True, False])
    def test_nested_model_with_meta_device_default_init(self, auto_wrap: bool) -> None:
        """The same with FSDP's default materialisation."""

        def meta_module_fn() -> nn.Module:
            return NestedModel(device="meta")

        self._test_nested_model_with_meta_device(auto_wrap=auto_wrap, meta_module_fn=meta_module_fn)

    @requires_torchdistx
    @parametrize("auto_wrap", [True, False])
    def test_nested_model_with_torchdistX_default_init(self, auto_wrap: bool) -> None:
        def meta_module_fn() -> nn.Module:
            return deferred_init.deferred_init(NestedModel, device=self.device)

        self._test_nested_model_with_meta_device(auto_wrap=auto_wrap, meta_module_fn=meta_module_fn)

    @requires_torchdistx
    @parametrize("auto_wrap", [True, False])
    def test_nested_model_with_torchdistX_init_fn(self, auto_wrap: bool) -> None:
        def meta_module_fn() -> nn.Module:
            return deferred_init.deferred_init(NestedModel, device=self.device)

        self._test_nested_model_with_meta_device(
            auto_wrap=auto_wrap, meta_module_fn=meta_module_fn, init_fn=_init_with_torchdistX
        )

    def _test_bad_arg(self, meta_module_fn: Callable[[], nn.Module]) -> None:
        mod = meta_module_fn()
        with self.assertRaisesRegex(ValueError, "to be callable"):
            FSDP(mod, param_init_fn=42)

    @requires_torchdistx
    def test_bad_arg_torchdistx(self) -> None:
        def meta_module_fn() -> nn.Module:
            return deferred_init.deferred_init(NestedModel, self.device)

        self._test_bad_arg(meta_module_fn)

    def test_bad_arg_meta(self) -> None:
        """A param_init_fn that is not callable raises for a meta module."""

        def meta_module_fn() -> nn.Module:
            return NestedModel(device="meta")

        self._test_bad_arg(meta_module_fn)

    def test_meta_device_with_mixed_precision(self) -> None:
        """A meta model whose root param_init_fn runs after an inner unit was
        built, with full-precision parameters and fp16 reduction, wraps."""

        class FakeLinear(nn.Module):
            def __init__(self, in_dim: int, out_dim: int, device: torch.device | str) -> None:
                super().__init__()
                self.weight = nn.Parameter(torch.randn((in_dim, out_dim), device=device))

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return x @ self.weight

        class Model(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.lin1 = nn.Linear(5, 5, device="meta")
                self.lin2 = FakeLinear(5, 5, device="meta")
                self.relu = nn.ReLU()

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return self.lin2(self.relu(self.lin1(x)))

            def _module_init_fn(self, module: nn.Module) -> None:
                if isinstance(module, nn.Linear):
                    torch.nn.init.normal_(module.weight, mean=0.0, std=0.1)
                    if module.bias is not None:
                        torch.nn.init.zeros_(module.bias)

        def _param_init_fn(module: nn.Module) -> None:
            # Recursive on purpose: it also reaches the inner unit's module.
            module.to_empty(device=self.device)
            module.apply(model._module_init_fn)

        model = Model()
        # Wrapping the linears means the root's param_init_fn reaches them
        # after they were wrapped.
        FSDP(
            model,
            auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
            mixed_precision=MixedPrecision(param_dtype=torch.float32, reduce_dtype=torch.float16),
            param_init_fn=_param_init_fn,
            device_id=self.device,
        )
