"""Timing: the one timer every benchmark uses, the repeat budget, and the progress bar
shown meanwhile.

Machines are shared and noisy, so a figure is the median of repeats after a warm-up call
(which compiles, faults pages in and starts thread pools), and calls compared with one
another take turns round by round."""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from collections.abc import Callable, Mapping


def time_rounds(
    calls: Mapping[str, Callable[..., object]],
    repeats: int | Mapping[str, int],
    *,
    warm_up: bool = True,
    prepare: Callable[[], tuple] | Mapping[str, Callable[[], tuple]] | None = None,
    on_round: Callable[[int, int], None] | None = None,
    on_error: Callable[[str, Exception], None] | None = None,
) -> dict[str, list[float]]:
    """The seconds of each repeat of each call, by name.

    The calls take turns, round by round (each until it has its ``repeats``, one count for
    all or one per name), so that a neighbour's burst of load falls on all of them alike
    rather than on whichever happened to run then. With ``warm_up``, each call first runs
    once, untimed. ``prepare`` (one for all, or one per name) gives a call's arguments before
    each run, untimed: a fresh cache, the next of the rotated states. ``on_round(i, rounds)``
    is told of each round before it runs. A call that raises is dropped from the later rounds
    and handed to ``on_error``; without ``on_error`` the error propagates.
    """
    if not isinstance(repeats, Mapping):
        repeats = dict.fromkeys(calls, repeats)
    if not isinstance(prepare, Mapping):
        prepare = dict.fromkeys(calls, prepare)

    def arguments(name: str) -> tuple:
        return () if prepare.get(name) is None else prepare[name]()

    if warm_up:
        for name, call in calls.items():
            call(*arguments(name))
    times = {name: [] for name in calls}
    failed = set()
    rounds = max(repeats.values(), default=0)
    for round_index in range(rounds):
        if on_round is not None:
            on_round(round_index, rounds)
        for name, call in calls.items():
            if name in failed or len(times[name]) >= repeats[name]:
                continue
            args = arguments(name)
            try:
                start = time.perf_counter()
                call(*args)
                times[name].append(time.perf_counter() - start)
            except Exception as error:
                if on_error is None:
                    raise
                failed.add(name)
                on_error(name, error)
    return times


def median_seconds(call: Callable[[], object], repeats: int, *, warm_up: bool = True) -> float:
    """The median seconds of ``call()`` over ``repeats`` runs, after an untimed warm-up run
    unless ``warm_up`` is false."""
    return statistics.median(time_rounds({"call": call}, repeats, warm_up=warm_up)["call"])


@dataclasses.dataclass(frozen=True)
class Budget:
    """How long to spend on one measurement: as many repeats as fit in ``seconds`` after the
    warm-up, at least one, at most ``max_repeats``."""

    seconds: float
    max_repeats: int


def repeats_within(budget: Budget, warm_up_seconds: float) -> int:
    if warm_up_seconds <= 0:
        return budget.max_repeats
    return max(1, min(budget.max_repeats, int(budget.seconds / warm_up_seconds)))


class Progress:
    """A one-line progress bar on stderr (tqdm's when it is installed).

    Calling it with a label announces the next step; ``advance()`` counts one step done.
    """

    def __init__(self, total: int):
        self.total = total
        self.done = 0
        self.started = time.perf_counter()
        try:
            from tqdm import tqdm
        except ImportError:
            self._tqdm = None
        else:
            self._tqdm = tqdm(total=total, file=sys.stderr, dynamic_ncols=True)

    def __call__(self, label: str) -> None:
        if self._tqdm is not None:
            self._tqdm.set_description_str(label)
            return
        width = 30
        filled = width * self.done // max(self.total, 1)
        elapsed = time.perf_counter() - self.started
        bar = "#" * filled + "." * (width - filled)
        sys.stderr.write(f"\r[{bar}] {self.done}/{self.total} {elapsed:5.0f}s {label[:60]:<60}")
        sys.stderr.flush()

    def advance(self) -> None:
        self.done += 1
        if self._tqdm is not None:
            self._tqdm.update(1)

    def close(self) -> None:
        if self._tqdm is not None:
            self._tqdm.close()
        else:
            self("done")
            sys.stderr.write("\n")
