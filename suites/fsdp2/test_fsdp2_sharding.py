"""How ``fully_shard`` lays out each parameter: dim-0 chunks like ``torch.chunk``
for every shape and dtype (empty past the last chunk), the full tensor kept, names,
order, ``requires_grad`` and the module tree unchanged, ``shard_placement_fn`` on
every dimension, nested groups that leave a child's parameters to the child, and
buffers (persistent or not) left alone. Facts from upstream's
``test_fully_shard_init.py``. Construction only: every check here is cheap, and
the matrices are wide.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from fsdptest.api import FSDPModule, fully_shard
from models import MLP
from suites.fsdp2.helpers import CollectiveLog, FSDP2Test, batch, mlp_stack, shard_each

SHAPES = [
    (1,),
    (2,),
    (3,),
    (5,),
    (7,),
    (8,),
    (13,),
    (3, 4),
    (5, 1),
    (1, 5),
    (6, 3, 2),
    (7, 2, 2, 3),
]
DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]


class Holder(nn.Module):
    """One parameter of a given shape and dtype (and a forward that uses it)."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(*shape).to(dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight.sum()


class TestFullyShardLayout(FSDP2Test):
    def test_dim0_chunks_for_every_shape_and_dtype(self) -> None:
        """The local shard is the rank's ``torch.chunk`` of dim 0 (empty past the
        last chunk), the DTensor keeps the shape, dtype and requires_grad, and its
        full tensor is the original."""
        self.run_subtests({"shape": SHAPES, "dtype": DTYPES}, self._chunks)

    def _chunks(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        torch.manual_seed(0)
        module = Holder(shape, dtype).to(self.device)
        original = module.weight.detach().clone()
        fully_shard(module)
        param = module.weight
        self.assertIsInstance(param, DTensor)
        self.assertEqual(
            (tuple(param.shape), param.dtype, param.requires_grad), (shape, dtype, True)
        )
        chunks = torch.chunk(original, self.world_size, dim=0)
        expected = chunks[self.rank] if self.rank < len(chunks) else original[:0]
        self.assertEqual(param.to_local(), expected)
        self.assertEqual(param.full_tensor(), original)

    def test_shard_placement_fn_on_every_dim(self) -> None:
        """``Shard(d)`` for each dimension d of a tensor whose size there is divisible
        by 2, 3 and 4: the local shard is the rank's chunk along d."""
        cases = [
            ((12, 24), 0),
            ((12, 24), 1),
            ((24, 12, 12), 0),
            ((24, 12, 12), 1),
            ((24, 12, 12), 2),
        ]
        self.run_subtests({"shape_and_dim": cases}, self._placed)

    def _placed(self, shape_and_dim: tuple[tuple[int, ...], int]) -> None:
        shape, dim = shape_and_dim
        torch.manual_seed(0)
        module = Holder(shape, torch.float32).to(self.device)
        original = module.weight.detach().clone()
        fully_shard(module, shard_placement_fn=lambda _: Shard(dim))
        self.assertEqual(tuple(module.weight.placements), (Shard(dim),))
        expected = torch.chunk(original, self.world_size, dim=dim)[self.rank]
        self.assertEqual(module.weight.to_local(), expected)

    def test_names_order_and_requires_grad_are_kept(self) -> None:
        """``named_parameters``, ``named_modules`` and each ``requires_grad`` are as
        before sharding, for several ways of grouping."""
        self.run_subtests({"grouping": ["root", "children", "linears", "nested"]}, self._kept)

    def _kept(self, grouping: str) -> None:
        model = mlp_stack(5, depth=3, bias=True)
        model[1].out_proj.weight.requires_grad_(False)
        before = [(n, p.shape, p.requires_grad) for n, p in model.named_parameters()]
        modules = [n for n, _ in model.named_modules()]
        linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
        groups = {
            "root": [],
            "children": list(model),
            "linears": linears,
            "nested": [*linears, *model],
        }
        shard_each(model, groups[grouping])
        self.assertEqual(
            [(n, p.shape, p.requires_grad) for n, p in model.named_parameters()], before
        )
        self.assertEqual([n for n, _ in model.named_modules()], modules)
        sharded = [m for m in model.modules() if isinstance(m, FSDPModule)]
        self.assertEqual(len(sharded), len(groups[grouping]) + 1)

    def test_fully_shard_returns_the_module(self) -> None:
        """``fully_shard(m)`` returns ``m`` itself (now an ``FSDPModule``)."""
        module = MLP(4)
        self.assertIs(fully_shard(module), module)

    def test_buffers_are_left_alone(self) -> None:
        """Persistent and non-persistent buffers stay plain tensors on the device,
        the non-persistent ones out of the state dict."""
        self.run_subtests({"persistent": [True, False]}, self._buffers)

    def _buffers(self, persistent: bool) -> None:
        module = nn.Linear(3, 3).to(self.device)
        module.register_buffer("stat", torch.arange(5.0, device=self.device), persistent=persistent)
        fully_shard(module)
        self.assertFalse(isinstance(module.stat, DTensor))
        self.assertEqual(module.stat, torch.arange(5.0, device=self.device))
        self.assertEqual("stat" in module.state_dict(), persistent)

    def test_nested_groups_leave_children_their_parameters(self) -> None:
        """A parent's group holds only the parameters no child group holds: each
        forward all-gathers each group's own share once (sizes add up to the model's
        padded shards), whatever the nesting depth."""
        self.run_subtests({"depth": [1, 2, 3]}, self._nested)

    def _nested(self, depth: int) -> None:
        torch.manual_seed(0)
        innermost = nn.Linear(4, 4)
        model: nn.Module = innermost
        for _ in range(depth):
            model = Wrap(model, 4)
        model = model.to(self.device)
        wraps = [m for m in model.modules() if isinstance(m, Wrap)]  # outermost first
        for module in [innermost, *reversed(wraps)]:  # bottom-up
            fully_shard(module)
        with CollectiveLog(("all_gather",)) as log:
            model(batch(self.rank, 0, 2, 4))
        # Every group holds one Linear(4, 4): one all-gather each, all of one size
        self.assertEqual(log.count("all_gather"), depth + 1)
        self.assertEqual(len({c.numel for c in log.of("all_gather")}), 1)


class Wrap(nn.Module):
    """A linear of its own around an inner module."""

    def __init__(self, inner: nn.Module, dim: int) -> None:
        super().__init__()
        self.inner = inner
        self.lin = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(torch.relu(self.inner(x)))


class FrozenHalfBeside(nn.Module):
    """A frozen bfloat16 table (3 elements per rank's shard: 6 bytes), managed
    before a float32 layer in the same group, so the all-gather buffer mixes
    dtypes (``uint8``) and the float32 shards start 6 bytes in."""

    def __init__(self, world_size: int) -> None:
        super().__init__()
        self.holder = nn.Module()
        self.holder.table = nn.Parameter(
            torch.arange(3 * world_size, dtype=torch.bfloat16), requires_grad=False
        )
        self.lin = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + self.holder.table.float().sum()


class TestFullyShardMixedDtypeBuffer(FSDP2Test):
    def test_unaligned_dtypes_in_one_all_gather(self) -> None:
        """A group whose shards of several dtypes do not fall on their dtypes'
        alignment in the shared byte buffer all-gathers every parameter whole
        (the frozen table's values, the layer's too) and trains."""
        torch.manual_seed(0)
        model = FrozenHalfBeside(self.world_size).to(self.device)
        reference = {n: p.detach().clone() for n, p in model.named_parameters()}
        fully_shard(model, reshard_after_forward=False)
        model(batch(self.rank, 0, 2, 3)).sum().backward()
        for name, param in model.named_parameters():
            self.assertEqual(param.full_tensor(), reference[name], msg=name)
            self.assertEqual(param.grad is None, name == "holder.table", msg=name)
