"""The Metal emulator (csrc/metal/emulator/module.cpp), for tests only.

Installed as the top-level module ``_mlx_gated_delta_metal_emulator`` for the
same reason as ``_ext``: a source checkout that shadows the installed package
still reaches the installed binary.

The binary binds the params (``CoreParams``, ``SegmentParams``) and the
``Plan`` as classes, with ``make_plan``, ``make_segment_plan``,
``make_backward_plan``, ``Plan.run`` (buffers by name) and ``run_kernel``;
``testing/metal_emulated.py`` builds its calls on them.
"""

from _mlx_gated_delta_metal_emulator import (  # noqa: F401
    CoreParams,
    Plan,
    SegmentParams,
    make_backward_plan,
    make_plan,
    make_segment_plan,
    run_kernel,
)
