"""Mutation testing of ``fsdp/`` with cosmic-ray: how many small bugs the gate kills.

Usage (from the checkout root, with the project's virtualenv active)::

    python bench/mutation.py prepare --workdir /tmp/fsdp-mutation --mutants 100 --seed 19
    python bench/mutation.py run --workdir /tmp/fsdp-mutation       # hours on 2 cores
    python bench/mutation.py report --workdir /tmp/fsdp-mutation --json docs/runs/mutation-results.json

[Note: Why cosmic-ray, in a scratch copy]
The suites spawn rank processes that import ``fsdp`` from the checkout. cosmic-ray
mutates the source file in place, runs one test command, and restores the file,
so every process of the gate (the pytest process and the spawned ranks) sees
the mutant without any import hook. mutmut 3 instead writes trampolined copies
to ``mutants/`` and selects the active mutant through an environment variable and
its own runner, which the spawned ranks and our pytest plugins would have to be
taught. To keep the checkout's ``fsdp/`` pristine while mutants are applied,
``prepare`` copies the checkout's files (tracked and untracked, not ignored) to
``--workdir``, commits them there in a throwaway git repository (the gate asks
``git diff`` which file is mutated), writes ``bench/mutation.toml`` with this
interpreter, runs ``cosmic-ray init`` and marks every mutant outside the sample
as skipped.

[Note: The sample]
``cosmic-ray init`` enumerates every mutant of every operator over ``fsdp/``. The
sample is stratified by file and seeded: every file gets ``--min-per-file``
mutants (or all it has), the rest of ``--mutants`` is shared out in proportion
to the files' mutant counts (largest remainders), and each file's mutants are
drawn with ``random.Random(f"{seed}:{file}")`` from the file's mutants in the
order of (operator, occurrence), and ``--shard I/N`` keeps every N-th of the
sample in (file, operator, occurrence) order. The same seed and the same sources
give the same sample in every prepared copy, so the shards are its disjoint
parts. (Keyed on cosmic-ray's job ids, which are random per ``cosmic-ray
init``, as in the first version of this script, each copy drew a sample of its
own: the shards of the run of 2026-11-26 overlap in two mutants and miss
others; docs/runs/mutation.md.)

[Note: Mutants that cannot change behaviour are not sampled]
Before sampling, ``prepare`` marks as skipped (``not sampled: unobservable``)
every mutant whose whole span lies where no program can see a change, by
construction of the language, not by argument about one mutant:

- an annotation (of a parameter, a return, or an annotated assignment) in a
  module with ``from __future__ import annotations``: the annotation is kept as
  a string that nothing evaluates (nothing in ``fsdp/`` calls
  ``typing.get_type_hints``; ``dataclasses`` reads a field's annotation string
  only to look for ``ClassVar``/``InitVar``, which no operator can produce);
- a docstring, or the body of an ``if TYPE_CHECKING:`` block (never executed).

These are not equivalent survivors triaged by hand: they are outside the
sample. Every other mutant, however likely to be equivalent, stays in the pool
and is triaged by hand when it survives.

[Note: The per-mutant gate]
``gate`` runs in the scratch copy with the mutant applied: one pytest session,
``-x``, the differential conformance search at world size 2
(``--conformance-scenarios``, derandomized ``ci`` profile, so every mutant meets
the same scenarios) first, then the suites of the mutated file's feature area
(``AREA_SUITES``). An unmutated gate exits 0 (``run`` checks that first with
``--baseline``).

[Note: Incompetent mutants]
cosmic-ray's operators work on parso's tree and can write a mutant that is not
Python (``{**a, **b}``'s unpacking ``**`` taken for a power and replaced by
``&``). Such a mutant fails every gate at import, which says nothing about the
gate: ``report`` compiles each mutant that ran and reports one that does not
compile as ``incompetent``, outside the kill rate, and ``prepare`` draws each
file's mutants in a seeded order and keeps the first that compile (the run of
2026-11-26 was sampled before this check: docs/runs/mutation.md).

The conformance search runs as a survey (``--conformance-survey``): every one
of its derandomized scenarios runs and the test fails at the end if any failed,
without shrinking. A mutant is killed by the same scenarios as without it (the
drawn sequence does not depend on outcomes before the first failure), and a kill
costs the budget's scenarios instead of a shrink (about 200 more scenarios).

[Note: Hangs]
A mutant that makes a test hang (a rank waits in a collective its peers never
enter, a loop that never ends) is a real failure of the gate: every test has
pytest-timeout's deadline (``--test-timeout``, 240 s: the conformance
search's 16 scenarios at three ranks took 102 s on the loaded 2-core machine),
and for a distributed test the harness's
deadline falls just below it and fails the test with every rank's stack, as
in CI. So a hang is *killed* by a failing test, not by cosmic-ray's timeout,
which is raised to a backstop (900 s; 600 s in the first part of the run) that only a gate hanging outside every
test reaches; such a "timeout" result is not counted as a kill until
``retest --outcomes timeout`` on a quiet machine shows it again. The gate log
marks a failure that was a deadline (``"deadline": true``) so that a kill by a
deadline can be told from a fast failure: on a loaded machine an unmutated test
can approach the deadline, so each deadline kill is rerun (``retest --outcomes
deadline``) and counted as killed only if the rerun fails the same way while
the file's unmutated gate passes well inside the deadline.
"""

