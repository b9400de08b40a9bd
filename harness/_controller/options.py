"""The runner's command-line options: their names, and the checks of their values.

[Note: Option names that cannot clash]
The package's plugins are ``pytest11`` entry points, so every pytest session of
an environment where the package is installed has the runner's options. pytest
refuses a second option of the same name or destination, so a project whose
conftest adds its own ``--device`` crashed as soon as the package was
installed. Each option of the runner therefore has a name of its own
(``--dist-device``, ``--dist-world-size``, ``--dist-subtest``, ``--dist-launcher``,
``--dist-timeout``, ...), and the short spellings that suites, tox and users type
(``--device``, ``--world-size``, ``--subtest``, ``--launcher``) are aliases added
only where no one else defines them (``--launcher`` is taken by some projects'
conftests, e.g. debugger test suites naming the program that starts theirs):
after the initial conftest files have added their options (the
``pytest_load_initial_conftests`` hook wraps their loading), or at once when the
plugin itself is loaded by a conftest's ``pytest_plugins`` (that conftest has
then added its options already). Where a project owns ``--device``, its option
is its own and ``--dist-device`` chooses where our ranks run.

[Note: Every option value is checked before anything runs]
A value that would make a run check nothing or hang (a world size below 1, a
negative deadline or grace period, ``--dist-device cuda`` where this process
sees no GPU) is a usage error at configure time, in one line that names the
option, instead of a green run, a skip of every test or an error deep inside a
pool. So is a value that would fail later with a raw traceback: a lease or
profile directory that cannot be created, a fake GPU named twice, and
``--dist-launcher torchrun`` outside torchrun's environment or with ``-n``.

[Note: Slots by default]
``--gpu-slots auto`` (the default) lets each GPU hold one test per pytest -n
worker, at most ``AUTO_SLOTS_MAX``: under ``pytest -n 2`` on two GPUs both
workers run a 2-rank test at once instead of one waiting for the other's lease.
The tests of a suite like ours are small and keep a GPU busy a third to a half
of the time, so a GPU per test left the GPUs idle: ``pytest suites -n 2`` on two
H100s took 893 s with one slot (docs/runs/gpu-runs.md, runs 25–27) and 470 s with
two (run 72), against 684 s on two CPU cores that day; four tests to a GPU is
the most the suites ran with (runs 65–69, at most 21 GiB used on a GPU). A test's ranks still get distinct GPUs, and the ranks of
different tests are different processes, so memory counts are per test.
``--gpu-slots 1`` gives every test GPUs of its own (tests that time kernels or
need a whole GPU's memory). Without -n one test runs at a time: one slot. A
shared ``--gpu-lease-dir`` must have one count for all its sessions, so ``auto``
takes the count it records when it records one (see
``harness._controller.leases.GpuLeases``).
"""

from __future__ import annotations

import math
import os
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import pytest

from harness._controller.devices import parse_gpu_ids
from harness._torchrun.env import NotUnderTorchrun, TorchrunEnv
from harness.subtests import parse_filter

GROUP = "distributed"
AUTO_SLOTS_MAX = 4  # see [Note: Slots by default]


@dataclass(frozen=True)
class Alias:
    """A short spelling of one of the runner's options, added where it is free."""

    name: str  # "--device"
    canonical: str  # "--dist-device"
    dest: str
    attrs: tuple[tuple[str, Any], ...]  # the canonical option's type, choices, default


_DEVICE = (("choices", ("auto", "cpu", "cuda")), ("default", "auto"))
_WORLD_SIZE = (("type", int), ("default", 2))
_SUBTEST = (("default", None), ("metavar", "KEY=VALUE,..."))
_LAUNCHER = (("choices", ("spawn", "torchrun")), ("default", "spawn"))
DEVICE = Alias("--device", "--dist-device", "dist_device", _DEVICE)
WORLD_SIZE = Alias("--world-size", "--dist-world-size", "dist_world_size", _WORLD_SIZE)
SUBTEST = Alias("--subtest", "--dist-subtest", "dist_subtest", _SUBTEST)
LAUNCHER = Alias("--launcher", "--dist-launcher", "dist_launcher", _LAUNCHER)
ALIASES = (DEVICE, WORLD_SIZE, SUBTEST, LAUNCHER)

