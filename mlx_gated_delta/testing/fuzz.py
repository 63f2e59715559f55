"""A fuzz of the public functions: `python -m mlx_gated_delta fuzz --calls N`.

Each call draws a function (`gated_delta_rule`, `gated_delta_update`,
`gated_delta_segment`, or `vjp(f)`: the gradient of one of them through
`mx.vjp`),
shapes (zero sizes included), dtypes, options (per-key-channel gates
included) and values (NaN and Inf included), and sometimes breaks one
argument (a wrong rank, size, dtype or type, an unknown option). Every call
must end in one of:

- `ok`: a result of the documented shapes and dtypes (valid arguments, or a
  changed argument that is still valid, such as a float64 gate), and for a
  gradient, one gradient per differentiated input, of that input's shape and
  dtype;
- `rejected`: a ValueError or TypeError whose message names one of the
  function's arguments;

and never in a failure:

- `crash`: any other exception, or a rejection of valid arguments;
- `unnamed_rejection`: a ValueError or TypeError naming no argument;
- `bad_result`: a result of the wrong shape or dtype;
- `nan_leak`: NaN or Inf put into one batch row (one head, for the core's
  outputs) turned a finite output of another batch row or head non-finite;
  for a gradient, a finite gradient of another batch row's inputs;
- `sentinel_overwrite`: the CPU kernel wrote past the end of an output (the
  core's guarded runs, `testing.guarded`, on every valid `gated_delta_rule`
  call, of the forward, and for `vjp(gated_delta_rule)` of the backward,
  with the vjp's cotangents).

A hang is caught by a watchdog (faulthandler) that dumps every thread's stack
and exits when one call takes longer than `--call-timeout` seconds.
"""

from __future__ import annotations

import faulthandler
import re
import sys
import time
from collections import Counter

import mlx.core as mx
import numpy as np

from mlx_gated_delta import gated_delta_rule, gated_delta_segment, gated_delta_update
from mlx_gated_delta.testing.guarded import run_core_backward_guarded, run_core_guarded

FAILURES = ("crash", "unnamed_rejection", "bad_result", "nan_leak", "sentinel_overwrite")
OUTCOMES = ("ok", "rejected", *FAILURES)
OPERATIONS = ("gated_delta_rule", "gated_delta_update", "gated_delta_segment")
# "vjp(f)": the forward call of f, then mx.vjp of f with respect to every
# floating-point array argument, with random cotangents of all outputs.
FUNCTIONS = (*OPERATIONS, *(f"vjp({f})" for f in OPERATIONS))

ARGUMENT_NAMES = {
    "gated_delta_rule": (
        "q",
        "k",
        "v",
        "g",
        "beta",
        "state",
        "scale",
        "head_mapping",
        "mask",
        "algorithm",
    ),
    "gated_delta_update": ("q", "k", "v", "gamma", "beta", "initial_state", "mask"),
    "gated_delta_segment": (
        "mixed_qkvzba",
        "conv_weight",
        "decay_parameter",
        "dt_bias",
        "norm_weight",
        "conv_state",
        "state",
        "key_heads",
        "value_heads",
        "key_dim",
        "value_dim",
        "decay_parameterization",
        "head_mapping",
        "norm_eps",
        "mask",
        "algorithm",
    ),
}
ARGUMENT_NAMES.update({f"vjp({f})": names for f, names in ARGUMENT_NAMES.items()})
# The arguments with a batch axis (axis 0): their gradients belong to one batch
# row. The segment's weights are shared by every row, so a NaN in one row may
# reach their gradients.
BATCHED = {
    "gated_delta_rule": ("q", "k", "v", "g", "beta", "state"),
    "gated_delta_update": ("q", "k", "v", "gamma", "beta", "initial_state"),
    "gated_delta_segment": ("mixed_qkvzba", "conv_state", "state"),
}
DTYPES = (mx.float32, mx.float16, mx.bfloat16)
SENTINEL = 73.25
# Words a rejection may name in place of an argument: the element counts of the
# 32-bit index limits name the tensors they count.
TENSOR_WORDS = ("activation elements", "state elements")


def operation_of(function):
    """The public function a fuzzed function calls: f for f and vjp(f)."""
    return function.removeprefix("vjp(").removesuffix(")")