from __future__ import annotations

import argparse
import ast
import itertools
import json
import os
import random
import shutil
import subprocess
import sys
import time
import warnings
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIG = "bench/mutation.toml"
SESSION = "mutation.sqlite"
GATE_LOG = "mutation-gate.jsonl"
TEST_TIMEOUT = 240  # seconds, per test of the gate (see [Note: Hangs])

CONFORMANCE = [
    "suites/test_conformance.py::test_fsdp_conforms_to_the_reference[2]",
]
# [Note: Uneven shards in the gate]
# At two ranks every drawn unit splits into two near-equal shards; at three, a
# rank holds a parameter's last few elements, one element, or only padding, and
# a mesh dimension can have more ranks than a tensor has rows. The files whose
# code handles where a unit's elements fall also meet the conformance search at
# world size 3 (its own 16 derandomized scenarios).
UNEVEN_SHARDS = "suites/test_conformance.py::test_fsdp_conforms_to_the_reference[3]"
SHARD_GEOMETRY = {
    "fsdp/_dtensor_extensions.py",
    "fsdp/_flat_param.py",
    "fsdp/_layout.py",
    "fsdp/_shard_utils.py",
    "fsdp/_state_dict/optim_unit.py",
    "fsdp/_state_dict/values.py",
    "fsdp/_storage.py",
    "fsdp/_unshard_params.py",
}
# The suites of each file's feature area, run after the conformance search.
AREA_SUITES: dict[str, list[str]] = {
    "fsdp/__init__.py": ["suites/test_utils.py"],
    "fsdp/_clip_grad.py": ["suites/test_clip_grad_norm.py"],
    "fsdp/_comm.py": ["suites/test_collective_traces.py"],
    "fsdp/_common.py": ["suites/test_utils.py"],
    # fully_shard: the suite that calls it
    "fsdp/_composable.py": [
        "suites/test_composable.py",
        "suites/test_construction.py",
        "suites/test_mixed_precision.py",
    ],
    "fsdp/_dtensor_extensions.py": [
        "suites/test_fsdp_dtensor_state_dict.py",
        "suites/test_fsdp_tp_integration.py",
    ],
    # and the prefetch candidates it gives: the collective order of both prefetches
    "fsdp/_exec_order.py": [
        "suites/test_fsdp_exec_order.py",
        "suites/test_collective_traces.py",
        "suites/test_fsdp_backward_prefetch.py",
    ],
    # and the handle phases backward prefetch reads
    "fsdp/_flat_param.py": [
        "suites/test_flatten_params.py",
        "suites/test_fsdp_backward_prefetch.py",
    ],
    "fsdp/_grads.py": ["suites/test_grad_accumulation.py"],
    "fsdp/_ignored.py": ["suites/test_construction.py"],
    # and its checks of tensor-parallel (DTensor) parameters, and HSDP's groups
    "fsdp/_init.py": [
        "suites/test_construction.py",
        "suites/test_fsdp_tp_integration.py",
        "suites/test_fsdp_hybrid_shard.py",
    ],
    "fsdp/_layout.py": ["suites/test_flatten_params.py"],
    "fsdp/_orig_params.py": ["suites/test_use_orig_params.py"],
    "fsdp/_placeholder.py": ["suites/test_utils.py"],
    "fsdp/_registry.py": ["suites/test_utils.py"],
    "fsdp/_runtime.py": ["suites/test_fsdp_comm.py"],
    "fsdp/_shard_utils.py": ["suites/test_fsdp_dtensor_state_dict.py"],
    "fsdp/_storage.py": ["suites/test_flatten_params.py"],
    # the unit's lifecycle, its post-backward hook and its gradient reduction
    "fsdp/_backward_hook.py": ["suites/test_fsdp_comm.py", "suites/test_grad_accumulation.py"],
    "fsdp/_lifecycle.py": ["suites/test_fsdp_comm.py"],
    "fsdp/_unit_state.py": ["suites/test_fsdp_comm.py"],
    "fsdp/_reduce.py": ["suites/test_fsdp_comm_hooks.py", "suites/test_grad_accumulation.py"],
    "fsdp/_streams.py": ["suites/test_fsdp_comm.py"],
    "fsdp/_unshard_params.py": ["suites/test_unshard_options.py"],
    "fsdp/_utils.py": ["suites/test_utils.py"],
    # the enums and the state-dict configs
    "fsdp/api.py": ["suites/test_utils.py", "suites/test_state_dict_options.py"],
    "fsdp/fully_sharded_data_parallel.py": ["suites/test_construction.py"],
    "fsdp/sharded_grad_scaler.py": ["suites/test_grad_scaler.py"],
    "fsdp/wrap.py": ["suites/test_wrap.py"],
}
# The state dicts and optimizer state dicts (the sub-package fsdp/_state_dict/).
AREA_SUITES.update(
    {
        f"fsdp/_state_dict/{name}.py": ["suites/test_state_dict_options.py"]
        for name in ("__init__", "hooks", "kinds", "keys", "settings")
    }
)
AREA_SUITES["fsdp/_state_dict/values.py"] = [
    "suites/test_state_dict_options.py",
    "suites/test_fsdp_dtensor_state_dict.py",
]
AREA_SUITES.update(
    {
        f"fsdp/_state_dict/{name}.py": [
            "suites/test_state_dict_options.py",
            "suites/test_fsdp_optim_state.py",
        ]
        for name in ("optim_keys", "optim_unit", "optim_save", "optim_load", "optim_rekey")
    }
)
# and the optimizer states of tensor-parallel (DTensor) parameters, gathered and sharded again
AREA_SUITES["fsdp/_state_dict/optim_unit.py"].append("suites/test_fsdp_tp_integration.py")
AREA_SUITES["fsdp/_state_dict/deprecation.py"] = ["suites/test_fsdp_optim_state.py"]


