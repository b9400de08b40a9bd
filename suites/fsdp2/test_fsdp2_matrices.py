"""Wide configuration matrices of cheap FSDP2 checks: each subtest builds a tiny
sharded model and checks one forward and backward exactly (or against the
replicated reference), so a bug that shows only for some shapes, dtypes,
groupings or policies is met by one of them (docs/guide/bug-classes.md: 1, 2, 5, 9, 10, 13).
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import functools

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fsdptest.api import MixedPrecisionPolicy, fully_shard
from suites.fsdp2.helpers import (
    CollectiveLog,
    FSDP2Test,
    average_gradients,
    batch,
    groups_with_parameters,
    lockstep,
    shard_each,
    skip_dataclass_outputs,
    skip_inf_norm_of_an_empty_shard,
)
from upstream.common_fsdp import check_sharded_parity

DTYPE_OPTIONS = [None, torch.float32, torch.bfloat16, torch.float16]


def linear_chain(dim: int, depth: int, bias: bool = True) -> nn.Sequential:
    from harness import current_device

    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(dim, dim, bias=bias) for _ in range(depth))).to(
        current_device()
    )


def group(model: nn.Sequential, grouping: str, **kwargs: object) -> None:
    """``root``: one group; ``children``: a group per layer but the last (the
    root's); ``each``: a group per layer and a root without parameters."""
    children = {"root": [], "children": list(model)[:-1], "each": list(model)}[grouping]
    shard_each(model, children, **kwargs)


class CastingLinear(nn.Linear):
    """A linear that records the dtype of its input, then computes in its weight's
    dtype (so an uncast fp32 input is the model's to handle)."""

    seen: torch.dtype | None = None

    def __init__(self, dim: int) -> None:
        super().__init__(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen = x.dtype
        return super().forward(x.to(self.weight.dtype))


class ParamSum(nn.Module):
    """``scale * (sum of the parameters of ``inner``)``: each gradient element is ``scale``."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, scale: torch.Tensor) -> torch.Tensor:
        return scale * sum(p.sum() for p in self.inner.parameters())


class TestFullyShardGradientMatrix(FSDP2Test):
    def test_mean_gradient_matrix(self) -> None:
        """``(rank + 1) * sum(w)`` gives every gradient element the mean of 1..W, for
        every width (padding included), dtype, bias and ``reshard_after_forward``."""
        self.run_subtests(
            {
                "dim": [1, 2, 3, 4, 5, 6, 7],
                "dtype": [torch.float32, torch.float64],
                "bias": [True, False],
                "reshard_after_forward": [True, False],
            },
            self._mean,
        )

    def test_mean_gradient_low_precision_matrix(self) -> None:
        """The same in float16 and bfloat16 parameters (the mean of 1..W is exact in
        both at these world sizes), widths 1 to 8: the reduction and its division
        run in the parameters' dtype."""
        self.run_subtests(
            {
                "dim": [1, 2, 3, 4, 5, 6, 7, 8],
                "dtype": [torch.float16, torch.bfloat16],
                "bias": [True, False],
                "reshard_after_forward": [True, False],
            },
            self._mean,
        )

    def _mean(self, dim: int, dtype: torch.dtype, bias: bool, reshard_after_forward: bool) -> None:
        torch.manual_seed(0)
        model = ParamSum(nn.Linear(dim, dim + 1, bias=bias)).to(self.device, dtype)
        # One group: ParamSum reads the inner module's parameters without calling it
        fully_shard(model, reshard_after_forward=reshard_after_forward)
        model(torch.tensor(float(self.rank + 1), device=self.device, dtype=dtype)).backward()
        expected = (self.world_size + 1) / 2
        for name, param in model.named_parameters():
            grad = param.grad.to_local()
            self.assertEqual(grad, torch.full_like(grad, expected), msg=name)

    def test_uneven_training_matrix(self) -> None:
        """A single linear of every row count from 1 to 13 (fewer rows than ranks,
        primes, multiples) trains as the reference with SGD and Adam."""
        self.run_subtests(
            {"rows": list(range(1, 14)), "optim": [torch.optim.SGD, torch.optim.Adam]},
            self._uneven,
        )

    def _uneven(self, rows: int, optim: type) -> None:
        def build() -> nn.Module:
            from harness import current_device

            torch.manual_seed(0)
            return nn.Linear(3, rows).to(current_device())

        run = lockstep(self, build, fully_shard, optim=optim)
        run.train(2, (2, 3))

    def test_clip_grad_norm_matrix(self) -> None:
        """The total norm over DTensor gradients equals the replicated one for every
        norm type, max norm, grouping and foreach."""
        self.run_subtests(
            {
                "norm_type": [1.0, 2.0, 3.0, float("inf")],
                "max_norm": [0.1, 1.0, 100.0],
                "grouping": ["root", "children"],
                "foreach": [False, True],
            },
            self._clip,
        )

    def _clip(self, norm_type: float, max_norm: float, grouping: str, foreach: bool) -> None:
        run = lockstep(
            self, lambda: linear_chain(4, 3), functools.partial(group, grouping=grouping)
        )
        skip_inf_norm_of_an_empty_shard(norm_type, run.reference, self.world_size)
        run.backward(batch(self.rank, 0, 2, 4), check=False)
        clip = functools.partial(
            nn.utils.clip_grad_norm_, max_norm=max_norm, norm_type=norm_type, foreach=foreach
        )
        ref_norm = clip(run.reference.parameters())
        self.assertEqual(clip(run.model.parameters()).full_tensor(), ref_norm)
        check_sharded_parity(self, run.reference, run.model)


class TestFullyShardPolicyMatrix(FSDP2Test):
    def test_mixed_precision_dtype_matrix(self) -> None:
        """For every combination of ``param_dtype``, ``reduce_dtype``,
        ``output_dtype`` and ``cast_forward_inputs``, on one group or several: the
        all-gathers carry the compute dtype, the reduce-scatters the reduce dtype
        (the compute dtype when unset), the output has the output dtype (else the
        compute dtype), the module's input has the compute dtype exactly when cast,
        and sharded parameters and gradients stay fp32."""
        self.run_subtests(
            {
                "param_dtype": DTYPE_OPTIONS,
                "reduce_dtype": [None, torch.float32, torch.bfloat16],
                "output_dtype": [None, torch.float32, torch.bfloat16],
                "cast_forward_inputs": [True, False],
                "grouping": ["root", "children", "each"],
            },
            self._dtypes,
        )

    def _dtypes(
        self,
        param_dtype: torch.dtype | None,
        reduce_dtype: torch.dtype | None,
        output_dtype: torch.dtype | None,
        cast_forward_inputs: bool,
        grouping: str,
    ) -> None:
        torch.manual_seed(0)
        model = nn.Sequential(*(CastingLinear(4) for _ in range(3))).to(self.device)
        policy = MixedPrecisionPolicy(param_dtype, reduce_dtype, output_dtype, cast_forward_inputs)
        group(model, grouping, mp_policy=policy)
        compute = param_dtype or torch.float32
        with CollectiveLog(("all_gather", "reduce_scatter")) as log:
            out = model(batch(self.rank, 0, 2, 4))
            self.assertEqual(out.dtype, output_dtype or compute)
            out.float().sum().backward()
        self.assertEqual({c.dtype for c in log.of("all_gather")}, {compute})
        self.assertEqual({c.dtype for c in log.of("reduce_scatter")}, {reduce_dtype or compute})
        self.assertEqual(model[0].seen, compute if cast_forward_inputs else torch.float32)
        for name, param in model.named_parameters():
            self.assertEqual(
                (param.dtype, param.grad.dtype), (torch.float32, torch.float32), msg=name
            )


class TestFullyShardStructureMatrix(FSDP2Test):
    def test_registration_matrix(self) -> None:
        """After forward every group's registered parameters are DTensors unless it
        does not reshard (then the full tensors), for every depth, width, grouping
        and ``reshard_after_forward``; all are DTensors after backward."""
        self.run_subtests(
            {
                "depth": [1, 2, 3],
                "dim": [1, 2, 3, 5],
                "reshard_after_forward": [True, False],
                "grouping": ["root", "children", "each"],
            },
            self._registration,
        )

    def _registration(
        self, depth: int, dim: int, reshard_after_forward: bool, grouping: str
    ) -> None:
        model = linear_chain(dim, depth)
        full = {n: p.detach().clone() for n, p in model.named_parameters()}
        group(model, grouping, reshard_after_forward=reshard_after_forward)
        out = model(batch(self.rank, 0, 2, dim))
        for name, param in model.named_parameters():
            if reshard_after_forward:
                self.assertIsInstance(param, DTensor, name)
            else:
                self.assertEqual(param, full[name], msg=name)
        out.sum().backward()
        for name, param in model.named_parameters():
            self.assertIsInstance(param, DTensor, name)

    def test_communication_count_matrix(self) -> None:
        """One all-gather per group in forward; in backward one per resharded group;
        one reduce-scatter per group; for every depth and grouping."""
        self.run_subtests(
            {
                "depth": [1, 2, 3, 4],
                "reshard_after_forward": [True, False],
                "grouping": ["root", "children"],
            },
            self._counts,
        )

    def _counts(self, depth: int, reshard_after_forward: bool, grouping: str) -> None:
        model = linear_chain(3, depth)
        group(model, grouping, reshard_after_forward=reshard_after_forward)
        groups = groups_with_parameters(model)
        with CollectiveLog(("all_gather", "reduce_scatter")) as log:
            out = model(batch(self.rank, 0, 2, 3))
            self.assertEqual(log.count("all_gather"), groups)
            log.calls.clear()
            out.sum().backward()
        self.assertEqual(log.count("all_gather"), groups if reshard_after_forward else 0)
        self.assertEqual(log.count("reduce_scatter"), groups)

    def test_state_dict_round_trip_matrix(self) -> None:
        """A state dict of any width, dtype and grouping loads into a model sharded
        from other weights, which then holds the same shards."""
        self.run_subtests(
            {
                "dim": [1, 2, 3, 5, 6, 7],
                "dtype": [torch.float32, torch.bfloat16, torch.float64],
                "grouping": ["root", "children"],
            },
            self._state_dict,
        )

    def _state_dict(self, dim: int, dtype: torch.dtype, grouping: str) -> None:
        models = []
        for seed in (0, 1):
            torch.manual_seed(seed)
            model = nn.Sequential(nn.Linear(dim, dim), nn.Linear(dim, 2)).to(self.device, dtype)
            group(model, grouping)
            models.append(model)
        models[1].load_state_dict(models[0].state_dict())
        for (name, a), (_, b) in zip(
            models[0].named_parameters(), models[1].named_parameters(), strict=True
        ):
            self.assertEqual(a.to_local(), b.to_local(), msg=name)
            self.assertEqual(a.dtype, dtype, msg=name)

    def test_output_structure_matrix(self) -> None:
        """Outputs returned in a list, tuple, dict, namedtuple or dataclass reach the
        loss and train as the reference, resharding after forward or not."""
        self.run_subtests(
            {
                "structure": ["list", "tuple", "dict", "namedtuple", "dataclass"],
                "reshard_after_forward": [True, False],
            },
            self._structures,
        )

    def _structures(self, structure: str, reshard_after_forward: bool) -> None:
        if structure == "dataclass":
            skip_dataclass_outputs(reshard_after_forward)

        def build() -> nn.Module:
            from harness import current_device

            torch.manual_seed(0)
            return Packed(4, structure).to(current_device())

        run = lockstep(
            self,
            build,
            lambda m: shard_each(m, [m.lin], reshard_after_forward=reshard_after_forward),
        )
        run.loss_fn = lambda out: unpack(out, structure).sum()
        run.train(2, (2, 4))

    def test_ignored_params_matrix(self) -> None:
        """Whichever parameters are ignored stay plain and keep each rank's own
        gradient; the others are the reference's mean."""
        self.run_subtests(
            {
                "ignore": ["first_weight", "first_layer", "last_layer", "biases"],
                "reshard_after_forward": [True, False],
            },
            self._ignored,
        )

    def _ignored(self, ignore: str, reshard_after_forward: bool) -> None:
        model = linear_chain(4, 3)
        reference = copy.deepcopy(model)
        chosen = {
            "first_weight": [model[0].weight],
            "first_layer": list(model[0].parameters()),
            "last_layer": list(model[2].parameters()),
            "biases": [layer.bias for layer in model],
        }[ignore]
        names = {n for n, p in model.named_parameters() if any(p is c for c in chosen)}
        shard_each(
            model,
            list(model)[:-1],
            ignored_params=set(chosen),
            reshard_after_forward=reshard_after_forward,
        )
        x = batch(self.rank, 0, 2, 4)
        model(x).sum().backward()
        reference(x).sum().backward()
        local = {n: p.grad.clone() for n, p in reference.named_parameters()}
        average_gradients(reference)
        references = dict(reference.named_parameters())
        for name, param in model.named_parameters():
            if name in names:
                self.assertFalse(isinstance(param, DTensor), name)
                self.assertEqual(param.grad, local[name], msg=name)
            else:
                self.assertEqual(param.grad.full_tensor(), references[name].grad, msg=name)

    def test_prefetch_matrix(self) -> None:
        """Forward prefetching of 0 to 3 next layers, for chains of 3 and 5 layers:
        the all-gathers done before each layer's forward body are 1 + the layers
        prefetched so far (capped at the chain), and the result is the reference's."""
        self.run_subtests({"num_to_prefetch": [0, 1, 2, 3], "layers": [3, 5]}, self._prefetch)

    def _prefetch(self, num_to_prefetch: int, layers: int) -> None:
        run = lockstep(
            self, lambda: linear_chain(3, layers + 1), functools.partial(group, grouping="children")
        )
        chain = list(run.model)[:-1]
        for i, layer in enumerate(chain):
            layer.set_modules_to_forward_prefetch(chain[i + 1 : i + 1 + num_to_prefetch])
        seen: list[int] = []
        with CollectiveLog(("all_gather",)) as log:
            for layer in chain:
                layer.register_forward_pre_hook(lambda *_: seen.append(log.count("all_gather")))
            run.backward(batch(self.rank, 0, 2, 3))
        self.assertEqual(
            seen, [1 + min(i + 1 + num_to_prefetch, len(chain)) for i in range(len(chain))]
        )


Pair = collections.namedtuple("Pair", "first second")


@dataclasses.dataclass
class Box:
    value: torch.Tensor
    tag: str = "box"


class Packed(nn.Module):
    """A linear whose output comes back in the container ``structure`` names."""

    def __init__(self, dim: int, structure: str) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, 2)
        self.structure = structure

    def forward(self, x: torch.Tensor) -> object:
        out = self.head(torch.relu(self.lin(x)))
        return {
            "list": lambda: [out],
            "tuple": lambda: (out, 0),
            "dict": lambda: {"out": out, "note": "n"},
            "namedtuple": lambda: Pair(out, None),
            "dataclass": lambda: Box(out),
        }[self.structure]()


def unpack(out: object, structure: str) -> torch.Tensor:
    if isinstance(out, dict):
        return out["out"]
    if isinstance(out, Box):
        return out.value
    assert isinstance(out, (list, tuple)), structure
    return out[0]


class TestFullyShardHSDPMatrix(FSDP2Test):
    world_size = 4

    def test_hsdp_mean_gradient_matrix(self) -> None:
        """On 1x4, 2x2 and 4x1 meshes every gradient element of ``(rank + 1) *
        sum(w)`` is the mean of 1..4 over all ranks, for several widths and dtypes."""
        self.run_subtests(
            {"replicas": [1, 2, 4], "dim": [1, 2, 3, 5], "dtype": [torch.float32, torch.float64]},
            self._hsdp_mean,
        )

    def _hsdp_mean(self, replicas: int, dim: int, dtype: torch.dtype) -> None:
        torch.manual_seed(0)
        model = ParamSum(nn.Linear(dim, dim + 1)).to(self.device, dtype)
        fully_shard(model, mesh=self.hsdp_mesh(replicas))
        model(torch.tensor(float(self.rank + 1), device=self.device, dtype=dtype)).backward()
        for name, param in model.named_parameters():
            grad = param.grad.to_local()
            self.assertEqual(grad, torch.full_like(grad, (self.world_size + 1) / 2), msg=name)
