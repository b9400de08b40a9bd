"""Parameter flattening and shard metadata (port of upstream ``test_fsdp_flatten_params.py``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fsdptest import FSDPTest
from fsdptest.api import FSDP, FlatParamHandle, FlatParamShardMetadata, HandleShardingStrategy

InputFn = Callable[[torch.device, torch.dtype], tuple[torch.Tensor, ...]]


class EmptyModule(nn.Module):
    """A module without parameters."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1

    def get_input(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        torch.manual_seed(1)
        return torch.rand(1).to(device=device, dtype=dtype)


class TransformerWithInput(nn.Transformer):
    """``nn.Transformer`` that makes its own (seeded) input."""

    def get_input(self, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        torch.manual_seed(1)
        src = torch.rand(20, 8, 32).to(device=device, dtype=dtype)
        tgt = torch.rand(10, 8, 32).to(device=device, dtype=dtype)
        return (src, tgt)


def get_input_fn(module: nn.Module) -> InputFn:
    """The test module's ``get_input`` (FSDP forwards the attribute to its module)."""
    get_input = module.get_input
    assert callable(get_input)
    return get_input


def expected_metadata(**fields: Any) -> FlatParamShardMetadata:
    """``FlatParamShardMetadata`` of the fields the implementation has.

    Torch's records each parameter's strides and contiguity too (``param_strides``,
    ``param_contiguities``, newer than the seed); ours does not, so those two are
    left out for it. Every field the implementation has must be given.
    """
    missing = set(FlatParamShardMetadata._fields) - set(fields)
    assert not missing, f"expected metadata lacks {sorted(missing)}"
    return FlatParamShardMetadata(
        **{name: value for name, value in fields.items() if name in FlatParamShardMetadata._fields}
    )


def maybe_half(module: nn.Module, half: bool) -> nn.Module:
    return module.half() if half else module


class TestFlattenParams(FSDPTest):
    """Tests parameter flattening and shard metadata logic."""

    @property
    def world_size(self) -> int:
        # One rank: these unit tests check only the flattening logic or call the
        # sharding subroutines directly, which needs no more processes.
        return 1

    def _get_default_config(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "sharding_strategy": HandleShardingStrategy.FULL_SHARD,
            "offload_params": False,
            "mp_param_dtype": None,
            "mp_reduce_dtype": None,
            "keep_low_precision_grads": False,
            "process_group": self.process_group,
            "use_orig_params": False,
            "fsdp_extension": None,
        }

    def _get_transformer(self, seed: int = 0) -> TransformerWithInput:
        torch.manual_seed(seed)
        module = TransformerWithInput(
            d_model=32,
            num_encoder_layers=2,
            num_decoder_layers=2,
            dim_feedforward=128,
            dropout=0.1,
        )
        module.register_buffer("dummy_buffer", torch.tensor(1.0))
        return module

    def _get_shared_params_transformer(self, seed: int = 0) -> TransformerWithInput:
        module = self._get_transformer(seed=seed)
        # Share the feed-forward weights of each encoder layer with a decoder layer.
        for enc_layer, dec_layer in zip(module.encoder.layers, module.decoder.layers):
            dec_layer.linear1.weight = enc_layer.linear1.weight
            dec_layer.linear2.weight = enc_layer.linear2.weight
        return module

    def test_partial_flattening(self) -> None:
        """Flattening some submodules leaves the others' parameters alone, keeps the
        total numel, and ``module.to(dtype)`` reaches the flat parameters."""
        self.run_subtests({"half": [False, True]}, self._test_partial_flattening)

    def _test_partial_flattening(self, half: bool) -> None:
        module = maybe_half(self._get_transformer(), half)
        numel = sum(p.numel() for p in module.parameters())

        encoder_1_params = list(module.encoder.layers[1].parameters())
        decoder_0_params = list(module.decoder.layers[0].parameters())
        params_to_flatten = encoder_1_params + decoder_0_params
        num_params = [len(encoder_1_params), len(decoder_0_params)]
        numel_to_flatten = sum(p.numel() for p in params_to_flatten)

        module.encoder.layers[1] = FSDP(module.encoder.layers[1])
        module.decoder.layers[0] = FSDP(module.decoder.layers[0])
        flat_params = [
            module.encoder.layers[1]._flat_param,
            module.decoder.layers[0]._flat_param,
        ]

        self.assertEqual(sum(fp.numel() for fp in flat_params), numel_to_flatten)
        self.assertEqual(sum(p.numel() for p in module.parameters()), numel)

        # The flattened parameters are replaced by one `FlatParameter` each ...
        self.assertEqual(len(list(module.encoder.layers[1].parameters())), 1)
        self.assertEqual(len(list(module.decoder.layers[0].parameters())), 1)
        # ... and the others are left as they were.
        self.assertEqual(len(list(module.encoder.layers[0].parameters())), num_params[0])
        self.assertEqual(len(list(module.decoder.layers[1].parameters())), num_params[1])

        # `module.to()` reaches the `FlatParameter`s.
        orig_dtype = params_to_flatten[0].dtype
        new_dtype = torch.float32 if orig_dtype == torch.float16 else torch.float16
        self._assert_dtypes(module, flat_params, orig_dtype)
        module = module.to(dtype=new_dtype)
        self._assert_dtypes(module, flat_params, new_dtype)

    def _assert_dtypes(
        self, module: nn.Module, flat_params: list[nn.Parameter], dtype: torch.dtype
    ) -> None:
        for flat_param in flat_params:
            self.assertEqual(flat_param.dtype, dtype)
        self.assertTrue(all(p.dtype == dtype for p in module.encoder.layers[0].parameters()))

    def test_flatten_nothing(self) -> None:
        """Constructing a ``FlatParamHandle`` with no parameters raises."""
        self.run_subtests({"half": [False, True]}, self._test_flatten_nothing)

    def _test_flatten_nothing(self, half: bool) -> None:
        module = maybe_half(self._get_transformer(), half)
        with self.assertRaisesRegex(
            ValueError,
            "Cannot construct a FlatParamHandle with an empty parameter list",
        ):
            FlatParamHandle([], module, **self._get_default_config())

    def test_empty_module(self) -> None:
        """FSDP over a module without parameters has no flat parameter and computes the
        module's output."""
        module = self._get_empty_module()
        in_data = torch.rand(1)
        ref_out = module(in_data)
        fsdp_module = FSDP(module)
        self.assertEqual(len(list(fsdp_module.parameters())), 0)
        self.assertIsNone(fsdp_module._flat_param)
        fsdp_out = fsdp_module(in_data)
        self.assertEqual(ref_out, fsdp_out)

    def _get_empty_module(self) -> EmptyModule:
        """Returns a module with no parameters."""
        torch.manual_seed(0)
        return EmptyModule()

    def test_numel_without_shared_params(self) -> None:
        """Flattening keeps the numel when no parameter is shared."""
        self.run_subtests({"half": [False, True]}, self._test_numel_without_shared_params)

    def _test_numel_without_shared_params(self, half: bool) -> None:
        self._test_numel(maybe_half(self._get_transformer(), half))

    def test_numel_with_shared_params(self) -> None:
        """Flattening keeps the numel (shared parameters counted once) when parameters
        are shared."""
        self.run_subtests({"half": [False, True]}, self._test_numel_with_shared_params)

    def _test_numel_with_shared_params(self, half: bool) -> None:
        self._test_numel(maybe_half(self._get_shared_params_transformer(), half))

    def _test_numel(self, module: nn.Module) -> None:
        ref_numel = sum(p.numel() for p in module.parameters())
        params_to_flatten = list(module.parameters())
        flat_param_handle = FlatParamHandle(params_to_flatten, module, **self._get_default_config())
        self.assertEqual(ref_numel, flat_param_handle.flat_param.numel())

    def test_output_without_shared_params(self) -> None:
        """A forward after flattening gives the unflattened module's output (no shared
        parameters)."""
        self.run_subtests({"half": [False, True]}, self._test_output_without_shared_params)

    def _test_output_without_shared_params(self, half: bool) -> None:
        self._test_output(maybe_half(self._get_transformer(), half))

    def test_output_with_shared_params(self) -> None:
        """A forward after flattening gives the unflattened module's output (shared
        parameters)."""
        self.run_subtests({"half": [False, True]}, self._test_output_with_shared_params)

    def _test_output_with_shared_params(self, half: bool) -> None:
        self._test_output(maybe_half(self._get_shared_params_transformer(), half))

    def _test_output(self, module: nn.Module) -> None:
        module = module.to(self.device)
        ref_output = self._get_output(module)
        fsdp_module = FSDP(module)
        fsdp_output = self._get_output(fsdp_module)
        self.assertEqual(ref_output, fsdp_output)

    def _get_output(self, module: nn.Module) -> torch.Tensor:
        param = next(module.parameters())
        input = get_input_fn(module)(param.device, param.dtype)
        return module(*input)

    def test_pnorm_after_step_with_shared_params(self) -> None:
        """The parameters' Frobenius norm after an optimizer step matches the
        unflattened module's with shared parameters: sharing handled wrongly would
        show in the step."""
        self.run_subtests({"half": [False, True]}, self._test_pnorm_after_step_with_shared_params)

    def _test_pnorm_after_step_with_shared_params(self, half: bool) -> None:
        module = maybe_half(self._get_shared_params_transformer().to(self.device), half)
        ref_pnorm_after_step = self._get_pnorm_after_step(module)
        module = maybe_half(self._get_shared_params_transformer().to(self.device), half)
        fsdp_module = FSDP(module)
        fsdp_pnorm_after_step = self._get_pnorm_after_step(fsdp_module)
        self.assertEqual(ref_pnorm_after_step, fsdp_pnorm_after_step)

    def _get_pnorm_after_step(self, module: nn.Module) -> torch.Tensor:
        optim = torch.optim.SGD(module.parameters(), lr=0.01)
        loss = self._get_output(module).sum()
        loss.backward()
        optim.step()
        return torch.norm(torch.stack([p.detach().norm() for p in module.parameters()]))

    def test_flat_param_shard_metadata_aligned_full_precision(self) -> None:
        """Shard metadata skip the alignment padding of fp32 parameters
        (``use_orig_params=True``) but account for it."""
        module = nn.Sequential(
            nn.Linear(3, 7, bias=False),  # 0.weight
            nn.Linear(7, 5, bias=False),  # 1.weight
            nn.Linear(5, 5, bias=False),  # 2.weight
        )
        handle = self._aligned_handle(module, mp_param_dtype=None)
        # In fp32 FSDP pads each original parameter with up to 3 elements to a numel
        # of 0 mod 4 (0 mod 16 bytes), so the unsharded flat parameter is laid out as
        #   21 + (3) + 35 + (1) + 25
        # where (x) is x padding elements: 85 elements in all.
        self._test_flat_param_shard_metadata(
            handle,
            # rank 0 of 2
            start=0,
            end=42,
            expected=expected_metadata(
                param_names=["0.weight", "1.weight"],
                param_shapes=[(7, 3), (5, 7)],
                param_strides=[(3, 1), (7, 1)],
                param_contiguities=[True, True],
                param_numels=[21, 35],
                # 21 + (3) + 19 = 43
                param_offsets=[(0, 20), (0, 18)],
            ),
        )
        self._test_flat_param_shard_metadata(
            handle,
            # rank 1 of 2
            start=43,
            end=85,
            expected=expected_metadata(
                param_names=["1.weight", "2.weight"],
                param_shapes=[(5, 7), (5, 5)],
                param_strides=[(7, 1), (5, 1)],
                param_contiguities=[True, True],
                param_numels=[35, 25],
                # 16 + (1) + 25 = 42
                param_offsets=[(19, 34), (0, 24)],
            ),
        )

    def test_flat_param_shard_metadata_aligned_mixed_precision(self) -> None:
        """Shard metadata skip the alignment padding of fp16 compute parameters
        (``use_orig_params=True``) but account for it."""
        module = nn.Sequential(
            nn.Linear(2, 5, bias=False),  # 0.weight
            nn.Linear(5, 5, bias=False),  # 1.weight
            nn.Linear(5, 3, bias=False),  # 2.weight
        )
        handle = self._aligned_handle(module, mp_param_dtype=torch.float16)
        # In 16-bit mixed precision FSDP pads each original parameter with up to 7
        # elements to a numel of 0 mod 8 (0 mod 16 bytes), so the unsharded flat
        # parameter is laid out as
        #   10 + (6) + 25 + (7) + 15
        # where (x) is x padding elements: 63 elements in all.
        self._test_flat_param_shard_metadata(
            handle,
            # rank 0 of 2
            start=0,
            end=31,
            expected=expected_metadata(
                param_names=["0.weight", "1.weight"],
                param_shapes=[(5, 2), (5, 5)],
                param_strides=[(2, 1), (5, 1)],
                param_contiguities=[True, True],
                param_numels=[10, 25],
                # 10 + (6) + 16 = 32
                param_offsets=[(0, 9), (0, 15)],
            ),
        )
        self._test_flat_param_shard_metadata(
            handle,
            # rank 1 of 2
            start=32,
            end=63,
            expected=expected_metadata(
                param_names=["1.weight", "2.weight"],
                param_shapes=[(5, 5), (3, 5)],
                param_strides=[(5, 1), (5, 1)],
                param_contiguities=[True, True],
                param_numels=[25, 15],
                # 9 + (7) + 15 = 31
                param_offsets=[(16, 24), (0, 14)],
            ),
        )

    def _aligned_handle(
        self, module: nn.Module, mp_param_dtype: torch.dtype | None
    ) -> FlatParamHandle:
        """A handle over every parameter of ``module`` with ``use_orig_params=True``,
        which aligns each original parameter."""
        handle_kwargs = self._get_default_config()
        handle_kwargs["use_orig_params"] = True
        handle_kwargs["mp_param_dtype"] = mp_param_dtype
        return FlatParamHandle(list(module.parameters()), module, **handle_kwargs)

    def _test_flat_param_shard_metadata(
        self,
        handle: FlatParamHandle,
        start: int,
        end: int,
        expected: FlatParamShardMetadata,
    ) -> None:
        """Checks ``_get_shard_metadata()``, which computes the shard metadata of the
        range ``[start, end]`` (both inclusive) of the unsharded flat parameter.

        Its result is set on the flat parameter by hand, so that ``shard_metadata()``
        shows it: normally ``_init_shard_metadata()`` sets it, with the range fixed by
        the rank and the world size.
        """
        flat_param = handle.flat_param
        flat_param._shard_param_infos = handle._get_shard_metadata(start, end)
        shard_metadata = handle.shard_metadata()
        self.assertEqual(shard_metadata, expected, msg=f"{handle.shard_metadata()}, {expected}")
