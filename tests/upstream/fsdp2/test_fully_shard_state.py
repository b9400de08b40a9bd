# An FSDP2 test file in the style of upstream's
# test/distributed/_composable/fsdp/test_fully_shard_state.py, written for this project.
# Only its imports differ from a file written against torch.testing._internal; each
# says what it replaces.

import copy

import torch.nn as nn

from fsdptest.api import FSDPModule, fully_shard  # torch.distributed.fsdp
from upstream.common_fsdp import MLP, FSDPTestMultiThread  # ..._internal.common_fsdp
from upstream.common_utils import run_tests  # torch.testing._internal.common_utils


class TestFullyShardState(FSDPTestMultiThread):
    @property
    def world_size(self) -> int:
        return 1

    def test_fully_shard_state(self):
        """The state object of a sharded module, one per fully_shard call."""
        num_mlps = 3
        model = nn.Sequential(*[MLP(8) for _ in range(num_mlps)])
        for mlp in model:
            fully_shard(mlp)
        fully_shard(model)
        root_state = fully_shard.state(model)
        self.assertTrue(root_state is not None)
        all_states = [root_state] + [fully_shard.state(mlp) for mlp in model]
        self.assertEqual(len(set(all_states)), num_mlps + 1)

    def test_fully_shard_reapply(self):
        model = MLP(8)
        fully_shard(model)
        with self.assertRaisesRegex(
            AssertionError,
            "Each distinct composable distributed API can only be applied to a module once.",
        ):
            fully_shard(model)

    def test_fully_shard_cls(self):
        # Only the module given to fully_shard changes class
        model = MLP(8)
        fully_shard(model)
        self.assertTrue(isinstance(model, MLP))
        self.assertTrue(isinstance(model, FSDPModule))
        self.assertEqual(model.__class__.__name__, "FSDPMLP")
        for module in model.modules():
            if module is not model:
                self.assertFalse(isinstance(module, FSDPModule))
        # A slice of a sharded Sequential is a plain Sequential
        model = nn.Sequential(*[MLP(8) for _ in range(3)])
        fully_shard(model)
        self.assertTrue(isinstance(model, nn.Sequential))
        self.assertTrue(isinstance(model, FSDPModule))
        self.assertEqual(model.__class__.__name__, "FSDPSequential")
        sliced_model = model[:2]
        self.assertTrue(isinstance(sliced_model, nn.Sequential))
        self.assertFalse(isinstance(sliced_model, FSDPModule))

    def test_fully_shard_unsupported_module_cls(self):
        regex = r"fully\_shard does not support containers that do not implement forward"
        model = nn.ModuleList([MLP(8) for _ in range(3)])
        with self.assertRaisesRegex(ValueError, regex):
            fully_shard(model)
        model = nn.ModuleDict({"1": MLP(8), "2": MLP(8)})
        with self.assertRaisesRegex(ValueError, regex):
            fully_shard(model)

    def test_fully_shard_deepcopy(self):
        model = MLP(8)
        fully_shard(model)
        with self.assertRaisesRegex(AssertionError, "FSDP does not support deepcopy"):
            copy.deepcopy(model)


if __name__ == "__main__":
    run_tests()