def _run(cmd: list[str], cwd: Path, **kwargs: object) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, check=True, **kwargs)  # type: ignore[call-overload]


def _copy_checkout(workdir: Path) -> None:
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    ).stdout.split(b"\0")
    for raw in files:
        if not raw:
            continue
        rel = Path(raw.decode())
        if not (ROOT / rel).is_file():
            continue
        (workdir / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, workdir / rel)
    (workdir / ".gitignore").write_text(
        (workdir / ".gitignore").read_text() + f"\n{SESSION}\n{GATE_LOG}\n"
    )
    _run(["git", "init", "-q"], workdir)
    _run(["git", "add", "-A"], workdir)
    _run(
        [
            "git",
            "-c",
            "user.name=mutation",
            "-c",
            "user.email=mutation@localhost",
            "commit",
            "-qm",
            "base",
        ],
        workdir,
    )


def _write_config(workdir: Path) -> None:
    text = (ROOT / CONFIG).read_text()
    text = text.replace(
        '"python bench/mutation.py gate"', f'"{sys.executable} bench/mutation.py gate"'
    )
    (workdir / CONFIG).write_text(text)


def allocate(counts: dict[str, int], total: int, min_per_file: int) -> dict[str, int]:
    """Mutants per file: ``min_per_file`` each (capped by what a file has), the rest
    in proportion to the files' counts by largest remainders."""
    share = {f: min(n, min_per_file) for f, n in counts.items()}
    left = total - sum(share.values())
    if left <= 0:
        return share
    room = {f: counts[f] - share[f] for f in counts}
    pool = sum(room.values())
    exact = {f: left * room[f] / pool for f in counts} if pool else {}
    for f, x in exact.items():
        share[f] += min(int(x), room[f])
    rest = total - sum(share.values())
    for f in sorted(exact, key=lambda f: exact[f] - int(exact[f]), reverse=True):
        if rest <= 0:
            break
        if share[f] < counts[f]:
            share[f] += 1
            rest -= 1
    return share


Span = tuple[tuple[int, int], tuple[int, int]]


def _docstring_node(node: ast.AST) -> ast.AST | None:
    body = getattr(node, "body", None)
    if not body or not isinstance(body, list):
        return None
    first = body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
        if isinstance(first.value.value, str):
            return first
    return None


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _span(node: ast.AST) -> Span:
    return (
        (node.lineno, node.col_offset),  # type: ignore[attr-defined]
        (node.end_lineno, node.end_col_offset),  # type: ignore[attr-defined]
    )


