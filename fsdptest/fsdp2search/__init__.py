"""The FSDP2 searches: drawn ``fully_shard`` programs, run on the pooled ranks,
compared with torch's FSDP2 (conformance) and with a replicated reference
(parity).

Pytest-process side (imports no FSDP implementation): ``program`` (programs as
plain data, replay ids), ``drawing`` (their strategies), ``search`` (budgets; one
rank call per program; reports with the replay line). Rank side: ``nets`` (the
models), ``run`` (one program run by one implementation, observed), ``replica``
(the replicated reference) and ``check`` (runs compared, reported).
"""
