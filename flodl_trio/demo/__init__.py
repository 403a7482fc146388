"""The local cluster demo (internal: ``scripts/demo``, ``flodl-trio demo``)."""