def unobservable_spans(source: str) -> list[Span]:
    """The spans of ``source`` that no running program can observe (see
    ``[Note: Mutants that cannot change behaviour are not sampled]``)."""
    tree = ast.parse(source)
    lazy = any(
        isinstance(n, ast.ImportFrom)
        and n.module == "__future__"
        and any(a.name == "annotations" for a in n.names)
        for n in tree.body
    )
    spans: list[Span] = []
    for node in ast.walk(tree):
        doc = _docstring_node(node) if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) else None  # fmt: skip
        if doc is not None:
            spans.append(_span(doc))
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            spans += [_span(stmt) for stmt in node.body]
        if not lazy:
            continue
        if isinstance(node, ast.arg) and node.annotation is not None:
            spans.append(_span(node.annotation))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.returns:
            spans.append(_span(node.returns))
        elif isinstance(node, ast.AnnAssign):
            spans.append(_span(node.annotation))
    return spans


def _inside(spans: list[Span], start: tuple[int, int], end: tuple[int, int]) -> bool:
    return any(lo <= start and end <= hi for lo, hi in spans)


def _file_of(job_id: str, by_file: dict[str, list[str]]) -> str:
    return next(f for f, ids in by_file.items() if job_id in ids)


def prepare(args: argparse.Namespace) -> None:
    from cosmic_ray.work_db import WorkDB, use_db
    from cosmic_ray.work_item import WorkerOutcome, WorkResult

    workdir = Path(args.workdir).resolve()
    if workdir.exists():
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True)
    _copy_checkout(workdir)
    _write_config(workdir)
    _run(["cosmic-ray", "init", CONFIG, SESSION], workdir)
    by_file: dict[str, list[str]] = defaultdict(list)
    unobservable: dict[str, list[str]] = defaultdict(list)
    spans: dict[str, list[Span]] = {}
    stable: dict[str, tuple[str, int]] = {}  # job id -> (operator, occurrence): see the note
    specs: dict[str, object] = {}
    with use_db(str(workdir / SESSION), WorkDB.Mode.open) as db:
        for item in db.work_items:
            m = item.mutations[0]
            f = str(m.module_path)
            if f not in spans:
                spans[f] = unobservable_spans((workdir / f).read_text())
            if _inside(spans[f], tuple(m.start_pos), tuple(m.end_pos)):
                unobservable[f].append(item.job_id)
            else:
                by_file[f].append(item.job_id)
                stable[item.job_id] = (m.operator_name, m.occurrence)
                specs[item.job_id] = m
        db.set_multiple_results(
            [i for ids in unobservable.values() for i in ids],
            WorkResult(worker_outcome=WorkerOutcome.SKIPPED, output="not sampled: unobservable"),
        )
        counts = {f: len(ids) for f, ids in sorted(by_file.items())}
        share = allocate(counts, args.mutants, args.min_per_file)
        chosen: set[str] = set()
        for f in sorted(by_file):
            ids = sorted(by_file[f], key=stable.__getitem__)
            drawn = random.Random(f"{args.seed}:{f}").sample(ids, len(ids))
            competent = (i for i in drawn if _compiles(workdir, specs[i]))
            chosen.update(itertools.islice(competent, share[f]))
        index, count = (int(x) for x in args.shard.split("/"))
        order = sorted(chosen, key=lambda i: (_file_of(i, by_file), stable[i]))
        mine = {i for k, i in enumerate(order) if k % count == index}
        skipped = [i for ids in by_file.values() for i in ids if i not in mine]
        db.set_multiple_results(
            skipped,
            WorkResult(worker_outcome=WorkerOutcome.SKIPPED, output="not sampled"),
        )
    plan = {
        "seed": args.seed,
        "mutants": len(chosen),
        "shard": args.shard,
        "in_shard": len(mine),
        "per_file": {f: [counts[f], share[f]] for f in counts},
        "unobservable": {f: len(ids) for f, ids in sorted(unobservable.items())},
    }
    (workdir / "mutation-plan.json").write_text(json.dumps(plan, indent=1))
    print(
        f"{sum(counts.values())} mutants in {len(counts)} files (and "
        f"{sum(len(i) for i in unobservable.values())} unobservable, not sampled); "
        f"{len(chosen)} sampled, {len(mine)} in shard {args.shard}"
    )
    for f in counts:
        print(f"  {f}: {share[f]} of {counts[f]}")


