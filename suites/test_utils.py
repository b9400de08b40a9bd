"""The container and state-dict helpers FSDP uses (port of the FSDP1 parts of
upstream ``test/distributed/fsdp/test_utils.py``).

``_apply_to_tensors`` finds the tensors of forward inputs and outputs in nested
containers; ``_replace_by_prefix`` renames state-dict keys. Under
``--fsdp-impl local`` they are this project's (``fsdp._utils``), under
``--fsdp-impl torch`` those of ``torch.distributed.utils``. These are
single-process tests, as upstream's.

Upstream mixes CPU tensors with tensors on an accelerator (``skip_if_lt_x_gpu(1)``);
without one, the meta device stands in as the second device: the helpers only
traverse and count, which works on meta tensors alike.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from fsdptest.api import _apply_to_tensors, _replace_by_prefix

LIST_DEVICE = "cuda" if torch.cuda.is_available() else "meta"


@dataclass
class NonFrozenDataClass:
    some_key: str
    some_float: float
    some_tensor: list[torch.Tensor]


@dataclass(frozen=True)
class FrozenDataClass:
    some_key: str
    some_float: float
    some_tensor: list[torch.Tensor]


class TestUtils:
    @pytest.mark.parametrize(
        "device_list",
        [["cpu"], [LIST_DEVICE], ["cpu", LIST_DEVICE]],
        ids=["device_list0", "device_list1", f"cpu_{LIST_DEVICE}"],
    )
    def test_apply_to_tensors(self, device_list: list[str]) -> None:
        """Every tensor of a nested structure is visited once, and every
        top-level element keeps its type (sets, dataclasses frozen or not,
        ``OrderedDict``)."""
        expected = 0

        def get_a_tensor() -> torch.Tensor:
            """Return a random tensor on random device."""
            nonlocal expected
            dev = random.choice(device_list)
            shape = random.choice(((1,), (2, 3), (4, 5, 6), (7, 8, 9, 10)))
            t = torch.rand(shape).to(dev)
            expected += t.numel()
            return t

        # create a mixed bag of data.
        data: list[Any] = [1, "str"]
        data.append({"key1": get_a_tensor(), "key2": {1: get_a_tensor()}, "key3": 3})
        data.insert(0, {"x", get_a_tensor(), get_a_tensor()})
        data.append(([1], get_a_tensor(), 1, [get_a_tensor()], {1, 2}))
        data.append({"non_frozen_ds": NonFrozenDataClass("some_key", 1.0, [get_a_tensor()])})
        data.append({"frozen_ds": FrozenDataClass("some_key", 1.0, [get_a_tensor()])})
        od = OrderedDict()
        od["k"] = "value"
        data.append(od)

        total = 0

        def fn(t: torch.Tensor) -> torch.Tensor:
            nonlocal total
            total += t.numel()
            return t

        new_data = _apply_to_tensors(fn, data)
        assert total == expected, f"{total} vs. {expected}"
        for i, v in enumerate(data):
            assert type(new_data[i]) is type(v), f"{type(new_data[i])} vs. {type(v)}"

    def test_replace_by_prefix(self) -> None:
        """Keys that start with the prefix are renamed in place; a key that
        contains it elsewhere is not; the reverse renaming restores the dict."""
        state_dict = {
            "layer.a": torch.tensor(1),
            "abc.layer.def": torch.tensor(2),
            "layer.b": torch.tensor(3),
        }
        original_state_dict = state_dict.copy()
        _replace_by_prefix(state_dict, "layer.", "module.layer.")
        assert state_dict == {
            "module.layer.a": torch.tensor(1),
            "abc.layer.def": torch.tensor(2),
            "module.layer.b": torch.tensor(3),
        }
        _replace_by_prefix(state_dict, "module.layer.", "layer.")
        assert state_dict == original_state_dict

    def test_packed_sequence(self) -> None:
        """A ``PackedSequence`` is handed over by its data, changed in place, and
        returned itself (what the function returns is not used)."""

        def fill_fn(x: torch.Tensor) -> None:
            x.fill_(0)

        x = torch.rand((5, 1, 5))
        seq_length = torch.tensor([4])
        rnn = nn.RNN(5, 5)
        x = pack_padded_sequence(x, seq_length)
        x, _ = rnn(x)
        x = _apply_to_tensors(fill_fn, x)
        x, _ = pad_packed_sequence(x)
        assert torch.sum(x) == 0
