"""The checkpoint property tests live in the package, so that
`python -m mlx_gated_delta selftest` runs them too; collected here by name."""

from mlx_gated_delta.testing.checkpoint_properties import *  # noqa: F401,F403
