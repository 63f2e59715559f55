"""Command line: ``python -m mlx_gated_delta {demo,bench,selftest}``."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
from typing import Optional

PROPERTIES_MODULE = "mlx_gated_delta.testing.properties"
DEMO_MODULE = "mlx_gated_delta.demo"


def run_demo(argv: list[str]) -> int:
    try:
        demo = importlib.import_module(DEMO_MODULE)
    except ModuleNotFoundError as error:
        if error.name != DEMO_MODULE:
            raise
        print("The demo (end-to-end mlx-lm generation with and without our layer) arrives with "
              "the fused layer; this version of mlx-gated-delta does not have it yet.",
              file=sys.stderr)
        return 1
    return demo.main(argv) or 0


def run_bench(args: argparse.Namespace) -> int:
    from . import bench

    bench.run(args)
    return 0


class _ExamplesPerProperty:
    """pytest plugin: runs every Hypothesis test with ``max_examples`` examples.

    Hypothesis fixes a test's settings when ``@given`` decorates it (at import, from the
    profile the properties module loads), so the count is set on the collected tests, through
    the attribute where Hypothesis keeps them (private; tests/test_bench_cli.py checks it).
    """

    def __init__(self, max_examples: int):
        self.max_examples = max_examples
        self.tests = set()

    def pytest_collection_modifyitems(self, items):
        from hypothesis import settings

        for item in items:
            obj = getattr(item, "obj", None)
            test = getattr(obj, "__func__", obj)
            current = getattr(test, "_hypothesis_internal_use_settings", None)
            if current is not None and id(test) not in self.tests:
                test._hypothesis_internal_use_settings = settings(
                    parent=current, max_examples=self.max_examples
                )
                self.tests.add(id(test))


def run_selftest(examples: Optional[int]) -> int:
    # Looked up, not imported: pytest must import Hypothesis itself to load its plugin.
    if any(importlib.util.find_spec(name) is None for name in ("pytest", "hypothesis")):
        print('selftest needs pytest and hypothesis: pip install "mlx-gated-delta[test]"',
              file=sys.stderr)
        return 2
    import mlx.core as mx
    import pytest

    from . import __version__

    print(f"mlx-gated-delta {__version__}, MLX {mx.__version__}, "
          f"default device: {mx.default_device()}")
    os.environ["MLX_GATED_DELTA_HYPOTHESIS_PROFILE"] = "selftest"
    plugins = [] if examples is None else [_ExamplesPerProperty(examples)]
    code = pytest.main(["--pyargs", PROPERTIES_MODULE, "-q", "-p", "no:cacheprovider"],
                       plugins=plugins)
    if examples is not None:
        print(f"{len(plugins[0].tests)} Hypothesis tests ran with {examples} examples each")
    passed = code == 0
    print(f"selftest {'PASS' if passed else 'FAIL'} on {mx.default_device()} "
          f"(pytest exit code {int(code)})")
    return 0 if passed else 1


def build_parser() -> argparse.ArgumentParser:
    from .bench import add_arguments as add_bench_arguments

    parser = argparse.ArgumentParser(
        prog="python -m mlx_gated_delta",
        description="Gated DeltaNet linear attention for MLX: demo, benchmark and self-test.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands.add_parser(
        "demo", add_help=False,
        help="end-to-end mlx-lm generation with and without our layer (no download); "
             "arguments after 'demo' go to the demo")
    bench = commands.add_parser(
        "bench", help="time the op against MLX core and mlx-lm, with rooflines",
        description="Time the gated delta rule against mx.fast.gated_delta_update and "
                    "mlx-lm's gated_delta_ops, with copy-bandwidth and GEMM rooflines measured "
                    "in the same run. Writes a table, a JSON record and a plot.")
    add_bench_arguments(bench)
    selftest = commands.add_parser(
        "selftest", help="run the property tests on this machine's default device",
        description="Run the Hypothesis property tests of the core op on MLX's default device "
                    "(the Metal GPU on a Mac) with a small budget, and print PASS or FAIL.")
    selftest.add_argument("--examples", type=int, metavar="N",
                          help="examples per property test (default: the selftest profile's "
                               "small budget)")
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command == "demo":
        return run_demo(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "selftest" and args.examples is not None and args.examples < 1:
        parser.error(f"--examples must be at least 1, got {args.examples}")
    if args.command == "bench":
        return run_bench(args)
    return run_selftest(args.examples)


if __name__ == "__main__":
    sys.exit(main())
