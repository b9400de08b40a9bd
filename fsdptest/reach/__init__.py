"""The reach of the searches: which parts of FSDP1's public surface the property
search and the differential conformance search draw.

[Note: How reach is measured]
The surface (``fsdptest.reach.surface``) is read, not listed by hand: the
constructor's arguments and the public methods (with their arguments) of both
implementations' ``FullyShardedDataParallel`` by introspection, the fields of
every config class and the members of every enum of both, the environment
variables torch's FSDP reads (from its sources); to these come the values that
matter for each argument and field, and the model shapes that change FSDP's
behaviour. Whether a search draws a row is measured, not declared
(``fsdptest.reach.sample``): each search's own strategies draw samples (the
deep profile's drawing, derandomized so that the table is the same on every
run of one hypothesis version), nothing runs, and each sample's rows are read
off its plain data (``fsdptest.reach.features``). The conformance search is
sampled for CPU ranks and for accelerator ranks: with torch's FSDP as the
reference it asks different things of each. A row no search draws names why
and the fixed test that covers it (``fsdptest.reach.undrawn``).

``python -m fsdptest.reach --write docs/reach.md`` rebuilds the table;
``tests/conformance/test_reach.py`` checks that every public argument, method,
field and environment variable of both implementations is a row, that every
row marked drawn is drawn by a fresh sample, and that every other row names a
reason and a test that exists.
"""
