"""The benchmarks, one module per job.

- ``cli``: the command line, ``python -m mlx_gated_delta bench`` (``--train`` for the
  training step);
- ``op``: the op against MLX core and mlx-lm, with rooflines measured in the same run;
- ``layer``: the whole layer against mlx-lm's stock layer (the op run's last rows; alone,
  ``python -m mlx_gated_delta.bench.layer``), and with ``--kda-layers`` Kimi-Linear's and
  OLMo-Hybrid's layers;
- ``train``: forward plus backward of the op and of the whole layer;
- ``serving``: the speculative verify step and prompt reuse
  (``python -m mlx_gated_delta.bench.serving``);
- ``shapes``: the shapes they run; ``timing``: the timer; ``machine``: the rooflines and
  the provenance of a run.

Nothing is imported here, so that importing one of them imports only what it needs.
"""
