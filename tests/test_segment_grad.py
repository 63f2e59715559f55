"""The segment's gradient property tests live in the package, beside the
forward's; collected here by name."""

from mlx_gated_delta.testing.segment_grad_properties import *  # noqa: F401,F403
