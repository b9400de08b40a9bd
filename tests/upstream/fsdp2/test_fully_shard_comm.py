# An FSDP2 test file in the style of upstream's
# test/distributed/_composable/fsdp/test_fully_shard_comm.py, written for this project.
# Only its imports differ from a file written against torch.testing._internal; each
# says what it replaces. It names its device "cuda" and counts GPUs: on CPU ranks it
# runs under --map-cuda-to-cpu (the folder's conftest).

import copy
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn as nn

from fsdptest.api import fully_shard  # torch.distributed.fsdp
from upstream.common_distributed import skip_if_lt_x_gpu  # ..._internal.common_distributed
from upstream.common_fsdp import (  # torch.testing._internal.common_fsdp
    MLP,
    FSDPTest,
    check_sharded_parity,
    patch_all_gather,
    patch_reduce_scatter,
    patch_unshard,
)
from upstream.common_utils import run_tests  # torch.testing._internal.common_utils
from upstream.fsdp2_param_group import (  # torch.distributed.fsdp._fully_shard._fsdp_param_group
    FSDPParamGroup,
)

EventType = tuple[str, str]


class TestFullyShardCommunication(FSDPTest):
    @property
    def world_size(self) -> int:
        return min(4, torch.cuda.device_count())

    @skip_if_lt_x_gpu(2)
    def test_fully_shard_communication_count(self):
        """How many all-gathers and reduce-scatters a forward and a backward issue."""
        self.run_subtests(
            {"reshard_after_forward": [True, False, self.world_size]},
            self._test_communication_count,
        )

    def _test_communication_count(self, reshard_after_forward):
        torch.manual_seed(42)
        num_blocks, dim = 3, 16
        model = nn.Sequential(*[MLP(dim) for _ in range(num_blocks)], nn.Linear(dim, dim)).cuda()
        for block in model[:num_blocks]:
            fully_shard(block, reshard_after_forward=reshard_after_forward)
        fully_shard(model, reshard_after_forward=reshard_after_forward)
        # One all-gather per group in forward: the blocks' and the root's (its linear)
        with self._patch_comms() as counts:
            loss = model(torch.randn((2, dim), device="cuda"))
            self.assertEqual(counts["all_gather"], num_blocks + 1)
            self.assertEqual(counts["reduce_scatter"], 0)
        # In backward the groups that resharded all-gather again; all reduce-scatter
        with self._patch_comms() as counts:
            loss.sum().backward()
            expected_all_gathers = num_blocks + 1 if reshard_after_forward else 0
            self.assertEqual(counts["all_gather"], expected_all_gathers)
            self.assertEqual(counts["reduce_scatter"], num_blocks + 1)

    @contextmanager
    def _patch_comms(self):
        counts = {"all_gather": 0, "reduce_scatter": 0}
        orig_all_gather = dist.all_gather_into_tensor
        orig_reduce_scatter = dist.reduce_scatter_tensor

        def all_gather_with_count(*args, **kwargs):
            counts["all_gather"] += 1
            return orig_all_gather(*args, **kwargs)

        def reduce_scatter_with_count(*args, **kwargs):
            counts["reduce_scatter"] += 1
            return orig_reduce_scatter(*args, **kwargs)

        with (
            patch_all_gather(all_gather_with_count),
            patch_reduce_scatter(reduce_scatter_with_count),
        ):
            yield counts

    @skip_if_lt_x_gpu(2)
    def test_set_modules_to_forward_prefetch(self):
        """A block told to prefetch the next ones unshards them in its own forward."""
        torch.manual_seed(42)
        num_blocks, dim = 3, 8
        model = nn.Sequential(*[MLP(dim) for _ in range(num_blocks)]).cuda()
        ref_model = copy.deepcopy(model)
        ref_optim = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
        for block in model:
            fully_shard(block)
        fully_shard(model)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        events: list[EventType] = []
        unshard_with_record = self._get_unshard_with_record(FSDPParamGroup.unshard, events)
        inp = torch.randn((2, dim), device="cuda")
        for block, nxt in zip(model[:-1], model[1:]):
            block.set_modules_to_forward_prefetch([nxt])
        for i, block in enumerate(model):
            block.register_forward_hook(lambda *_, i=i: events.append(("forward", str(i))))
        with patch_unshard(unshard_with_record):
            for iter_idx in range(3):
                loss = model(inp)
                # Each block unshards the next in its own pre-forward: before its
                # forward ends
                for i in range(num_blocks - 1):
                    self.assertLess(
                        events.index(("unshard", str(i + 1))), events.index(("forward", str(i)))
                    )
                events.clear()
                loss.sum().backward()
                events.clear()
                for param in ref_model.parameters():
                    if param.grad is not None:
                        param.grad = None
                ref_loss = ref_model(inp)
                ref_loss.sum().backward()
                for param in ref_model.parameters():
                    dist.all_reduce(param.grad)
                    param.grad.div_(self.world_size)
                check_sharded_parity(self, ref_model, model)
                for _optim in (optim, ref_optim):
                    _optim.step()
                    _optim.zero_grad(set_to_none=(iter_idx % 2 == 0))

    def _get_unshard_with_record(self, orig_unshard, events):
        def unshard_with_record(self, *args, **kwargs):
            nonlocal events
            events.append(("unshard", self._module_fqn))
            return orig_unshard(self, *args, **kwargs)

        return unshard_with_record


if __name__ == "__main__":
    run_tests()
