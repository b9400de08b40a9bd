"""The reach table: every row of FSDP1's public surface, which search draws it,
and for a row no search draws, why and the fixed test that covers it (see
[Note: How reach is measured] in fsdptest.reach)."""

from __future__ import annotations

from dataclasses import dataclass

import hypothesis

from fsdptest.reach.sample import COLUMNS, sample
from fsdptest.reach.surface import Row, all_rows
from fsdptest.reach.undrawn import UNDRAWN, Undrawn

DEFAULT_COUNT = 60
COMMAND = "python -m fsdptest.reach --write docs/reach.md"
_DRAWN, _NOT_DRAWN = "yes", "·"
_SECTIONS = {
    "constructor": "Constructor arguments and their values",
    "config": "Fields of the config classes",
    "enum": "Members of the enums",
    "environment": "Environment variables torch's FSDP reads",
    "method": "Public methods and context managers, with their arguments",
    "attribute": "Public attributes",
    "model": "Model shapes that change FSDP's behaviour",
}


@dataclass(frozen=True)
class Table:
    count: int
    hypothesis_version: str
    rows: list[Row]
    drawn: dict[str, set[str]]  # column -> rows' keys

    def drawn_anywhere(self, key: str) -> bool:
        return any(key in keys for keys in self.drawn.values())

    def undrawn_keys(self) -> list[str]:
        return [row.key for row in self.rows if not self.drawn_anywhere(row.key)]


def build(count: int = DEFAULT_COUNT) -> Table:
    """Sample every search ``count`` times per world size and read the rows off."""
    return Table(count, hypothesis.__version__, all_rows(), sample(count))


def render(table: Table) -> str:
    lines = _header(table)
    for section, title in _SECTIONS.items():
        rows = [row for row in table.rows if row.section == section]
        if rows:
            lines += ["", f"## {title}", "", *_section_table(table, rows)]
    return "\n".join(lines) + "\n"


def _header(table: Table) -> list[str]:
    undrawn = table.undrawn_keys()
    reasoned = sum(key in UNDRAWN for key in undrawn)
    drawn = len(table.rows) - len(undrawn)
    return [
        "# Reach of the searches",
        "",
        "Which parts of FSDP1's public surface the property search and the differential",
        "conformance search draw. Generated; do not edit: `" + COMMAND + "`.",
        "`tests/conformance/test_reach.py` checks it. How it is measured: [Note: How reach",
        "is measured] in `fsdptest/reach/__init__.py`.",
        "",
        f"- Sample: {table.count} drawn programs or examples per search and world size",
        f"  (2, 3 and 4), derandomized, hypothesis {table.hypothesis_version}.",
        f"- {len(table.rows)} rows: {drawn} drawn by a search, {reasoned} not drawn with a",
        f"  reason and a fixed test, {len(undrawn) - reasoned} not drawn without one.",
    ]


def _section_table(table: Table, rows: list[Row]) -> list[str]:
    head = ["Row", *COLUMNS, "Not drawn: why, and the test that covers it"]
    lines = [_cells(head), _cells(["---"] * len(head))]
    for row in rows:
        marks = [_DRAWN if row.key in table.drawn[column] else _NOT_DRAWN for column in COLUMNS]
        lines.append(_cells([f"`{_escape(row.key)}`", *marks, _why(table, row.key)]))
    return lines


def _why(table: Table, key: str) -> str:
    if table.drawn_anywhere(key):
        return ""
    undrawn: Undrawn | None = UNDRAWN.get(key)
    if undrawn is None:
        return "**no reason given**"
    return f"{_escape(undrawn.reason)}; `{undrawn.test}`"


def _cells(values: list[str]) -> str:
    return "| " + " | ".join(values) + " |"


def _escape(text: str) -> str:
    return text.replace("|", "\\|")
