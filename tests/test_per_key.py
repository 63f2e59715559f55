"""The property tests of per-key-channel gates live in the package, so that
`python -m mlx_gated_delta selftest` runs them too; collected here by name."""

from mlx_gated_delta.testing.per_key_properties import *  # noqa: F401,F403
