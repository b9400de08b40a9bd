"""Where the harness's own code lives, to drop its frames from what users read."""

from __future__ import annotations

import os

HARNESS_DIR = os.path.dirname(os.path.abspath(__file__))


def is_harness_file(filename: str) -> bool:
    return os.path.abspath(filename).startswith(HARNESS_DIR + os.sep)
