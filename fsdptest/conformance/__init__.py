"""Differential conformance: everything a user can observe of the FSDP under
test, compared with a reference FSDP (torch's by default) on scenarios
hypothesis draws.

Pytest-process side (imports no FSDP implementation):
``scenario`` (scenarios as plain data, replay ids), ``drawing`` (the strategies
and the rule-based state machine that draws programs), ``allowed`` (the named,
reasoned differences and what the reference is not asked), ``search`` (budgets;
one rank call per scenario; reports with the replay line).

Rank side: ``implementation`` (an implementation's public API, by module),
``nets`` (the models and their data), ``observe`` (observations as plain,
comparable data; the collective recorder; warnings and exceptions),
``execute`` (one scenario run by one implementation, observed),
``compare`` (two traces compared, with tolerances) and ``check`` (both runs on
the same ranks, normalised, compared, reported).
"""
