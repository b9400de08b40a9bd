"""FSDP2's collectives, seen through the seams upstream's tests patch: how many
all-gathers, reduce-scatters and all-reduces a step issues under each
``reshard_after_forward``; gradient accumulation with ``set_requires_gradient_sync``,
``set_is_last_backward``, ``set_reshard_after_backward`` and ``set_requires_all_reduce``
(parity and counts); explicit forward and backward prefetching (order and
parity); where the parameters are registered after forward and backward. Facts
from upstream's ``test_fully_shard_comm.py`` and ``test_fully_shard_training.py``.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fsdptest.api import fully_shard
from suites.fsdp2.helpers import (
    STEPS,
    CollectiveLog,
    FSDP2Test,
    average_gradients,
    batch,
    fsdp_modules,
    lockstep,
    mlp_stack,
    shard_each,
)
from upstream.common_fsdp import check_sharded_parity

WIDTHS = (4, 5, 6, 7, 3)


def chain(widths: tuple[int, ...] = WIDTHS) -> nn.Sequential:
    """Linear layers of the given widths, on the rank's device (the last is the root's)."""
    from harness import current_device

    torch.manual_seed(0)
    layers = [nn.Linear(a, b) for a, b in zip(widths, widths[1:])]
    return nn.Sequential(*layers).to(current_device())


def shard_chain(model: nn.Sequential, **kwargs: object) -> None:
    """A group per layer but the last, whose parameters are the root's group."""
    shard_each(model, list(model)[:-1], **kwargs)


