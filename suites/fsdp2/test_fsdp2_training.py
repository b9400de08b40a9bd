"""FSDP2 training equals a replicated reference: one and several parameter groups,
``reshard_after_forward`` as True, False or an int, several forwards before one
backward, shared and frozen parameters, activation checkpointing, unused
parameters, and DDP itself ([Note: FSDP2 parity recipe] in
``suites/fsdp2/helpers.py``). Facts from upstream's ``test_fully_shard_training.py``."""

from __future__ import annotations

import copy
import functools

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._composable import checkpoint
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint as utils_checkpoint

from fsdptest.api import fully_shard
from models import MLP, DoubleLinear
from suites.fsdp2.helpers import (
    LR,
    STEPS,
    FSDP2Test,
    batch,
    full_tensor,
    lockstep,
    mlp_stack,
    shard_each,
)
from upstream.common_fsdp import check_sharded_parity


def reshard_values(world_size: int) -> list[bool | int]:
    """True, False and every int a 1-D mesh of ``world_size`` accepts other than 1
    (the world size itself means True; a proper divisor reshards to a smaller mesh)."""
    return [True, False, *(d for d in range(2, world_size + 1) if world_size % d == 0)]


class TestFullyShardTrainingParity(FSDP2Test):
    def test_train_parity_single_group(self) -> None:
        """One parameter group (``fully_shard`` on the root only) trains as the
        reference, for even and uneven shapes, resharding after forward or not."""
        self.run_subtests(
            {"lin_shapes": [(4, 4), (5, 7), (3, 1)], "reshard_after_forward": [True, False]},
            self._single_group,
        )

    def _single_group(self, lin_shapes: tuple[int, int], reshard_after_forward: bool) -> None:
        d_in, d_out = lin_shapes

        def build() -> nn.Module:
            torch.manual_seed(0)
            return nn.Sequential(nn.Linear(d_in, d_out), nn.ReLU(), nn.Linear(d_out, d_out))

        run = lockstep(
            self,
            lambda: build().to(self.device),
            lambda m: fully_shard(m, reshard_after_forward=reshard_after_forward),
        )
        run.train(STEPS, (2, d_in))

    def test_train_parity_multi_group(self) -> None:
        """A group per MLP and one for the root train as the reference under every
        ``reshard_after_forward``, with SGD and Adam, even and uneven widths."""
        self.run_subtests(
            {
                "reshard_after_forward": reshard_values(self.world_size),
                "dim": [8, 5],
                "optim": [torch.optim.SGD, torch.optim.Adam],
            },
            self._multi_group,
        )

    def _multi_group(self, reshard_after_forward: bool | int, dim: int, optim: type) -> None:
        run = lockstep(
            self,
            lambda: mlp_stack(dim),
            functools.partial(shard_each, reshard_after_forward=reshard_after_forward),
            optim=optim,
        )
        run.train(STEPS, (2, dim))

    def test_train_parity_with_buffers_and_no_bias(self) -> None:
        """Buffers stay unsharded and are added as the reference's; bias-free linears."""
        self.run_subtests(
            {"bias": [True, False], "with_buffer": [True, False]},
            self._buffers,
        )

    def _buffers(self, bias: bool, with_buffer: bool) -> None:
        run = lockstep(self, lambda: mlp_stack(6, bias=bias, with_buffer=with_buffer), shard_each)
        run.train(STEPS, (3, 6))
        for (name, ours), (_, theirs) in zip(
            run.model.named_buffers(), run.reference.named_buffers(), strict=True
        ):
            self.assertFalse(isinstance(ours, DTensor), name)
            self.assertEqual(ours, theirs, msg=name)

    def test_multi_forward_before_backward(self) -> None:
        """Two forwards on different inputs, then one backward of both losses."""
        self.run_subtests({"reshard_after_forward": [True, False]}, self._multi_forward)

    def _multi_forward(self, reshard_after_forward: bool) -> None:
        run = lockstep(
            self,
            lambda: mlp_stack(8),
            functools.partial(shard_each, reshard_after_forward=reshard_after_forward),
        )
        for step in range(STEPS):
            xs = [batch(self.rank, 10 * step + i, 2, 8) for i in range(2)]
            losses = []
            for model in (run.model, run.reference):
                loss = sum(model(x).sum() for x in xs)
                loss.backward()
                losses.append(loss)
            from suites.fsdp2.helpers import average_gradients

            average_gradients(run.reference)
            self.assertEqual(losses[0], losses[1])
            check_sharded_parity(self, run.reference, run.model)
            run.step(step)

    def test_train_parity_with_activation_checkpointing(self) -> None:
        """Activation checkpointing (composable, or torch.utils.checkpoint in the
        forward) inside each group recomputes with the unsharded parameters."""
        self.run_subtests(
            {"checkpoint_impl": ["composable", "utils"], "reshard_after_forward": [True, False]},
            self._checkpointed,
        )

    def _checkpointed(self, checkpoint_impl: str, reshard_after_forward: bool) -> None:
        def build() -> nn.Module:
            model = mlp_stack(8)
            if checkpoint_impl == "composable":
                for mlp in model:
                    checkpoint(mlp)
                return model
            return CheckpointedStack(model)

        run = lockstep(
            self,
            build,
            lambda m: shard_each(m, _mlps(m), reshard_after_forward=reshard_after_forward),
        )
        run.train(STEPS, (2, 8))

    def test_unused_module_has_no_gradient(self) -> None:
        """A module the forward never calls gets no gradient, as in the reference,
        and its shard is left as it was."""
        self.run_subtests({"reshard_after_forward": [True, False]}, self._unused)

    def _unused(self, reshard_after_forward: bool) -> None:
        def build() -> nn.Module:
            torch.manual_seed(0)
            return DoubleLinear(6, use_second_linear=False).to(self.device)

        run = lockstep(
            self,
            build,
            lambda m: shard_each(m, [m.lin1], reshard_after_forward=reshard_after_forward),
        )
        before = run.model.lin2.weight.to_local().clone()
        run.train(STEPS, (2, 6))
        self.assertIsNone(run.model.lin2.weight.grad)
        self.assertEqual(run.model.lin2.weight.to_local(), before)

    def test_multiple_outputs(self) -> None:
        """A group whose forward returns two tensors, both used by the loss."""

        def build() -> nn.Module:
            torch.manual_seed(0)
            return DoubleLinear(6).to(self.device)

        run = lockstep(self, build, lambda m: shard_each(m, [m.lin1, m.lin2]))
        run.loss_fn = lambda out: out[0].sum() + 2 * out[1].sum()
        run.train(STEPS, (2, 6))


