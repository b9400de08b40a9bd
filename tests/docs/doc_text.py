"""The docs read as data: which files they are, their fenced ``bash`` blocks split
into commands, the repository paths and module names they cite, and the
``[Note: ...]`` titles they point to.

[Note: What counts as a cited path]
A cited path is a folder (ending in ``/``) or a file (with a suffix) that starts with one of the repository's top folders
(``suites/``, ``fsdptest/``, ``docs/``, ...) or is ``.ci/run``, anywhere in a doc
(prose, backticks, tables, code blocks), plus the target of every relative
Markdown link, read from the linking file's folder. ``<name>`` and ``$name`` stand for any
word (``suites/test_<suite>.py``) and ``*`` is a glob; ``::test`` after a file is
a test id and is dropped. A word preceded by ``/`` or ``.`` belongs to another
path (``torch/distributed/fsdp/...``, ``../shared/...``) and is not one of ours;
citing a folder outside the repository is reported separately.
"""

from __future__ import annotations

import os
import re
import shlex
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[2]
TOP_FOLDERS = (
    "suites",
    "fsdptest",
    "bench",
    "docs",
    "tests",
    "harness",
    "fsdp",
    "models",
    "upstream",
)
PACKAGES = ("harness", "fsdp", "fsdptest", "models", "upstream", "suites", "bench")

_PATH = re.compile(r"(?<![\w./$-])(?:\.ci/run\b|(?:" + "|".join(TOP_FOLDERS) + r")/[\w./*<>$-]*)")
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_OUTSIDE = re.compile(r"(?:\.\./)+(?:shared|notes)/[\w./-]*|(?<![\w./])(?:shared|notes)/[\w./-]+")
_DOTTED = re.compile(r"`((?:" + "|".join(PACKAGES) + r")(?:\.\w+)+)")
_NOTE = re.compile(r"\[Note: ([^\]]+)\]")
_FENCE = re.compile(r"^```(\w*)\s*$")


class Citation(NamedTuple):
    """One thing a doc names, with where it names it."""

    doc: Path
    line: int
    text: str

    def where(self) -> str:
        shown = self.doc.relative_to(ROOT) if self.doc.is_relative_to(ROOT) else self.doc.name
        return f"{shown}:{self.line}: {self.text}"


class Block(NamedTuple):
    """A fenced code block: its language and its first line in the doc."""

    doc: Path
    line: int
    lang: str
    text: str


def doc_files() -> list[Path]:
    """The README and every Markdown file under ``docs/``."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _lines(doc: Path) -> Iterator[tuple[int, str]]:
    yield from enumerate(doc.read_text().splitlines(), start=1)


def blocks(doc: Path) -> list[Block]:
    """Every fenced block of ``doc``."""
    found: list[Block] = []
    start, lang, body = 0, "", []
    for number, line in _lines(doc):
        fence = _FENCE.match(line)
        if fence and not start:
            start, lang, body = number, fence.group(1), []
        elif line.strip() == "```" and start:
            found.append(Block(doc, start + 1, lang, "\n".join(body)))
            start = 0
        elif start:
            body.append(line)
    return found


def cited_paths(doc: Path) -> list[Citation]:
    """The repository paths ``doc`` names ([Note: What counts as a cited path])."""
    found = []
    for number, line in _lines(doc):
        for match in _PATH.finditer(line):
            cited = match.group(0).rstrip(".,:;")
            if _is_path(cited):
                found.append(Citation(doc, number, cited))
        for match in _LINK.finditer(line):
            target = match.group(1).split("#")[0]
            if target and not re.match(r"\w+:", target):
                resolved = os.path.relpath((doc.parent / target).resolve(), ROOT)
                found.append(Citation(doc, number, resolved))
    return found


def _is_path(word: str) -> bool:
    """A folder (a trailing ``/``), a file with a suffix, a glob, or ``.ci/run``: not
    ``tests/s`` in "0.6 tests/s"."""
    last = word.rsplit("/", 1)[-1]
    return word == ".ci/run" or not last or any(mark in last for mark in ".*<$")


def path_exists(cited: str) -> bool:
    """Whether a cited path names something in the tree (a glob: at least one thing)."""
    pattern = re.sub(r"<[^>]*>|\$\w+", "*", cited.split("::")[0]).rstrip("/")
    if "*" in pattern:
        return any(ROOT.glob(pattern))
    return (ROOT / pattern).exists()


def outside_citations(doc: Path) -> list[Citation]:
    """Files outside the repository that ``doc`` cites (``../shared/...``)."""
    return [
        Citation(doc, number, match.group(0).rstrip(".,:;"))
        for number, line in _lines(doc)
        for match in _OUTSIDE.finditer(line)
    ]


def dotted_names(doc: Path) -> list[Citation]:
    """Module paths in backticks that start with one of the project's packages."""
    return [
        Citation(doc, number, match.group(1))
        for number, line in _lines(doc)
        for match in _DOTTED.finditer(line)
    ]


def note_titles(doc: Path) -> list[Citation]:
    """The ``[Note: Title]`` blocks ``doc`` points to."""
    return [
        Citation(doc, number, match.group(1))
        for number, line in _lines(doc)
        for match in _NOTE.finditer(line)
    ]


def commands(block: Block) -> list[Citation]:
    """The commands of a ``bash`` block: continuation lines joined, comments and a
    trailing ``&`` dropped, ``&&`` chains split."""
    found = []
    for offset, line in _logical_lines(block.text):
        words = shlex.split(line, comments=True)
        for part in _split_on(words, "&&"):
            if part and part[-1] == "&":
                part = part[:-1]
            if part:
                found.append(Citation(block.doc, block.line + offset, shlex.join(part)))
    return found


def _logical_lines(text: str) -> Iterator[tuple[int, str]]:
    """Lines ending in a backslash joined to the next, each with its first line's offset."""
    start, pending = 0, ""
    for offset, line in enumerate(text.splitlines()):
        if not pending:
            start = offset
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        yield start, pending + line
        pending = ""


def _split_on(words: list[str], separator: str) -> list[list[str]]:
    parts: list[list[str]] = [[]]
    for word in words:
        if word == separator:
            parts.append([])
        else:
            parts[-1].append(word)
    return parts
