"""The property tests shipped with the package, one module per subject: the core op
(``test_core``), its gradients (``test_core_gradients``), per-key-channel gates
(``test_per_key``), the fused segment (``test_segment``) and its gradients
(``test_segment_gradients``), the drop-in layers (``test_layers``), checkpoints
(``test_checkpoints``) and serving (``test_serving``).

``python -m mlx_gated_delta selftest`` runs them through pytest on the default device;
the repository's ``pytest`` collects them from here too. What they share (strategies,
contracts, fingerprints, the segment's cases) is in ``mlx_gated_delta.testing``.
"""