# The aliases each session got (by its plugin manager, which lives as long as it).
_ADDED: weakref.WeakKeyDictionary[object, set[str]] = weakref.WeakKeyDictionary()


def add_options(parser: pytest.Parser, pluginmanager: pytest.PytestPluginManager) -> None:
    group = parser.getgroup(GROUP, "distributed tests (harness)")
    group.addoption(
        "--dist-device",
        dest="dist_device",
        **dict(_DEVICE),
        help="where ranks run: cuda+nccl when enough GPUs are visible (auto), "
        "always cpu+gloo (cpu), or cuda only (cuda: a usage error where no GPU is "
        "visible, and a test needing more GPUs than this process owns fails). "
        "Default: auto. Also --device, where no other plugin defines it.",
    )
    group.addoption(
        "--dist-world-size",
        dest="dist_world_size",
        **dict(_WORLD_SIZE),
        metavar="N",
        help="ranks (at least 1) for test classes that do not pin world_size. "
        "Default: 2. Also --world-size, where no other plugin defines it.",
    )
    group.addoption(
        "--dist-subtest",
        dest="dist_subtest",
        **dict(_SUBTEST),
        help="run only the subtest combinations matching every pair, e.g. "
        '--dist-subtest "sharding_strategy=SHARD_GRAD_OP,use_orig_params=True". '
        "Values are matched as they appear in reports; a test whose run_subtests "
        "calls offer no matching combination fails, listing the keys and values "
        "they have. Also --subtest, where no other plugin defines it.",
    )
    group.addoption(
        "--dist-launcher",
        dest="dist_launcher",
        **dict(_LAUNCHER),
        help="who starts the ranks: the harness's own pools (spawn), or torchrun, "
        "which started this pytest process as one rank (see the README's "
        '"Across hosts: torchrun"). Default: spawn. Also --launcher, where no other '
        "plugin defines it.",
    )
    _add_runner_options(group)
    _add_pool_options(group)
    if _loaded_by_a_conftest(pluginmanager):
        add_free_aliases(parser, pluginmanager)


def _add_runner_options(group: pytest.OptionGroup) -> None:
    group.addoption(
        "--dist-timeout",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="per-test deadline (> 0) on the ranks' time (starting a pool is not "
        "counted); on expiry every rank's Python stack is reported and the ranks are "
        "stopped. A dist_timeout marker replaces it; pytest-timeout's marker, option or "
        "ini value also bounds the whole call, pool start included. Default: 600.",
    )
    group.addoption(
        "--fail-grace",
        type=float,
        default=2.0,
        metavar="SECONDS",
        help="after one rank fails, how long (>= 0) the other ranks have to report "
        "their own outcome before they are stopped (with their stacks). Default: 2.",
    )
    group.addoption(
        "--check-collectives",
        action="store_true",
        default=False,
        help="run distributed tests in pools started with TORCH_DISTRIBUTED_DEBUG=DETAIL: "
        "torch compares each collective (op, shapes, dtypes) across ranks before running "
        "it, so a mismatch fails at once, naming every rank's call, instead of hanging "
        "until the deadline. Slower per collective; the check_collectives marker does "
        "this for one test.",
    )
    group.addoption(
        "--map-cuda-to-cpu",
        action="store_true",
        default=False,
        help="on CPU ranks, resolve the CUDA devices tests name (tensor.cuda(), "
        "module.cuda(), device='cuda', .to('cuda')) to the rank's device, for tests "
        "written for GPUs. The map_cuda_to_cpu marker or ini value enables it too.",
    )


def _add_pool_options(group: pytest.OptionGroup) -> None:
    """How pools, their process groups and their GPUs are reused and watched."""
    group.addoption(
        "--fresh-pool",
        action="store_true",
        default=False,
        help="give every distributed test a fresh pool of ranks instead of reusing one.",
    )
    group.addoption(
        "--fresh-groups",
        action="store_true",
        default=False,
        help="create and destroy the process groups of every test instead of handing a "
        "pooled rank's groups to later tests that ask for the same ones.",
    )
    _add_gpu_options(group)
    _add_schedule_options(group)
    group.addoption(
        "--rank-profile",
        default=None,
        metavar="DIR",
        help="write a cProfile of every distributed test on every rank, and the pools' "
        "start times, to DIR (created if missing; bench/nccl_test_cost.py summarises "
        "them).",
    )


