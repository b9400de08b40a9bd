"""expecttest's ``assertExpectedInline`` for code that runs in rank processes.

``assert_expected_inline(actual, expect)`` compares ``actual`` with the string
literal ``expect`` of its caller and, under ``EXPECTTEST_ACCEPT=1``, rewrites that
literal in the caller's source file, as ``expecttest`` does.

[Note: Accepting golden texts from several processes]
expecttest rewrites the literal at the line its caller's frame reports and keeps,
per process, the history of the edits it made, so that a later call in a file it
already edited finds its line. Here a file's calls run in several processes: the
ranks of one pool, pools of several world sizes (each imports the test module when
it first runs a test of it), a pool replaced after a failure (importing the file
as edited so far), and pytest-xdist workers for code running in the pytest
process. So:

- Only rank 0 of a process group accepts (the other ranks compute the same text;
  they are compared on the next plain run); without ``EXPECTTEST_ACCEPT`` every
  rank compares, and a mismatch fails on every rank that differs.
- Accepting holds an exclusive lock on the source file (``fcntl.flock`` on a lock
  file in the temporary directory), so two processes never rewrite it at once.
- Under the lock, the caller's function is found by its qualified name in the
  file as it is now. Its first line there, against the line this process believes
  it is at (its compiled line plus its own edits), is the shift other processes'
  edits caused; it is recorded into expecttest's edit history as one more edit
  just above the function, so expecttest finds the literal's current line. This
  holds while one process edits a given function, which is the case unless the
  same test runs in two processes of one accepting run.
"""

from __future__ import annotations

import ast
import contextlib
import fcntl
import hashlib
import os
import sys
import tempfile
from collections.abc import Iterator
from types import CodeType

import torch.distributed as dist

ACCEPT_ENV = "EXPECTTEST_ACCEPT"


def accepting() -> bool:
    """Whether golden texts are being rewritten (``EXPECTTEST_ACCEPT`` is set)."""
    return bool(os.environ.get(ACCEPT_ENV))


def assert_expected_inline(actual: str, expect: str, skip: int = 0) -> None:
    """Asserts ``actual == expect`` (a unified diff on mismatch); under
    ``EXPECTTEST_ACCEPT=1`` rewrites the literal ``expect`` of the caller (``skip``
    frames further up) instead, on rank 0 only (see the module note)."""
    import expecttest  # imported where a golden text is compared, not with the plugin

    if not accepting():
        expecttest.assert_eq(expect, actual, msg=_HELP)
        return
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return
    frame = sys._getframe(skip + 1)
    position = expecttest.PositionInfo(frame.f_code.co_filename, frame.f_lineno)
    with _locked(position.filename):
        _align_edit_history(position.filename, frame.f_code)
        expecttest.assert_expected_inline(actual, expect, pos=position)


_HELP = (
    "To accept the new output, re-run the test with EXPECTTEST_ACCEPT=1 "
    "(commit or stage your changes first)"
)


@contextlib.contextmanager
def _locked(filename: str) -> Iterator[None]:
    digest = hashlib.sha1(os.path.realpath(filename).encode()).hexdigest()[:16]
    lock_path = os.path.join(tempfile.gettempdir(), f"expecttest-{digest}.lock")
    with open(lock_path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _align_edit_history(filename: str, code: CodeType) -> None:
    """Records, as one edit above the caller's function, the lines other processes
    added or removed there since this process compiled the file."""
    with open(filename) as f:
        now = _first_line(ast.parse(f.read()), code.co_qualname)
    if now is None:
        return
    import expecttest

    history = expecttest.EDIT_HISTORY
    believed = history.adjust_lineno(filename, code.co_firstlineno)
    if now != believed:
        history.state.setdefault(filename, []).append((believed - 1, now - believed))


def _first_line(tree: ast.Module, qualname: str) -> int | None:
    """The first line (its first decorator's) of the function ``qualname`` in ``tree``."""
    scope: list[ast.AST] = list(tree.body)
    node: ast.AST | None = None
    for name in qualname.split("."):
        if name == "<locals>":  # a function defined anywhere in the one before
            scope = [n for n in ast.walk(node) if n is not node] if node is not None else []
            continue
        node = next((n for n in scope if isinstance(n, _DEFS) and n.name == name), None)
        if node is None:
            return None
        scope = list(node.body)
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    return min([node.lineno, *(d.lineno for d in node.decorator_list)])


_DEFS = (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