def _mutated_files(cwd: Path) -> list[str]:
    out = subprocess.run(
        ["git", "diff", "--name-only", "--", "fsdp"],
        cwd=cwd,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return [line for line in out.splitlines() if line]


def gate_command(files: list[str], scenarios: int, test_timeout: int) -> list[str]:
    suites: list[str] = []
    for f in files:
        if f not in AREA_SUITES:
            raise SystemExit(
                f"no area suites for {f!r}: add it to AREA_SUITES in bench/mutation.py"
            )
        suites += [s for s in AREA_SUITES[f] if s not in suites]
    conformance = CONFORMANCE + ([UNEVEN_SHARDS] if SHARD_GEOMETRY & set(files) else [])
    return [
        sys.executable, "-m", "pytest", *conformance, *suites,
        "-x", "-q", "-p", "no:cacheprovider", "-p", "no:randomly",
        f"--timeout={test_timeout}", f"--conformance-scenarios={scenarios}",
        "--conformance-survey",
    ]  # fmt: skip


def _hit_deadline(output: str) -> bool:
    """Whether a test of the gate failed on a deadline (see [Note: Hangs])."""
    return "Failed: Timeout >" in output or "timed out after" in output


def gate(args: argparse.Namespace) -> int:
    cwd = Path.cwd()
    files = _mutated_files(cwd) or list(args.files)
    if not files:
        raise SystemExit("gate: no mutated file under fsdp/ (and no --files given)")
    cmd = gate_command(files, args.scenarios, args.test_timeout)
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    elapsed = time.monotonic() - start
    tail = (proc.stdout + proc.stderr).splitlines()[-40:]
    with open(cwd / GATE_LOG, "a") as log:
        log.write(
            json.dumps(
                {
                    "files": files,
                    "rc": proc.returncode,
                    "seconds": round(elapsed, 1),
                    "deadline": _hit_deadline(proc.stdout + proc.stderr),
                    "tail": tail,
                }
            )
            + "\n"
        )
    sys.stdout.write("\n".join(tail) + "\n")
    return proc.returncode


def run(args: argparse.Namespace) -> None:
    workdir = Path(args.workdir).resolve()
    if args.baseline:
        for f in sorted({f for f in AREA_SUITES}):
            cmd = gate_command([f], args.scenarios, TEST_TIMEOUT)
            start = time.monotonic()
            rc = subprocess.run(cmd, cwd=workdir, capture_output=True).returncode
            print(f"baseline {f}: rc={rc} {time.monotonic() - start:.1f}s", flush=True)
            if rc != 0:
                raise SystemExit(f"the unmutated gate of {f} fails: fix it before mutating")
    _run(["cosmic-ray", "exec", CONFIG, SESSION], workdir)


def retest(args: argparse.Namespace) -> None:
    """Runs the survivors of ``--results`` again, each applied with ``cosmic-ray apply``
    in ``--workdir`` (a prepared copy of the checkout as it is now: widened
    observations and area suites), and records how each ends."""
    if args.carry:
        return retest_carried(args)
    workdir = Path(args.workdir).resolve()
    survivors = [
        r
        for w in args.results
        for r in _rows(Path(w).resolve())
        if (r["outcome"] in args.outcomes or ("deadline" in args.outcomes and r["deadline"]))
        and r["job_id"] not in args.skip
        and (not args.only or any(r["job_id"].startswith(k) for k in args.only))
    ]
    if args.only:  # in the order given
        survivors.sort(
            key=lambda r: next(i for i, k in enumerate(args.only) if r["job_id"].startswith(k))
        )
    out = []
    for r in survivors:
        _run(["cosmic-ray", "apply", r["file"], r["operator"], str(r["occurrence"])], workdir)
        try:
            cmd = gate_command(_mutated_files(workdir), args.scenarios, TEST_TIMEOUT)
            start = time.monotonic()
            try:
                proc = subprocess.run(
                    cmd, cwd=workdir, capture_output=True, text=True, timeout=args.timeout
                )
                outcome = "survived" if proc.returncode == 0 else "killed"
                deadline = _hit_deadline(proc.stdout + proc.stderr)
                tail = (proc.stdout + proc.stderr).splitlines()[-6:]
            except subprocess.TimeoutExpired:
                outcome, deadline, tail = "timeout", False, []
        finally:
            _run(["git", "checkout", "-q", "--", "fsdp"], workdir)
        seconds = round(time.monotonic() - start, 1)
        row = {
            "job_id": r["job_id"],
            "file": r["file"],
            "line": r["line"],
            "outcome": outcome,
            "deadline": deadline,
            "seconds": seconds,
            "tail": tail,
        }
        print(json.dumps(row), flush=True)
        out.append(row)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


# [Note: Carrying a mutant over to moved code]
# A run's mutants are cosmic-ray's (file, operator, occurrence) at the commit the
# run sampled; once ``fsdp/`` has changed (a file split, lines moved) the same
# occurrence names another spot or another file. ``retest --carry`` re-applies a
# mutant by its diff instead: the hunk's old lines (context and removed) must
# occur exactly once in ``fsdp/`` of the prepared copy, and are replaced there by
# the hunk's new lines. A mutant whose old lines are gone or ambiguous is
# reported ``not carried`` (the code it mutated no longer exists as it was), never
# counted as killed. Where the hunk's context changed, its changed lines alone are
# tried (again: exactly once); where the mutated code was rewritten, the mutant is
# ported by hand to the same change of today's code (``--ported``,
# docs/runs/mutation-ported.json, each with why it is the same mutant).


def _hunk_texts(diff: str) -> tuple[str, str]:
    """(old, new) text of a one-hunk unified diff."""
    old: list[str] = []
    new: list[str] = []
    lines = diff.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("@@")) + 1
    for line in lines[start:]:
        tag, text = line[:1], line[1:]
        if tag in (" ", "-"):
            old.append(text)
        if tag in (" ", "+"):
            new.append(text)
    return "\n".join(old) + "\n", "\n".join(new) + "\n"


