"""The pytest-process side of the property search: hypothesis profiles, and the
object that sends one example to the pooled ranks and turns a failure into a
report with the example and the line that replays it.

[Note: Where the search runs]
Hypothesis runs in the pytest process: a property test is a plain pytest test
(not a ``DistributedTest``) decorated with ``@given``, and each example it
draws goes to the ranks as one call of the harness (``rank_calls``; see
[Note: Tests that drive the ranks]). The ranks only ever see one example at a
time, built from plain data, so they never need to agree on what hypothesis
drew, and whatever goes wrong on them (an assertion on one rank, a dead rank, a
hang in a collective) comes back as an ordinary failed call: the harness
reports every rank, stops the stuck ones with their stacks and replaces the
pool, and hypothesis goes on shrinking with the next call on a fresh pool.
Drawing on rank 0 and broadcasting instead would put hypothesis inside the
collectives it tests: one hung example would end the search, and a failure on
another rank would have to be brought back to rank 0 over the process group
under test. Each call has its own deadline (``EXAMPLE_TIMEOUT_S``), so a hang
costs one example's time, not the test's.

[Note: Budgets]
Two budgets: ``ci`` (the default) is derandomized (its seed comes from each
test's own code, so every run draws the same examples) with ``CI_EXAMPLES``
examples per property test and no database; ``deep`` draws ``DEEP_EXAMPLES``
random examples per test and saves failing ones in the hypothesis database
(``.hypothesis/`` in the directory pytest runs from), which replays them first
on the next run. Choose with hypothesis's own ``--hypothesis-profile deep`` or
``HYPOTHESIS_PROFILE=deep``; the option wins; another profile name means that
(registered) profile. ``--property-examples N`` replaces the count (to bound a
run's time). A failure's report also prints a replay id: ``--replay-example ID``
runs that one example again (``test_replay_example``), without hypothesis.

[Note: Budgets only for the property tests]
The package's plugin loads in every pytest session of the environment, and
hypothesis reads its default settings when a test is decorated, so loading a
profile would change every other project's hypothesis tests (and replace a
profile a project loaded itself). The budget is therefore never loaded: the
plugin applies it, as ``@settings`` would, to the tests that use the
``property_search`` fixture and have no ``@settings`` of their own
(``apply_budget``). When ``--hypothesis-profile ci`` or ``deep`` asks for one,
it is also registered as a profile (where no profile has that name yet), so that
hypothesis accepts the option; loading it that way is the user's choice and
applies to the session.
A property test that checked no example fails (``PropertySearch.checked``).
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, Phase, settings
from hypothesis.errors import InvalidArgument

from fsdptest.properties.examples import Example
from fsdptest.properties.strategies import Target
from harness.rank_calls import CallOutcome, RankCalls
from harness.testcase import DistributedTest

CI_EXAMPLES = 40
DEEP_EXAMPLES = 2000
EXAMPLE_TIMEOUT_S = 60.0
PROFILE_ENV = "HYPOTHESIS_PROFILE"
DEFAULT_PROFILE = "ci"
_SLOW_IS_EXPECTED = [HealthCheck.too_slow, HealthCheck.data_too_large]
# The explain phase reruns a failing example with parts varied to name the lines
# only failures run; those lines are on the ranks, where it cannot see.
_PHASES = [p for p in Phase if p is not Phase.explain]


def budgets(max_examples: int | None = None) -> dict[str, settings]:
    """The ``ci`` and ``deep`` budgets (see [Note: Budgets]); ``max_examples``
    replaces both counts."""
    common = settings(
        deadline=None,
        print_blob=True,
        suppress_health_check=_SLOW_IS_EXPECTED,
        phases=_PHASES,
    )
    ci = settings(common, max_examples=max_examples or CI_EXAMPLES, derandomize=True, database=None)
    deep = settings(common, max_examples=max_examples or DEEP_EXAMPLES, derandomize=False)
    return {"ci": ci, "deep": deep}


_REGISTERED: dict[str, settings] = {}  # the budgets this process registered as profiles


def register_profiles(max_examples: int | None = None) -> None:
    """Registers the budgets as profiles where no one else registered those names
    (see [Note: Budgets only for the property tests])."""
    for name, budget in budgets(max_examples).items():
        try:
            existing = settings.get_profile(name)
        except InvalidArgument:
            existing = None
        if existing is None or existing is _REGISTERED.get(name):
            settings.register_profile(name, budget)
            _REGISTERED[name] = settings.get_profile(name)


def chosen_profile(option: str | None) -> str:
    """The profile a session uses: hypothesis's option, the environment, else ``ci``."""
    return option or os.environ.get(PROFILE_ENV) or DEFAULT_PROFILE


def budget_of(profile: str, max_examples: int | None) -> settings:
    """The settings the property tests get: this project's budget for ``ci`` and
    ``deep``, else the registered profile of that name (``max_examples`` replaces
    the count); verbosity is the session's (``--hypothesis-verbosity``)."""
    ours = budgets(max_examples)
    chosen = ours.get(profile) or settings.get_profile(profile)
    if max_examples and profile not in ours:
        chosen = settings(chosen, max_examples=max_examples)
    return settings(chosen, verbosity=settings.default.verbosity)


def apply_budget(test: object, budget: settings) -> bool:
    """Gives a ``@given`` test ``budget`` as ``@settings(budget)`` would, unless it
    has settings of its own; returns whether it did."""
    if not getattr(test, "is_hypothesis_test", False):
        return False
    try:
        budget(test)
    except InvalidArgument:  # its own @settings, or given already
        return False
    return True


class ExampleFailed(AssertionError):
    """An example broke a property; the message is the ranks' report, the example
    and how to replay it."""


class PropertySearch:
    """Sends examples to the pooled ranks (see [Note: Where the search runs])."""

    calls: RankCalls
    impl: str
    replay_test: str
    checked: int  # examples sent to the ranks so far

    def __init__(self, calls: RankCalls, impl: str, replay_test: str) -> None:
        self.calls = calls
        self.impl = impl
        self.replay_test = replay_test
        self.checked = 0

    def target(self, world_size: int) -> Target:
        """What examples for ``world_size`` ranks may ask of the FSDP under test."""
        device_type = self.calls.device_type(world_size) or "cpu"
        return Target(self.impl, device_type, world_size)

    def check(self, ranks: type[DistributedTest], example: Example) -> None:
        """Runs ``ranks().check(example=example)`` on the example's ranks; raises
        ``ExampleFailed`` unless every rank passed."""
        self.checked += 1
        outcome = self.calls.run(
            ranks, "check", example.world_size, timeout_s=EXAMPLE_TIMEOUT_S, example=example
        )
        if not outcome.passed:
            raise ExampleFailed(self.report(example, outcome))

    def replay_command(self, example: Example) -> str:
        return (
            f"python -m pytest '{self.replay_test}' --fsdp-impl {self.impl} "
            f"--replay-example {example.replay_id()}"
        )

    def report(self, example: Example, outcome: CallOutcome) -> str:
        how = "skipped, which no drawn example may" if not outcome.failed else "failed"
        return (
            f"the example {how}:\n{example.describe()}\n"
            f"replay it with:\n  {self.replay_command(example)}\n\n{outcome.report}"
        )