class TestFullyShardCollectiveCounts(FSDP2Test):
    def test_fully_shard_communication_count(self) -> None:
        """Each forward all-gathers every group once; the backward all-gathers every
        group again when it resharded after forward (the root included, when told
        True) and none when not; every backward reduce-scatters every group once;
        a 1-D mesh never all-reduces."""
        self.run_subtests({"reshard_after_forward": [True, False]}, self._counts)

    def _counts(self, reshard_after_forward: bool) -> None:
        model = chain()
        shard_chain(model, reshard_after_forward=reshard_after_forward)
        groups = len(fsdp_modules(model))
        for step in range(STEPS):
            with CollectiveLog() as log:
                out = model(batch(self.rank, step, 2, WIDTHS[0]))
                self.assertEqual(log.count("all_gather"), groups, "forward all-gathers")
                log.calls.clear()
                out.sum().backward()
            expected = groups if reshard_after_forward else 0
            self.assertEqual(log.count("all_gather"), expected, "backward all-gathers")
            self.assertEqual(log.count("reduce_scatter"), groups, "reduce-scatters")
            self.assertEqual(log.count("all_reduce"), 0, "all-reduces")

    def test_reduce_scatter_sizes(self) -> None:
        """Each group's reduce-scatter takes W times what the group's all-gather
        gives (every rank's padded shard), over all W ranks, in fp32."""
        model = chain()
        shard_chain(model)
        with CollectiveLog() as log:
            out = model(batch(self.rank, 0, 2, WIDTHS[0]))
            gathered = sorted(c.numel for c in log.of("all_gather"))
            out.sum().backward()
        scattered = log.of("reduce_scatter")
        self.assertEqual(sorted(c.numel // self.world_size for c in scattered), gathered)
        for call in scattered:
            self.assertEqual(call.group_size, self.world_size)
            self.assertEqual(call.numel % self.world_size, 0, "padded to a multiple of W")
            self.assertEqual(call.dtype, torch.float32)

    def test_set_reshard_after_forward_changes_the_backward(self) -> None:
        """``set_reshard_after_forward`` after construction: False avoids the
        backward all-gathers, True brings them back."""
        self.run_subtests({"initial": [True, False]}, self._set_reshard)

    def _set_reshard(self, initial: bool) -> None:
        model = chain()
        shard_chain(model, reshard_after_forward=initial)
        groups = len(fsdp_modules(model))
        for setting in (not initial, initial):
            model.set_reshard_after_forward(setting)
            out = model(batch(self.rank, 0, 2, WIDTHS[0]))
            with CollectiveLog(("all_gather",)) as log:
                out.sum().backward()
            self.assertEqual(log.count("all_gather"), groups if setting else 0, f"{setting}")


class TestFullyShardParamRegistration(FSDP2Test):
    def test_param_registration_after_forward(self) -> None:
        """After forward, a group that reshards (True, or an int: the copy on the
        smaller mesh is FSDP's own) holds its sharded DTensors on the whole mesh, one
        that does not (False) holds plain tensors, the unsharded parameters of the
        full shape; after backward every group is sharded."""
        self.run_subtests(
            {"reshard_after_forward": [True, False, *self._proper_divisors()]},
            self._registration,
        )

    def _proper_divisors(self) -> list[int]:
        return [d for d in range(2, self.world_size) if self.world_size % d == 0]

    def _registration(self, reshard_after_forward: bool | int) -> None:
        torch.manual_seed(0)
        model = mlp_stack(8, depth=2)
        full = {n: p.detach().clone() for n, p in model.named_parameters()}
        shard_each(model, model, reshard_after_forward=reshard_after_forward)
        self._assert_sharded(model, "after construction")
        out = model(batch(self.rank, 0, 2, 8))
        children = list(model.named_parameters())
        for name, param in children:
            if reshard_after_forward is False:
                self.assertFalse(isinstance(param, DTensor), name)
                self.assertEqual(param, full[name], msg=name)
            else:
                self.assertIsInstance(param, DTensor, name)
                self.assertEqual(param.device_mesh.size(), self.world_size, name)
        out.sum().backward()
        self._assert_sharded(model, "after backward")

    def _assert_sharded(self, model: nn.Module, when: str) -> None:
        for name, param in model.named_parameters():
            self.assertIsInstance(param, DTensor, f"{name} {when}")
            self.assertEqual(param.device_mesh.size(), self.world_size, f"{name} {when}")


class TestFullyShardGradientAccumulation(FSDP2Test):
    def test_gradient_accumulation(self) -> None:
        """Microbatches without gradient sync, then one with it, equal the reference's
        summed gradients; only the synced backward reduce-scatters the groups that
        skipped sync. With ``set_is_last_backward(False)`` and
        ``set_reshard_after_backward(False)`` on the first microbatches the result is
        the same."""
        self.run_subtests(
            {
                "microbatches": [2, 3],
                "scope": ["all", "root_only"],
                "reshard_after_backward": [True, False],
                "mark_last_backward": [True, False],
            },
            self._accumulate,
        )

    def _accumulate(
        self, microbatches: int, scope: str, reshard_after_backward: bool, mark_last_backward: bool
    ) -> None:
        run = lockstep(self, chain, shard_chain)
        model = run.model
        groups = len(fsdp_modules(model))  # the root holds the last layer
        skipping = groups if scope == "all" else 1
        for step in range(STEPS):
            with CollectiveLog(("reduce_scatter",)) as log:
                for micro in range(microbatches):
                    last = micro == microbatches - 1
                    model.set_requires_gradient_sync(last, recurse=scope == "all")
                    if mark_last_backward:
                        model.set_is_last_backward(last)
                    model.set_reshard_after_backward(last or reshard_after_backward)
                    x = batch(self.rank, 10 * step + micro, 2, WIDTHS[0])
                    losses = [m(x).sum() for m in (model, run.reference)]
                    for loss in losses:
                        loss.backward()
                    self.assertEqual(losses[0], losses[1], msg=f"microbatch {micro}")
            expected = groups * microbatches - skipping * (microbatches - 1)
            self.assertEqual(log.count("reduce_scatter"), expected, "reduce-scatters")
            average_gradients(run.reference)
            check_sharded_parity(self, run.reference, model)
            run.step(step)

    def test_sync_again_after_no_sync(self) -> None:
        """A backward without sync, then ``set_requires_gradient_sync(True)``: the next
        backward reduces both microbatches' gradients, and after the optimizer step
        the next backward's gradients are that batch's mean over ranks alone."""
        run = lockstep(self, chain, shard_chain)
        model = run.model
        model.set_requires_gradient_sync(False)
        for m in (model, run.reference):
            m(batch(self.rank, 0, 2, WIDTHS[0])).sum().backward()
        model.set_requires_gradient_sync(True)
        run.backward(batch(self.rank, 1, 2, WIDTHS[0]))
        for step in range(STEPS):
            run.step(step)
            run.backward(batch(self.rank, 2 + step, 2, WIDTHS[0]))


class TestFullyShardHSDPAccumulation(FSDP2Test):
    world_size = 4

    def test_hsdp_all_reduce_count_and_accumulation(self) -> None:
        """On a 2x2 mesh every synced backward all-reduces every group once over its
        two replicas; ``set_requires_all_reduce(False)`` on the first microbatches
        defers the all-reduce and keeps parity with the reference."""
        self.run_subtests({"defer_all_reduce": [True, False]}, self._hsdp_accumulate)

    def _hsdp_accumulate(self, defer_all_reduce: bool) -> None:
        mesh = self.hsdp_mesh(2)
        run = lockstep(self, chain, functools.partial(shard_chain, mesh=mesh))
        model = run.model
        groups = len(fsdp_modules(model))
        with CollectiveLog(("all_reduce", "reduce_scatter")) as log:
            for micro in range(2):
                last = micro == 1
                if defer_all_reduce:
                    model.set_requires_all_reduce(last)
                x = batch(self.rank, micro, 2, WIDTHS[0])
                for m in (model, run.reference):
                    m(x).sum().backward()
        all_reduces = log.of("all_reduce")
        self.assertEqual(len(all_reduces), groups * (1 if defer_all_reduce else 2))
        self.assertEqual({c.group_size for c in all_reduces}, {2})
        self.assertEqual(log.count("reduce_scatter"), 2 * groups)
        average_gradients(run.reference)
        check_sharded_parity(self, run.reference, model)


class TestFullyShardAllReduceHook(FSDP2Test):
    def test_hook_runs_on_the_given_stream(self) -> None:
        """``set_all_reduce_hook(hook, stream=s)`` on a 1-D mesh runs the hook once per
        group and backward with ``s`` as the device's current stream (``torch.cpu``'s
        streams on CPU ranks too, as torch runs it through the device's module); a
        hook that changes nothing keeps parity with the reference. On a 2-D (HSDP)
        mesh a stream is refused."""
        device_module = torch.get_device_module(self.device_type)
        stream = device_module.Stream()
        on_stream: list[bool] = []

        def hook(output: torch.Tensor) -> None:
            on_stream.append(device_module.current_stream() == stream)

        run = lockstep(self, chain, shard_chain)
        groups = fsdp_modules(run.model)
        for module in groups:
            module.set_all_reduce_hook(hook, stream=stream)
        run.train(2, (2, WIDTHS[0]))
        self.assertEqual(on_stream, [True] * (2 * len(groups)))
        hsdp = chain()
        fully_shard(hsdp, mesh=self.hsdp_mesh(1))
        with self.assertRaisesRegex(ValueError, "stream cannot be set when using native HSDP"):
            hsdp.set_all_reduce_hook(hook, stream=stream)


class TestFullyShardPrefetch(FSDP2Test):
    def test_set_modules_to_forward_prefetch(self) -> None:
        """A layer told to prefetch the next ``n`` all-gathers them in its own
        pre-forward: before layer i's forward body runs, 1 + n later layers (capped)
        have been all-gathered instead of 1; the training matches the reference."""
        self.run_subtests({"num_to_prefetch": [0, 1, 2]}, self._forward_prefetch)

    def _forward_prefetch(self, num_to_prefetch: int) -> None:
        run = lockstep(self, chain, functools.partial(shard_chain))
        layers = list(run.model)[:-1]
        for i, layer in enumerate(layers):
            layer.set_modules_to_forward_prefetch(layers[i + 1 : i + 1 + num_to_prefetch])
        seen: list[int] = []
        with CollectiveLog(("all_gather",)) as log:
            hooks = [
                layer.register_forward_pre_hook(lambda *_: seen.append(log.count("all_gather")))
                for layer in layers
            ]
            run.backward(batch(self.rank, 0, 2, WIDTHS[0]))
        for hook in hooks:
            hook.remove()
        root_gathers = 1  # the root's group (the last layer) is gathered first
        expected = [
            root_gathers + min(i + 1 + num_to_prefetch, len(layers)) for i in range(len(layers))
        ]
        self.assertEqual(seen, expected)

    def test_set_modules_to_backward_prefetch(self) -> None:
        """Explicit backward prefetching of one or two earlier layers keeps one
        all-gather per group in the backward and trains as the reference."""
        self.run_subtests({"num_to_prefetch": [1, 2]}, self._backward_prefetch)

    def _backward_prefetch(self, num_to_prefetch: int) -> None:
        run = lockstep(self, chain, functools.partial(shard_chain, reshard_after_forward=True))
        layers = list(run.model)[:-1]
        for i, layer in enumerate(layers):
            layer.set_modules_to_backward_prefetch(layers[max(0, i - num_to_prefetch) : i][::-1])
        groups = len(fsdp_modules(run.model))
        for step in range(STEPS):
            x = batch(self.rank, step, 2, WIDTHS[0])
            with CollectiveLog(("all_gather",)) as log:
                run.backward(x)
            self.assertEqual(log.count("all_gather"), 2 * groups)
            run.step(step)

    def test_unshard_and_reshard_by_hand(self) -> None:
        """``unshard()`` before forward makes that forward all-gather nothing for the
        group; ``reshard()`` afterwards frees it, so the next forward gathers again;
        ``unshard(async_op=True)`` returns a handle whose ``wait()`` finishes it."""
        self.run_subtests({"async_op": [False, True]}, self._by_hand)

    def _by_hand(self, async_op: bool) -> None:
        model = chain()
        shard_chain(model)
        groups = len(fsdp_modules(model))
        x = batch(self.rank, 0, 2, WIDTHS[0])
        model(x)  # lazy initialisation happens at the first forward
        model.reshard()
        with CollectiveLog(("all_gather",)) as log:
            handle = model[0].unshard(async_op=async_op)
            if async_op:
                self.assertIsNotNone(handle)
                handle.wait()
            else:
                self.assertIsNone(handle)
            self.assertFalse(isinstance(model[0].weight, DTensor), "unsharded")
            gathered_by_hand = log.count("all_gather")
            model(x)
            self.assertEqual(log.count("all_gather") - gathered_by_hand, groups - 1)
        self.assertEqual(gathered_by_hand, 1)
        model[0].reshard()
        self.assertIsInstance(model[0].weight, DTensor)