class CheckpointedStack(nn.Module):
    """A ``Sequential`` of MLPs whose forward checkpoints each with torch.utils."""

    def __init__(self, mlps: nn.Sequential) -> None:
        super().__init__()
        self.mlps = mlps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for mlp in self.mlps:
            x = utils_checkpoint(mlp, x, use_reentrant=False)
        return x


def _mlps(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, MLP)]


class TestFullyShardSharedAndFrozen(FSDP2Test):
    def test_shared_params(self) -> None:
        """A weight tied between the first and the last layer (in the root's group,
        the module that holds both) trains as the reference, and stays tied."""
        self.run_subtests({"reshard_after_forward": [True, False]}, self._shared)

    def _shared(self, reshard_after_forward: bool) -> None:
        run = lockstep(
            self,
            lambda: TiedModel(7).to(self.device),
            lambda m: shard_each(m, [m.middle], reshard_after_forward=reshard_after_forward),
        )
        run.train(STEPS, (3, 7))
        self.assertIs(run.model.first.weight, run.model.last.weight)

    def test_frozen_params(self) -> None:
        """Frozen layers (in groups of their own, or mixed into a group with trained
        ones) keep their values and get no gradient; the rest trains as the reference."""
        self.run_subtests(
            {
                "freeze": ["first_mlp", "in_projs", "all_but_last"],
                "reshard_after_forward": [True, False],
            },
            self._frozen,
        )

    def _frozen(self, freeze: str, reshard_after_forward: bool) -> None:
        def build() -> nn.Module:
            model = mlp_stack(8)
            frozen = {
                "first_mlp": list(model[0].parameters()),
                "in_projs": [p for mlp in model for p in mlp.in_proj.parameters()],
                "all_but_last": [p for mlp in model[:-1] for p in mlp.parameters()],
            }[freeze]
            for param in frozen:
                param.requires_grad_(False)
            return model

        run = lockstep(
            self, build, functools.partial(shard_each, reshard_after_forward=reshard_after_forward)
        )
        frozen_before = {
            n: p.to_local().clone() for n, p in run.model.named_parameters() if not p.requires_grad
        }
        run.train(STEPS, (2, 8))
        for name, param in run.model.named_parameters():
            if not param.requires_grad:
                self.assertIsNone(param.grad, name)
                self.assertEqual(param.to_local(), frozen_before[name], msg=name)


