"""Tensor parallelism: mlx-lm's Qwen3.5 `shard(group)` on a patched model,
two local processes over MLX's ring backend (heads split across ranks)."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("mlx_lm")

from mlx_gated_delta.testing.contracts import assert_matches  # noqa: E402

PARITY = "layer.mlx_lm_parity.v2.float32.logits"
WORKER = Path(__file__).with_name("sharding_worker.py")


def free_ports(count):
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def test_sharded_patched_qwen35_matches_the_unsharded_model(tmp_path):
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps([[f"127.0.0.1:{port}"] for port in free_ports(2)]))
    processes = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(tmp_path)],
            env=dict(os.environ, MLX_HOSTFILE=str(hosts), MLX_RANK=str(rank)),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for rank in range(2)
    ]
    try:
        outputs = [p.communicate(timeout=120)[0].decode() for p in processes]
    finally:
        for p in processes:
            p.kill()
    for rank, (p, output) in enumerate(zip(processes, outputs)):
        assert p.returncode == 0, f"rank {rank} failed:\n{output}"
    for rank in range(2):
        result = np.load(tmp_path / f"rank{rank}.npz")
        assert int(result["local_value_heads"]) == 2  # 4 value heads over 2 ranks
        assert_matches(f"rank {rank} logits", result["got"], result["expected"], PARITY)
