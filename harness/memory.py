"""How many bytes of tensor memory a rank holds, at points a test marks.

[Note: Measuring tensor memory on CPU ranks]
On CUDA, the caching allocator's count of requested bytes answers at once (see
[Note: Measuring tensor memory on CUDA ranks]). The CPU allocator
keeps no such count, but torch's profiler, with ``profile_memory=True``, records
every allocation and free of the threads it profiles with its size. A
``MemoryMeter`` on a CPU rank profiles the whole measured stretch; ``mark(key)``
drops a zero-length annotation; ``held()`` then adds up the allocations and
frees recorded before each mark: the bytes allocated since the meter started
and still held at that mark. Sizes are the allocator's requests (no caching,
no rounding).

The profiler records only the thread that runs the test. A tensor that thread
allocated and another thread freed would look held for ever, and gloo's worker
threads drop their references to a collective's tensors after the caller's
wait returned, racing the caller for the last reference. So while measuring,
the all-gathers, reduce-scatters and all-reduces (every name, see
``harness.collectives``) run on a helper thread, on copies it makes and frees
itself, and it copies the result into the caller's output in place: the
test's thread never shares a tensor with gloo, and the copies, allocated and
freed outside the profiled thread, are not counted.
"""

from __future__ import annotations

import contextlib
import gc
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function
from torch.utils._pytree import tree_map_only

from harness.collectives import Collective, patch_collective

_MARK = "harness.memory:"


class MemoryMeter:
    """Bytes of tensor memory held at marked points, on the rank's device."""

    device: torch.device
    _profile: profile | None
    _cuda: dict[str, int]
    _ledger: _CudaLedger | None  # CUDA: the bytes at measuring()'s entry, and older frees
    _keys: list[str]
    _held: dict[str, int] | None

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._profile = None
        self._cuda = {}
        self._ledger = None
        self._keys = []
        self._held = None

    @contextlib.contextmanager
    def measuring(self) -> Iterator[MemoryMeter]:
        """Measures from entry: CPU marks count the bytes allocated since then."""
        if self.device.type == "cuda":
            gc.collect()
            with _CudaLedger.recording(self.device) as self._ledger:
                yield self
            return
        self._profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        with _collectives_off_thread(), self._profile:
            yield self

    def mark(self, key: str) -> None:
        """Notes the bytes held now under ``key``."""
        if key in self._keys:
            raise ValueError(f"mark {key!r} twice")
        self._keys.append(key)
        gc.collect()
        if self.device.type == "cuda":
            assert self._ledger is not None, "mark() outside measuring()"
            self._cuda[key] = self._ledger.held()
            return
        with record_function(_MARK + key):
            pass

    def held(self) -> dict[str, int]:
        """Bytes held at each mark, in marking order (CPU: available once the
        ``measuring()`` block is left)."""
        if self.device.type == "cuda":
            return dict(self._cuda)
        if self._held is None:
            self._held = self._held_from_profile()
        return dict(self._held)

    def _held_from_profile(self) -> dict[str, int]:
        assert self._profile is not None and self._profile.profiler is not None, "not measured"
        results = self._profile.profiler.kineto_results
        assert results is not None
        stream: list[tuple[int, int, str | None, int]] = []  # (time, order, mark, bytes)
        for event in results.events():
            name = event.name()
            if name == "[memory]":
                stream.append((event.start_ns(), 1, None, event.nbytes()))
            elif name.startswith(_MARK):
                stream.append((event.start_ns(), 0, name[len(_MARK) :], 0))
        stream.sort(key=lambda e: (e[0], e[1]))
        held, total = {}, 0
        for _, _, key, nbytes in stream:
            if key is None:
                total += nbytes
            else:
                held[key] = total
        missing = [k for k in self._keys if k not in held]
        assert not missing, f"marks not recorded by the profiler: {missing}"
        return {key: held[key] for key in self._keys}


