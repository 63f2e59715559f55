"""The compiled core (csrc/bindings.cpp).

It is installed as the top-level module ``_mlx_gated_delta_ext`` rather than
inside this package, so that a source checkout that shadows the installed
package (``python -m mlx_gated_delta`` or pytest from the repository root)
still reaches the installed binary.
"""

from _mlx_gated_delta_ext import *  # noqa: F401,F403
