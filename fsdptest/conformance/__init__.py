"""Differential conformance (see fsdptest.conformance.search)."""
