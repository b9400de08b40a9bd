"""What the ranks of a torchrun session tell each other, through the TCPStore.

Values are pickled small messages (``harness._protocol``) and text; a key per
rank (``<what>/<rank>``) is written once by its rank and read by every rank.
"""

from __future__ import annotations

import hashlib
import pickle
import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

_POLL_S = 0.002
_POLL_MAX_S = 0.02


class Exchange:
    """The store seen under one prefix (a test's, the session's)."""

    def __init__(self, store: dist.Store, rank: int, world_size: int) -> None:
        self.store = store
        self.rank = rank
        self.world_size = world_size

    def scope(self, name: str) -> Exchange:
        return Exchange(dist.PrefixStore(name, self.store), self.rank, self.world_size)

    def for_test(self, nodeid: str) -> Exchange:
        return self.scope("t/" + hashlib.sha1(nodeid.encode()).hexdigest()[:20])

    def put(self, key: str, value: object) -> None:
        self.store.set(key, pickle.dumps(value))

    def put_mine(self, key: str, value: object) -> None:
        self.put(f"{key}/{self.rank}", value)

    def has(self, *keys: str) -> bool:
        return bool(self.store.check(list(keys)))

    def take(self, key: str) -> Any:
        return pickle.loads(self.store.get(key))

    def everyones(self, key: str) -> dict[int, Any]:
        """What each rank put under ``key`` so far."""
        return {
            r: self.take(f"{key}/{r}") for r in range(self.world_size) if self.has(f"{key}/{r}")
        }

    def gather(self, key: str, until: float, gone: Callable[[], set[int]] = set) -> dict[int, Any]:
        """Waits until every rank put ``key`` (or is gone, or ``until`` passes)."""
        delay = _POLL_S
        while True:
            got = self.everyones(key)
            missing = set(range(self.world_size)) - set(got)
            if not missing or missing <= gone() or time.monotonic() >= until:
                return got
            time.sleep(delay)
            delay = min(2 * delay, _POLL_MAX_S)


class Heartbeat:
    """Each rank counts up its ``hb/<rank>`` key every ``period_s`` from a thread;
    a rank whose count has not moved for ``dead_after_s`` is gone."""

    def __init__(self, exchange: Exchange, period_s: float, dead_after_s: float) -> None:
        self._exchange = exchange
        self._period_s = period_s
        self._dead_after_s = dead_after_s
        self._seen: dict[int, tuple[bytes, float]] = {}
        self._checked_at = 0.0
        self._gone: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="harness-heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _beat(self) -> None:
        key = f"hb/{self._exchange.rank}"
        while not self._stop.is_set():
            try:
                self._exchange.store.add(key, 1)
            except Exception:  # the store went away: the job is ending
                return
            self._stop.wait(self._period_s)

    def gone(self) -> set[int]:
        """The ranks whose heartbeat stopped (checked at most once a period)."""
        now = time.monotonic()
        if now - self._checked_at < self._period_s:
            return self._gone
        self._checked_at = now
        for rank in range(self._exchange.world_size):
            key = f"hb/{rank}"
            beat = self._exchange.store.get(key) if self._exchange.has(key) else b""
            last = self._seen.get(rank)
            if last is None or last[0] != beat:
                self._seen[rank] = (beat, now)
            elif now - last[1] > self._dead_after_s:
                self._gone.add(rank)
        return self._gone
