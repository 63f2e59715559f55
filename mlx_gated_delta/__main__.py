"""Command line: ``python -m mlx_gated_delta {demo,bench,selftest,fuzz,lm}``."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

# The shipped suites (mlx_gated_delta/tests/) that selftest runs, each with the name its
# verdict gives it (tests/test_bench_cli.py checks that every suite is here).
PROPERTY_MODULES = {
    "mlx_gated_delta.tests.test_core": "core op",
    "mlx_gated_delta.tests.test_per_key": "per-key gates",
    "mlx_gated_delta.tests.test_segment": "segment",
    "mlx_gated_delta.tests.test_layers": "layer",
    "mlx_gated_delta.tests.test_core_gradients": "gradients",
    "mlx_gated_delta.tests.test_segment_gradients": "segment gradients",
    "mlx_gated_delta.tests.test_checkpoints": "checkpoints",
    "mlx_gated_delta.tests.test_serving": "serving",
    "mlx_gated_delta.tests.test_token_blocks": "token blocks",
}


def run_demo(argv: list[str]) -> int:
    from . import demo

    return demo.main(argv) or 0


def run_bench(args: argparse.Namespace) -> int:
    from .bench import cli

    cli.run(args)
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


class _Outcomes:
    """pytest plugin: the outcome of every test of one run, and why a whole module was
    skipped (the layer's, without mlx-lm)."""

    def __init__(self):
        self.by_test = {}  # node id -> outcome
        self.module_skip_reason = None

    def pytest_runtest_logreport(self, report):
        # One outcome per test: a failure or skip in any phase (setup, call, teardown)
        # outweighs the pass of its call.
        if self.by_test.get(report.nodeid, "passed") == "passed" and (
            report.when == "call" or report.outcome != "passed"
        ):
            self.by_test[report.nodeid] = report.outcome

    def pytest_collectreport(self, report):
        if report.skipped:
            reason = report.longrepr[-1] if isinstance(report.longrepr, tuple) else report.longrepr
            self.module_skip_reason = str(reason).removeprefix("Skipped: ")

    def summary(self):
        """'9 passed, 1 failed', or 'skipped (why)'."""
        if self.module_skip_reason is not None and not self.by_test:
            return f"skipped ({self.module_skip_reason})"
        counts = {}
        for outcome in self.by_test.values():
            counts[outcome] = counts.get(outcome, 0) + 1
        return ", ".join(f"{count} {outcome}" for outcome, count in counts.items()) or "0 ran"


def run_selftest(examples: int | None) -> int:
    # Looked up, not imported: pytest must import Hypothesis itself to load its plugin.
    if any(importlib.util.find_spec(name) is None for name in ("pytest", "hypothesis")):
        print(
            'selftest needs pytest and hypothesis: pip install "mlx-gated-delta[test]"',
            file=sys.stderr,
        )
        return 2
    import mlx.core as mx
    import pytest

    from . import __version__

    print(
        f"mlx-gated-delta {__version__}, MLX {mx.__version__}, "
        f"default device: {mx.default_device()}"
    )
    os.environ["MLX_GATED_DELTA_HYPOTHESIS_PROFILE"] = "selftest"
    examples_plugin = None if examples is None else _ExamplesPerProperty(examples)
    # One pytest run per module: each module's count is then the count of its run (node
    # ids alone do not tell the modules apart: outside the working directory, --pyargs
    # can give them no file part).
    passed = True
    summaries, codes = [], []
    for module, name in PROPERTY_MODULES.items():
        outcomes = _Outcomes()
        plugins = [outcomes] if examples_plugin is None else [outcomes, examples_plugin]
        code = pytest.main(
            ["--pyargs", module, "-q", "-rs", "-p", "no:cacheprovider"], plugins=plugins
        )
        skipped_as_a_whole = (
            code == pytest.ExitCode.NO_TESTS_COLLECTED and outcomes.module_skip_reason is not None
        )
        passed = passed and (code == pytest.ExitCode.OK or skipped_as_a_whole)
        summaries.append(f"{name}: {outcomes.summary()}")
        codes.append(str(int(code)))
    if examples_plugin is not None:
        print(f"{len(examples_plugin.tests)} Hypothesis tests ran with {examples} examples each")
    print(
        f"selftest {'PASS' if passed else 'FAIL'} on {mx.default_device()}: "
        f"{'; '.join(summaries)} (pytest exit codes {', '.join(codes)})"
    )
    return 0 if passed else 1


def build_parser() -> argparse.ArgumentParser:
    from .bench.cli import add_arguments as add_bench_arguments

    parser = argparse.ArgumentParser(
        prog="python -m mlx_gated_delta",
        description="Gated DeltaNet linear attention for MLX: demo, benchmark, self-test, and "
        "mlx-lm's commands with our layers.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    commands.add_parser(
        "demo",
        add_help=False,
        help="end-to-end mlx-lm generation with and without our layer (no download); "
        "arguments after 'demo' go to the demo",
    )
    commands.add_parser(
        "lm",
        add_help=False,
        help="mlx-lm's own commands (generate, chat, server, lora, ...) with every model "
        "they load patched: 'lm COMMAND [ARGS]' runs 'mlx_lm COMMAND [ARGS]'",
    )
    bench = commands.add_parser(
        "bench",
        help="time the op against MLX core and mlx-lm, with rooflines",
        description="Time the gated delta rule against mx.fast.gated_delta_update and "
        "mlx-lm's gated_delta_ops, with copy-bandwidth and GEMM rooflines measured "
        "in the same run. Writes a table, a JSON record and a plot.",
    )
    add_bench_arguments(bench)
    selftest = commands.add_parser(
        "selftest",
        help="run the property tests on this machine's default device",
        description="Run the Hypothesis property tests of the core op, the fused segment and "
        "the drop-in layer (with mlx-lm) on MLX's default device (the Metal GPU "
        "on a Mac) with a small budget, and print PASS or FAIL with the count of "
        "tests of each.",
    )
    selftest.add_argument(
        "--examples",
        type=int,
        metavar="N",
        help="examples per property test (default: the selftest profile's small budget)",
    )
    fuzz = commands.add_parser(
        "fuzz",
        help="call every public function with drawn shapes, dtypes and values",
        description="Call gated_delta_rule, gated_delta_update and gated_delta_segment with "
        "drawn shapes (zero sizes included), dtypes, options and values (NaN and "
        "Inf included), some with one argument broken. Counts the outcomes per "
        "function; fails on a crash, a rejection that names no argument, a "
        "result of the wrong shape, NaN reaching an unrelated batch row or head, "
        "or a write past an output.",
    )
    fuzz.add_argument(
        "--calls", type=int, default=1000, metavar="N", help="number of calls (default 1000)"
    )
    fuzz.add_argument("--seed", type=int, default=0, help="seed of the draws (default 0)")
    fuzz.add_argument(
        "--call-timeout",
        type=float,
        default=60.0,
        metavar="S",
        help="seconds one call may take before the run is stopped as hung (default 60)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "lm":
        # mlx-lm's arguments go to mlx-lm untouched (argparse would take "--").
        from . import lm

        return lm.main(argv[1:])
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
    if args.command == "fuzz":
        if args.calls < 1:
            parser.error(f"--calls must be at least 1, got {args.calls}")
        from .testing import fuzz as fuzz_module

        return fuzz_module.main(args.calls, args.seed, args.call_timeout)
    return run_selftest(args.examples)


if __name__ == "__main__":
    sys.exit(main())
