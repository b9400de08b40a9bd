"""Property-based parity search: hypothesis draws models, FSDP configurations and
training schedules (``strategies``) as plain data (``examples``) in the pytest
process; each example runs on the pooled ranks (``search``), which train it
under FSDP and under DDP in lockstep and check the properties (``lockstep``).

Only ``examples``, ``strategies`` and ``search`` are imported by the pytest
plugin; ``lockstep``, ``reference`` and ``modules`` import the FSDP under test
(``fsdptest.api``) and are imported where examples run.
"""
