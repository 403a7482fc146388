"""The fault scenarios these tests run live in ``scripts/_chaos`` (``scripts/chaos_sweep.py``
runs the same ones with more iterations). Loaded here, before the tests of this folder are
imported, as the package ``_chaos``, so that they import its modules by name."""

from helpers.scripts import load_script

load_script("_chaos")
