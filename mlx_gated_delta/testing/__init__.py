"""Test support shipped with the package, shared by the property suites
(`mlx_gated_delta.tests`, which `python -m mlx_gated_delta selftest` runs) and the
repository's tests: the numerical contracts (`contracts`) and their reviewed
fingerprints (`fingerprints`), the Hypothesis strategies and profiles (`strategies`),
the segment's cases (`segment_cases`), the guarded kernel runs (`guarded`), the
fuzz of the public functions (`fuzz`), and the tiny mlx-lm checkpoints and server
that the tests and benchmarks of mlx-lm's commands share (`lm_checkpoints`,
`lm_server`)."""
