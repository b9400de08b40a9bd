"""Every command the README and the guide show in a ``bash`` block is run, or
checked by the parser of the program it calls; the README keeps its quick start
first, and the options page names every option the plugins add.

[Note: How a shown command is checked]
Each command of a ``bash`` block (``doc_text.commands``: continuation lines
joined, comments dropped, ``&&`` chains split) is sorted by the program it
calls, after its leading ``NAME=value`` assignments:

- ``python -m pytest ARGS``: pytest parses ARGS with every plugin of the session
  (unknown options and ill-typed values fail, ``-p`` plugins are imported), then
  the runner's own value checks run (``harness._controller.options.check``), each
  ``--fsdp-impl``/``--fsdp-reference`` resolves, a ``--hypothesis-profile`` is one
  of ours, and every file or folder named is in the tree. Nothing is collected.
- ``torchrun ARGS -m pytest ARGS`` (also after ``srun``): torchrun's own parser
  takes its part, the rest is checked as pytest's, in the environment torchrun
  gives its workers.
- ``python SCRIPT ARGS``: the script runs up to its ``argparse`` call, which
  parses ARGS and stops it; the commands in ``CHEAP`` are also run to the end,
  and must exit 0.
- ``python -m pip install ...``: the same install as CI's (``.ci/run``), ``-q``
  aside, and every extra it names is one of the project's.
- ``NAME=$(...)``: the shell's own (SLURM's host list); nothing of ours to check.

Any other program fails, naming the doc and line, as does any error above. The
parsing happens in one subprocess for all commands (``tests/docs/parse_args.py``):
pytest's plugins and torch are imported once, and nothing leaks into this session.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

import pytest

from tests.docs import doc_text
from tests.docs.doc_text import ROOT, Citation

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs" / "guide").glob("*.md"))]
CHEAP = frozenset(
    {
        "python bench/fsdp2_planted_bugs.py list",
        "python bench/suite_list.py",
        "python bench/suite_list.py --check",
    }
)
README_LINES = 200
QUICK_START_BY = 40
_ASSIGNMENT = re.compile(r"^\w+=")
_OPTION = re.compile(r"`(--[\w-]+)")


class Shown(NamedTuple):
    """A shown command, with the program that checks it and that program's arguments."""

    citation: Citation
    program: str  # pytest, torchrun, script, pip, shell, or the unknown program's name
    args: tuple[str, ...]

    @property
    def where(self) -> str:
        return self.citation.where()


def classify(citation: Citation) -> Shown:
    """Which program ``citation``'s command calls ([Note: How a shown command is checked])."""
    words = shlex.split(citation.text)
    while words and _ASSIGNMENT.match(words[0]):
        if "$(" in words[0]:
            return Shown(citation, "shell", tuple(words))
        words = words[1:]
    if words[:2] == ["srun", "torchrun"]:
        words = words[1:]
    match words:
        case ["python", "-m", "pytest", *args]:
            return Shown(citation, "pytest", tuple(args))
        case ["python", "-m", "pip", *args]:
            return Shown(citation, "pip", tuple(args))
        case ["torchrun", *args]:
            return Shown(citation, "torchrun", tuple(args))
        case ["python", script, *args] if script.endswith(".py"):
            return Shown(citation, "script", (script, *args))
    return Shown(citation, words[0] if words else "", tuple(words[1:]))


def shown_commands(docs: Iterable[Path]) -> list[Shown]:
    """Every command of every ``bash`` block of ``docs``."""
    return [
        classify(command)
        for doc in docs
        for block in doc_text.blocks(doc)
        if block.lang == "bash"
        for command in doc_text.commands(block)
    ]


