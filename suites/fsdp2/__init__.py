"""The FSDP2 suites: ``fully_shard`` of the implementation under test against a
replicated reference or DDP (``suites/fsdp2/helpers.py`` has the recipe)."""
