"""Trims faulthandler stack dumps down to the frames that explain the test."""

from __future__ import annotations

import os
import re

from harness._frames import HARNESS_DIR

_NOISE = (
    os.sep + "multiprocessing" + os.sep,
    os.sep + "threading.py",
    'File "<string>"',
)
_BLOCK_START = re.compile(r"^(Current thread|Thread) 0x[0-9a-f]+")


def clean(text: str) -> str:
    """Drops the harness's own threads and frames and the interpreter's
    bootstrap frames; keeps every thread that runs test or library code."""
    blocks: list[list[str]] = [[]]
    for line in text.splitlines():
        if _BLOCK_START.match(line):
            blocks.append([])
        blocks[-1].append(line)
    kept: list[str] = []
    for block in blocks:
        lines = [line for line in block if not _is_noise(line)]
        frames = [line for line in lines if line.lstrip().startswith("File ")]
        if block and _BLOCK_START.match(block[0]) and not frames:
            continue  # a harness-only thread (the parent watcher)
        if lines and lines[0].startswith("Extension modules:"):
            continue
        kept.extend(line for line in lines if not line.startswith("Extension modules:"))
    return "\n".join(kept).strip("\n")


def _is_noise(line: str) -> bool:
    stripped = line.lstrip()
    if not stripped.startswith("File "):
        return False
    return HARNESS_DIR + os.sep in stripped or any(n in stripped for n in _NOISE)