@contextlib.contextmanager
def _collectives_off_thread() -> Iterator[None]:
    """See [Note: Measuring tensor memory on CPU ranks]."""
    executor = ThreadPoolExecutor(1, thread_name_prefix="harness-memory-collectives")
    on_helper = threading.local()

    def handler(original: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if getattr(on_helper, "active", False):  # the original calling another name
            return original(*args, **kwargs)
        async_op = kwargs.pop("async_op", False)
        executor.submit(_run_on_copies, on_helper, original, args, kwargs).result()
        return _Done() if async_op else None

    with contextlib.ExitStack() as stack:
        for kind in Collective:
            stack.enter_context(patch_collective(kind, handler))
        try:
            yield
        finally:
            executor.shutdown()


def _run_on_copies(
    on_helper: threading.local, original: Callable[..., Any], args: Any, kwargs: Any
) -> None:
    """Runs the collective on copies of its tensors, then copies the written
    operand (the first: an output, a list of outputs, or all-reduce's tensor)
    back in place."""
    on_helper.active = True
    try:
        copies: dict[int, torch.Tensor] = {}

        def copy(t: torch.Tensor) -> torch.Tensor:
            return copies.setdefault(id(t), t.detach().clone())

        copied_args, copied_kwargs = tree_map_only(torch.Tensor, copy, (args, kwargs))
        original(*copied_args, **copied_kwargs)
        written = args[0] if args else next(iter(kwargs.values()))
        written_copy = copied_args[0] if args else next(iter(copied_kwargs.values()))
        pairs = (
            zip([written], [written_copy])
            if torch.is_tensor(written)
            else zip(written, written_copy)
        )
        with torch.no_grad():
            for target, result in pairs:
                target.copy_(result)
    finally:
        on_helper.active = False


class _Done:
    """The work handle of a collective that already ran."""

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _cuda_bytes_requested(device: torch.device) -> int:
    """[Note: Measuring tensor memory on CUDA ranks]
    The bytes the caching allocator was asked for and has not taken back: its
    ``requested_bytes`` count, not ``memory_allocated``, which counts blocks
    rounded up to 512 bytes (so a few small tensors differ from the CPU ranks'
    exact sizes). A tensor freed while another stream still used it (a
    collective's, through ``record_stream``) stays allocated until the allocator
    sees that stream's event done, which it checks only in its next allocation:
    after synchronising, one small allocation settles those frees."""
    torch.cuda.synchronize(device)
    _clear_cublas_workspaces()  # not tensors: upstream clears them too
    torch.empty(1, device=device)  # processes the frees waiting on stream events
    stats = torch.cuda.memory_stats(device)
    return int(stats.get("requested_bytes.all.current", torch.cuda.memory_allocated(device)))


class _CudaLedger:
    """[Note: Frees of older blocks while measuring]
    A CUDA mark is the requested bytes now less those at ``measuring()``'s entry,
    plus the bytes of blocks allocated before the entry and freed since: those
    frees are not the measured code's, yet they lower the count. The entry is
    read once the count settles (see [Note: A CUDA meter's baseline]), but some
    frees of earlier blocks come later: NCCL keeps a finished collective's tensors
    until its watchdog or the next collective on the group lets them go, and a
    busy GPU (tests sharing it) delays both (a mark 656 bytes short on two H100s
    shared by four tests each, docs/runs/gpu-runs.md run 74). So from the entry the
    allocator records its actions (``torch.cuda.memory._record_memory_history``,
    without stacks); the entry's count and each mark's are the requested sizes of
    the live blocks of a snapshot, and a mark adds back those of the entry's
    blocks the record shows freed since. Where the allocator cannot record, marks
    are the difference of its requested-bytes counts. The record is switched off
    at the exit (a test recording the allocator's history itself loses it there)."""

    def __init__(
        self, device: torch.device, older: dict[int, int] | None, baseline: int, seen: int = 0
    ) -> None:
        self.device = device
        self.older = older  # address -> requested bytes of the blocks live at the entry
        self.baseline = baseline
        self.seen = seen  # the trace's entries from before the entry

    @classmethod
    @contextlib.contextmanager
    def recording(cls, device: torch.device) -> Iterator[_CudaLedger]:
        baseline = _settled_cuda_bytes(device)
        if not _record_allocator_actions(True):
            yield cls(device, None, baseline)
            return
        snapshot = _snapshot()
        older, seen = _live_blocks(snapshot, device), len(_trace(snapshot, device))
        try:
            yield cls(device, older, sum(older.values()), seen)
        finally:
            _record_allocator_actions(False)

    def held(self) -> int:
        counted = _cuda_bytes_requested(self.device)  # settles the frees waiting on streams
        if self.older is None:
            return counted - self.baseline
        snapshot = _snapshot()
        now = sum(_live_blocks(snapshot, self.device).values())
        return now - self.baseline + self._older_freed(snapshot)

    def _older_freed(self, snapshot: dict[str, Any]) -> int:
        assert self.older is not None
        live, freed = dict(self.older), 0
        for entry in _trace(snapshot, self.device)[self.seen :]:
            if entry.get("action") == "free_completed" and entry.get("addr") in live:
                freed += live.pop(entry["addr"])
        return freed


def _record_allocator_actions(on: bool) -> bool:
    """Starts (with an empty history) or stops the CUDA allocator's record of its
    actions; False where this torch cannot record them."""
    record = getattr(torch.cuda.memory, "_record_memory_history", None)
    if record is None:
        return False
    try:
        if not on:
            record(enabled=None)
            return True
        try:
            record(enabled="all", context=None, stacks="python", clear_history=True)
        except TypeError:  # a torch without clear_history: the trace may hold older entries
            record(enabled="all", context=None, stacks="python")
    except (RuntimeError, TypeError):
        return False
    return True


def _snapshot() -> dict[str, Any]:
    return torch.cuda.memory._snapshot()


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _live_blocks(snapshot: dict[str, Any], device: torch.device) -> dict[int, int]:
    """Address -> requested bytes of the device's allocated blocks."""
    index = _index(device)
    return {
        block["address"]: block.get("requested_size", block["size"])
        for segment in snapshot["segments"]
        if segment.get("device", index) == index
        for block in segment["blocks"]
        if block["state"] != "inactive"
    }


def _trace(snapshot: dict[str, Any], device: torch.device) -> list[dict[str, Any]]:
    traces = snapshot.get("device_traces", [])
    index = _index(device)
    return list(traces[index]) if index < len(traces) else []


def _settled_cuda_bytes(device: torch.device) -> int:
    """[Note: A CUDA meter's baseline]
    CUDA marks count, as CPU marks do, the bytes allocated since ``measuring()``
    began and still held: a pooled rank may hold what earlier tests left (a
    library's caches), which is not the measured code's. Some of it is freed
    asynchronously: NCCL's watchdog thread drops the tensors it keeps for
    collectives nobody waited on when it next polls (every 100 ms or so), so a
    baseline read at once could be freed during the measured stretch and show
    as negative bytes. The baseline is read once the count held still for
    three polls 100 ms apart (at most 2 s)."""
    last, steady = _cuda_bytes_requested(device), 0
    for _ in range(_SETTLE_POLLS):
        if steady == 3:
            break
        time.sleep(0.1)
        now = _cuda_bytes_requested(device)
        steady, last = (steady + 1 if now == last else 0), now
    return last


_SETTLE_POLLS = 20


def _clear_cublas_workspaces() -> None:
    """Frees cuBLAS's workspaces: ``torch._C._cuda_clearCublasWorkspaces`` (what
    upstream's tests call; ``torch.cuda`` has no public name for it on 2.11)."""
    clear = getattr(torch.cuda, "_clear_cublas_workspaces", None) or getattr(
        torch._C, "_cuda_clearCublasWorkspaces", None
    )
    if clear is None:
        raise RuntimeError(f"torch {torch.__version__} has no call to clear cuBLAS workspaces")
    clear()