def _changed_lines(diff: str) -> tuple[str, str]:
    """(old, new) of a hunk's removed and added lines only, without context."""
    lines = diff.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("@@")) + 1
    old = [line[1:] for line in lines[start:] if line.startswith("-")]
    new = [line[1:] for line in lines[start:] if line.startswith("+")]
    return "".join(t + "\n" for t in old), "".join(t + "\n" for t in new)


def _replace_once(workdir: Path, old: str, new: str) -> str | None:
    found = [
        path
        for path in sorted((workdir / "fsdp").rglob("*.py"))
        for _ in range(path.read_text().count(old))
    ]
    if len(found) != 1 or not old:
        return None
    found[0].write_text(found[0].read_text().replace(old, new))
    return str(found[0].relative_to(workdir))


def carry(diff: str, workdir: Path, ported: dict | None = None) -> str | None:
    """Applies ``diff``'s change where its old lines occur once in ``workdir``'s
    ``fsdp/`` (the whole hunk, else its changed lines alone), or ``ported``'s
    hand-ported ``old``/``new`` where the code was rewritten; returns the changed
    file (relative), or None (see [Note: Carrying a mutant over to moved code])."""
    if ported is not None:
        return _replace_once(workdir, ported["old"], ported["new"])
    return _replace_once(workdir, *_hunk_texts(diff)) or _replace_once(
        workdir, *_changed_lines(diff)
    )


def retest_carried(args: argparse.Namespace) -> None:
    """``retest --carry RESULTS.json``: every survivor of a report (not triaged
    equivalent), carried over to the prepared copy's code and run under its gate."""
    workdir = Path(args.workdir).resolve()
    rows = json.loads(Path(args.carry).read_text())["mutants"]
    ported = json.loads(Path(args.ported).read_text()) if args.ported else {}
    survivors = [
        r
        for r in rows
        if r.get("final") == "survived"
        and (r.get("triage") or {}).get("verdict") != "equivalent"
        and not r.get("duplicate")
        and (not args.only or any(r["job_id"].startswith(k) for k in args.only))
    ]
    out = []
    for r in survivors:
        port = next((v for k, v in ported.items() if r["job_id"].startswith(k)), None)
        changed = carry(r["diff"], workdir, port)
        row = {"job_id": r["job_id"], "file": r["file"], "line": r["line"], "carried_to": changed}
        if changed is None:
            row.update(outcome="not carried", deadline=False, seconds=0.0, tail=[])
        else:
            try:
                row.update(_gate_once(workdir, [changed], args))
            finally:
                _run(["git", "checkout", "-q", "--", "fsdp"], workdir)
        print(json.dumps(row), flush=True)
        out.append(row)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


def _gate_once(workdir: Path, files: list[str], args: argparse.Namespace) -> dict:
    cmd = gate_command(files, args.scenarios, TEST_TIMEOUT)
    start = time.monotonic()
    try:
        proc = subprocess.run(
            cmd, cwd=workdir, capture_output=True, text=True, timeout=args.timeout
        )
    except subprocess.TimeoutExpired:
        return {"outcome": "timeout", "deadline": False, "seconds": args.timeout, "tail": []}
    output = proc.stdout + proc.stderr
    return {
        "outcome": "survived" if proc.returncode == 0 else "killed",
        "deadline": _hit_deadline(output),
        "seconds": round(time.monotonic() - start, 1),
        "tail": output.splitlines()[-6:],
    }


