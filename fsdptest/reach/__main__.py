"""``python -m fsdptest.reach [--count N] [--write PATH]``: print or write the reach table."""

from __future__ import annotations

import argparse
from pathlib import Path

from fsdptest.reach.table import DEFAULT_COUNT, build, render


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fsdptest.reach", description=__doc__)
    parser.add_argument(
        "--count",
        type=int,
        default=DEFAULT_COUNT,
        help=f"drawn programs per search and world size (default {DEFAULT_COUNT})",
    )
    parser.add_argument("--write", type=Path, help="write the table here instead of printing it")
    args = parser.parse_args(argv)
    if args.count < 1:
        parser.error(f"--count must be at least 1, got {args.count}")
    text = render(build(args.count))
    if args.write is None:
        print(text, end="")
    else:
        args.write.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
