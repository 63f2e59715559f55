"""Benchmark the gated delta rule against its peers: ``python benchmarks/bench.py [--quick]``.

The benchmark itself lives in the installed package (``mlx_gated_delta.bench.cli``), so
``python -m mlx_gated_delta bench`` runs the same code; see ``--help`` for the options.
"""

import sys

from mlx_gated_delta.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