def _outcome(result: object) -> str:
    if result is None:
        return "pending"
    if result.worker_outcome == "skipped":  # type: ignore[attr-defined]
        return "skipped"
    if result.worker_outcome != "normal":  # type: ignore[attr-defined]
        return f"error:{result.worker_outcome}"  # type: ignore[attr-defined]
    if result.test_outcome == "killed":  # type: ignore[attr-defined]
        return "timeout" if result.output == "timeout" else "killed"  # type: ignore[attr-defined]
    return str(result.test_outcome.value)  # type: ignore[attr-defined]


def report(args: argparse.Namespace) -> None:

    rows = []
    seconds = []
    for workdir in (Path(w).resolve() for w in args.workdir):
        rows += _rows(workdir)
        log = workdir / GATE_LOG
        if log.exists():
            seconds += [json.loads(line)["seconds"] for line in log.read_text().splitlines()]
    _settle(rows, args.retest, args.triage)
    _summarise(rows, seconds, args.json)


def _settle(rows: list[dict], retests: list[str], triage: str | None) -> None:
    """Each mutant's final outcome: its last retest's (``retest --json`` files, in
    order) or the run's; and its triage (``--triage``: a JSON object from job-id
    prefix to ``{"verdict": ..., "why": ...}``)."""
    last: dict[str, dict] = {}
    for path in retests:
        for row in json.loads(Path(path).read_text()):
            last[row["job_id"]] = row
    verdicts = json.loads(Path(triage).read_text()) if triage else {}
    for r in rows:
        again = last.get(r["job_id"])
        r["retest"] = None if again is None else {k: again[k] for k in ("outcome", "seconds")}
        r["final"] = r["outcome"] if again is None else again["outcome"]
        found = [v for k, v in verdicts.items() if r["job_id"].startswith(k)]
        r["triage"] = found[0] if found else None


def _rows(workdir: Path) -> list[dict]:
    from cosmic_ray.work_db import WorkDB, use_db

    rows = []
    with use_db(str(workdir / SESSION), WorkDB.Mode.open) as db:
        results = dict(db.results)
        for item in db.work_items:
            outcome = _outcome(results.get(item.job_id))
            if outcome == "skipped":
                continue
            m = item.mutations[0]
            if outcome != "pending" and not _compiles(workdir, m):
                outcome = "incompetent"
            rows.append(
                {
                    "job_id": item.job_id,
                    "file": str(m.module_path),
                    "operator": m.operator_name,
                    "occurrence": m.occurrence,
                    "line": m.start_pos[0],
                    "definition": m.definition_name,
                    "outcome": outcome,
                    "deadline": outcome == "killed"
                    and _hit_deadline(results[item.job_id].output or ""),
                    "diff": results[item.job_id].diff if item.job_id in results else "",
                }
            )
    return rows


def _compiles(workdir: Path, mutation: object) -> bool:
    """Whether the mutant is Python at all (see [Note: Incompetent mutants])."""
    from cosmic_ray.mutating import mutate_code
    from cosmic_ray.plugins import get_operator

    m = mutation
    path = str(m.module_path)  # type: ignore[attr-defined]
    source = subprocess.run(
        ["git", "show", f"HEAD:{path}"], cwd=workdir, check=True, capture_output=True, text=True
    ).stdout
    operator = get_operator(m.operator_name)(**m.operator_args)  # type: ignore[attr-defined]
    code = mutate_code(source, operator, m.occurrence)  # type: ignore[attr-defined]
    try:
        with warnings.catch_warnings():  # a mutant's `is` with a literal warns
            warnings.simplefilter("ignore", SyntaxWarning)
            compile(code, path, "exec")
    except SyntaxError:
        return False
    return True


