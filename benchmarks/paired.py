"""Two builds of the core op, taking turns call by call.

    python benchmarks/paired.py BASE NEW [--mode forward|gradients]
        [--tokens 2048] [--dtype float32] [--gates scalar|per-key]
        [--algorithm chunked|recurrent|auto] [--pairs 16]

BASE and NEW are folders that each hold a build of the package: the folder
with `mlx_gated_delta/` and `_mlx_gated_delta_ext*.so` in it, as
`pip install --target FOLDER .` leaves it (a folder without the extension
module takes the one installed in this interpreter's site-packages). Each runs in a process of its own
that holds its inputs (Qwen3-Next's heads, B=1, the same seed in both), and
the two time one call each in turn, the order swapped every pair, after one
untimed call each. The report gives each build's median and the median and
quartiles of NEW / BASE over the pairs.

Why pairs: on a shared VM the time of one build moves by a tenth from one
process to the next, as the machine goes through slow and fast phases; one
pair's two calls run a few hundred milliseconds apart, in the same phase, so
their ratio separates a change of a few percent where processes taking turns
do not.

`forward` is the forward (`--algorithm`, chunked unless given; `--tokens 1
--algorithm auto` is the decode step), q and k normalised (`--gates
per-key`: a log decay per value head and key channel, `g` of shape
`[B, T, Hv, Dk]`, as Kimi Delta Attention's);
`gradients` is `mx.grad` of the sum of its output and final state with
respect to q, k, v, g and beta (the forward, then the backward).

The workers run under `python -S`, with the build's folder and then this
interpreter's site-packages on `PYTHONPATH`: an editable install of the
package registers an import hook from site-packages that would otherwise
take precedence over the folder.
"""

from __future__ import annotations

import argparse
import os
import site
import statistics
import subprocess
import sys


def make_call(mode: str, tokens: int, dtype_name: str, gates: str, algorithm: str):
    import mlx.core as mx

    from mlx_gated_delta.ops import gated_delta_rule

    batch, key_heads, value_heads, dim = 1, 16, 32, 128
    mx.random.seed(0)
    dtype = getattr(mx, dtype_name)
    q = mx.random.normal((batch, tokens, key_heads, dim)).astype(dtype)
    k = mx.random.normal((batch, tokens, key_heads, dim)).astype(dtype)
    v = mx.random.normal((batch, tokens, value_heads, dim)).astype(dtype)
    gate_shape = (batch, tokens, value_heads) + ((dim,) if gates == "per-key" else ())
    g = -mx.random.uniform(0.01, 0.1, gate_shape)
    beta = mx.random.uniform(0.0, 1.0, (batch, tokens, value_heads))
    state = mx.zeros((batch, value_heads, dim, dim))
    mx.eval(q, k, v, g, beta, state)

    def forward(q, k, v, g, beta):
        return gated_delta_rule(q, k, v, g, beta, state, normalize_qk=True, algorithm=algorithm)

    if mode == "forward":
        return lambda: forward(q, k, v, g, beta)

    def loss(q, k, v, g, beta):
        y, final = forward(q, k, v, g, beta)
        return y.astype(mx.float32).sum() + final.sum()

    gradients = mx.grad(loss, argnums=(0, 1, 2, 3, 4))
    return lambda: gradients(q, k, v, g, beta)


def worker(folder: str, mode: str, tokens: int, dtype_name: str, gates: str, algorithm: str):
    """Times one call per line read from stdin; prints the seconds."""
    import time

    import mlx.core as mx

    import mlx_gated_delta

    loaded = os.path.dirname(os.path.dirname(os.path.abspath(mlx_gated_delta.__file__)))
    if os.path.realpath(loaded) != os.path.realpath(folder):
        sys.exit(f"paired.py: mlx_gated_delta came from {loaded}, not {folder}")
    call = make_call(mode, tokens, dtype_name, gates, algorithm)
    for _ in sys.stdin:
        start = time.perf_counter()
        mx.eval(call())
        print(time.perf_counter() - start, flush=True)


class Build:
    def __init__(self, folder: str, args: argparse.Namespace):
        folder = os.path.abspath(folder)
        path = os.pathsep.join([folder, *site.getsitepackages()])
        command = [sys.executable, "-S", os.path.abspath(__file__), "--worker", folder]
        command += ["--mode", args.mode, "--tokens", str(args.tokens), "--dtype", args.dtype]
        command += ["--gates", args.gates, "--algorithm", args.algorithm]
        self.process = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": path},
        )

    def time_one_call(self) -> float:
        self.process.stdin.write("\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError("a worker stopped; its error is above")
        return float(line)

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("base", nargs="?", help="folder holding the base build")
    parser.add_argument("new", nargs="?", help="folder holding the new build")
    parser.add_argument("--mode", choices=("forward", "gradients"), default="forward")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    parser.add_argument("--gates", choices=("scalar", "per-key"), default="scalar")
    parser.add_argument("--algorithm", choices=("chunked", "recurrent", "auto"), default="chunked")
    parser.add_argument("--pairs", type=int, default=16)
    parser.add_argument("--worker", metavar="FOLDER", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.mode, args.tokens, args.dtype, args.gates, args.algorithm)
        return
    if not (args.base and args.new):
        parser.error("give the two folders, BASE and NEW")
    for folder in (args.base, args.new):
        if not os.path.isfile(os.path.join(folder, "mlx_gated_delta", "__init__.py")):
            parser.error(f"{folder} holds no mlx_gated_delta package")
    if args.pairs < 1:
        parser.error("--pairs must be at least 1")
    base, new = Build(args.base, args), Build(args.new, args)
    # Untimed: the first call pays for setup.
    base.time_one_call()
    new.time_one_call()
    base_times, new_times = [], []
    for pair in range(args.pairs):
        if pair % 2 == 0:
            base_times.append(base.time_one_call())
            new_times.append(new.time_one_call())
        else:
            new_times.append(new.time_one_call())
            base_times.append(base.time_one_call())
    base.close()
    new.close()
    ratios = sorted(n / b for n, b in zip(new_times, base_times))
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
    print(
        f"{args.mode} {args.algorithm} T={args.tokens} {args.dtype}, {args.pairs} pairs: "
        f"base median {1e3 * statistics.median(base_times):.4g} ms, "
        f"new median {1e3 * statistics.median(new_times):.4g} ms, "
        f"new / base per pair: median {statistics.median(ratios):.3f} "
        f"(quartiles {quartiles[0]:.3f}, {quartiles[2]:.3f})"
    )


if __name__ == "__main__":
    main()
