"""The fault scenarios: run by ``scripts/chaos_sweep.py`` (many iterations, a table) and by the
tests of ``tests/chaos/`` (one iteration each, every outcome asserted).

They live here rather than in ``tests/`` so that a script does not depend on the tests: the sweep
runs as ``python scripts/chaos_sweep.py``, which puts ``scripts/`` first on ``sys.path``, and the
tests load this package with ``helpers.load_script("_chaos")``. They are not part of
:mod:`flodl_trio.chaos` on purpose: that module holds the fault tools a user's own tests build on
(plans, the proxy, faulty streams and dials), while these are the project's own scenarios, each
tied to what the suite expects of one cluster shape.

Modules: :mod:`.util` (handshake byte maps, recording hosts, outcomes), :mod:`.streams`
(misbehaving streams and dialers), :mod:`.handshake_faults`, :mod:`.run_faults` (in memory,
under ``MockClock``), :mod:`.procs`, :mod:`.stalls` and :mod:`.netns` (real processes).
"""
