"""``--rank-profile DIR``: a cProfile of every test on every rank, for finding
where the ranks' time goes (``bench/nccl_test_cost.py`` reads them).

Each test's ``run_test`` (body, ``setUp``/``tearDown``, and the rank's return to
its baseline: synchronisation, group destruction, restore, leak check) is
profiled on its own and written as ``<test id>.rank<r>.<n>.prof``.
"""

from __future__ import annotations

import cProfile
import itertools
import os
import re
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
_COUNTER = itertools.count()


def profiled(directory: str | None, name: str, fn: Callable[[], T]) -> T:
    if directory is None:
        return fn()
    profile = cProfile.Profile()
    try:
        return profile.runcall(fn)
    finally:
        safe = re.sub(r"[^A-Za-z0-9_.\-\[\]=,]+", "_", name)[-180:]
        profile.dump_stats(os.path.join(directory, f"{safe}.{next(_COUNTER)}.prof"))
