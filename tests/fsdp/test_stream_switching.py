"""The unshard and reduce streams are entered and left as ``torch.cuda.stream``
does (see [Note: Switching streams cheaply] in fsdp._streams). No GPU here:
torch.cuda's stream functions are replaced by recorders of what is current, so
this checks the switching logic; the GPU suites run it on real streams."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from fsdp._streams import CommStreams


class _FakeCuda:
    """The current device and each device's current stream, as torch.cuda keeps them."""

    device: int
    current: dict[int, str]
    contexts: int

    def __init__(self, device: int) -> None:
        self.device = device
        self.current = {0: "default0", 1: "default1"}
        self.contexts = 0

    def set_stream(self, stream: str) -> None:
        self.device = int(stream[-1])  # torch's setStream makes its device current
        self.current[self.device] = stream

    def current_stream(self, index: int | None = None) -> str:
        return self.current[self.device if index is None else index]

    def stream(self, stream: str) -> _FakeStreamContext:
        return _FakeStreamContext(self, stream)


class _FakeStreamContext:
    """torch.cuda.StreamContext's moves."""

    def __init__(self, cuda: _FakeCuda, stream: str) -> None:
        self.cuda, self.stream = cuda, stream
        self.source = self.destination = ""

    def __enter__(self) -> None:
        self.cuda.contexts += 1
        self.source = self.cuda.current_stream()
        self.destination = self.cuda.current_stream(int(self.stream[-1]))
        self.cuda.set_stream(self.stream)

    def __exit__(self, *_: object) -> None:
        self.cuda.set_stream(self.destination)
        self.cuda.set_stream(self.source)


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> Iterator[_FakeCuda]:
    fake = _FakeCuda(device=0)
    monkeypatch.setattr(torch.cuda, "set_stream", fake.set_stream)
    monkeypatch.setattr(torch.cuda, "current_stream", fake.current_stream)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: fake.device)
    monkeypatch.setattr(torch.cuda, "stream", fake.stream)
    monkeypatch.setattr(torch.cuda, "StreamContext", _FakeStreamContext)
    yield fake


def _streams() -> CommStreams:
    streams = CommStreams(torch.device("cpu"), limit_all_gathers=False)
    streams._index = 0
    streams.unshard = "unshard0"  # type: ignore[assignment]
    return streams


@pytest.mark.parametrize("current_device", [0, 1])
def test_unshard_stream_is_current_inside_and_restored_after(
    fake_cuda: _FakeCuda, current_device: int
) -> None:
    """On the tree's device the switch is direct; on another, torch.cuda.stream's."""
    fake_cuda.device = current_device
    fake_cuda.current = {0: "user0", 1: "user1"}
    streams = _streams()
    with streams.on_unshard():
        assert fake_cuda.current_stream() == "unshard0" and fake_cuda.device == 0
    assert fake_cuda.current == {0: "user0", 1: "user1"}
    assert fake_cuda.device == current_device
    assert fake_cuda.contexts == (0 if current_device == 0 else 1)


def test_stream_restored_when_the_work_raises(fake_cuda: _FakeCuda) -> None:
    """An error inside the unshard leaves the user's stream current."""
    fake_cuda.current = {0: "user0", 1: "default1"}
    with pytest.raises(RuntimeError, match="inside"), _streams().on_unshard():
        raise RuntimeError("inside")
    assert fake_cuda.current_stream() == "user0"


class _FakeEvent:
    stream: str = ""

    def record(self, stream: str) -> None:
        self.stream = stream


def test_only_freed_all_gather_outputs_count_for_limit_all_gathers(
    fake_cuda: _FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reshard that frees no all-gather output (NO_SHARD's cast copy, a kept
    unsharded parameter) leaves the rate limiter's count alone, as torch's does."""
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    streams = _streams()
    streams.limit_all_gathers = True
    freed = [torch.empty(0)]  # no storage left: nothing to record on the stream
    streams.release(freed, frees_gathered=False)
    assert len(streams._free_events) == 0
    streams.release(freed, frees_gathered=True)
    streams.release(freed)
    events = list(streams._free_events)
    assert len(events) == 2
    assert all(isinstance(e, _FakeEvent) and e.stream == "default0" for e in events)