class Fuzzer:
    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)
        self.counts = {name: Counter() for name in FUNCTIONS}
        self.examples = []  # (function, outcome, detail) of the first failures
        # How many calls each check ran on (a check that never runs proves nothing).
        self.checks = Counter()

    # -- drawing -------------------------------------------------------------

    def size(self, choices):
        return int(self.rng.choice(choices))

    def values(self, shape, dtype, scale=1.0):
        x = self.rng.standard_normal(shape) * scale
        return mx.array(x.astype(np.float32)).astype(dtype)

    def poison(self, x, where):
        """x with NaN or +-Inf at the index `where` (a tuple of ints or slices)."""
        value = self.rng.choice([np.nan, np.inf, -np.inf])
        a = np.array(x.astype(mx.float32))
        a[where] = value
        return mx.array(a).astype(x.dtype)

    def broken(self, arguments, shapes_of):
        """Breaks one argument: returns its name (the expected error's subject)."""
        name = str(self.rng.choice(list(shapes_of)))
        x = arguments[name]
        how = self.rng.integers(0, 5)
        if how == 0:  # rank
            arguments[name] = mx.zeros((*x.shape, 1), dtype=x.dtype)
        elif how == 1:  # one size
            shape = list(x.shape)
            shape[self.rng.integers(0, len(shape))] += int(self.rng.integers(1, 3))
            arguments[name] = mx.zeros(shape, dtype=x.dtype)
        elif how == 2:  # an integer dtype
            arguments[name] = x.astype(self.rng.choice([mx.int32, mx.uint8, mx.int64]))
        elif how == 3:  # not an mlx array
            arguments[name] = np.zeros(x.shape, dtype=np.float32)
        else:  # float64, which no kernel reads
            arguments[name] = x.astype(mx.float64)
        return name

    # -- one call ------------------------------------------------------------

    def record(self, function, outcome, detail=""):
        self.counts[function][outcome] += 1
        if outcome in FAILURES and len(self.examples) < 20:
            self.examples.append((function, outcome, detail))

    def call(self, function):
        if operation_of(function) == "gated_delta_segment":
            self.segment_call(function)
        else:
            self.core_call(function)

    def vjp(self, op, arguments, options, outputs):
        """(names, gradients) of `op` at `arguments`, by mx.vjp with respect to
        every floating-point mlx array argument, with cotangents drawn for
        `outputs` (the same draw for the same outputs, so that a clean rerun
        uses the same cotangents)."""
        names = [
            n
            for n, a in arguments.items()
            if isinstance(a, mx.array) and mx.issubdtype(a.dtype, mx.floating)
        ]

        def forward(*primals):
            return op(**{**arguments, **dict(zip(names, primals))}, **options)

        _, gradients = mx.vjp(forward, [arguments[n] for n in names], self.cotangents(outputs))
        mx.eval(gradients)
        return names, gradients

    @staticmethod
    def cotangents(outputs):
        """The cotangents of `outputs`: drawn from their sizes, so the same
        outputs get the same ones."""
        rng = np.random.default_rng([int(np.prod(o.shape)) for o in outputs])
        return [
            mx.array(rng.standard_normal(o.shape).astype(np.float32)).astype(o.dtype)
            for o in outputs
        ]

    @staticmethod
    def gradient_failure(names, gradients, arguments):
        """'' or what is wrong with the gradients' shapes and dtypes."""
        for name, gradient in zip(names, gradients):
            x = arguments[name]
            if gradient.shape != x.shape or gradient.dtype != x.dtype:
                return f"gradient of {name}: {gradient.shape} {gradient.dtype}, input {x.shape} {x.dtype}"
        return ""

    def gradient_leak(self, op, function, clean, options, outputs, names, gradients, row):
        """Gradients of the batched inputs of rows other than the poisoned
        `row` stay finite wherever the same call without the poison gives
        finite gradients."""
        self.checks["gradient NaN/Inf isolation"] += 1
        clean_names, clean_gradients = self.vjp(op, clean, options, outputs)
        assert clean_names == names
        for name, gradient, clean_gradient in zip(names, gradients, clean_gradients):
            if name in BATCHED[operation_of(function)]:
                leak = self.leak_between(gradient, clean_gradient, row, None, 1)
                if leak:
                    return f"gradient of {name}: {leak}"
        return ""

    def rejection(self, function, error, broke):
        message = str(error)
        names = ARGUMENT_NAMES[function]
        named = any(re.search(rf"(?<![\w.]){re.escape(n)}(?!\w)", message) for n in names)
        named = named or any(w in message for w in TENSOR_WORDS)
        if broke is None:
            return "crash", f"valid arguments rejected: {type(error).__name__}: {message}"
        return ("rejected", "") if named else ("unnamed_rejection", message)

    def core_call(self, function):
        operation = operation_of(function)
        rng = self.rng
        B = self.size([0, 1, 1, 2, 3])
        T = self.size([0, 1, 2, 5, 63, 64, 65, 70])
        Hk = self.size([0, 1, 1, 2, 2, 2])
        Hv = Hk * self.size([1, 2])
        Dk = self.size([0, 1, 3, 8, 16, 16, 17, 32])
        Dv = self.size([0, 1, 4, 8, 16, 33])
        dtype = DTYPES[rng.integers(0, 3)]
        k = self.values((B, T, Hk, Dk), mx.float32)
        k = (k / mx.maximum(mx.linalg.norm(k, axis=-1, keepdims=True), 1.0)).astype(dtype)
        gate_dtype = mx.float32 if rng.integers(0, 2) else dtype
        # One decay per value head, or per value head and key channel.
        gate_shape = (B, T, Hv, Dk) if rng.integers(0, 4) == 0 else (B, T, Hv)
        decays = mx.array(
            -rng.exponential(rng.choice([0.01, 1.0, 50.0]), gate_shape).astype(np.float32)
        )
        if rng.integers(0, 3) == 0:
            decays = mx.where(mx.array(rng.uniform(size=gate_shape) < 0.1), -mx.inf, decays)
        arguments = {
            "q": self.values((B, T, Hk, Dk), dtype),
            "k": k,
            "v": self.values((B, T, Hv, Dv), dtype),
            "beta": mx.array(rng.uniform(0, 1, (B, T, Hv)).astype(np.float32)).astype(gate_dtype),
        }
        gate_name = "g" if operation == "gated_delta_rule" else "gamma"
        arguments[gate_name] = (decays if gate_name == "g" else mx.exp(decays)).astype(gate_dtype)
        state_name = "state" if operation == "gated_delta_rule" else "initial_state"
        if rng.integers(0, 2):
            arguments[state_name] = self.values(
                (B, Hv, Dv, Dk), mx.float32, rng.choice([1e-30, 1.0, 1e6])
            )
        if rng.integers(0, 2):
            arguments["mask"] = mx.array(rng.uniform(size=(B, T)) < 0.7)
        options = {}
        if operation == "gated_delta_rule":
            options = {
                "algorithm": str(rng.choice(["auto", "recurrent", "chunked"])),
                "head_mapping": str(rng.choice(["grouped", "interleaved"])),
                "normalize_qk": bool(rng.integers(0, 2)),
                "scale": rng.choice([None, 0.5]),
            }
        # Poison one (batch row, head) of a valid call's inputs.
        poisoned = None
        if B and T and Hk and Dk and rng.integers(0, 3) == 0:
            name = str(rng.choice(["q", "k", "v", gate_name, "beta"]))
            b, t = int(rng.integers(0, B)), int(rng.integers(0, T))
            key_input = name in ("q", "k")
            head = int(rng.integers(0, Hk if key_input else Hv))
            arguments[name] = self.poison(arguments[name], (b, t, head))
            poisoned = (name, b, head, key_input)
        # No key head or a zero key dim: an error naming q (zero B, T, Hv, Dv
        # are valid and give empty results).
        broke = "q" if Hk == 0 or Dk == 0 else None
        if broke is None and rng.integers(0, 4) == 0:
            breakable = {n: a for n, a in arguments.items() if isinstance(a, mx.array)}
            if rng.integers(0, 4) == 0 and operation == "gated_delta_rule":
                broke = str(rng.choice(["head_mapping", "algorithm"]))
                options[broke] = "nonsense"
            else:
                broke = self.broken(arguments, breakable)
            poisoned = None
        op = gated_delta_rule if operation == "gated_delta_rule" else gated_delta_update
        try:
            y, state = op(**arguments, **options)
            mx.eval(y, state)
            if operation != function:
                names, gradients = self.vjp(op, arguments, options, (y, state))
        except (ValueError, TypeError) as error:
            return self.record(function, *self.rejection(function, error, broke))
        except Exception as error:  # noqa: BLE001 - any other exception is the finding
            return self.record(function, "crash", f"{type(error).__name__}: {error}")
        if broke is not None:
            # Accepted (a float64 gate, a Conv1d-layout weight): a valid
            # variant after all; the shapes below still have to be right.
            poisoned = None
        # A changed size of v (or of q and k) that was still valid changes the
        # result's shape with it: the shapes follow the arguments passed.
        B, T, Hv, Dv = arguments["v"].shape
        Dk = arguments["q"].shape[3]
        if (
            y.shape != (B, T, Hv, Dv)
            or y.dtype != arguments["v"].dtype
            or state.shape != (B, Hv, Dv, Dk)
            or state.dtype != mx.float32
        ):
            return self.record(
                function, "bad_result", f"{y.shape} {y.dtype} {state.shape}, broken: {broke}"
            )
        if 0 in y.shape or 0 in state.shape:
            self.checks["zero-size result"] += 1
        if operation != function:
            failure = self.gradient_failure(names, gradients, arguments)
            if failure:
                return self.record(function, "bad_result", failure)
        if poisoned is not None:
            self.checks["NaN/Inf isolation"] += 1
            leak = self.core_leak(op, arguments, options, y, state, poisoned, Hk, Hv)
            if not leak and operation != function:
                clean = self.without_poison(arguments, poisoned[0])
                leak = self.gradient_leak(
                    op, function, clean, options, (y, state), names, gradients, poisoned[1]
                )
            if leak:
                return self.record(function, "nan_leak", leak)
        if operation == "gated_delta_rule" and B and T and broke is None:
            if function == operation:
                overwrite = self.guarded(arguments, options)
                self.checks["sentinel guard"] += 1
            else:
                overwrite = self.guarded_backward(arguments, options, (y, state))
                self.checks["gradient sentinel guard"] += 1
            if overwrite:
                return self.record(function, "sentinel_overwrite", overwrite)
        self.record(function, "ok")

    @staticmethod
    def without_poison(arguments, name):
        """`arguments` with NaN and Inf of `name` made finite (a gate keeps its
        -inf: that is a wipe, not poison)."""
        x = arguments[name]
        if name in ("g", "gamma"):
            clean = mx.where(mx.isnan(x), 0.0, x)
        else:
            clean = mx.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)
        return {**arguments, name: clean}

    def core_leak(self, op, arguments, options, y, state, poisoned, Hk, Hv):
        """Which (row, head) slices the poison may reach; the others must stay
        finite wherever the same call without the poison is finite."""
        name, b, head, key_input = poisoned
        mapping = options.get("head_mapping", "grouped")
        if key_input:
            group = Hv // Hk
            reached = [
                h for h in range(Hv) if (h // group if mapping == "grouped" else h % Hk) == head
            ]
        else:
            reached = [head]
        clean_y, clean_state = op(**self.without_poison(arguments, name), **options)
        return self.leak_between(y, clean_y, b, reached, head_axis=2) or self.leak_between(
            state, clean_state, b, reached, head_axis=1
        )

    @staticmethod
    def leak_between(result, clean, row, reached_heads, head_axis):
        finite_now = np.isfinite(np.array(result.astype(mx.float32)))
        finite_clean = np.isfinite(np.array(clean.astype(mx.float32)))
        unrelated = np.ones(finite_now.shape, dtype=bool)
        index = [slice(None)] * finite_now.ndim
        index[0] = row
        if reached_heads is not None:
            index[head_axis] = reached_heads
        unrelated[tuple(index)] = False
        leaked = unrelated & finite_clean & ~finite_now
        if leaked.any():
            return f"non-finite at {tuple(int(i) for i in np.argwhere(leaked)[0])}"
        return ""

    @staticmethod
    def guard_inputs(arguments, options):
        """A `gated_delta_rule` call's arguments and options as the guarded
        runs take them: the arrays in order (gates in float32, a zero state
        for none), then the keywords."""
        q, k, v, g, beta = (arguments[n] for n in ("q", "k", "v", "g", "beta"))
        state = arguments.get("state")
        if state is None:
            state = mx.zeros((q.shape[0], v.shape[2], v.shape[3], q.shape[3]))
        keywords = dict(
            scale=options["scale"],
            head_mapping=options["head_mapping"],
            mask=arguments.get("mask"),
            normalize_qk=options["normalize_qk"],
            algorithm=options["algorithm"],
            sentinel=SENTINEL,
        )
        return (q, k, v, g.astype(mx.float32), beta.astype(mx.float32), state), keywords

    @staticmethod
    def overwritten(tails, activation_dtype, activations):
        """'' or the outputs whose words past the end lost their sentinel (in
        the activation dtype for the `activations`)."""
        in_activation_dtype = mx.array(SENTINEL, dtype=activation_dtype).astype(mx.float32).item()
        return ", ".join(
            f"{name} tail {tail[:4]}"
            for name, tail in tails.items()
            if not np.all(tail == (in_activation_dtype if name in activations else SENTINEL))
        )

    def guarded(self, arguments, options):
        inputs, keywords = self.guard_inputs(arguments, options)
        _, _, y_tail, state_tail = run_core_guarded(*inputs, **keywords)
        tails = {"y": y_tail, "state": state_tail}
        return self.overwritten(tails, arguments["v"].dtype, ("y",))

    def guarded_backward(self, arguments, options, outputs):
        inputs, keywords = self.guard_inputs(arguments, options)
        _, tails = run_core_backward_guarded(*inputs, *self.cotangents(outputs), **keywords)
        return self.overwritten(tails, arguments["v"].dtype, ("dq", "dk", "dv"))

    def segment_call(self, function):
        rng = self.rng
        B = self.size([0, 1, 1, 2, 3])
        T = self.size([0, 1, 2, 5, 63, 64, 65])
        Hk = self.size([1, 2])
        Hv = Hk * self.size([1, 2])
        Dk = self.size([1, 8, 16])
        Dv = self.size([1, 8, 12])
        K = self.size([1, 2, 4])
        C = 2 * Hk * Dk + Hv * Dv
        F = C + Hv * Dv + 2 * Hv
        dtype = DTYPES[rng.integers(0, 3)]
        arguments = {
            "mixed_qkvzba": self.values((B, T, F), dtype),
            "conv_weight": self.values((C, K), mx.float32, 0.5),
            "decay_parameter": self.values((Hv,), mx.float32),
            "dt_bias": self.values((Hv,), mx.float32),
            "norm_weight": self.values((Dv,), mx.float32),
        }
        if rng.integers(0, 2):
            arguments["conv_state"] = self.values((B, K - 1, C), dtype)
        if rng.integers(0, 2):
            arguments["state"] = self.values(
                (B, Hv, Dv, Dk), mx.float32, rng.choice([1e-30, 1.0, 1e6])
            )
        if rng.integers(0, 2):
            arguments["mask"] = mx.array(rng.uniform(size=(B, T)) < 0.7)
        options = {
            "key_heads": Hk,
            "value_heads": Hv,
            "key_dim": Dk,
            "value_dim": Dv,
            "decay_parameterization": str(rng.choice(["log_rate", "negative_rate"])),
            "head_mapping": str(rng.choice(["grouped", "interleaved"])),
            "algorithm": str(rng.choice(["auto", "recurrent", "chunked"])),
        }
        if options["decay_parameterization"] == "negative_rate":
            arguments["decay_parameter"] = -mx.abs(arguments["decay_parameter"])
        poisoned_row = None
        if B > 1 and T and rng.integers(0, 3) == 0:
            poisoned_row = int(rng.integers(0, B))
            where = (poisoned_row, int(rng.integers(0, T)), int(rng.integers(0, F)))
            arguments["mixed_qkvzba"] = self.poison(arguments["mixed_qkvzba"], where)
        broke = None
        if rng.integers(0, 4) == 0:
            poisoned_row = None
            if rng.integers(0, 3) == 0:
                broke = str(rng.choice(["decay_parameterization", "head_mapping", "algorithm"]))
                options[broke] = "nonsense"
            else:
                broke = self.broken(arguments, dict(arguments))
        try:
            outputs = gated_delta_segment(**arguments, **options)
            mx.eval(outputs)
            out, conv_state, state = outputs
            if function != "gated_delta_segment":
                names, gradients = self.vjp(gated_delta_segment, arguments, options, outputs)
        except (ValueError, TypeError) as error:
            return self.record(function, *self.rejection(function, error, broke))
        except Exception as error:  # noqa: BLE001
            return self.record(function, "crash", f"{type(error).__name__}: {error}")
        # A changed size that was still valid (more tokens, a longer conv
        # kernel) changes the result's shape with it.
        B, T = arguments["mixed_qkvzba"].shape[:2]
        K = arguments["conv_weight"].shape[1]
        if (
            out.shape != (B, T, Hv, Dv)
            or out.dtype != arguments["mixed_qkvzba"].dtype
            or conv_state.shape != (B, K - 1, C)
            or state.shape != (B, Hv, Dv, Dk)
        ):
            return self.record(
                function,
                "bad_result",
                f"{out.shape} {conv_state.shape} {state.shape}, broken: {broke}",
            )
        if function != "gated_delta_segment":
            failure = self.gradient_failure(names, gradients, arguments)
            if failure:
                return self.record(function, "bad_result", failure)
        if 0 in out.shape or 0 in state.shape:
            self.checks["zero-size result"] += 1
        if poisoned_row is not None:
            self.checks["NaN/Inf isolation"] += 1
            clean = self.without_poison(arguments, "mixed_qkvzba")
            clean_out, _, clean_state = gated_delta_segment(**clean, **options)
            leak = self.leak_between(out, clean_out, poisoned_row, None, 2) or self.leak_between(
                state, clean_state, poisoned_row, None, 1
            )
            if not leak and function != "gated_delta_segment":
                leak = self.gradient_leak(
                    gated_delta_segment,
                    function,
                    clean,
                    options,
                    outputs,
                    names,
                    gradients,
                    poisoned_row,
                )
            if leak:
                return self.record(function, "nan_leak", leak)
        self.record(function, "ok")

    # -- the run -------------------------------------------------------------

    def run(self, calls, progress=None, call_timeout=60.0):
        start = time.monotonic()
        every = max(1, calls // 20)
        for i in range(calls):
            function = FUNCTIONS[self.rng.integers(0, len(FUNCTIONS))]
            faulthandler.dump_traceback_later(call_timeout, exit=True, file=sys.__stderr__)
            try:
                self.call(function)
            finally:
                faulthandler.cancel_dump_traceback_later()
            if progress is not None and ((i + 1) % every == 0 or i + 1 == calls):
                total = sum(self.totals()[o] for o in FAILURES)
                print(
                    f"fuzz: {i + 1}/{calls} calls, {total} failures, "
                    f"{time.monotonic() - start:.0f} s",
                    file=progress,
                    flush=True,
                )
        return self.totals()

    def totals(self):
        total = Counter()
        for counts in self.counts.values():
            total.update(counts)
        return total

    def table(self):
        width = max(len(f) for f in FUNCTIONS)
        lines = [f"{'function':<{width}}  " + "  ".join(f"{o:>10}" for o in OUTCOMES)]
        for function in FUNCTIONS:
            counts = self.counts[function]
            lines.append(f"{function:<{width}}  " + "  ".join(f"{counts[o]:>10}" for o in OUTCOMES))
        totals = self.totals()
        lines.append(f"{'all':<{width}}  " + "  ".join(f"{totals[o]:>10}" for o in OUTCOMES))
        lines.append(
            "calls checked: "
            + ", ".join(
                f"{name} {self.checks[name]}"
                for name in (
                    "NaN/Inf isolation",
                    "gradient NaN/Inf isolation",
                    "sentinel guard",
                    "gradient sentinel guard",
                    "zero-size result",
                )
            )
        )
        return "\n".join(lines)


def main(calls: int, seed: int, call_timeout: float) -> int:
    fuzzer = Fuzzer(seed)
    totals = fuzzer.run(calls, progress=sys.stderr, call_timeout=call_timeout)
    print(f"fuzz: {calls} calls, seed {seed}, device {mx.default_device()}")
    print(fuzzer.table())
    for function, outcome, detail in fuzzer.examples:
        print(f"{outcome} in {function}: {detail}")
    failed = sum(totals[o] for o in FAILURES)
    print(f"fuzz {'PASS' if failed == 0 else 'FAIL'}: {failed} failures")
    return 0 if failed == 0 else 1
