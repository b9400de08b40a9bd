"""Per-file test and subtest counts of a JUnit report, as the Markdown table
``docs/suites.md`` keeps.

Usage::

    python -m pytest suites -n 2 --junitxml=local.xml
    python bench/suite_counts.py local.xml [--skips]
    python bench/suite_counts.py local.xml torch.xml    # side by side: passed / failed / skipped

With two reports the table puts them side by side, each cell ``passed / failed
/ skipped`` for tests and ``ran / failed / skipped`` for subtests.

Subtest counts come from each test's ``subtest`` properties (one per subtest,
``passed [a=1, b=2]``, written by the harness); a ``<skipped>`` element of a
subtest (message ``subtest [...]: reason``) does not make its test skipped.
``--skips`` also lists each skip reason of a test with its count.
"""

from __future__ import annotations

import argparse
import collections
import xml.etree.ElementTree as ET
from pathlib import Path

COLUMNS = ("passed", "failed", "skipped", "sub ran", "sub failed", "sub skipped")


def file_of(classname: str) -> str:
    """``suites.test_core.TestParity`` -> ``suites/test_core.py``."""
    parts = classname.split(".")
    for end in range(len(parts), 0, -1):
        if parts[end - 1].startswith("test_"):
            return "/".join(parts[:end]) + ".py"
    return classname


def own_skip(case: ET.Element) -> ET.Element | None:
    """The test's own ``<skipped>`` element (not one of its subtests')."""
    for skipped in case.iter("skipped"):
        if not skipped.get("message", "").startswith("subtest ["):
            return skipped
    return None


def outcome(case: ET.Element) -> str:
    if case.find("failure") is not None or case.find("error") is not None:
        return "failed"
    return "skipped" if own_skip(case) is not None else "passed"


def subtests(case: ET.Element) -> dict[str, int]:
    outcomes = collections.Counter(
        prop.get("value", "").split(" ", 1)[0]
        for prop in case.iter("property")
        if prop.get("name") == "subtest"
    )
    return {
        "ran": outcomes["passed"] + outcomes["failed"],
        "failed": outcomes["failed"],
        "skipped": outcomes["skipped"],
    }


def counts(path: Path) -> tuple[dict[str, collections.Counter[str]], collections.Counter[str]]:
    per_file: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    reasons: collections.Counter[str] = collections.Counter()
    for case in ET.parse(path).getroot().iter("testcase"):
        row = per_file[file_of(case.get("classname", ""))]
        result = outcome(case)
        row[result] += 1
        if result == "skipped":
            reasons[own_skip(case).get("message", "")] += 1  # type: ignore[union-attr]
        sub = subtests(case)
        row["sub ran"] += sub.get("ran", 0)
        row["sub failed"] += sub.get("failed", 0)
        row["sub skipped"] += sub.get("skipped", 0)
    return per_file, reasons


def table(per_file: dict[str, collections.Counter[str]]) -> str:
    lines = ["| suite | " + " | ".join(COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
    total: collections.Counter[str] = collections.Counter()
    for name in sorted(per_file):
        row = per_file[name]
        total.update(row)
        lines.append(f"| `{name}` | " + " | ".join(str(row[c]) for c in COLUMNS) + " |")
    lines.append("| total | " + " | ".join(f"**{total[c]}**" for c in COLUMNS) + " |")
    return "\n".join(lines)


def _cells(row: collections.Counter[str]) -> str:
    tests = " / ".join(str(row[c]) for c in COLUMNS[:3])
    subs = " / ".join(str(row[c]) for c in COLUMNS[3:])
    return f"{tests} | {subs}"


PerFile = dict[str, collections.Counter[str]]


def side_by_side(first: str, second: str, left: PerFile, right: PerFile) -> str:
    """Two reports' counts per file in one table, under the reports' names."""
    header = f"| suite | {first} tests | {first} subtests | {second} tests | {second} subtests |"
    lines = [header, "|---|---|---|---|---|"]
    totals = (collections.Counter[str](), collections.Counter[str]())
    for name in sorted(set(left) | set(right)):
        totals[0].update(left[name])
        totals[1].update(right[name])
        lines.append(f"| `{name}` | {_cells(left[name])} | {_cells(right[name])} |")
    lines.append(f"| total | {_cells(totals[0])} | {_cells(totals[1])} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("junit", type=Path, nargs="+", help="one or two JUnit files")
    parser.add_argument("--skips", action="store_true", help="list skip reasons with counts")
    opts = parser.parse_args()
    if len(opts.junit) > 2:
        parser.error("give one or two JUnit files")
    reports = [counts(path) for path in opts.junit]
    if len(reports) == 2:
        print(side_by_side(opts.junit[0].stem, opts.junit[1].stem, reports[0][0], reports[1][0]))
    else:
        print(table(reports[0][0]))
    if opts.skips:
        for path, (_, reasons) in zip(opts.junit, reports):
            print(f"\nskips of {path.name}:")
            for reason, n in reasons.most_common():
                print(f"- {n} × {reason}")


if __name__ == "__main__":
    main()