def parse_errors(commands: list[Shown]) -> dict[Shown, str]:
    """The error each pytest, torchrun and script command stops with ("" for none)."""
    parsed = [c for c in commands if c.program in ("pytest", "torchrun", "script")]
    request = json.dumps([[c.program, list(c.args)] for c in parsed])
    result = subprocess.run(
        [sys.executable, "-m", "tests.docs.parse_args"],
        input=request,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return dict(zip(parsed, json.loads(result.stdout.splitlines()[-1]), strict=True))


def ci_install() -> list[str]:
    """The arguments of ``.ci/run``'s ``pip install``, ``-q`` left out."""
    for line in (ROOT / ".ci" / "run").read_text().splitlines():
        words = shlex.split(line, comments=True)
        if words[:4] == ["python", "-m", "pip", "install"] and "--upgrade" not in words:
            return [w for w in words[3:] if w != "-q"]
    raise AssertionError(".ci/run installs nothing with pip")


def extras() -> set[str]:
    """The extras ``pyproject.toml`` declares (its ``[project.optional-dependencies]``)."""
    text = (ROOT / "pyproject.toml").read_text()
    section = text.split("[project.optional-dependencies]\n", 1)[1].split("\n[", 1)[0]
    return set(re.findall(r"^([\w-]+)\s*=", section, re.M))


def pip_error(args: tuple[str, ...]) -> str:
    """What is wrong with a shown ``pip install``: an unknown extra, or not CI's install."""
    named = re.findall(r"\[([^\]]*)\]", " ".join(args))
    unknown = [e for group in named for e in group.split(",") if e.strip() not in extras()]
    if unknown:
        return f"no such extra: {', '.join(unknown)}"
    if list(args) != ci_install():
        return f"not the install .ci/run makes: pip {' '.join(ci_install())}"
    return ""


def errors(commands: list[Shown]) -> dict[Shown, str]:
    """What is wrong with each command ("" for nothing)."""
    parsed = parse_errors(commands)
    found: dict[Shown, str] = {}
    for command in commands:
        if command in parsed:
            found[command] = parsed[command]
        elif command.program == "pip":
            found[command] = pip_error(command.args)
        elif command.program == "shell":
            found[command] = ""
        else:
            found[command] = f"{command.program or 'nothing'}: not a program the docs may show"
    return found


SHOWN = shown_commands(DOCS)


@pytest.fixture(scope="module")
def shown_errors() -> dict[Shown, str]:
    return errors(SHOWN)


def _id(command: Shown) -> str:
    return f"{command.citation.where().split(': ')[0]}:{command.program}"


@pytest.mark.parametrize("command", SHOWN, ids=[_id(c) for c in SHOWN])
def test_shown_command_is_accepted(command: Shown, shown_errors: dict[Shown, str]) -> None:
    """The command's program accepts it: every option known, every value valid,
    every path there ([Note: How a shown command is checked])."""
    assert not shown_errors[command], f"{command.where}\n  {shown_errors[command]}"


@pytest.mark.parametrize("text", sorted(CHEAP))
def test_cheap_command_runs(text: str) -> None:
    """A command shown that is cheap to run exits 0 (and is still shown)."""
    assert text in {shlex.join(["python", *c.args]) for c in SHOWN if c.program == "script"}
    words = shlex.split(text)
    result = subprocess.run(
        [sys.executable, *words[1:]], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, f"{text}\n{result.stdout}\n{result.stderr}"


def test_the_checks_fail_on_a_wrong_command(tmp_path: Path) -> None:
    """An unknown option, a missing path, a bad value, a wrong torchrun or script
    argument and an unknown program each fail, naming the doc and the line."""
    fake = tmp_path / "fake.md"
    fake.write_text(
        "```bash\n"
        "python -m pytest suites --no-such-option\n"
        "python -m pytest suites/test_no_such_suite.py\n"
        "python -m pytest suites --gpu-slots 0\n"
        "torchrun --no-such-flag -m pytest suites\n"
        "python bench/suite_list.py --no-such-flag\n"
        'python -m pip install -e ".[no-such-extra]"\n'
        "frobnicate --all\n"
        "```\n"
    )
    found = errors(shown_commands([fake]))
    assert [c.citation.line for c, error in found.items() if error] == list(range(2, 9))
    assert all(c.where.startswith("fake.md:") for c in found)


def test_readme_is_short_with_the_quick_start_first() -> None:
    """The README has at most 200 lines, and its quick start (heading and
    commands) is within the first 40."""
    readme = ROOT / "README.md"
    lines = readme.read_text().splitlines()
    assert len(lines) <= README_LINES, f"README.md has {len(lines)} lines"
    heading = lines.index("## Quick start") + 1
    block = next(b for b in doc_text.blocks(readme) if b.line > heading)
    end = block.line + len(block.text.splitlines())
    assert block.lang == "bash" and end <= QUICK_START_BY, f"the quick start ends at line {end}"


def test_the_quick_start_is_what_ci_runs() -> None:
    """The README's quick start installs as ``.ci/run`` does, and its last command
    is the test command ``.ci/run`` runs."""
    readme = ROOT / "README.md"
    first = next(b for b in doc_text.blocks(readme) if b.lang == "bash")
    quick = [classify(c) for c in doc_text.commands(first)]
    ci = [
        words
        for line in (ROOT / ".ci" / "run").read_text().splitlines()
        if (words := shlex.split(line, comments=True))[:3] == ["python", "-m", "pytest"]
    ]
    assert quick[-1].program == "pytest" and ["python", "-m", "pytest", *quick[-1].args] == ci[-1]
    assert all(list(c.args) == ci_install() for c in quick if c.program == "pip")


def test_the_options_page_names_every_option() -> None:
    """Every option the project's plugins add is in ``docs/guide/options.md``'s
    table, and every option the table names is one the parser knows."""
    page = (ROOT / "docs" / "guide" / "options.md").read_text()
    rows = [line.split("|")[1] for line in page.splitlines() if line.startswith("| `")]
    documented = {name for row in rows for name in _OPTION.findall(row)}
    known = json.loads(_run_python(_OPTIONS_SCRIPT))
    ours = set(known["ours"])
    assert not ours - documented, f"options not in the table: {sorted(ours - documented)}"
    unknown = documented - set(known["all"])
    assert not unknown, f"options the parser does not know: {sorted(unknown)}"


# The options of the project's groups (the runner's and the FSDP layer's), and all.
_OPTIONS_SCRIPT = """
import json
from _pytest.config import _prepareconfig
config = _prepareconfig([], prog="pytest")
groups = config._parser._groups
names = lambda g: [n for o in g.options for n in o.names() if n.startswith("--")]
ours = [n for g in groups if g.name in ("distributed", "fsdp") for n in names(g)]
print(json.dumps({"ours": ours, "all": [n for g in groups for n in names(g)]}))
config._ensure_unconfigure()
"""


def _run_python(code: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()[-1]