def _add_gpu_options(group: pytest.OptionGroup) -> None:
    """How the session's workers share the GPUs."""
    group.addoption(
        "--gpu-lease-dir",
        default=None,
        metavar="DIR",
        help="lease GPUs through the lock files in DIR (created if missing), shared "
        "with every session that names it (two sessions never share a GPU). Default: "
        "a directory of this session's own.",
    )
    group.addoption(
        "--gpu-slots",
        default="auto",
        metavar="N|auto",
        help="let up to N tests run on one GPU at once (their ranks are different "
        "processes; the ranks of one test still get distinct GPUs). 1: no two concurrent "
        f"tests share a GPU. Default auto: one per pytest -n worker, at most {AUTO_SLOTS_MAX} "
        "(the count a shared --gpu-lease-dir records, if it records one). Sessions sharing "
        "a --gpu-lease-dir must agree.",
    )


def _add_schedule_options(group: pytest.OptionGroup) -> None:
    """The order in which pytest -n hands out the tests."""
    group.addoption(
        "--dist-schedule",
        choices=("longest", "xdist"),
        default="longest",
        help="under pytest -n (xdist's load mode): send each worker the longest test "
        "still pending, by durations known from earlier runs (longest), or keep xdist's "
        "own order (xdist). Default: longest (xdist's order where no duration is known).",
    )
    group.addoption(
        "--dist-durations",
        default=None,
        metavar="FILE",
        help="a JSON file of test ids to seconds that --dist-schedule longest reads "
        "(pytest's cache is read too). Default: the harness_durations ini value.",
    )
    group.addoption(
        "--dist-record-durations",
        action="store_true",
        default=False,
        help="write this session's test durations into the --dist-durations file "
        "(merged with what it holds).",
    )


def _loaded_by_a_conftest(pluginmanager: pytest.PytestPluginManager) -> bool:
    """Whether a conftest file is already registered: then this plugin came from
    its ``pytest_plugins``, after ``pytest_load_initial_conftests`` began."""
    return any(
        str(getattr(plugin, "__file__", "")).endswith("conftest.py")
        for plugin in pluginmanager.get_plugins()
    )


def add_free_aliases(parser: pytest.Parser, pluginmanager: pytest.PytestPluginManager) -> None:
    """Adds each alias that no plugin or conftest has taken (see the note)."""
    added = _ADDED.setdefault(pluginmanager, set())
    taken = _option_names(parser)
    group = parser.getgroup(GROUP)
    for alias in ALIASES:
        if alias.name in taken or alias.name in added:
            continue
        group.addoption(
            alias.name, dest=alias.dest, **dict(alias.attrs), help=f"the same as {alias.canonical}"
        )
        added.add(alias.name)


def _option_names(parser: pytest.Parser) -> set[str]:
    # pytest has no public listing of the options added so far; its groups have
    # them (the group of ungrouped options is among them from pytest 9 on).
    groups = [*getattr(parser, "_groups", []), getattr(parser, "_anonymous", None)]
    return {
        name
        for group in groups
        if group is not None
        for option in group.options
        for name in option.names()
    }


def spelling(config: pytest.Config, alias: Alias) -> str:
    """How this session spells the option: the alias where it was added."""
    return alias.name if alias.name in _ADDED.get(config.pluginmanager, set()) else alias.canonical


def _named(config: pytest.Config, dest: str) -> str:
    for alias in ALIASES:
        if alias.dest == dest:
            return spelling(config, alias)
    return "--" + dest.replace("_", "-")


def check(config: pytest.Config) -> tuple[tuple[str, str], ...]:
    """See [Note: Every option value is checked before anything runs]; returns the
    parsed ``--subtest`` filter."""
    world_size = config.getoption("dist_world_size")
    if world_size < 1:
        _refuse(config, "dist_world_size", f"needs at least 1 rank, got {world_size}")
    _check_seconds(config, "dist_timeout", minimum_exclusive=True)
    _check_seconds(config, "fail_grace", minimum_exclusive=False)
    given_slots(config)
    fake_gpus(config)
    if config.getoption("dist_record_durations") and durations_file(config) is None:
        _refuse(
            config, "dist_record_durations", "needs a file: --dist-durations or harness_durations"
        )
    for dest in ("gpu_lease_dir", "rank_profile"):
        directory(config, dest)
    if config.getoption("dist_launcher") == "torchrun":
        _check_torchrun(config)
    return parse_filter(config.getoption("dist_subtest"), _named(config, "dist_subtest"))


