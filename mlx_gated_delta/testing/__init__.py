"""Test support shipped with the package, so `python -m mlx_gated_delta selftest`
runs the same checks as the repository's test suite: the numerical contracts
(`contracts`) and the property tests of the core op (`properties`)."""
