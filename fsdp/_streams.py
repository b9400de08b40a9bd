"""Streams that let communication overlap computation (CUDA); no-ops on the CPU.

[Note: Streams and the memory they touch]
On CUDA every all-gather (with the cast or host-to-device copy that feeds it)
runs on the *unshard* stream and every gradient reduction on the *reduce*
stream, so communication overlaps the computation on the current stream.

- The unshard stream waits for the current stream once per iteration, at the
  root's pre-forward (the optimizer has finished updating the shards); it does
  not wait again before each all-gather, so a prefetched all-gather runs while
  the previous layer computes. Unshards outside forward and backward
  (summon_full_params, state dicts) wait each time: the shards may have just
  been updated by an optimizer step. A writeback of the user's changes to
  original parameters (``use_orig_params``: a copy into the shard on the
  current stream, issued by the unshard itself, after those waits) makes the
  unshard stream wait again: without it the all-gather may read the shard
  before the copy (the values from before the change).
- Computation waits for an unshard with an event recorded after it.
- Unsharded storage is allocated on the unshard stream and used on the current
  stream: before it is freed it is recorded on the current stream, so the
  caching allocator does not hand it out again before that use has finished.
- The reduce stream waits for the current stream before each reduction (the
  gradient was just computed there); the gradient, and a gradient set aside
  before this backward that the reduced shard is added to, are recorded on the
  reduce stream before their last reference is dropped (a gradient the user
  assigned between backward and step was allocated on the current stream,
  which would otherwise reuse its memory while the addition is still pending).
  At the end of backward the current stream waits for the reduce stream.
- ``limit_all_gathers``: at most two unsharded buffers are in flight; before a
  third all-gather the CPU waits until the oldest freed buffer's last use ran.
  Only a reshard that frees an all-gather's output counts (torch's FSDP's
  rule): not one that keeps the unsharded parameter, nor any ``NO_SHARD``
  reshard, whose low-precision copy is a cast, not an all-gather. Counting
  those made every ``NO_SHARD`` unshard under mixed precision wait for the
  device, so the CPU could not run ahead of it.

On the CPU (gloo) collectives are synchronous and none of this is needed.

[Note: Switching streams cheaply]
Every unshard and reduction runs its work on a side stream, three switches per
unit and step. ``torch.cuda.stream(s)`` finds the current device and its
current stream through the general device parsing, and also handles a stream
on another device than the current one. Where the current device is the
tree's (the usual case) the same switch is done directly: the current stream of
that device is kept, ``s`` set, and the kept one set again on exit, which is
all ``torch.cuda.stream`` does there. Where another device is current (the
user switched devices), or the tree's device has no index, it runs
``torch.cuda.stream`` itself.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor

_MAX_INFLIGHT_ALL_GATHERS = 2


class CommStreams:
    """The streams and events of one root's FSDP tree."""

    device: torch.device
    # ``device``'s index, or None for the current device: an int reaches
    # ``torch.cuda.current_stream`` without its device parsing (every hook asks)
    _index: int | None
    unshard: torch.cuda.Stream | None
    reduce: torch.cuda.Stream | None
    limit_all_gathers: bool
    _free_events: collections.deque[torch.cuda.Event]

    def __init__(self, device: torch.device, limit_all_gathers: bool) -> None:
        self.device = device
        self._index = device.index
        cuda = device.type == "cuda"
        self.unshard = torch.cuda.Stream(device) if cuda else None
        self.reduce = torch.cuda.Stream(device) if cuda else None
        self.limit_all_gathers = limit_all_gathers and cuda
        self._free_events = collections.deque()

    @property
    def is_cuda(self) -> bool:
        return self.unshard is not None

    def current(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device if self._index is None else self._index)

    def unshard_waits_for_compute(self) -> None:
        if self.unshard is not None:
            self.unshard.wait_stream(self.current())

    def _switch_to(self, stream: torch.cuda.Stream) -> torch.cuda.Stream | torch.cuda.StreamContext:
        """Makes ``stream`` current; returns what ``_switch_back`` restores (see
        [Note: Switching streams cheaply])."""
        index = self._index
        if index is not None and torch.cuda.current_device() == index:
            previous = torch.cuda.current_stream(index)
            torch.cuda.set_stream(stream)
            return previous
        context = torch.cuda.stream(stream)
        context.__enter__()
        return context

    @staticmethod
    def _switch_back(previous: torch.cuda.Stream | torch.cuda.StreamContext) -> None:
        if isinstance(previous, torch.cuda.StreamContext):
            previous.__exit__(None, None, None)
        else:
            torch.cuda.set_stream(previous)

    @contextlib.contextmanager
    def on_unshard(self) -> Iterator[None]:
        if self.unshard is None:
            yield
            return
        self._throttle()
        previous = self._switch_to(self.unshard)
        try:
            yield
        finally:
            self._switch_back(previous)

    def record_unshard(self) -> torch.cuda.Event | None:
        """An event after the work just issued on the unshard stream."""
        if self.unshard is None:
            return None
        event = torch.cuda.Event()
        event.record(self.unshard)
        return event

    def record_compute(self) -> torch.cuda.Event | None:
        """An event after the work just issued on the current stream."""
        if self.unshard is None:
            return None
        event = torch.cuda.Event()
        event.record(self.current())
        return event

    def unshard_waits(self, event: torch.Event | None) -> None:
        """The unshard stream waits for ``event`` (data the current stream wrote)."""
        if self.unshard is not None and event is not None:
            self.unshard.wait_event(event)  # type: ignore[arg-type]

    def compute_waits(self, event: torch.cuda.Event | None) -> None:
        if event is not None:
            self.current().wait_event(event)

    def compute_waits_for_unshard(self) -> None:
        """The current stream waits for every all-gather issued so far."""
        if self.unshard is not None:
            self.current().wait_stream(self.unshard)

    def release(self, tensors: list[Tensor], frees_gathered: bool = True) -> None:
        """``tensors`` (allocated on the unshard stream) are about to be freed
        after use on the current stream; ``frees_gathered``: among them an
        all-gather's output, which ``limit_all_gathers`` counts."""
        if self.unshard is None or not tensors:
            return
        current = self.current()
        for tensor in tensors:
            if tensor.untyped_storage().size() > 0:
                tensor.record_stream(current)
        if self.limit_all_gathers and frees_gathered:
            event = torch.cuda.Event()
            event.record(current)
            self._free_events.append(event)

    def _throttle(self) -> None:
        while len(self._free_events) >= _MAX_INFLIGHT_ALL_GATHERS:
            self._free_events.popleft().synchronize()

    @contextlib.contextmanager
    def on_reduce(self, grad: Tensor, set_aside: Tensor | None = None) -> Iterator[None]:
        """Runs a reduction of ``grad`` (computed on the current stream) that also
        reads ``set_aside``, a gradient from before this backward (perhaps assigned
        by the user on the current stream), if any."""
        if self.reduce is None:
            yield
            return
        self.reduce.wait_stream(self.current())
        grad.record_stream(self.reduce)
        if set_aside is not None and set_aside.device.type == "cuda":
            set_aside.record_stream(self.reduce)
        previous = self._switch_to(self.reduce)
        try:
            yield
        finally:
            self._switch_back(previous)

    def compute_waits_for_reduce(self) -> None:
        if self.reduce is not None:
            self.current().wait_stream(self.reduce)

    def synchronize(self) -> None:
        """The CPU waits for the device (before the optimizer reads CPU gradients)."""
        if self.is_cuda:
            self.current().synchronize()


class UnshardHandle:
    """What ``_unshard(async_op=True)`` returns: ``wait()`` makes the current
    stream wait for the all-gather (nothing to wait for on the CPU)."""

    _streams: CommStreams
    _event: torch.cuda.Event | None

    def __init__(self, streams: CommStreams, event: torch.cuda.Event | None) -> None:
        self._streams = streams
        self._event = event

    def wait(self) -> None:
        self._streams.compute_waits(self._event)
        self._event = None