class TiedModel(nn.Module):
    """``first`` and ``last`` share one weight; ``middle`` is a group of its own."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(dim, dim, bias=False)
        self.middle = MLP(dim)
        self.last = nn.Linear(dim, dim)
        self.last.weight = self.first.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(self.middle(torch.relu(self.first(x))))


class TestFullyShardHSDP(FSDP2Test):
    world_size = 4

    def test_train_parity_hsdp(self) -> None:
        """A 2-D mesh (replicas x shards: 1x4, 2x2, 4x1): parameters are
        (Replicate(), Shard(0)) DTensors and train as the reference."""
        self.run_subtests(
            {"replicas": [1, 2, 4], "reshard_after_forward": [True, False]},
            self._hsdp,
        )

    def _hsdp(self, replicas: int, reshard_after_forward: bool) -> None:
        mesh = self.hsdp_mesh(replicas)
        run = lockstep(
            self,
            lambda: mlp_stack(8),
            functools.partial(shard_each, mesh=mesh, reshard_after_forward=reshard_after_forward),
        )
        run.train(STEPS, (2, 8))
        for name, param in run.model.named_parameters():
            self.assertEqual(tuple(param.placements), (_replicate(), _shard(0)), msg=name)

    def test_hsdp_reshard_after_forward_int(self) -> None:
        """``reshard_after_forward=2`` on a 1x4 mesh reshards to pairs after forward
        and trains as the reference."""
        mesh = self.hsdp_mesh(1)
        run = lockstep(
            self,
            lambda: mlp_stack(8),
            functools.partial(shard_each, mesh=mesh, reshard_after_forward=2),
        )
        run.train(STEPS, (2, 8))


def _replicate() -> object:
    from torch.distributed.tensor import Replicate

    return Replicate()


def _shard(dim: int) -> object:
    from torch.distributed.tensor import Shard

    return Shard(dim)


class TestFullyShardAgainstDDP(FSDP2Test):
    def test_parity_with_ddp(self) -> None:
        """The same model under DDP (the reference there is DDP itself) and FSDP2:
        equal losses every step and equal full parameters at the end."""
        self.run_subtests({"reshard_after_forward": [True, False], "depth": [1, 3]}, self._ddp)

    def _ddp(self, reshard_after_forward: bool, depth: int) -> None:
        model = mlp_stack(8, depth=depth)
        ddp = DDP(copy.deepcopy(model))
        shard_each(model, reshard_after_forward=reshard_after_forward)
        optims = [torch.optim.SGD(m.parameters(), lr=LR) for m in (model, ddp)]
        for step in range(STEPS):
            x = batch(self.rank, step, 2, 8)
            losses = [m(x).sum() for m in (model, ddp)]
            for loss, optim in zip(losses, optims, strict=True):
                loss.backward()
                optim.step()
                optim.zero_grad()
            self.assertEqual(losses[0], losses[1])
        for (name, ours), (_, theirs) in zip(
            model.named_parameters(), ddp.module.named_parameters(), strict=True
        ):
            self.assertEqual(full_tensor(ours), theirs, msg=name)


class TestFullyShardGradientArithmetic(FSDP2Test):
    def test_gradient_is_the_mean_over_ranks(self) -> None:
        """With a loss of ``(rank + 1) * sum(w)``, every gradient element is the
        mean of 1..W: a missing, doubled or shard-sized divide shows at any W."""
        self.run_subtests({"dim": [4, 5, 7]}, self._mean)

    def _mean(self, dim: int) -> None:
        torch.manual_seed(0)
        model = ParamSum(nn.Linear(dim, dim)).to(self.device)
        fully_shard(model)
        model(torch.tensor(float(self.rank + 1), device=self.device)).backward()
        expected = (self.world_size + 1) / 2
        for name, param in model.named_parameters():
            grad = param.grad.to_local()
            self.assertEqual(grad, torch.full_like(grad, expected), msg=name)

    def test_replicas_hold_equal_parameters_after_steps(self) -> None:
        """Ranks train on different data; afterwards every rank's full parameters
        are the same (all-gathered checksums agree)."""
        model = mlp_stack(8)
        shard_each(model)
        optim = torch.optim.SGD(model.parameters(), lr=LR)
        for step in range(STEPS):
            model(batch(self.rank, step, 2, 8)).sum().backward()
            optim.step()
            optim.zero_grad()
        checksum = torch.stack([full_tensor(p).sum() for p in model.parameters()])
        gathered = [torch.empty_like(checksum) for _ in range(self.world_size)]
        dist.all_gather(gathered, checksum)
        for other in gathered[1:]:
            self.assertEqual(other, gathered[0], rtol=0, atol=0)

    def test_every_rank_shard_changes(self) -> None:
        """After one step every rank's non-empty shard of every trained parameter
        has changed (no rank's shard is left out of the update). Linear layers
        without activations, so that no output unit is dead and every gradient row
        is non-zero."""
        torch.manual_seed(0)
        model = nn.Sequential(*(nn.Linear(8, 8) for _ in range(3))).to(self.device)
        shard_each(model)
        before = {n: p.to_local().clone() for n, p in model.named_parameters()}
        optim = torch.optim.SGD(model.parameters(), lr=1.0)
        model(batch(self.rank, 0, 4, 8)).square().sum().backward()
        optim.step()
        for name, param in model.named_parameters():
            if param.to_local().numel():
                self.assertNotEqual(param.to_local(), before[name], msg=name)

    def test_uneven_shards_follow_torch_chunk(self) -> None:
        """Dim-0 sizes not divisible by the world size shard like ``torch.chunk``:
        the local shard is the rank's chunk (empty past the last one), and the full
        tensor is the original."""
        self.run_subtests({"rows": [1, 3, 5, 7, 11]}, self._uneven)

    def _uneven(self, rows: int) -> None:
        torch.manual_seed(0)
        model = nn.Linear(3, rows).to(self.device)
        original = {n: p.detach().clone() for n, p in model.named_parameters()}
        fully_shard(model)
        for name, param in model.named_parameters():
            chunks = torch.chunk(original[name], self.world_size, dim=0)
            expected = chunks[self.rank] if self.rank < len(chunks) else original[name][:0]
            self.assertEqual(param.to_local(), expected, msg=name)
            self.assertEqual(param.full_tensor(), original[name], msg=name)


class ParamSum(nn.Module):
    """``scale * (sum of every parameter of the wrapped module)``: its gradient is
    ``scale`` everywhere."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, scale: torch.Tensor) -> torch.Tensor:
        return scale * sum(p.sum() for p in self.inner.parameters())


def _attach_float64_gather(
    local: torch.Tensor, seen: list[tuple[int, int, tuple[int, ...]]]
) -> None:
    """Torch's all-gather extension, monkey-patched onto one sharded weight's local
    tensor: the shard travels padded and in float64 (a lossless detour, so the
    training stays exactly the reference's), and the unsharded weight is cast
    back from the float64 rows. ``seen`` records each all-gather's mesh (its
    dimensions and size) and the weight's unsharded size."""

    def pre(
        self: torch.Tensor,
        mesh: object,
        outer_size: torch.Size,
        outer_stride: tuple[int, ...],
        module: nn.Module,
        mp_policy: object,
    ) -> tuple[tuple[torch.Tensor, ...], None]:
        seen.append((mesh.ndim, mesh.size(), tuple(outer_size)))  # type: ignore[attr-defined]
        rows = -(-outer_size[0] // mesh.size())  # type: ignore[attr-defined]
        padded = self.new_zeros((rows, *outer_size[1:]), dtype=torch.float64)
        padded[: self.size(0)].copy_(self)
        return (padded,), None

    @torch.no_grad()  # ``out`` is the unsharded parameter, a leaf that requires grad
    def post(
        self: torch.Tensor,
        outputs: tuple[torch.Tensor, ...],
        metadata: None,
        param_dtype: torch.dtype,
        *,
        out: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None:
        (gathered,) = outputs
        if out is not None:  # refill the unsharded weight autograd may have saved
            with torch.autograd._unsafe_preserve_version_counter(out):
                out.copy_(gathered[: out.size(0)])
            return None
        weight = gathered.to(param_dtype)
        return weight, (gathered, weight)

    local.fsdp_pre_all_gather = pre.__get__(local)  # type: ignore[attr-defined]
    local.fsdp_post_all_gather = post.__get__(local)  # type: ignore[attr-defined]


class TestFullyShardAllGatherExtensions(FSDP2Test):
    def test_extension_trains_as_the_reference(self) -> None:
        """Weights whose local tensors carry ``fsdp_pre_all_gather`` /
        ``fsdp_post_all_gather`` are all-gathered through them (float64 inputs
        sharing the group's buffer with the float32 biases, uneven shapes): every
        all-gather passes the 1-D shard mesh (on a 2-D mesh its shard dimension)
        and the weight's full size, forward and backward, and training matches the
        reference, with or without resharding after forward."""
        self.run_subtests(
            {"reshard_after_forward": [True, False], "replicas": [1, self.world_size]},
            self._extension_parity,
        )

    def _extension_parity(self, reshard_after_forward: bool, replicas: int) -> None:
        def build() -> nn.Module:
            torch.manual_seed(0)
            return nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3)).to(self.device)

        mesh = self.hsdp_mesh(replicas) if replicas > 1 else self.mesh()
        kwargs = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
        run = lockstep(self, build, lambda m: shard_each(m, [m[0], m[2]], **kwargs))
        seen: list[tuple[int, int, tuple[int, ...]]] = []
        for layer in (run.model[0], run.model[2]):
            _attach_float64_gather(layer.weight._local_tensor, seen)
        run.train(2, (3, 5))
        shard_size = self.world_size // replicas
        self.assertEqual({s[:2] for s in seen}, {(1, shard_size)})
        self.assertEqual({s[2] for s in seen}, {(7, 5), (3, 7)})
        gathers_per_step = 4 if reshard_after_forward else 2
        self.assertEqual(len(seen), 2 * gathers_per_step)

    def test_invalid_pre_all_gather_signature(self) -> None:
        """An ``fsdp_pre_all_gather`` taking neither ``(mesh)`` nor ``(mesh,
        outer_size, outer_stride, module, mp_policy)`` is refused at the first
        all-gather."""
        model = nn.Linear(4, 4).to(self.device)
        fully_shard(model)
        local = model.weight._local_tensor
        local.fsdp_pre_all_gather = lambda mesh, size: ((local,), None)
        local.fsdp_post_all_gather = lambda outputs, metadata, dtype, *, out=None: None
        with self.assertRaisesRegex(AssertionError, "Invalid fsdp_pre_all_gather"):
            model(batch(self.rank, 0, 2, 4))