def _summarise(rows: list[dict], seconds: list[float], json_path: str | None) -> None:
    rows.sort(key=lambda r: (r["file"], r["line"], r["operator"]))
    per_file: dict[str, Counter] = defaultdict(Counter)
    for r in rows:
        per_file[r["file"]][r["outcome"]] += 1
    total = Counter(r["outcome"] for r in rows)
    seen: set[tuple[str, str, int]] = set()
    for r in rows:  # the same mutant drawn by two shards (see [Note: The sample]) counts once
        key = (r["file"], r["operator"], r["occurrence"])
        r["duplicate"] = key in seen and r["outcome"] != "pending"
        if r["outcome"] != "pending":
            seen.add(key)
    ran = [r for r in rows if r["outcome"] != "pending" and not r["duplicate"]]
    incompetent = [r for r in ran if r["outcome"] == "incompetent"]
    equivalent = [r for r in ran if (r.get("triage") or {}).get("verdict") == "equivalent"]
    counted = [r for r in ran if r not in equivalent and r not in incompetent]
    killed = [r for r in counted if r.get("final", r["outcome"]) == "killed"]
    summary = {
        "outcomes": dict(total),
        "final": {
            "ran": len(ran),
            "duplicates": sum(r["duplicate"] for r in rows),
            "incompetent": len(incompetent),
            "equivalent": len(equivalent),
            "non_equivalent": len(counted),
            "killed": len(killed),
            "not_killed": len(counted) - len(killed),
            "kill_rate": round(len(killed) / len(counted), 3) if counted else None,
            "final_outcomes": dict(Counter(r.get("final", r["outcome"]) for r in ran)),
        },
        "per_file": {f: dict(c) for f, c in sorted(per_file.items())},
        "gate_seconds": {
            "runs": len(seconds),
            "mean": round(sum(seconds) / len(seconds), 1) if seconds else None,
            "max": max(seconds) if seconds else None,
        },
        "mutants": rows,
    }
    print(json.dumps({k: v for k, v in summary.items() if k != "mutants"}, indent=1))
    for r in rows:
        if r["outcome"] == "survived":
            print(
                f"\nSURVIVED {r['file']}:{r['line']} {r['operator']} #{r['occurrence']} ({r['job_id']})"
            )
            print(r["diff"])
    if json_path:
        Path(json_path).write_text(json.dumps(summary, indent=1) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="copy the checkout, enumerate and sample the mutants")
    p.add_argument("--workdir", default="/tmp/fsdp-mutation")
    p.add_argument("--mutants", type=int, default=100)
    p.add_argument("--min-per-file", type=int, default=2)
    p.add_argument("--seed", type=int, default=19)
    p.add_argument(
        "--shard",
        default="0/1",
        help="I/N: keep the I-th of N interleaved parts of the sample (one workdir per part, "
        "run side by side)",
    )
    g = sub.add_parser("gate", help="the per-mutant test command (cosmic-ray's test-command)")
    g.add_argument("--scenarios", type=int, default=int(os.environ.get("MUTATION_SCENARIOS", "16")))
    g.add_argument("--test-timeout", type=int, default=TEST_TIMEOUT)
    g.add_argument("--files", nargs="*", default=[])
    r = sub.add_parser("run", help="cosmic-ray exec over the sampled mutants")
    r.add_argument("--workdir", default="/tmp/fsdp-mutation")
    r.add_argument("--baseline", action="store_true", help="check every unmutated gate first")
    r.add_argument("--scenarios", type=int, default=16)
    q = sub.add_parser("report", help="kill rate per file and the survivors' diffs")
    q.add_argument("--workdir", nargs="+", default=["/tmp/fsdp-mutation"], help="one per shard")
    q.add_argument("--json", default=None)
    q.add_argument("--retest", nargs="*", default=[], help="retest --json files, oldest first")
    q.add_argument("--triage", default=None, help="JSON: job-id prefix -> verdict and why")
    t = sub.add_parser("retest", help="run the survivors again under the checkout's current gate")
    t.add_argument("--workdir", default="/tmp/fsdp-mutation-retest", help="a prepared copy")
    t.add_argument("--results", nargs="+", default=[], help="the workdirs of the run")
    t.add_argument(
        "--carry",
        default=None,
        help="a report's --json: retest its survivors carried over to today's code "
        "(see [Note: Carrying a mutant over to moved code])",
    )
    t.add_argument("--scenarios", type=int, default=16)
    t.add_argument("--timeout", type=float, default=900.0)
    t.add_argument("--json", default=None)
    t.add_argument(
        "--ported", default=None, help="JSON: job-id prefix -> hand-ported old/new (with --carry)"
    )
    t.add_argument("--skip", nargs="*", default=[], help="job ids not to retest (equivalent)")
    t.add_argument("--only", nargs="*", default=[], help="job-id prefixes to retest, in order")
    t.add_argument(
        "--outcomes",
        nargs="+",
        default=["survived"],
        help="which results to retest: survived, timeout (cosmic-ray's backstop), deadline "
        "(killed by a test's deadline: a hang or load?)",
    )
    args = parser.parse_args()
    if args.command == "gate":
        return gate(args)
    {"prepare": prepare, "run": run, "report": report, "retest": retest}[args.command](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