def durations_file(config: pytest.Config) -> Path | None:
    """The durations file of --dist-durations (relative to the invocation
    directory) or of the harness_durations ini value (relative to the ini file)."""
    given = config.getoption("dist_durations")
    if given:
        return Path(config.invocation_params.dir, given)
    value = str(config.getini("harness_durations") or "")
    if not value:
        return None
    base = config.inipath.parent if config.inipath is not None else config.rootpath
    return Path(base, value)


def given_slots(config: pytest.Config) -> int | None:
    """``--gpu-slots N``'s N, or None for ``auto`` (see ``gpu_slots``)."""
    given = str(config.getoption("gpu_slots")).strip()
    if given == "auto":
        return None
    if not given.isdigit() or int(given) < 1:
        _refuse(config, "gpu_slots", f"needs a whole number of at least 1 or 'auto', got {given!r}")
    return int(given)


def gpu_slots(config: pytest.Config) -> int:
    """The tests one GPU may hold at once: ``--gpu-slots N``, or under ``auto`` one
    per pytest -n worker up to ``AUTO_SLOTS_MAX`` (see [Note: Slots by default])."""
    given = given_slots(config)
    if given is not None:
        return given
    workerinput = getattr(config, "workerinput", None)
    workers = int(workerinput["workercount"]) if workerinput else 1
    return max(1, min(workers, AUTO_SLOTS_MAX))


def fake_gpus(config: pytest.Config) -> tuple[str, ...]:
    """The ``harness_fake_gpus`` ini value's ids (see harness._controller.devices)."""
    return parse_gpu_ids(config.getini("harness_fake_gpus"))


def directory(config: pytest.Config, dest: str) -> Path | None:
    """The directory an option names, created if missing; None when not given."""
    given = config.getoption(dest)
    if given is None:
        return None
    if not str(given).strip():
        _refuse(config, dest, "needs a directory, got an empty path")
    path = Path(given).expanduser().resolve()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        _refuse(config, dest, f"{given}: cannot create the directory ({exc.strerror or exc})")
    if not os.access(path, os.W_OK | os.X_OK):
        _refuse(config, dest, f"{given}: the directory is not writable")
    return path


def _check_torchrun(config: pytest.Config) -> None:
    spelled = _named(config, "dist_launcher")
    if getattr(config.option, "numprocesses", None):
        _refuse(config, "dist_launcher", "torchrun runs one pytest session per rank: leave out -n")
    try:
        TorchrunEnv.read()
    except NotUnderTorchrun as exc:
        _refuse(
            config,
            "dist_launcher",
            f"torchrun needs the environment torchrun gives its workers; {exc} not set "
            f"(start pytest as: torchrun ... -m pytest {spelled} torchrun ...)",
        )


def _check_seconds(config: pytest.Config, dest: str, minimum_exclusive: bool) -> None:
    value = float(config.getoption(dest))
    bad = value <= 0 if minimum_exclusive else value < 0
    if bad or not math.isfinite(value):
        bound = "more than 0" if minimum_exclusive else "at least 0"
        _refuse(config, dest, f"must be a finite number of seconds, {bound}; got {value:g}")


def _refuse(config: pytest.Config, dest: str, why: str) -> NoReturn:
    raise pytest.UsageError(f"{_named(config, dest)} {why}")


def refuse_cuda_without_gpus(config: pytest.Config, visible: tuple[str, ...]) -> None:
    """``--dist-device cuda`` where this process sees no GPU would skip everything."""
    spelled = _named(config, "dist_device")
    raise pytest.UsageError(
        f"{spelled} cuda: no GPU is visible to this process "
        f"(CUDA_VISIBLE_DEVICES entries: {list(visible)}); use {spelled} auto or cpu"
    )
