"""The Metal emulator (csrc/metal/emulator/module.cpp), for tests only.

Installed as the top-level module ``_mlx_gated_delta_metal_emulator`` for the
same reason as ``_ext``: a source checkout that shadows the installed package
still reaches the installed binary.
"""

from _mlx_gated_delta_metal_emulator import *  # noqa: F401,F403
