"""Timing: the median timer, the repeat budget, and the progress bar shown meanwhile."""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from collections.abc import Callable


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up: page faults, thread pools, BLAS kernels
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


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
