"""Command lines parsed as the programs the docs call parse them, without running
them ([Note: How a shown command is checked] in ``tests/docs/test_commands.py``).

``python -m tests.docs.parse_args`` (from the checkout root) reads a JSON list of
``[program, args]`` pairs from standard input, ``program`` one of ``pytest``,
``torchrun`` and ``script``, and prints a JSON list with, for each, the error the
program would stop with: ``""`` where it would start.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import runpy
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn
from unittest import mock

import pytest
from _pytest.config import _prepareconfig

ROOT = Path(__file__).resolve().parents[2]
# What a reader brings: an upstream test file (docs/guide/porting.md) and their
# own FSDP, by module path or registered name (docs/guide/your-fsdp.md).
PLACEHOLDERS = frozenset({"test_fsdp_apply.py", "mypkg.fsdp", "myfsdp"})
# The environment torchrun gives each worker, for the pytest arguments it passes on.
TORCHRUN_ENV = {
    "RANK": "0",
    "WORLD_SIZE": "2",
    "LOCAL_RANK": "0",
    "MASTER_ADDR": "localhost",
    "MASTER_PORT": "29500",
}


class _Parsed(Exception):
    """Raised by a script's ``parse_args`` once its arguments parsed: stop there."""


def pytest_error(args: list[str]) -> str:
    """What pytest with the project's plugins says of ``args`` before collecting."""
    try:
        config = _prepareconfig(list(args), prog="pytest")
    except (pytest.UsageError, SystemExit) as error:
        return _error_line(str(error))
    try:
        return _value_error(config)
    finally:
        config._ensure_unconfigure()


def _value_error(config: pytest.Config) -> str:
    """The project's own checks of the options' values, and the paths named."""
    from fsdptest.implementations import UnknownImplementation, resolve
    from harness._controller.options import check

    try:
        check(config)
        for option in ("fsdp_impl", "fsdp_reference"):
            name = config.getoption(option)
            if name not in PLACEHOLDERS:
                resolve(name)
    except (pytest.UsageError, UnknownImplementation) as error:
        return str(error)
    profile = config.getoption("hypothesis_profile", None)
    if profile not in (None, "ci", "deep"):
        return f"--hypothesis-profile {profile}: no such profile (ci, deep)"
    missing = [a for a in config.args if a not in PLACEHOLDERS and not _exists(a)]
    return f"no such path: {', '.join(missing)}" if missing else ""


def _exists(arg: str) -> bool:
    return (ROOT / arg.split("::")[0]).exists()


def torchrun_error(args: list[str]) -> str:
    """What torchrun's parser says of ``args``, then pytest of what it passes on."""
    from torch.distributed.run import get_args_parser

    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            parser = get_args_parser()
            parser.prog = "torchrun"
            parsed = parser.parse_args(args)
    except SystemExit:
        return _error_line(stderr.getvalue())
    if not parsed.module or parsed.training_script != "pytest":
        return f"torchrun starts {parsed.training_script}, not -m pytest"
    with _environment(TORCHRUN_ENV):
        return pytest_error(parsed.training_script_args)


def script_error(args: list[str]) -> str:
    """What a script's ``argparse`` parser says of its arguments (``args[0]`` is the
    script): the script runs up to its ``parse_args`` call, and stops there."""
    script = ROOT / args[0]
    if not script.is_file():
        return f"no such script: {args[0]}"
    if "argparse" not in script.read_text():
        return f"{args[0]} parses no arguments with argparse: it cannot be checked unrun"
    stderr = io.StringIO()
    try:
        with _stopped_at_parse(), _argv([str(script), *args[1:]], script.parent):
            with contextlib.redirect_stderr(stderr):
                runpy.run_path(str(script), run_name="__main__")
    except _Parsed:
        return ""
    except SystemExit as exit:
        return "" if exit.code in (0, None) else _error_line(stderr.getvalue())
    return f"{args[0]} ran to its end without parsing its arguments"


def _error_line(message: str) -> str:
    """The line of an argparse usage message that says what is wrong."""
    lines = [line.strip() for line in message.strip().splitlines()] or [""]
    return next((line for line in lines if "error:" in line), lines[0])


@contextlib.contextmanager
def _stopped_at_parse() -> Iterator[None]:
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self: argparse.ArgumentParser, *a: Any, **k: Any) -> NoReturn:
        original(self, *a, **k)
        raise _Parsed

    with mock.patch.object(argparse.ArgumentParser, "parse_args", parse_then_stop):
        yield


@contextlib.contextmanager
def _argv(argv: list[str], folder: Path) -> Iterator[None]:
    """``sys.argv`` and ``sys.path[0]`` as ``python SCRIPT ARGS`` sets them."""
    saved = sys.argv, list(sys.path)
    sys.argv, sys.path[:0] = argv, [str(folder)]
    try:
        yield
    finally:
        sys.argv, sys.path[:] = saved


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    saved = dict(os.environ)
    os.environ.update(values)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


CHECKERS: dict[str, Callable[[list[str]], str]] = {
    "pytest": pytest_error,
    "torchrun": torchrun_error,
    "script": script_error,
}


def checked(program: str, args: list[str]) -> str:
    """The error of one command; a crash of the check (a plugin or a script that
    does not import) is that command's error, not the end of the others' checks."""
    try:
        return CHECKERS[program](args)
    except Exception as error:
        return f"{type(error).__name__}: {error}".splitlines()[0]


def main() -> None:
    requests = json.load(sys.stdin)
    with contextlib.redirect_stdout(io.StringIO()):
        errors = [checked(program, args) for program, args in requests]
    print(json.dumps(errors))


if __name__ == "__main__":
    main()
